"""One command-line convention (docs/cli.md): `--out` on every writing verb (old spellings as
aliases), its default named in --help, `--no-progress` and `--quiet` on every verb."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptforge.cli import VERBS

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ("the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs.\n\n" * 40)

# verb -> the default its --out help names (writers only)
WRITERS = {
    "preprocess": "required", "tokenizer train": "required", "pretrain": "Engine.save_load.output_dir",
    "finetune": "Engine.save_load.output_dir", "generate": "default: none", "eval": "./eval_results_<task>.json",
    "ptq": "required", "qat": "Engine.save_load.output_dir", "quantize": "required",
    "analyze": "default: analysis_results", "prune": "Engine.save_load.output_dir", "export": "required",
    "infer": "default: none", "convert": "required", "demo": "default: runs/demo",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-step tiny training run (out/step_2), its config and a text file."""
    from gptforge.config import save_config
    from gptforge.train import pretrain
    from test_train_support import small_tokenizer, train_config

    root = tmp_path_factory.mktemp("conventions")
    cfg = train_config(root, "Engine.save_load.save_steps=2", "Engine.eval_freq=100", steps=2)
    save_config(cfg, root / "run.yaml")
    pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    (root / "text.txt").write_text(TEXT)
    return root


def _help(run_cli, verb: str) -> str:
    code, out, _ = run_cli(*verb.split(), "--help")
    assert code == 0
    return " ".join(out.split())


@pytest.mark.parametrize("verb", [*VERBS, "tokenizer train"])
def test_every_verb_has_quiet_and_no_progress(run_cli, verb):
    text = _help(run_cli, verb)
    assert "--no-progress" in text and "--quiet" in text, verb


@pytest.mark.parametrize("verb", sorted(WRITERS))
def test_every_writer_has_out_naming_its_default(run_cli, verb):
    text = _help(run_cli, verb)
    assert "--out" in text, verb
    options = text.split("options:", 1)[1]
    out_help = options[options.index("--out "):]
    assert WRITERS[verb] in out_help[:400], (verb, out_help[:400])


def _cases(root: Path, t: Path) -> dict[str, tuple[list, Path]]:
    """verb -> (argv with the output flag last, the file `--out` must create under it)."""
    step = root / "out" / "step_2"
    tok = root / "tok"
    data = ["-o", "Global.device=cpu"]
    return {
        "preprocess": (["preprocess", "--input", root / "text.txt", "--tokenizer", tok, "--workers", "1"],
                       Path("_ids.npy")),
        "tokenizer train": (["tokenizer", "train", "--input", root / "text.txt", "--vocab-size", "300"],
                            Path("tokenizer.json")),
        "pretrain": (["pretrain", "-c", root / "run.yaml", "-o", f"Engine.save_load.output_dir={t / 'ignored'}",
                      "-o", "Engine.max_steps=1", "-o", "Engine.save_load.save_steps=1"], Path("step_1")),
        "qat": (["qat", "--ckpt", step, "-o", "Engine.max_steps=1", "-o", "Engine.save_load.save_steps=1",
                 "-o", "Compress.Quantization.enable=True", *data], Path("step_1")),
        "eval": (["eval", "--ckpt", step, "-o", f"Offline_Eval.eval_path={root / 'text.txt'}",
                  "-o", "Offline_Eval.max_seq_len=32", *data], Path("")),
        "generate": (["generate", "--ckpt", step, "--prompt", "the quick", "-o", "Generation.max_dec_len=4",
                      "--no-stream", *data], Path("")),
        "ptq": (["ptq", "--ckpt", step, "-o", "Compress.Quantization.calib_batches=1", *data],
                Path("model.safetensors")),
        "analyze": (["analyze", "--mode", "ptq", "--float-ckpt", step, "--metric", "cosine", "--batches", "1",
                     "--no-plot", *data], Path("analysis.json")),
        "prune": (["prune", "--ckpt", step, "-o", "Engine.max_steps=1", "-o", "Engine.save_load.save_steps=1",
                   "-o", "Compress.Prune.ratio=0.25", *data], Path("step_1")),
        "export": (["export", "--ckpt", step, "--format", "hf"], Path("config.json")),
        "convert": (["convert", "--src", step], Path("model.safetensors")),
    }


OLD_SPELLINGS = {"preprocess": "--output-prefix", "eval": "--output", "generate": "--json"}
FILE_OUT = {"eval", "generate"}  # --out names a file
PREFIX_OUT = {"preprocess"}  # --out names a file-name prefix


@pytest.mark.parametrize("verb", ["preprocess", "tokenizer train", "pretrain", "qat", "eval", "generate", "ptq",
                                  "analyze", "prune", "export", "convert"])
def test_out_is_where_every_writer_writes(run, run_cli, tmp_path, verb):
    argv, made = _cases(run, tmp_path)[verb]
    flags = ["--out", *([OLD_SPELLINGS[verb]] if verb in OLD_SPELLINGS else [])]
    for i, flag in enumerate(flags):
        out = tmp_path / f"o{i}{'.json' if verb in FILE_OUT else ''}"
        code, _, err = run_cli(*argv, "--no-progress", flag, out)
        assert code == 0, (flag, err)
        if verb in FILE_OUT:
            assert json.loads(out.read_text()), flag
        elif verb in PREFIX_OUT:
            assert Path(f"{out}{made}").is_file(), flag
        else:
            assert (out / made).exists(), (flag, sorted(p.name for p in out.iterdir()))
    if verb == "pretrain":  # --out wins over -o Engine.save_load.output_dir
        assert not (tmp_path / "ignored").exists()
        # the helper the help names: the run's config records --out as its output_dir
        from gptforge.config import load_config

        assert Path(load_config(tmp_path / "o0" / "step_1" / "config.yaml").Engine.save_load.output_dir) == \
            tmp_path / "o0"


def test_finetune_out_overrides_output_dir(run, run_cli, tmp_path, monkeypatch):
    """finetune's --out reaches the config (a GLUE run itself is tested in test_finetune.py)."""
    import gptforge.finetune.run as ft

    seen = {}

    class Res:
        best, task, steps, checkpoint_dir = None, "SST2", 0, "x"

    def fake(cfg, ckpt, device=None, progress=None):
        seen["dir"] = cfg.Engine.save_load.output_dir
        return Res()

    monkeypatch.setattr(ft, "finetune", fake)
    code, _, err = run_cli("finetune", "-c", run / "run.yaml", "-o", "Engine.save_load.output_dir=a",
                           "--out", tmp_path / "ft")
    assert code == 0, err
    assert Path(seen["dir"]) == tmp_path / "ft"


def test_eval_default_is_the_working_directory_not_the_checkpoint(run, run_cli, tmp_path, monkeypatch):
    argv, _ = _cases(run, tmp_path)["eval"]
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(*argv, "--quiet")
    assert code == 0, err
    assert json.loads((tmp_path / "eval_results_wikitext.json").read_text())["metrics"]["ppl"] > 0
    assert not list((run / "out" / "step_2").glob("eval_results_*"))
    assert "ppl" in out.lower() or "perplexity" in out.lower()  # the results are printed too
