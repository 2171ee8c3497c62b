"""The one loader (`generate.loader`): every model kind runs through the library API as through
the CLI (pruned, QAT, an HF export, ONNX fp32 and INT8), and an ONNX draft works from the
library (`generate(..., Generation.draft=ONNX_DIR)`) as from `gptforge generate`."""

from __future__ import annotations

import dataclasses

import pytest

from gptforge.config.schema import GenerationConfig
from gptforge.errors import CheckpointError
from gptforge.generate import generate
from gptforge.generate.loader import load_draft, load_runnable

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["the quick brown fox", "pack my box"]
GREEDY = GenerationConfig(decode_strategy="greedy_search", max_dec_len=8)


def _cli_texts(run_cli, path, onnx: bool) -> list[str]:
    args = ["infer", "--onnx", path] if onnx else ["generate", "--ckpt", path]
    code, out, err = run_cli(*args, *[a for p in PROMPTS for a in ("--prompt", p)], "--no-stream",
                             "-o", "Generation.decode_strategy=greedy_search", "-o", "Generation.max_dec_len=8")
    assert code == 0, err
    return [line for line in out.splitlines() if not line.startswith("### ")]


def test_every_model_kind_runs_through_the_library_as_through_the_cli(run_cli, fp32, int8, tmp_path):
    pruned_dir, onnx_fp32 = fp32
    qat_dir, onnx_int8 = int8
    code, _, err = run_cli("export", "--format", "hf", "--ckpt", pruned_dir, "--out", tmp_path / "hf")
    assert code == 0, err
    kinds = [(pruned_dir, False), (qat_dir, False), (tmp_path / "hf", False), (onnx_fp32, True), (onnx_int8, True)]
    for path, onnx in kinds:
        runnable, cfg, tok = load_runnable(path)
        assert onnx == (not hasattr(runnable, "wte")), path  # ONNX runs in onnxruntime, the rest is our GPT
        res = generate(runnable, tok, PROMPTS, GREEDY)
        assert [p + t[0] for p, t in zip(PROMPTS, res.texts, strict=True)] == _cli_texts(run_cli, path, onnx), path


def test_an_onnx_draft_works_through_the_library(fp32, int8):
    pruned_dir, onnx_fp32 = fp32
    _, onnx_int8 = int8
    model, cfg, tok = load_runnable(pruned_dir)
    plain = generate(model, tok, PROMPTS, GREEDY)
    spec = generate(model, tok, PROMPTS, dataclasses.replace(GREEDY, draft=str(onnx_int8), num_draft_tokens="3"))
    assert spec.texts == plain.texts
    assert spec.speculative is not None and spec.speculative.drafted > 0 and spec.speculative.rounds > 0
    # an ONNX target with a model-directory draft, and a draft passed as a loaded backend
    backend, _, otok = load_runnable(onnx_fp32)
    draft = load_draft(onnx_int8, tokenizer=otok)
    spec = generate(backend, otok, PROMPTS, dataclasses.replace(GREEDY, num_draft_tokens="2"), draft=draft)
    assert spec.texts == generate(backend, otok, PROMPTS, GREEDY).texts
    spec = generate(backend, otok, PROMPTS, dataclasses.replace(GREEDY, draft=str(pruned_dir)))
    assert spec.texts == plain.texts and spec.speculative.accepted > 0  # the same model, exported


def test_a_draft_with_another_tokenizer_is_refused_by_the_library(fp32, tmp_path):
    from gf_testutil import tiny_model
    from gptforge.data.tokenizer import train_tokenizer
    from gptforge.model_io import save_model_dir

    pruned_dir, _ = fp32
    model, _, tok = load_runnable(pruned_dir)
    m, mcfg = tiny_model()
    other = train_tokenizer(["sphinx of black quartz, judge my vow. " * 20], vocab_size=280, show_progress=False)
    save_model_dir(m, mcfg, tmp_path / "draft", tokenizer=other)
    with pytest.raises(CheckpointError, match="tokenizer"):
        generate(model, tok, PROMPTS, dataclasses.replace(GREEDY, draft=str(tmp_path / "draft")))
