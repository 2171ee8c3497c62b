"""Recipes are package data: `config list`, `-c NAME`, the `config show` round trip, presets that
run as is on the built-in corpus, and a wheel that carries the recipes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from gptforge.config import check_train_shapes, load_config
from gptforge.config.presets import PRESETS
from gptforge.config.recipes import list_recipes, recipe_dir, recipe_names
from gptforge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "src" / "gptforge" / "recipes").glob("*.yaml"))
CPU_PRESETS = ("tiny", "mini", "small")


def test_recipes_live_in_the_package_and_config_list_shows_them(run_cli):
    assert len(RECIPES) >= 10 and recipe_names() == RECIPES
    assert recipe_dir() == ROOT / "src" / "gptforge" / "recipes"
    assert not (ROOT / "configs").exists(), "recipes moved into src/gptforge/recipes"
    code, out, _ = run_cli("config", "list")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line[0].isspace()}
    for r in list_recipes():
        assert r.description and not r.description.startswith("#"), r.name
        assert r.name in lines and r.description in lines[r.name]
    assert lines["qat_gpt_tiny_cpu"].split(None, 1)[1].startswith("INT8 quantization-aware training")


def test_dash_c_name_resolves_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    want = load_config(recipe_dir() / "qat_gpt_tiny_cpu.yaml").to_dict()
    for spec in ("qat_gpt_tiny_cpu", "qat_gpt_tiny_cpu.yaml", "configs/qat_gpt_tiny_cpu.yaml",
                 str(tmp_path / "configs" / "qat_gpt_tiny_cpu.yaml")):
        assert load_config(spec).to_dict() == want, spec
    # A name whose stem has a dot ("1.3B") is still a name.
    assert load_config("pretrain_gpt_1.3B_single_card").Model.hidden_size == 2048


def test_an_existing_file_wins_over_the_packaged_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "pretrain_gpt_tiny_cpu.yaml").write_text("Engine: {max_steps: 7}\n")
    (tmp_path / "pretrain_gpt_tiny_cpu").write_text("Engine: {max_steps: 9}\n")
    assert load_config("configs/pretrain_gpt_tiny_cpu.yaml").Engine.max_steps == 7
    assert load_config("pretrain_gpt_tiny_cpu").Engine.max_steps == 9


def test_base_resolves_to_a_packaged_recipe(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("_base_: pretrain_gpt_tiny_cpu.yaml\nEngine: {max_steps: 20}\n")
    cfg = load_config(mine)
    assert cfg.Engine.max_steps == 20 and cfg.Model.hidden_size == 128
    assert cfg.Data.Train.dataset.input_dir == "builtin"
    (tmp_path / "other.yaml").write_text("_base_: [configs/qat_gpt_tiny_cpu.yaml, nope.yaml]\n")
    with pytest.raises(ConfigError, match=r"_base_ file not found: nope.yaml .*config list"):
        load_config(tmp_path / "other.yaml")


@pytest.mark.parametrize("spec,expected", [
    ("pretrain_gpt_tiny", "pretrain_gpt_tiny: config file not found, nor a packaged recipe of that name "
                          "(did you mean -c pretrain_gpt_tiny_cpu?); `gptforge config list`"),
    ("elsewhere/qat_gpt_tiny_cpu.yaml", "config file not found; for the packaged recipe of that name use "
                                        "-c qat_gpt_tiny_cpu"),
])
def test_unknown_recipe_is_one_line_naming_the_fix(run_cli, tmp_path, monkeypatch, spec, expected):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli("config", "show", "-c", spec)
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err


def test_config_show_path(run_cli):
    code, out, _ = run_cli("config", "show", "--path", "-c", "configs/prune_gpt_mini_cpu.yaml")
    assert code == 0 and Path(out.strip()) == recipe_dir() / "prune_gpt_mini_cpu.yaml"


# ------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("name", RECIPES)
def test_config_show_round_trips_every_recipe(run_cli, tmp_path, name):
    """show → file → -c file → the identical resolved config (also at another world size)."""
    for world, overrides in ((1, []), (4, ["Global.local_batch_size=", "Global.global_batch_size=32"])):
        argv = ["config", "show", "-c", name, "--world-size", str(world)]
        for o in overrides:
            argv += ["-o", o]
        code, out, err = run_cli(*argv)
        assert code == 0, err
        f = tmp_path / "shown.yaml"
        f.write_text(out)
        want = load_config(name, overrides, world_size=world).to_dict()
        assert load_config(f, world_size=world).to_dict() == want
        # Derived values are comments, not keys: the file does not pin them.
        assert yaml.safe_load(out)["Engine"]["accumulate_steps"] is None
        assert f"  accumulate_steps:  # derived: {want['Engine']['accumulate_steps']}" in out.splitlines()


def test_edited_show_output_derives_again(run_cli, tmp_path):
    """The issue's four tries: edit the shown file and the derived values follow the edit."""
    code, out, _ = run_cli("config", "show", "-c", "pretrain_gpt_tiny_cpu")
    assert code == 0 and "  ffn_hidden_size: 512" in out and "  decay_steps:  # derived: 300" in out
    edited = (out.replace("  max_steps: 300", "  max_steps: 40").replace("  hidden_size: 128", "  hidden_size: 256")
              .replace("  ffn_hidden_size: 512", "  ffn_hidden_size:").replace("  global_batch_size: 8", "  global_batch_size: 16")
              .replace("  local_batch_size: 8", "  local_batch_size:"))
    f = tmp_path / "edited.yaml"
    f.write_text(edited)
    cfg = load_config(f)
    assert cfg.Optimizer.lr.decay_steps == 40 and cfg.Model.ffn_hidden_size == 1024 and cfg.Model.head_dim == 64
    assert cfg.Global.local_batch_size == 16 and cfg.Engine.accumulate_steps == 2
    # --resolved pins the derived values: the form a checkpoint's config.yaml has.
    code, out, _ = run_cli("config", "show", "--resolved", "-c", "pretrain_gpt_tiny_cpu")
    assert yaml.safe_load(out)["Optimizer"]["lr"]["decay_steps"] == 300


# -------------------------------------------------------------------------------- presets


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_resolves_over_the_cpu_recipe(run_cli, preset):
    """`-o Model.preset=P` over a recipe: the preset's shape wins over the recipe's, sequences fit
    its positions, and the vocabulary holds GPT-2's tokens (the recipe's tokenizer)."""
    code, out, err = run_cli("config", "show", "-c", "pretrain_gpt_tiny_cpu", "-o", f"Model.preset={preset}")
    assert code == 0, err
    cfg = load_config("pretrain_gpt_tiny_cpu", [f"Model.preset={preset}"])
    shape = PRESETS[preset]
    assert cfg.Model.hidden_size == shape["hidden_size"] and cfg.Model.num_layers == shape["num_layers"]
    assert cfg.Model.vocab_size >= 50257
    check_train_shapes(cfg)
    # Over the reference's base recipe (seq 1024), too.
    base = load_config("pretrain_gpt_base", [f"Model.preset={preset}"])
    check_train_shapes(base)
    assert base.Data.Train.dataset.max_seq_len == min(1024, shape["max_position_embeddings"])


def test_preset_rules():
    # Keys set in the same layer as the preset win over it.
    cfg = load_config("pretrain_gpt_345M_single_card", ["Model.preset=tiny", "Model.hidden_size=128"])
    assert (cfg.Model.hidden_size, cfg.Model.num_layers, cfg.Model.max_position_embeddings) == (128, 2, 256)
    # A trained tokenizer keeps the preset's own vocabulary.
    assert load_config(overrides=["Model.preset=mini", "Data.tokenizer=runs/tok8k"]).Model.vocab_size == 8192
    assert load_config(overrides=["Model.preset=mini", "Data.tokenizer=gpt2"]).Model.vocab_size == 50304
    # A blank tokenizer may be a checkpoint's: the preset's size stays (the trainer names the fix).
    assert load_config(overrides=["Model.preset=mini"]).Model.vocab_size == 8192
    # An explicit sequence length in the preset's own layer is judged, not lowered.
    cfg = load_config(overrides=["Model.preset=tiny", "Data.Train.dataset.max_seq_len=512"])
    with pytest.raises(ConfigError, match="Data.Train.dataset.max_seq_len: 512 exceeds"):
        check_train_shapes(cfg)
    # A preset in a file's _base_ is overridden by the including file's shape keys.
    assert load_config("pretrain_gpt_tiny_cpu", ["Model.num_layers=3"]).Model.num_layers == 3


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One step of `pretrain -c pretrain_gpt_tiny_cpu` on the built-in corpus, as shipped."""
    from gptforge.cli import main

    out = tmp_path_factory.mktemp("recipe") / "tiny"
    code = main(["pretrain", "-c", "pretrain_gpt_tiny_cpu", "-o", "Engine.max_steps=1", "-o", "Engine.eval_iters=1",
                 "-o", "Global.device=cpu", "-o", f"Engine.save_load.output_dir={out}", "--no-progress"])
    assert code == 0
    return out


def _pretrain(run_cli, tmp_path, *overrides: str):
    args = ["pretrain", "-c", "pretrain_gpt_tiny_cpu", "--no-progress", "-o", "Engine.max_steps=1", "-o", "Engine.eval_iters=1",
            "-o", "Global.device=cpu", "-o", f"Engine.save_load.output_dir={tmp_path / 'out'}"]
    for o in overrides:
        args += ["-o", o]
    return run_cli(*args)


def test_preset_vocabulary_that_misses_gpt2_names_the_override(run_cli, tmp_path):
    code, _, err = run_cli("pretrain", "-c", "pretrain_gpt_base", "-o", "Model.preset=tiny", "-o", "Global.device=cpu",
                           "-o", "Data.Train.dataset.input_dir=builtin", "-o", "Data.Eval.dataset.input_dir=builtin",
                           "-o", f"Engine.save_load.output_dir={tmp_path / 'out'}")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "'gpt2' has 50257 tokens but the model's vocabulary is 4096; add -o Model.vocab_size=50257" in err


def test_tiny_cpu_recipe_trains_as_shipped(tiny_run):
    assert (tiny_run / "step_1" / "model.safetensors").is_file()


@pytest.mark.parametrize("preset", [
    "tiny", pytest.param("mini", marks=pytest.mark.slow), pytest.param("small", marks=pytest.mark.slow)])
def test_cpu_preset_pretrains_on_the_builtin_corpus(run_cli, tmp_path, preset):
    code, out, err = _pretrain(run_cli, tmp_path, f"Model.preset={preset}")
    assert code == 0, err
    cfg = load_config(tmp_path / "out" / "step_1" / "config.yaml")
    assert cfg.Model.hidden_size == PRESETS[preset]["hidden_size"]
    # A sequence length set next to the preset that its positions cannot hold: one line naming it.
    code, out, err = run_cli("pretrain", "-c", "pretrain_gpt_tiny_cpu", "-o", f"Model.preset={preset}",
                             "-o", "Data.Train.dataset.max_seq_len=4096")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "Data.Train.dataset.max_seq_len: 4096 exceeds Model.max_position_embeddings" in err


@pytest.mark.slow
@pytest.mark.parametrize("verb,recipe", [("qat", "qat_gpt_tiny_cpu"), ("prune", "prune_gpt_mini_cpu")])
def test_cpu_compression_recipes_run_as_shipped(run_cli, tmp_path, tiny_run, verb, recipe):
    code, out, err = run_cli(verb, "-c", recipe, "--no-progress", "-o", f"Compress.pretrained={tiny_run / 'step_1'}",
                             "-o", "Engine.max_steps=1", "-o", "Engine.eval_iters=1", "-o", "Global.device=cpu",
                             "-o", f"Engine.save_load.output_dir={tmp_path / 'out'}")
    assert code == 0, err
    assert (tmp_path / "out" / "step_1" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------- wheel


def _build_wheel(dest: Path) -> Path:
    """Build from a copy of the sources, so the checkout gets no build/ or egg-info."""
    src = dest / "src_copy"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dest / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (dest / "dist").glob("gptforge-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("setuptools")
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_contains_every_recipe(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n.split("/")[-1][:-5] for n in names if n.startswith("gptforge/recipes/")) == RECIPES
    assert "gptforge/config/recipes.py" in names and "gptforge/cli.py" in names


def test_wheel_contains_the_docs_pages(wheel):
    """`gptforge docs VERB` and every verb's --help point at pages a pip user has."""
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n.split("/")[-1] for n in names if n.startswith("gptforge/docs/"))
    assert shipped == sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert "gptforge/commands/docs.py" in names


@pytest.mark.slow
def test_installed_wheel_runs_recipes_by_name(wheel, tmp_path):
    """A fresh venv with only the wheel installed (its dependencies borrowed from this
    interpreter's site-packages, nothing downloaded): `-c NAME` works from an empty directory."""
    import site
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    Path(purelib, "borrowed_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=300, env=env, capture_output=True)
    work = tmp_path / "empty"
    work.mkdir()

    def gf(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "gptforge"), *argv], cwd=work, env=env, capture_output=True,
                              text=True, timeout=300)

    where = subprocess.run([str(py), "-c", "import gptforge; print(gptforge.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where
    listed = gf("config", "list")
    assert listed.returncode == 0 and all(name in listed.stdout for name in RECIPES)
    for spec in ("qat_gpt_tiny_cpu", "configs/pretrain_gpt_345M_single_card.yaml"):
        shown = gf("config", "show", "-c", spec, "-o", "Engine.max_steps=5")
        assert shown.returncode == 0, shown.stderr
        assert yaml.safe_load(shown.stdout)["Engine"]["max_steps"] == 5
    page = gf("docs", "generate")
    assert page.returncode == 0 and page.stdout == (ROOT / "docs" / "generate.md").read_text(encoding="utf-8")
    assert gf("docs", "serve", "--path").stdout.strip().startswith(str(venv))
    path = gf("config", "show", "--path", "-c", "pretrain_gpt_tiny_cpu").stdout.strip()
    assert path.startswith(str(venv)) and path.endswith("gptforge/recipes/pretrain_gpt_tiny_cpu.yaml")
