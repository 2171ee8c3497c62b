"""`gptforge eval`: LAMBADA cloze accuracy / WikiText perplexity / lm-eval tasks."""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args
from gptforge.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)


def run(args: argparse.Namespace) -> int:
    raise UsageError("`gptforge eval` is not implemented yet")
