"""The command line users already know (issue #34): defaults that fit the model, the sampling
flags of LitGPT / transformers as `-o` overrides, errors that name the verb, one `--ckpt`, quiet
`--quiet`, speculative decoding figures, docs readable from a wheel, no telemetry files, honest
demo output."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import gptforge
from gf_testutil import spread_gpt2_vocab_dir
from gptforge.cli import VERBS, build_parser

ROOT = Path(__file__).resolve().parents[1]
SRC = str(Path(gptforge.__file__).resolve().parents[1])  # the gptforge under test, for subprocesses
GREEDY = ["-o", "Generation.decode_strategy=greedy_search"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model (context 256 positions) with GPT-2's tokenizer, as a model directory."""
    return spread_gpt2_vocab_dir(tmp_path_factory.mktemp("habits") / "model")


def _parser(verb: str, *sub: str) -> argparse.ArgumentParser:
    p = build_parser(verb)
    for name in (verb, *sub):
        p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return p


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GPTFORGE_PROGRESS", "GPTFORGE_QUIET")}
    env.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1", **extra)
    return env


# ------------------------------------------------------------------ item 2: eval's default window


def test_eval_window_defaults_to_the_model_context(model_dir, tmp_path, run_cli):
    text = tmp_path / "wiki.txt"
    text.write_text(" The quick brown fox jumps over the lazy dog . \n" * 30)
    out = tmp_path / "r.json"
    code, _, err = run_cli("eval", "--ckpt", model_dir, "-o", f"Offline_Eval.eval_path={text}", "--out", out,
                           "--no-progress")
    assert code == 0, err
    res = json.loads(out.read_text())
    assert res["config"]["max_seq_len"] is None and res["metrics"]["windows"] >= 1
    # an explicit window longer than the context is still one clear error
    code, _, err = run_cli("eval", "--ckpt", model_dir, "-o", f"Offline_Eval.eval_path={text}",
                           "-o", "Offline_Eval.max_seq_len=1024")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "Offline_Eval.max_seq_len=1024: longer than the model's context (256 positions)" in err
    # a checkpoint written by an older gptforge stored the old default (1024): it is not a choice
    old = tmp_path / "old"
    old.mkdir()
    for f in model_dir.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    raw = yaml.safe_load((old / "config.yaml").read_text())
    raw.setdefault("Offline_Eval", {})["max_seq_len"] = 1024
    (old / "config.yaml").write_text(yaml.safe_dump(raw))
    code, _, err = run_cli("eval", "--ckpt", old, "-o", f"Offline_Eval.eval_path={text}", "--out", out, "--force",
                           "--no-progress")
    assert code == 0, err


# ------------------------------------------------------------------ item 3: the flags people type

FLAGS = {"--max-new-tokens": ("7", "Generation", "max_dec_len", 7), "--temperature": ("0.5", "Generation",
         "temperature", 0.5), "--top-k": ("3", "Generation", "top_k", 3), "--top-p": ("0.8", "Generation", "top_p",
         0.8), "--seed": ("11", "Generation", "seed", 11), "--device": ("cpu", "Global", "device", "cpu"),
         "--kv-cache-dtype": ("int8", "Generation", "kv_cache_dtype", "int8")}


def test_sampling_flags_are_overrides_that_config_show_shows(model_dir, run_cli):
    argv = [x for flag, (v, *_) in FLAGS.items() for x in (flag, v)]
    code, out, err = run_cli("config", "show", "--ckpt", model_dir, *argv)
    assert code == 0, err
    cfg = yaml.safe_load(out)
    for _, section, key, want in FLAGS.values():
        assert cfg[section][key] == want, key
    # a flag and an -o of the same key: the later one on the command line wins
    code, out, _ = run_cli("config", "show", "--ckpt", model_dir, "-o", "Generation.top_k=9", "--top-k", "5")
    assert yaml.safe_load(out)["Generation"]["top_k"] == 5
    code, out, _ = run_cli("config", "show", "--ckpt", model_dir, "--top-k", "5", "-o", "Generation.top_k=9")
    assert yaml.safe_load(out)["Generation"]["top_k"] == 9


@pytest.mark.parametrize("verb", ["generate", "infer", "serve"])
def test_generating_verbs_take_the_sampling_flags(verb):
    opts = _parser(verb)._option_string_actions
    assert all(flag in opts for flag in FLAGS), verb


def test_generate_flags_run_what_the_overrides_run(model_dir, tmp_path, run_cli):
    flags = ["--max-new-tokens", "6", "--temperature", "0.7", "--top-k", "20", "--seed", "5", "--device", "cpu"]
    code, out, err = run_cli("generate", "--ckpt", model_dir, "--prompt", "Hello", *flags, "--out", tmp_path / "a.json")
    assert code == 0, err
    code, out2, err = run_cli("generate", "--ckpt", model_dir, "--prompt", "Hello", "-o", "Generation.max_dec_len=6",
                              "-o", "Generation.temperature=0.7", "-o", "Generation.top_k=20", "-o", "Generation.seed=5",
                              "-o", "Global.device=cpu")
    assert code == 0, err
    assert out == out2
    g = json.loads((tmp_path / "a.json").read_text())["generation"]
    assert (g["max_dec_len"], g["temperature"], g["top_k"], g["seed"]) == (6, 0.7, 20, 5)
    assert len(json.loads((tmp_path / "a.json").read_text())["results"][0]["completions"][0]["token_ids"]) <= 6


def test_serve_sampling_flags_become_the_server_defaults():
    """serve's sampling flags are the defaults of the request fields a client omits (only the
    ones given: OpenAI's defaults stay for the rest), range-checked through the config."""
    from gptforge.commands.serve import sampling_defaults
    from gptforge.config import load_config

    args = build_parser("serve").parse_args(["serve", "--ckpt", "x", "--temperature", "0.5", "--max-new-tokens", "7",
                                             "--seed", "3", "--device", "cpu"])
    assert args.override == ["Generation.temperature=0.5", "Generation.max_dec_len=7", "Generation.seed=3",
                             "Global.device=cpu"]
    cfg = load_config(None, args.override)
    assert sampling_defaults(args, cfg.Generation) == {"temperature": 0.5, "max_tokens": 7, "seed": 3}
    none = build_parser("serve").parse_args(["serve", "--ckpt", "x"])
    assert sampling_defaults(none, cfg.Generation) == {}


def test_infer_device_is_the_cpu(run_cli, tmp_path):
    code, _, err = run_cli("infer", "--ckpt", tmp_path, "--prompt", "x", "--device", "cuda")
    assert code == 2 and "runs onnxruntime on the CPU" in err


def test_unknown_flag_is_reported_by_the_verb(run_cli):
    code, _, err = run_cli("generate", "--ckpt", "m", "--foo")
    assert code == 2
    assert err == "gptforge generate: error: unrecognized arguments: --foo (see gptforge generate --help)\n"
    code, _, err = run_cli("generate", "--ckpt", "m", "--max_new_tokens", "5")
    assert code == 2 and "(did you mean --max-new-tokens?) (see gptforge generate --help)" in err
    code, _, err = run_cli("tokenizer", "show", "--bogus")
    assert err == "gptforge tokenizer show: error: unrecognized arguments: --bogus (see gptforge tokenizer show --help)\n"


def test_mistyped_verb_gets_did_you_mean(run_cli):
    code, _, err = run_cli("genrate", "--ckpt", "m")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "unknown verb 'genrate' (did you mean generate?)" in err
    code, _, err = run_cli("xyzzy")
    assert code == 2 and "unknown verb 'xyzzy'" in err and "did you mean" not in err


# ------------------------------------------------------------------ item 4: one name per concept

READERS = ["generate", "eval", "export", "quantize", "ptq", "qat", "prune", "pretrain", "finetune", "serve", "infer",
           "convert", "analyze"]


@pytest.mark.parametrize("verb", READERS)
def test_every_model_reader_takes_ckpt(verb):
    assert "--ckpt" in _parser(verb)._option_string_actions


@pytest.mark.parametrize("verb,old,dest", [("infer", "--onnx", "onnx"), ("convert", "--src", "src"),
                                           ("analyze", "--qat-ckpt", "qat_ckpt")])
def test_old_model_spellings_still_work(verb, old, dest):
    p = build_parser(verb)
    base = {"infer": ["--prompt", "x"], "convert": ["--out", "o"], "analyze": []}[verb]
    assert getattr(p.parse_args([verb, *base, old, "M"]), dest) == "M"
    if verb != "analyze":  # analyze places --ckpt by the model's kind (below)
        assert getattr(p.parse_args([verb, *base, "--ckpt", "M"]), dest) == "M"


def test_analyze_ckpt_is_the_model_analysed(tmp_path):
    from gf_testutil import tiny_model
    from gptforge.commands.analyze import _place_ckpt
    from gptforge.model_io import save_model_dir

    model, cfg = tiny_model()
    save_model_dir(model, cfg, tmp_path / "float")
    cfg.Compress.Quantization.enable = True  # only its config is read here
    save_model_dir(model, cfg, tmp_path / "fq")
    p = build_parser("analyze")
    a = p.parse_args(["analyze", "--mode", "ptq", "--ckpt", str(tmp_path / "float")])
    _place_ckpt(a)
    assert (a.float_ckpt, a.qat_ckpt) == (str(tmp_path / "float"), None)  # ptq mode quantizes a float model
    a = p.parse_args(["analyze", "--mode", "ptq", "--ckpt", str(tmp_path / "fq")])
    _place_ckpt(a)
    assert (a.float_ckpt, a.qat_ckpt) == (None, str(tmp_path / "fq"))  # a fake-quant model is used as it is
    a = p.parse_args(["analyze", "--ckpt", str(tmp_path / "fq"), "--float-ckpt", str(tmp_path / "float")])
    _place_ckpt(a)
    assert (a.float_ckpt, a.qat_ckpt) == (str(tmp_path / "float"), str(tmp_path / "fq"))


@pytest.mark.parametrize("path", [("ptq",), ("quantize",), ("export",), ("convert",), ("tokenizer", "train"),
                                  ("pretrain",), ("prune",), ("demo",)])
def test_writers_that_overwrite_take_force(path):
    assert "--force" in _parser(*path)._option_string_actions


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run trained by `gptforge pretrain --quiet` on a fresh corpus: (root, stdout, stderr)."""
    import contextlib
    import io

    from gptforge.cli import main
    from gptforge.config import save_config
    from test_train_support import train_config

    root = tmp_path_factory.mktemp("trained")
    cfg = train_config(root, "Engine.save_load.save_steps=2", "Engine.eval_freq=100", steps=2)
    save_config(cfg, root / "run.yaml")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["pretrain", "-c", str(root / "run.yaml"), "--quiet"])
    assert code == 0, err.getvalue()
    return root, out.getvalue(), err.getvalue()


def test_quiet_training_prints_no_index_map_line(trained):
    _, out, err = trained
    assert "index maps" not in out + err, err
    assert "done at step 2" in out


def test_prune_names_itself_in_its_lines(trained, tmp_path, run_cli):
    root, _, _ = trained
    code, out, err = run_cli("prune", "--ckpt", root / "out" / "step_2", "--out", tmp_path / "p", "-o",
                             "Engine.max_steps=1", "-o", "Engine.save_load.save_steps=1", "-o",
                             "Compress.Prune.ratio=0.25", "-o", "Global.device=cpu", "--no-progress")
    assert code == 0, err
    log = (tmp_path / "p" / "train.log").read_text()
    assert "gptforge prune: " in log and "gptforge pretrain" not in log + out + err


# ------------------------------------------------------------------ item 5: quiet output, prompt files


def test_tokenizer_train_prints_only_its_result_line(tmp_path):
    """Redirected, tokenizers' own bar printed bare newlines to stdout (fd 1, so a subprocess)."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog.\n\n" * 200)
    r = subprocess.run([sys.executable, "-m", "gptforge", "tokenizer", "train", "--input", str(text), "--vocab-size",
                        "300", "--out", str(tmp_path / "tok")], capture_output=True, text=True, env=_env(),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("trained a byte-level BPE tokenizer") and r.stdout.count("\n") == 1, repr(r.stdout)


def test_prompt_file_may_end_in_blank_lines(tmp_path):
    from gptforge.commands.generate import read_prompts
    from gptforge.errors import DataError

    f = tmp_path / "p.txt"
    f.write_text("first prompt\nsecond prompt\n\n  \n")
    assert read_prompts(argparse.Namespace(prompt=[], prompt_file=str(f))) == ["first prompt", "second prompt"]
    f.write_text("first prompt\n\nsecond prompt\n")
    with pytest.raises(DataError, match=r"p.txt:2: empty prompt line"):
        read_prompts(argparse.Namespace(prompt=[], prompt_file=str(f)))


# ------------------------------------------------------------------ item 6: speculative decoding figures


def test_generate_reports_speculative_decoding(model_dir, tmp_path, run_cli):
    argv = ["generate", "--ckpt", model_dir, "--prompt", "Hello", "--prompt", "The cat", "--max-new-tokens", "6",
            *GREEDY, "-o", f"Generation.draft={model_dir}", "-o", "Generation.num_draft_tokens=3"]
    code, _, err = run_cli(*argv, "--out", tmp_path / "s.json")
    assert code == 0, err
    spec = json.loads((tmp_path / "s.json").read_text())["speculative"]
    # the model as its own draft: every drafted token is accepted
    assert spec["rounds"] > 0 and spec["drafted_tokens"] > 0
    assert spec["accepted_tokens"] == spec["drafted_tokens"] and spec["acceptance_rate"] == 1.0
    assert re.search(rf"speculative decoding: acceptance rate 100\.0% \({spec['accepted_tokens']} of "
                     rf"{spec['drafted_tokens']} drafted tokens accepted in {spec['rounds']} rounds\)", err), err
    code, _, err = run_cli(*argv, "--quiet")
    assert code == 0 and "speculative" not in err
    code, _, _ = run_cli("generate", "--ckpt", model_dir, "--prompt", "Hi", "--max-new-tokens", "3", *GREEDY,
                         "--out", tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["speculative"] is None


def test_stats_sum_the_decoders_rounds():
    """`collect_stats` around generate_ids sums exactly what each SpeculativeDecoder counted."""
    import copy

    import torch

    from gf_testutil import tiny_model
    from gptforge.config.schema import GenerationConfig
    from gptforge.generate import generate_ids
    from gptforge.generate.spec_stats import SpeculativeStats, collect_stats

    target, _ = tiny_model("Model.num_layers=2")
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    cfg = GenerationConfig(decode_strategy="greedy_search", max_dec_len=6, num_draft_tokens="2")
    with collect_stats() as total:
        generate_ids(target, [[5, 6, 7], [9, 10]], cfg, draft=draft)
        first = total.stats
        generate_ids(target, [[1, 2, 3, 4]], cfg, draft=draft)
    assert first.rounds > 0 and 0 <= first.accepted <= first.drafted
    assert total.stats.rounds > first.rounds and total.stats.drafted > first.drafted
    with pytest.raises(AttributeError):
        total.stats.rounds = 0  # read-only
    assert (SpeculativeStats(1, 4, 2) + SpeculativeStats(2, 6, 6)).as_dict() == {
        "rounds": 3, "drafted_tokens": 10, "accepted_tokens": 8, "acceptance_rate": 0.8}


def test_infer_reports_speculative_decoding(fp32, tmp_path, run_cli):
    pytest.importorskip("onnxruntime")
    model_dir, onnx_dir = fp32
    code, _, err = run_cli("infer", "--ckpt", onnx_dir, "--prompt", "the quick brown fox", "--no-stream", *GREEDY,
                           "--max-new-tokens", "8", "-o", f"Generation.draft={model_dir}", "-o",
                           "Generation.num_draft_tokens=2", "--out", tmp_path / "i.json")
    assert code == 0, err
    spec = json.loads((tmp_path / "i.json").read_text())["speculative"]
    assert spec["rounds"] > 0 and 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    assert "gptforge infer: speculative decoding: acceptance rate" in err


# ------------------------------------------------------------------ item 8: pip users


def test_docs_pages_print_from_the_package(run_cli):
    code, out, _ = run_cli("docs", "generate")
    assert code == 0 and out == (ROOT / "docs" / "generate.md").read_text(encoding="utf-8")
    code, out, _ = run_cli("docs")
    assert code == 0 and re.search(r"^cli +Command-line conventions$", out, re.M)
    code, _, err = run_cli("docs", "genrate")
    assert code == 2 and "(did you mean generate?)" in err


@pytest.mark.parametrize("verb", list(VERBS))
def test_help_points_at_docs_a_wheel_has(run_cli, verb):
    code, out, _ = run_cli(verb, "--help")
    assert code == 0 and "source repository" not in out
    if verb != "docs":
        assert f"gptforge docs {verb}" in out
    code, out, _ = run_cli("--help")
    assert "source repository" not in out and "gptforge docs" in out


def test_serve_and_all_extras_have_the_openai_client():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("serve", "all"):
        assert any(d.startswith("openai") for d in extras[name]), name


# ------------------------------------------------------------------ item 9: docs and the demo


def test_doc_examples_write_only_in_their_working_directory():
    from doc_examples import examples, pages

    bad = [f"{e.where}: {line.strip()}" for p in pages() for e in examples(p) if e.lang
           for line in e.code.splitlines() if re.search(r"(^|[\s>'\"=])/tmp/", line)]
    assert not bad, bad


def _checks(quick: bool, qat: float, ptq: float):
    from gptforge.demo.report import _checks

    rows = {"float": {"ppl": 9.0, "bits_per_byte": 2.0, "tokens_per_s": 100.0, "tokens_per_s_rounds": [100.0]},
            "pruned": {"ppl": 9.5, "tokens_per_s": 100.0, "tokens_per_s_rounds": [100.0]},
            "ptq": {"ppl": ptq}, "qat": {"ppl": qat}}
    outs = {"pretrain": {"train": [(1, 5.0), (2, 4.0)], "eval": []}, "data": {}}
    d = SimpleNamespace(s=SimpleNamespace(quick=quick), out=lambda name: outs[name], records={})
    return {name: (verdict, detail) for verdict, name, detail in _checks(d, rows)}


def test_quick_demo_does_not_judge_qat_against_ptq():
    verdict, detail = _checks(quick=True, qat=12.0, ptq=11.0)["QAT better than PTQ"]
    assert verdict == "n/a" and "not measured" in detail and "--quick" in detail
    assert _checks(quick=False, qat=12.0, ptq=11.0)["QAT better than PTQ"][0] == "FAIL"
    assert _checks(quick=False, qat=10.0, ptq=11.0)["QAT better than PTQ"][0] == "PASS"


def test_demo_stage_lines_go_to_stderr(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    import inspect

    from gptforge.demo import QUICK, Settings
    from gptforge.demo.pipeline import Demo

    # (a later Demo takes the verb runner its stages call; this stage calls none)
    extra = [lambda *a, **k: 0] if "run_verb" in inspect.signature(Demo).parameters else []
    d = Demo(Settings(out=str(tmp_path / "demo"), quick=True, minutes=1.0, shape=QUICK), *extra)
    d.stage(1, 15, "tokenizer", "learn a tokenizer", lambda: {"x": 1})
    out, err = capsys.readouterr()
    assert out == "" and "[ 1/15] learn a tokenizer" in err and "done in" in err


# ------------------------------------------------------------------ item 10: onnxruntime telemetry


def test_onnxruntime_leaves_home_alone(fp32, tmp_path):
    pytest.importorskip("onnxruntime")
    _, onnx_dir = fp32
    home = tmp_path / "home"
    home.mkdir()
    env = _env(HOME=str(home))
    env.pop("ORT_DISABLE_TELEMETRY", None)  # gptforge sets it, not the caller
    r = subprocess.run([sys.executable, "-m", "gptforge", "infer", "--ckpt", str(onnx_dir), "--prompt", "the quick",
                        "--max-new-tokens", "2", "--quiet"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not (home / ".cache" / "Microsoft").exists(), sorted(str(p) for p in home.rglob("*"))
