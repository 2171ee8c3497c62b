"""`gptforge generate`: our checkpoints and HF directories, streaming, prompt files, JSON, errors."""

from __future__ import annotations

import json

import pytest

from gf_testutil import spread_gpt2_vocab_dir
from gptforge.config.schema import GenerationConfig
from gptforge.data.tokenizer import gpt2_tokenizer
from gptforge.generate import generate
from gptforge.model_io import load_model, save_hf_dir

GREEDY = ["-o", "Generation.decode_strategy=greedy_search", "-o", "Generation.max_dec_len=8"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return spread_gpt2_vocab_dir(tmp_path_factory.mktemp("gen") / "model")


def _api(path, prompts, **kw):
    model, _ = load_model(path)
    return generate(model, gpt2_tokenizer(), prompts, GenerationConfig(**kw))


def test_single_prompt_streams_the_api_text(ckpt, run_cli):
    code, out, err = run_cli("generate", "--ckpt", ckpt, "--prompt", "Hello world", *GREEDY)
    assert code == 0, err
    expected = _api(ckpt, "Hello world", decode_strategy="greedy_search", max_dec_len=8).texts[0][0]
    assert out == "Hello world" + expected + "\n"
    assert "new tokens in" in err
    code, out2, _ = run_cli("generate", "--ckpt", ckpt, "--prompt", "Hello world", "--no-stream", *GREEDY)
    assert code == 0 and out2 == out


def test_prompt_file_batches_and_writes_json(ckpt, tmp_path, run_cli):
    prompts = ["The cat sat", "Once upon a time there was", "A"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    code, out, err = run_cli("generate", "--ckpt", ckpt, "--prompt-file", tmp_path / "p.txt", "--batch-size", "2",
                             "-o", "Generation.decode_strategy=beam_search", "-o", "Generation.num_beams=3",
                             "-o", "Generation.num_return_sequences=2", "-o", "Generation.max_dec_len=6",
                             "--json", tmp_path / "out" / "gen.json")
    assert code == 0, err
    data = json.loads((tmp_path / "out" / "gen.json").read_text(encoding="utf-8"))
    assert [r["prompt"] for r in data["results"]] == prompts
    ref = _api(ckpt, prompts, decode_strategy="beam_search", num_beams=3, num_return_sequences=2, max_dec_len=6)
    for r, texts, scores in zip(data["results"], ref.texts, ref.scores, strict=True):
        assert [c["text"] for c in r["completions"]] == texts
        assert [c["score"] for c in r["completions"]] == pytest.approx(scores, abs=1e-5)
    assert data["generation"]["num_beams"] == 3
    assert out.count("### prompt") == 6 and prompts[1] + ref.texts[1][0] in out


def test_hf_directory_and_sampling_seed(ckpt, tmp_path, run_cli):
    model, cfg = load_model(ckpt)
    save_hf_dir(model, cfg, tmp_path / "hf", gpt2_tokenizer())
    args = ["generate", "--ckpt", tmp_path / "hf", "--prompt", "Hi there", "-o", "Generation.seed=4",
            "-o", "Generation.top_k=50", "-o", "Generation.max_dec_len=10"]
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert run_cli(*args)[1] == out  # seeded: reproducible
    expected = _api(ckpt, "Hi there", seed=4, top_k=50, max_dec_len=10).texts[0][0]
    assert out == "Hi there" + expected + "\n"


@pytest.mark.parametrize("extra,match", [
    ([], "give a prompt"),
    (["--prompt", ""], "empty"),
    (["--prompt", "x", "-o", "Generation.top_p=2"], "Generation.top_p"),
    (["--prompt", "x", "-o", "Generation.temperature=0"], "Generation.temperature"),
    (["--prompt", "x", "--stream", "-o", "Generation.decode_strategy=beam_search", "-o", "Generation.num_beams=2"],
     "--stream"),
    (["--prompt", " ".join(["word"] * 300)], "has 300 tokens"),
])
def test_errors_are_one_line(ckpt, run_cli, extra, match):
    code, out, err = run_cli("generate", "--ckpt", ckpt, *extra)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err


def test_a_mistyped_allocator_switch_is_one_line(ckpt, run_cli, monkeypatch):
    """GPTFORGE_MALLOC_TUNING takes 0 or 1: `off` would otherwise be read as on, silently."""
    monkeypatch.setenv("GPTFORGE_MALLOC_TUNING", "off")
    code, _, err = run_cli("generate", "--ckpt", ckpt, "--prompt", "x", *GREEDY)
    assert code == 2 and "GPTFORGE_MALLOC_TUNING='off'" in err and len(err.strip().splitlines()) == 1, err


def test_blank_prompt_line_and_missing_ckpt(ckpt, tmp_path, run_cli):
    (tmp_path / "p.txt").write_text("one\n\nthree\n", encoding="utf-8")
    code, _, err = run_cli("generate", "--ckpt", ckpt, "--prompt-file", tmp_path / "p.txt")
    assert code == 2 and "p.txt:2: empty prompt line" in err
    code, _, err = run_cli("generate", "--prompt", "x")
    assert code == 2 and "--ckpt" in err


def test_truncate_prompt_flag(ckpt, run_cli):
    code, out, err = run_cli("generate", "--ckpt", ckpt, "--prompt", " ".join(["word"] * 300), "--truncate-prompt", *GREEDY)
    assert code == 0, err
