"""Validate before work: num_beams (vocabulary, memory), checkpoint tensor dtypes, path kinds.
Every failure is one line naming the key or the file, exit 2, before anything heavy runs."""

from __future__ import annotations

import shutil

import pytest
import torch

from gptforge.config.schema import GenerationConfig
from gptforge.errors import CheckpointError, ConfigError
from gptforge.generate import generate_ids
from gptforge.generate import memory as mem
from gptforge.generate.backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model directory (with a small tokenizer) saved the way `pretrain` saves them."""
    from gf_testutil import tiny_model
    from gptforge.model_io import save_model_dir
    from test_train_support import small_tokenizer

    model, cfg = tiny_model("Global.device=cpu")
    out = tmp_path_factory.mktemp("validation") / "model"
    save_model_dir(model, cfg, out, tokenizer=small_tokenizer())
    return out


@pytest.fixture(scope="module")
def tiny():
    from gf_testutil import tiny_model

    return tiny_model()[0]


def one_error_line(code: int, err: str, *needles: str) -> str:
    lines = [x for x in err.strip().splitlines() if x]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# --------------------------------------------------------------------------- num_beams


def test_num_beams_above_the_vocabulary_is_refused(tiny):
    cfg = GenerationConfig(decode_strategy="beam_search", num_beams=60000, max_dec_len=4)
    with pytest.raises(ConfigError, match=r"Generation.num_beams=60000: more beams than the vocabulary has "
                                          r"tokens \(4096\)"):
        generate_ids(tiny, [[1, 2, 3]], cfg)


def test_num_beams_beyond_free_memory_is_refused_before_allocating(tiny, monkeypatch):
    cfg = GenerationConfig(decode_strategy="beam_search", num_beams=4000, max_dec_len=64)
    monkeypatch.setattr(mem, "available_memory", lambda device: 50_000_000)  # 50 MB free
    allocated = []
    real = type(tiny).new_cache
    monkeypatch.setattr(type(tiny), "new_cache", lambda self, *a, **k: allocated.append(a) or real(self, *a, **k))
    with pytest.raises(ConfigError) as e:
        generate_ids(tiny, [[1, 2, 3]], cfg)
    msg = str(e.value)
    assert msg.startswith("Generation.num_beams=4000:") and "GB" in msg and "50.0 MB is free on cpu" in msg
    assert allocated == []  # refused before the first cache
    # sampling rows are num_return_sequences: named instead
    cfg = GenerationConfig(decode_strategy="sampling", num_return_sequences=4000, max_dec_len=64)
    with pytest.raises(ConfigError, match=r"^Generation.num_return_sequences=4000:"):
        generate_ids(tiny, [[1, 2, 3]], cfg)


def test_memory_estimate_bounds_the_real_kv_cache(tiny):
    """The estimate covers the KV cache beam search really allocates (all its copies)."""
    cfg = GenerationConfig(decode_strategy="beam_search", num_beams=8, max_dec_len=10)
    be = TorchBackend(tiny)
    cache = tiny.new_cache(2 * 8, 5 + 10)
    real_kv = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert mem.kv_bytes_per_position(be) * 2 * 8 * 15 == real_kv
    assert mem.decode_bytes(be, cfg, 2, 5) >= 2 * real_kv  # old + new copy during a reorder
    free = mem.available_memory("cpu")
    assert free is None or free > 0
    generate_ids(tiny, [[1, 2, 3], [4, 5, 6, 7, 8]], cfg)  # a sane request still runs


def test_cli_num_beams_is_one_line(model_dir, run_cli):
    code, _, err = run_cli("generate", "--ckpt", model_dir, "--prompt", "the quick", "-o", "Global.device=cpu",
                           "-o", "Generation.decode_strategy=beam_search", "-o", "Generation.num_beams=60000")
    one_error_line(code, err, "Generation.num_beams=60000", "vocabulary")


# --------------------------------------------------------------------------- dtypes


def _retype(src, dst, key: str, dtype: torch.dtype):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    sd[key] = sd[key].to(dtype)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_integer_tensors_in_safetensors_are_one_line(model_dir, tmp_path, run_cli, dtype):
    bad = _retype(model_dir, tmp_path / "bad", "blocks.0.linear1.weight", dtype)
    name = str(dtype).replace("torch.", "")
    for argv in (("generate", "--ckpt", bad, "--prompt", "hi", "-o", "Global.device=cpu"),
                 ("convert", "--src", bad, "--out", tmp_path / "cv")):
        code, _, err = run_cli(*argv)
        one_error_line(code, err, f"{bad / 'model.safetensors'}: tensor blocks.0.linear1.weight is {name}",
                       "floating-point")
    assert not (tmp_path / "cv").exists()


def test_integer_tensors_refused_on_resume(tmp_path):
    """A step checkpoint's weights are copied in place on resume: an int32 tensor would be cast
    into nonsense floats silently."""
    from gf_testutil import tiny_model
    from gptforge.model_io import WEIGHTS_FILE, save_model_dir
    from gptforge.train.checkpoint import load_model_weights

    model, cfg = tiny_model()
    save_model_dir(model, cfg, tmp_path / "ok")
    bad = _retype(tmp_path / "ok", tmp_path / "bad", "wpe.weight", torch.int32)
    with pytest.raises(CheckpointError, match=f"{bad / WEIGHTS_FILE}: tensor wpe.weight is int32"):
        load_model_weights(bad, model)


def test_int8_weights_must_stay_int8(tmp_path):
    from gptforge.model_io import check_dtypes

    expected = {"w": torch.zeros(2, dtype=torch.int8), "s": torch.zeros(2)}
    check_dtypes(expected, {"w": torch.zeros(2, dtype=torch.int8), "s": torch.zeros(2, dtype=torch.float16)}, "f")
    with pytest.raises(CheckpointError, match="tensor w is float32 but the model expects int8"):
        check_dtypes(expected, {"w": torch.zeros(2), "s": torch.zeros(2)}, "f")


# --------------------------------------------------------------------------- path kinds


def test_prompt_file_that_is_a_directory(model_dir, tmp_path, run_cli):
    code, _, err = run_cli("generate", "--ckpt", model_dir, "--prompt-file", tmp_path, "-o", "Global.device=cpu")
    one_error_line(code, err, f"--prompt-file {tmp_path}: is a directory, expected a file")
    code, _, err = run_cli("generate", "--ckpt", model_dir, "--prompt-file", tmp_path / "nope.txt")
    one_error_line(code, err, "nope.txt: not found")


def test_input_dir_that_is_a_text_file(tmp_path, run_cli):
    from gptforge.config import save_config
    from test_train_support import train_config

    text = tmp_path / "corpus.txt"
    text.write_text("some raw text that was never preprocessed\n")
    cfg = train_config(tmp_path, f"Data.Train.dataset.input_dir={text}", f"Data.Eval.dataset.input_dir={text}")
    save_config(cfg, tmp_path / "run.yaml")
    code, _, err = run_cli("pretrain", "-c", tmp_path / "run.yaml", "--no-progress")
    one_error_line(code, err, f"{text}: is a file, expected a directory", "gptforge preprocess")


def test_ckpt_that_is_a_plain_file(tmp_path, run_cli):
    f = tmp_path / "weights.txt"
    f.write_text("x")
    code, _, err = run_cli("generate", "--ckpt", f, "--prompt", "hi")
    one_error_line(code, err, f"{f}: is a file, expected a directory")


def test_eval_file_that_is_a_directory_and_output_that_is_a_directory(model_dir, tmp_path, run_cli):
    code, _, err = run_cli("eval", "--ckpt", model_dir, "-o", f"Offline_Eval.eval_path={tmp_path}",
                           "-o", "Global.device=cpu", "--no-progress")
    one_error_line(code, err, f"{tmp_path}: is a directory, expected a file")
    (tmp_path / "wiki.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    (tmp_path / "res").mkdir()
    code, _, err = run_cli("eval", "--ckpt", model_dir, "-o", f"Offline_Eval.eval_path={tmp_path / 'wiki.txt'}",
                           "-o", "Offline_Eval.max_seq_len=32", "-o", "Global.device=cpu", "--no-progress",
                           "--output", tmp_path / "res")
    one_error_line(code, err, f"{tmp_path / 'res'}: is a directory, expected a file")


def test_out_dir_that_is_a_file_is_never_replaced(model_dir, tmp_path, run_cli):
    f = tmp_path / "precious.txt"
    f.write_text("keep me")
    code, _, err = run_cli("convert", "--src", model_dir, "--out", f, "--force")
    one_error_line(code, err, f"{f}: is a file, expected a directory")
    assert f.read_text() == "keep me"


def test_config_and_resume_kinds(model_dir, tmp_path, run_cli):
    code, _, err = run_cli("config", "show", "-c", tmp_path)
    one_error_line(code, err, f"{tmp_path}: is a directory")
    f = tmp_path / "step.txt"
    f.write_text("x")
    from gptforge.train.checkpoint import resolve_resume_dir

    with pytest.raises(CheckpointError, match="is a file, expected a directory"):
        resolve_resume_dir(f)
