"""`gptforge infer`: Generate with an exported ONNX model."""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args
from gptforge.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p, ckpt=False)


def run(args: argparse.Namespace) -> int:
    raise UsageError("`gptforge infer` is not implemented yet")
