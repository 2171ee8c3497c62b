"""Truncated, emptied and corrupted files of every kind gptforge reads: each must give exit 2
and one line naming the file, never a traceback and never a silently wrong result.

One small world is built once (a 2-step training run with its step checkpoint, token files and
index maps, an HF directory, a .pdparams, an ONNX export, eval and prompt files); each case
copies it, damages one file and runs the verb that reads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = ("truncated", "empty", "garbage")


def damage(path: Path, mode: str) -> None:
    data = path.read_bytes()
    if mode == "truncated":
        cut = max(1, len(data) // 2)
        if path.suffix in (".yaml", ".yml"):
            # cut a key before its colon: a YAML cut at a line break or inside a value can
            # still parse (a shorter config), one cut inside a key cannot
            cut = max(1, data.rfind(b":", 0, cut))
        path.write_bytes(data[:cut])
    elif mode == "empty":
        path.write_bytes(b"")
    else:  # bytes no text or binary format accepts: invalid UTF-8, no magic numbers
        rng = np.random.default_rng(len(data))
        junk = rng.integers(0x80, 0x100, size=max(64, len(data)), dtype=np.uint8).tobytes()
        path.write_bytes(b"\xff\xfe\x00" + junk)


@pytest.fixture(scope="module")
def world(tmp_path_factory, fp32):
    from gf_testutil import tiny_model
    from gptforge.config import save_config
    from gptforge.model_io import save_hf_dir
    from gptforge.train import pretrain
    from test_convert_paddle import paddle_arrays, write_pdparams
    from test_eval import make_lambada
    from test_train_support import small_tokenizer, train_config

    root = tmp_path_factory.mktemp("badfiles") / "world"
    cfg = train_config(root, "Engine.save_load.save_steps=2", "Engine.eval_freq=100", steps=2)
    save_config(cfg, root / "run.yaml")
    pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    model, mcfg = tiny_model()
    save_hf_dir(model, mcfg, root / "hf", tokenizer=small_tokenizer())
    write_pdparams(root / "model.pdparams", paddle_arrays(np.random.default_rng(0)))
    shutil.copytree(fp32[1], root / "onnx")
    tok = root / "tok_vm"
    tok.mkdir()
    for f in ("vocab.json", "merges.txt"):
        shutil.copy(root / "tok" / f, tok / f)
    make_lambada(root / "lambada.jsonl", n=6)
    (root / "wiki.txt").write_text("the quick brown fox jumps over the lazy dog. " * 30)
    (root / "prompts.txt").write_text("the quick\nsphinx of\n")
    return root


def _pretrain(w: Path, resume: bool = False):
    """Resume the world's run to step 4, or start a new run over its token files (as long as
    the world's: it reads the index maps the world's run built)."""
    from gptforge.config import save_config
    from test_train_support import train_config

    out = [] if resume else [f"Engine.save_load.output_dir={w / 'out2'}"]
    name = "resume.yaml" if resume else "fresh.yaml"
    save_config(train_config(w, "Engine.save_load.save_steps=2", "Engine.eval_freq=100", *out,
                             steps=4 if resume else 2), w / name)
    return ("pretrain", "-c", w / name, "--no-progress", *(["--resume", "auto"] if resume else []))


CPU = ("-o", "Global.device=cpu")
# file (relative to the world) -> (the command that reads it, the modes that must fail)
CASES: dict[str, tuple] = {
    "out/step_2/model.safetensors": (lambda w: ("generate", "--ckpt", w / "out/step_2", "--prompt", "hi", *CPU), MODES),
    "out/step_2/config.yaml": (lambda w: ("generate", "--ckpt", w / "out/step_2", "--prompt", "hi", *CPU), MODES),
    "out/step_2/tokenizer.json": (lambda w: ("tokenizer", "show", "--ckpt", w / "out/step_2"), MODES),
    "out/step_2/training_state.pt": (lambda w: _pretrain(w, resume=True), MODES),
    "out/step_2/trainer_state.json": (lambda w: _pretrain(w, resume=True), MODES),
    "tok_vm/vocab.json": (lambda w: ("tokenizer", "show", "--tokenizer", w / "tok_vm"), MODES),
    "tok_vm/merges.txt": (lambda w: ("tokenizer", "show", "--tokenizer", w / "tok_vm"), ("garbage",)),
    "data/corpus_ids.npy": (lambda w: _pretrain(w), MODES),
    "data/corpus_idx.npz": (lambda w: _pretrain(w), MODES),
    "hf/config.json": (lambda w: ("generate", "--ckpt", w / "hf", "--prompt", "hi", *CPU), MODES),
    "hf/model.safetensors": (lambda w: ("generate", "--ckpt", w / "hf", "--prompt", "hi", *CPU), MODES),
    "model.pdparams": (lambda w: ("convert", "--src", w / "model.pdparams", "--out", w / "cv",
                                  "-o", "Model.num_attention_heads=4"), MODES),
    "onnx/model.onnx": (lambda w: ("infer", "--onnx", w / "onnx", "--prompt", "hi"), MODES),
    "onnx/gptforge_export.json": (lambda w: ("infer", "--onnx", w / "onnx", "--prompt", "hi"), MODES),
    "lambada.jsonl": (lambda w: ("eval", "--ckpt", w / "out/step_2", "--no-progress", *CPU, "-o",
                                 "Offline_Eval.cloze_eval=True", "-o", f"Offline_Eval.eval_path={w / 'lambada.jsonl'}",
                                 "-o", "Offline_Eval.max_seq_len=32"), MODES),
    "wiki.txt": (lambda w: ("eval", "--ckpt", w / "out/step_2", "--no-progress", *CPU,
                            "-o", f"Offline_Eval.eval_path={w / 'wiki.txt'}", "-o", "Offline_Eval.max_seq_len=32"),
                 ("empty", "garbage")),
    "prompts.txt": (lambda w: ("generate", "--ckpt", w / "out/step_2", "--prompt-file", w / "prompts.txt", *CPU),
                    ("empty", "garbage")),
    # a user's -c file cut short is often still a valid (shorter) YAML: only garbage is detectable
    "run.yaml": (lambda w: ("config", "show", "-c", w / "run.yaml"), ("garbage",)),
}

PARAMS = [pytest.param(f, m, id=f"{f}-{m}") for f, (_, modes) in CASES.items() for m in modes]


# Index maps are a cache: a damaged one is rebuilt, never trusted and never fatal.
CACHES = ("data/corpus_gpt_Train_indexmap_*_sample_idx.npy", "data/corpus_gpt_Train_indexmap_*_doc_idx.npy",
          "data/corpus_gpt_Train_indexmap_*_info.json")


def _copy_world(world: Path, w: Path) -> None:
    shutil.copytree(world, w, symlinks=True)
    for f in (w / "out" / "config.yaml", w / "out" / "step_2" / "config.yaml"):
        f.write_text(f.read_text().replace(str(world), str(w)))  # the copied run's config points at the copy


def _one(w: Path, rel: str) -> Path:
    found = sorted(w.glob(rel))
    assert len(found) == 1, (rel, found)
    return found[0]


@pytest.mark.parametrize("rel, mode", [pytest.param(f, m, id=f"{f}-{m}") for f in CACHES for m in MODES])
def test_damaged_index_map_cache_is_rebuilt(world, tmp_path, run_cli, rel, mode):
    w = tmp_path / "w"
    _copy_world(world, w)
    target = _one(w, rel)
    good = target.read_bytes()
    damage(target, mode)
    code, out, err = run_cli(*_pretrain(w))
    assert code == 0, err[-2000:]
    assert "built Train index maps" in err
    assert target.read_bytes() == good  # the same maps, written whole again


@pytest.mark.parametrize("rel, mode", PARAMS)
def test_damaged_file_is_one_line_naming_it(world, tmp_path, run_cli, rel, mode):
    w = tmp_path / "w"
    _copy_world(world, w)
    target = _one(w, rel)
    argv = CASES[rel][0](w)
    damage(target, mode)
    code, out, err = run_cli(*argv)
    lines = [x for x in err.strip().splitlines() if x.startswith("gptforge ") and ": error: " in x]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err[-2000:])
    assert target.name in lines[0], lines[0]


def test_world_is_sound(world, tmp_path, run_cli, monkeypatch):
    """The undamaged files all work, so each failure above is the damage's doing."""
    monkeypatch.chdir(tmp_path)  # `eval` writes its results in the working directory by default
    w = tmp_path / "w"
    _copy_world(world, w)
    seen = set()
    for rel, (cmd, _) in CASES.items():
        argv = tuple(map(str, cmd(w)))
        if argv in seen:
            continue
        seen.add(argv)
        code, out, err = run_cli(*argv)
        assert code == 0, (rel, err[-2000:])
        json.dumps(out)  # printable


@pytest.mark.parametrize("mode", MODES)
def test_damaged_analysis_state(tmp_path, mode):
    """`gptforge analyze` resumes from its state file; a damaged one is one line naming it."""
    from gptforge.compress.sensitivity import read_state
    from gptforge.errors import UsageError

    f = tmp_path / "analysis.json"
    f.write_text(json.dumps({"format": "x", "fingerprint": {}, "layers": {"a": 1.0}}))
    damage(f, mode)
    with pytest.raises(UsageError, match=f"{f}: "):
        read_state(f, {})
