"""The package's shape (docs/architecture.md): imports go downward only.

The rules are import-linter contracts in pyproject.toml ([tool.importlinter]): the layers
cli > commands > stages > engine/io > transforms > model > config > support, no circles between
the modules or packages of any package, and forbidden pairs. import-linter reads the graph with
grimp, which counts imports made inside functions too (checked below on a package of its own).
What a contract cannot say ("the model imports nothing but its config schema") is checked here
on the same graph.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import grimp
import importlinter.api  # noqa: F401  (registers import-linter's readers and contract types)
from importlinter.application import use_cases

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "gptforge"


def _lint(config: Path, capsys) -> tuple[bool, str]:
    capsys.readouterr()
    ok = use_cases.lint_imports(config_filename=str(config), cache_dir=None, no_logo=True)
    return ok, capsys.readouterr().out


def test_the_import_contracts_hold(capsys):
    import gptforge

    # the graph is built from the package the tests import: it must be this checkout's source
    assert Path(gptforge.__file__).resolve().parent == PKG, gptforge.__file__
    ok, report = _lint(ROOT / "pyproject.toml", capsys)
    assert ok, report
    assert "0 broken" in report and "kept" in report.lower(), report


def test_the_model_files_are_pure_pytorch():
    graph = grimp.build_graph("gptforge", cache_dir=None)
    shape = {"gptforge.config.schema"}  # the typed shape they are built from
    assert graph.find_modules_directly_imported_by("gptforge.model.moe") <= shape
    assert graph.find_modules_directly_imported_by("gptforge.model.kv_cache") == set()
    assert graph.find_modules_directly_imported_by("gptforge.model.gpt") <= shape | {"gptforge.model.moe",
                                                                                      "gptforge.model.kv_cache"}


def _probe_package(root: Path, name: str, lazy_import: str) -> Path:
    """A two-layer package whose lower layer imports `lazy_import` inside a function."""
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "high.py").write_text(f"from {name} import low\n")
    (pkg / "low.py").write_text(textwrap.dedent(f"""
        def f():
            {lazy_import}
    """))
    config = root / "probe.toml"
    config.write_text(textwrap.dedent(f"""
        [tool.importlinter]
        root_package = "{name}"

        [[tool.importlinter.contracts]]
        name = "high above low"
        type = "layers"
        layers = ["{name}.high", "{name}.low"]
    """))
    return config


def test_an_upward_import_inside_a_function_breaks_a_contract(tmp_path, monkeypatch, capsys):
    """The checker sees function-level imports: else a lazy import could hide a broken layer."""
    monkeypatch.syspath_prepend(str(tmp_path / "bad"))
    (tmp_path / "bad").mkdir()
    ok, report = _lint(_probe_package(tmp_path / "bad", "gf_probe_bad", "from gf_probe_bad import high"), capsys)
    assert not ok and "gf_probe_bad.low -> gf_probe_bad.high" in report, report

    monkeypatch.syspath_prepend(str(tmp_path / "good"))
    (tmp_path / "good").mkdir()
    ok, report = _lint(_probe_package(tmp_path / "good", "gf_probe_good", "import os"), capsys)
    assert ok, report
