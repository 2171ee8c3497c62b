"""`gptforge infer`: the ONNX model in onnxruntime generates what `gptforge generate` generates
from the same checkpoint (fp32 and INT8; greedy, batched, streamed, seeded sampling, beam
search), and its errors are one line."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("onnxruntime")

PROMPTS = ["the quick brown fox", "pack my box", "sphinx of black quartz, judge my"]
GREEDY = ["-o", "Generation.decode_strategy=greedy_search", "-o", "Generation.max_dec_len=12"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _both(run_cli, model_dir, onnx_dir, *args):
    """(stdout of generate, stdout of infer) for the same arguments."""
    code, want, err = run_cli("generate", "--ckpt", model_dir, *args)
    assert code == 0, err
    code, got, err = run_cli("infer", "--onnx", onnx_dir, *args)
    assert code == 0, err
    assert "gptforge infer:" in err and "new tokens in" in err
    return want, got


def _same_but_scores(want: str, got: str, tol: float) -> None:
    score = re.compile(r"score (-?[0-9.]+)")
    assert score.sub("score S", got) == score.sub("score S", want)
    for a, b in zip(score.findall(want), score.findall(got), strict=True):
        assert abs(float(a) - float(b)) <= tol, (a, b)


@pytest.mark.parametrize("which", ["fp32", "int8"])
def test_infer_greedy_equals_generate(run_cli, which, fp32, int8, tmp_path):
    model_dir, onnx_dir = fp32 if which == "fp32" else int8
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    # several prompts of different lengths: one left-padded batch
    # --force: infer writes over the file generate wrote (the JSON checked below is infer's)
    want, got = _both(run_cli, model_dir, onnx_dir, *prompts, *GREEDY, "--json", tmp_path / "out.json", "--force")
    # Same tokens and text; the summed log-probabilities within a tolerance: the two engines'
    # attention kernels (gptforge's decode attention, onnxruntime's) differ in the last bits, and
    # a fake-quant model's activation rounding can turn that into ~1e-3 in a sequence's score.
    _same_but_scores(want, got, 1e-4 if which == "fp32" else 1e-2)
    assert want.count("### prompt") == 3
    data = json.loads((tmp_path / "out.json").read_text())
    assert [r["prompt"] for r in data["results"]] == PROMPTS
    assert all(len(r["completions"][0]["token_ids"]) > 0 for r in data["results"])
    # one prompt: streamed token by token
    want, got = _both(run_cli, model_dir, onnx_dir, "--prompt", PROMPTS[0], *GREEDY)
    assert got == want and got.startswith(PROMPTS[0]) and len(got) > len(PROMPTS[0]) + 1


def test_infer_sampling_and_beam_search_equal_generate(run_cli, fp32, tmp_path):
    model_dir, onnx_dir = fp32
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    want, got = _both(run_cli, model_dir, onnx_dir, "--prompt-file", tmp_path / "prompts.txt", "-o",
                      "Generation.seed=3", "-o", "Generation.top_k=20", "-o", "Generation.max_dec_len=10")
    assert got == want
    beams = ["-o", "Generation.decode_strategy=beam_search", "-o", "Generation.num_beams=3",
             "-o", "Generation.num_return_sequences=2", "-o", "Generation.max_dec_len=8"]
    want, got = _both(run_cli, model_dir, onnx_dir, "--prompt", PROMPTS[1], "--prompt", PROMPTS[2], *beams)
    strip = [line for line in want.splitlines() if not line.startswith("###")]  # scores may differ in ~1e-6
    assert [line for line in got.splitlines() if not line.startswith("###")] == strip and len(strip) == 4


def test_infer_errors_are_one_line(run_cli, fp32, tmp_path):
    model_dir, onnx_dir = fp32

    def fails(*args, needle):
        code, out, err = run_cli("infer", *args)
        assert code == 2 and err.startswith("gptforge infer: error:") and err.count("\n") == 1, err
        assert needle in err, err

    fails("--prompt", "x", needle="--ckpt DIR")
    fails("--onnx", tmp_path / "nope", "--prompt", "x", needle="not found")
    fails("--onnx", model_dir, "--prompt", "x", needle="a model directory, not an export")
    fails("--onnx", onnx_dir, needle="give a prompt")
    fails("--onnx", onnx_dir, "--prompt", "x", "-o", "Generation.top_p=2", needle="Generation.top_p")
    fails("--onnx", onnx_dir, "--prompt", "x", "-o", "Generation.decode_strategy=beam_search", "-o",
          "Generation.num_beams=2", "--stream", needle="--stream needs one sequence")
    fails("--onnx", onnx_dir, "--prompt", "x" * 400, needle="--truncate-prompt")
    other = tmp_path / "pt2"
    other.mkdir()
    (other / "gptforge_export.json").write_text(json.dumps({"format": "torch"}))
    fails("--onnx", other, "--prompt", "x", needle="holds a 'torch' export, not onnx")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "gptforge_export.json").write_text((onnx_dir / "gptforge_export.json").read_text())
    (broken / "model.onnx").write_bytes(b"not a model")
    fails("--onnx", broken, "--prompt", "x", needle="onnxruntime cannot load it")


def test_int8_storage_runs_exactly_on_any_cpu(run_cli, int8, tmp_path):
    """`--qdq-dtype int8` (the reference's form): `auto` fuses it only where onnxruntime's s8
    GEMM is exact, so `gptforge infer` still equals `gptforge generate`."""
    from gptforge.export.ort_session import s8_gemm_is_exact

    model_dir, _ = int8
    code, out, err = run_cli("export", "--format", "onnx", "--ckpt", model_dir, "--out", tmp_path / "s8",
                             "--qdq-dtype", "int8")
    assert code == 0, err
    assert f"int8 GEMMs {'on' if s8_gemm_is_exact() else 'off'}" in out
    meta = json.loads((tmp_path / "s8" / "gptforge_export.json").read_text())
    assert meta["qdq_dtype"] == "int8" and meta["check"]["argmax_agreement"] >= 0.99
    want, got = _both(run_cli, model_dir, tmp_path / "s8", "--prompt", PROMPTS[2], *GREEDY)
    assert got == want
