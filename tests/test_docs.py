"""Docs that are generated from code stay in sync with it."""

from pathlib import Path

from gptforge.config.docs import keys_table

ROOT = Path(__file__).resolve().parents[1]


def test_config_doc_lists_every_key():
    doc = (ROOT / "docs" / "config.md").read_text()
    assert keys_table() in doc, "docs/config.md is stale: regenerate its table with `gptforge config keys`"


def test_readme_opens_with_the_two_commands():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:8])
    assert "make demo" in head and "make test" in head
