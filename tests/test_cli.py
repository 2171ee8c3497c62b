"""The CLI skeleton: every verb has --help, user errors are one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gptforge import __version__
from gptforge.cli import VERBS


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_has_help(run_cli, verb):
    code, out, _ = run_cli(verb, "--help")
    assert code == 0
    assert "usage: gptforge " + verb in out


def test_top_level_help_lists_verbs(run_cli):
    code, out, _ = run_cli("--help")
    assert code == 0
    for verb in ("preprocess", "pretrain", "generate", "eval", "qat", "ptq", "analyze", "prune",
                 "export", "infer", "convert", "demo", "config"):
        assert verb in out


def test_version_and_no_verb(run_cli):
    code, out, _ = run_cli("--version")
    assert code == 0 and __version__ in out
    code, _, _ = run_cli()
    assert code == 2


def test_usage_error_is_one_line(run_cli):
    code, _, err = run_cli("convert", "--src", "a", "--out", "b", "--bogus")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "unrecognized arguments: --bogus" in err


def test_console_script_and_module_entry():
    out = subprocess.run([sys.executable, "-m", "gptforge", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and __version__ in out.stdout
