"""Model directories are relocatable (issue #16, finding 8): every kind of directory gptforge
writes, made by runs that named their inputs with paths relative to where they started (as the
demo's recipes did), still generates, evaluates and exports the same after it is copied to
another place, the original tree is gone, and the command runs from a third directory, one
that holds a different tokenizer at the old relative path (a decoy a cwd-relative lookup would
silently pick)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from gptforge.config.loader import PATH_KEYS, _at
from gptforge.model_io import load_run_config
from test_train_support import small_tokenizer, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")

# Each kind of directory, relative to the start directory of the runs that made it.
KINDS = {
    "float": "runs/float/step_4",
    "qat": "runs/qat/step_2",
    "int8": "runs/int8",
    "pruned": "runs/pruned/pruned",
    "hf": "runs/hf",
}
GREEDY = ("-o", "Generation.decode_strategy=greedy_search", "-o", "Generation.max_dec_len=6", "--no-stream")
EVAL = ("-o", "Offline_Eval.max_seq_len=32", "-o", "Offline_Eval.overlapping_eval=16", "--no-progress")
TEXT = "the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs. " * 6

RECIPE = """\
Model: {preset: tiny, hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0}
Global: {device: cpu, global_batch_size: 4, micro_batch_size: 2, seed: 3}
Engine:
  max_steps: 4
  logging_freq: 2
  eval_freq: 0
  mix_precision: {enable: false}
  save_load: {output_dir: runs/float, save_steps: 4}
Data:
  tokenizer: runs/tok
  Train: {dataset: {input_dir: runs/data/corpus, max_seq_len: 32}, loader: {num_workers: 0}}
  Eval: {dataset: {input_dir: runs/data/corpus, max_seq_len: 32}, loader: {num_workers: 0}}
Optimizer: {lr: {max_lr: 2.0e-3, min_lr: 1.0e-4}}
"""


@contextlib.contextmanager
def cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def cli(*argv) -> tuple[int, str, str]:
    """`gptforge ...` in-process, capturing its output (module fixtures cannot use capsys)."""
    import io

    from gptforge.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def ok(*argv) -> str:
    code, out, err = cli(*argv)
    assert code == 0, f"gptforge {' '.join(map(str, argv))}: {err[-2000:]}"
    return out


def decoy_tokenizer():
    """Another byte-level BPE of the same size: other merges, so other ids for the same text."""
    from gptforge.data.tokenizer import train_tokenizer

    return train_tokenizer(["sphinx of black quartz, judge my vow. zebras quickly jump. " * 4] * 40,
                           vocab_size=300, show_progress=False)


def outputs(root: Path, prefix: Path) -> dict[str, object]:
    """What each directory under `prefix` produces, run from `root` (the cwd)."""
    got: dict[str, object] = {}
    with cwd(root):
        (root / "eval.txt").write_text(TEXT, encoding="utf-8")
        for kind, rel in KINDS.items():
            got[f"generate {kind}"] = ok("generate", "--ckpt", prefix / rel, "--prompt", "the quick", *GREEDY)
        for kind in ("float", "int8"):
            res = root / f"eval_{kind}.json"
            ok("eval", "--ckpt", prefix / KINDS[kind], "-o", f"Offline_Eval.eval_path={root / 'eval.txt'}", *EVAL,
               "--output", res)
            got[f"eval {kind}"] = json.loads(res.read_text())["metrics"]["avg_loss"]
        out = root / "export_pruned_hf"
        ok("export", "--ckpt", prefix / KINDS["pruned"], "--format", "hf", "--out", out)
        got["export pruned"] = ok("generate", "--ckpt", out, "--prompt", "the quick", *GREEDY)
        got["infer onnx"] = ok("infer", "--onnx", prefix / "runs/onnx", "--prompt", "the quick", *GREEDY)
    return got


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(start dir, what its directories produce there): every kind made with relative paths."""
    start = tmp_path_factory.mktemp("start")
    with cwd(start):
        small_tokenizer().save(Path("runs/tok"))
        write_corpus(Path("runs/data"))
        Path("pretrain.yaml").write_text(RECIPE, encoding="utf-8")
        ok("pretrain", "-c", "pretrain.yaml", "--no-progress")
        ok("qat", "--ckpt", KINDS["float"], "-c", "pretrain.yaml", "-o", "Engine.save_load.output_dir=runs/qat",
           "-o", "Engine.max_steps=2", "-o", "Engine.save_load.save_steps=2", "-o", "Compress.Quantization.enable=true",
           "--no-progress")
        ok("quantize", "--ckpt", KINDS["qat"], "--out", KINDS["int8"], "--convert")
        ok("prune", "--ckpt", KINDS["float"], "-c", "pretrain.yaml", "--out", "runs/pruned", "-o", "Engine.max_steps=0",
           "-o", "Compress.Prune.enable=true", "-o", "Compress.Prune.head_ratio=0.5", "-o", "Compress.Prune.ffn_ratio=0.25")
        ok("export", "--ckpt", KINDS["float"], "--format", "hf", "--out", KINDS["hf"])
        ok("export", "--ckpt", KINDS["float"], "--format", "onnx", "--out", "runs/onnx", "--no-check")
    return start, outputs(start, start)


def test_saved_configs_store_no_relative_path(made):
    start, _ = made
    configs = list((start / "runs").rglob("config.yaml"))
    assert len(configs) >= 7  # run dirs, step dirs, int8, pruned, onnx export
    for f in configs:
        raw = yaml.safe_load(f.read_text())
        for key, words in PATH_KEYS.items():
            v = _at(raw, key)
            assert v is None or v.lower() in words or os.path.isabs(v), (f, key, v)
    # the tokenizer the runs named by a relative path is recorded absolute
    assert yaml.safe_load((start / KINDS["float"] / "config.yaml").read_text())["Data"]["tokenizer"] == \
        str(start / "runs" / "tok")


def test_copied_directories_give_the_same_outputs_from_another_directory(made, tmp_path):
    start, expected = made
    moved = tmp_path / "moved"
    shutil.copytree(start / "runs", moved / "runs")
    hidden = start.with_name(start.name + "_gone")
    os.rename(start, hidden)  # as on another machine: the paths the runs recorded do not exist
    try:
        third = tmp_path / "third"
        decoy_tokenizer().save(third / "runs" / "tok")
        got = outputs(third, moved)
        # a copied run resumes next to its checkpoint (its data named again: the old tree is gone)
        data = moved / "runs" / "data" / "corpus"
        with cwd(third):
            ok("pretrain", "--ckpt", moved / KINDS["float"], "-o", "Engine.max_steps=6", "-o",
               "Engine.save_load.save_steps=2", "-o", f"Data.Train.dataset.input_dir={data}",
               "-o", f"Data.Eval.dataset.input_dir={data}", "--no-progress")
        assert (moved / "runs" / "float" / "step_6" / "model.safetensors").is_file()
        assert not (third / "runs" / "float").exists() and not (hidden / "runs" / "float" / "step_6").exists()
    finally:
        os.rename(hidden, start)
    assert got == expected


def _legacy(step: Path) -> None:
    """Rewrite a step's config.yaml as gptforge wrote it before: paths relative to its start dir."""
    f = step / "config.yaml"
    raw = yaml.safe_load(f.read_text())
    raw["Data"]["tokenizer"] = "runs/tok"
    for split in ("Train", "Eval", "Test"):
        raw["Data"][split]["dataset"]["input_dir"] = "runs/data/corpus"
    raw["Engine"]["save_load"]["output_dir"] = "runs/float"
    f.write_text(yaml.safe_dump(raw, sort_keys=False))


def test_an_older_directory_with_relative_paths_uses_its_own_tokenizer(made, tmp_path):
    start, expected = made
    step = tmp_path / "old" / "step_4"
    shutil.copytree(start / KINDS["float"], step)
    _legacy(step)
    third = tmp_path / "third"
    decoy_tokenizer().save(third / "runs" / "tok")
    (third / "runs" / "float").mkdir()
    with cwd(third):
        code, out, err = cli("generate", "--ckpt", step, "--prompt", "the quick", *GREEDY)
        assert code == 0, err
        assert out == expected["generate float"]
        # the data and output paths relative to a start dir nobody knows are not read against this one
        assert "ignoring Data.Train.dataset.input_dir=runs/data/corpus" in err

        cfg = load_run_config(ckpt_dir=step)
        # a step's run directory is the one it is in now
        assert cfg.Data.tokenizer is None and cfg.Engine.save_load.output_dir == str(step.parent)
        assert cfg.Data.Train.dataset.input_dir == "./data/"  # the default, not runs/data/corpus
        # a -o still chooses, as with any checkpoint
        cfg = load_run_config(overrides=["Data.tokenizer=runs/tok"], ckpt_dir=step)
        assert cfg.Data.tokenizer == "runs/tok"


def test_a_relative_tokenizer_without_tokenizer_files_is_one_line(made, tmp_path):
    start, _ = made
    step = tmp_path / "old" / "step_4"
    shutil.copytree(start / KINDS["float"], step)
    _legacy(step)
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        (step / name).unlink(missing_ok=True)
    with cwd(tmp_path):
        code, _, err = cli("generate", "--ckpt", step, "--prompt", "x", *GREEDY)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "Data.tokenizer: the checkpoint" in err and "'runs/tok'" in err and "-o Data.tokenizer=PATH" in err


def test_the_demo_recipes_store_absolute_paths(tmp_path):
    from gptforge.demo.plan import Paths, Settings, Steps, write_configs

    with cwd(tmp_path):
        s = Settings(out="runs/demo", quick=True)
        files = write_configs(s, Paths(s.out), Steps(step_seconds=0.1, pretrain=20, finetune=20, device="cpu"))
    for f in files.values():
        raw = yaml.safe_load(Path(tmp_path, f).read_text())
        assert raw["Data"]["tokenizer"] == str(tmp_path / "runs" / "demo" / "tokenizer")
        assert raw["Data"]["Train"]["dataset"]["input_dir"] == str(tmp_path / "runs" / "demo" / "data" / "builtin")
        assert os.path.isabs(raw["Engine"]["save_load"]["output_dir"])


def test_a_recorded_resume_source_does_not_block_a_later_ckpt(made, tmp_path):
    """A run launched with Engine.save_load.ckpt_dir records it; loading its checkpoint must
    not inherit it (it made `pretrain --ckpt` of the newer step a conflict)."""
    start, _ = made
    step = tmp_path / "run" / "step_4"
    shutil.copytree(start / KINDS["float"], step)
    raw = yaml.safe_load((step / "config.yaml").read_text())
    raw["Engine"]["save_load"]["ckpt_dir"] = str(start / "runs" / "float" / "step_2")
    (step / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))

    assert load_run_config(ckpt_dir=step).Engine.save_load.ckpt_dir is None
