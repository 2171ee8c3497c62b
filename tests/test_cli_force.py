"""Every verb that writes `--out` takes `--force` (issue #34): without it an existing output is
refused in one line naming the path and the fix, exit 2, before any model, tokenizer or data file
is read, and the file is left as it was; with it the output is replaced."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gptforge.cli import VERBS, build_parser
from gptforge.errors import UsageError

GREEDY = ["-o", "Generation.decode_strategy=greedy_search", "-o", "Generation.max_dec_len=3"]
OLD = b'{"written by": "an earlier run"}\n'


def _leaves(p: argparse.ArgumentParser, name: str):
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield name, p
    for a in subs:
        for sub, child in a.choices.items():
            yield from _leaves(child, f"{name} {sub}")


def _verb_parsers():
    for verb in VERBS:
        root = build_parser(verb)
        sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
        yield from _leaves(sub.choices[verb], verb)


def test_every_verb_with_out_takes_force():
    """A new verb (or sub-command) with `--out` and no `--force` fails here."""
    parsers = dict(_verb_parsers())
    with_out = sorted(n for n, p in parsers.items() if "--out" in p._option_string_actions)
    assert {"preprocess", "eval", "generate", "infer", "analyze", "export"} <= set(with_out), with_out
    missing = [n for n in with_out if "--force" not in parsers[n]._option_string_actions]
    assert not missing, f"verbs with --out but no --force: {missing}"


# ------------------------------------------------------------------ second run into an existing output


@pytest.fixture(scope="module")
def model_dir(fp32):
    """The tiny model of the export / infer tests (small tokenizer), shared with them."""
    return fp32[0]


@pytest.fixture(scope="module")
def onnx_dir(fp32):
    """Its fp32 ONNX export (made once per session by conftest's `fp32`)."""
    return fp32[1]


def _preprocess(tmp_path, request):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(20)))
    prefix = tmp_path / "data" / "c"
    argv = ["preprocess", "--input", corpus, "--tokenizer", "gpt2", "--out", prefix, "--no-progress"]
    return argv, tmp_path / "data" / "c_idx.npz", ["gptforge.data.tokenizer.load_tokenizer",
                                                   "gptforge.data.preprocess.preprocess_files"]


def _eval(tmp_path, request):
    text = tmp_path / "wiki.txt"
    text.write_text(" The quick brown fox jumps over the lazy dog . \n" * 20)
    out = tmp_path / "res.json"
    argv = ["eval", "--ckpt", request.getfixturevalue("model_dir"), "-o", f"Offline_Eval.eval_path={text}",
            "-o", "Offline_Eval.max_seq_len=32", "--out", out, "--no-progress"]
    return argv, out, ["gptforge.model_io.load_model"]


def _generate(tmp_path, request):
    out = tmp_path / "gen.json"
    argv = ["generate", "--ckpt", request.getfixturevalue("model_dir"), "--prompt", "def ", *GREEDY, "--out", out]
    return argv, out, ["gptforge.generate.loader.load_runnable", "gptforge.commands.generate.read_prompts"]


def _infer(tmp_path, request):
    out = tmp_path / "infer.json"
    argv = ["infer", "--ckpt", request.getfixturevalue("onnx_dir"), "--prompt", "def ", *GREEDY, "--out", out]
    return argv, out, ["gptforge.generate.loader.load_runnable", "gptforge.commands.generate.read_prompts",
                       "gptforge.export.export_dir.read_export_dir"]


WRITERS = {"preprocess": _preprocess, "eval": _eval, "generate": _generate, "infer": _infer}


def _poison(monkeypatch, targets: list[str], calls: list[str]) -> None:
    """Record any call of the functions that do a verb's work (load a model, read data)."""
    for target in targets:
        module, name = target.rsplit(".", 1)

        def boom(*a, _t=target, **k):
            calls.append(_t)
            raise UsageError(f"{_t} called")  # exit 2 (any other exception would end the test)

        monkeypatch.setattr(f"{module}.{name}", boom)


def _one_line(code: int, err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    return lines[0]


@pytest.mark.parametrize("verb", sorted(WRITERS))
def test_existing_output_is_refused_before_work_and_replaced_with_force(verb, tmp_path, request, run_cli,
                                                                      monkeypatch, capsys):
    argv, existing, work = WRITERS[verb](tmp_path, request)
    capsys.readouterr()  # what making the shared fixtures printed
    existing.parent.mkdir(parents=True, exist_ok=True)
    existing.write_bytes(OLD)
    calls: list[str] = []
    with monkeypatch.context() as m:
        _poison(m, work, calls)
        code, _, err = run_cli(*argv)
    line = _one_line(code, err)
    assert f"gptforge {verb}: error: {existing}: already exists" in line and "--force" in line, line
    assert "choose another --out" in line, line
    assert calls == [], f"work started before the check: {calls}"
    assert existing.read_bytes() == OLD

    code, _, err = run_cli(*argv, "--force")
    assert code == 0, err
    assert existing.read_bytes() != OLD
    if verb == "preprocess":
        from gptforge.data.indexed import load_token_files

        assert load_token_files(tmp_path / "data" / "c").n_docs == 20
    else:
        assert json.loads(existing.read_text())  # a whole results file, not the old bytes
    assert not [p.name for p in existing.parent.iterdir() if p.name.startswith(".")], "temp files left"


def test_preprocess_completes_what_a_killed_run_published(tmp_path, request, run_cli):
    """`_ids.npy` / `_meta.json` without `_idx.npz` (renamed last) are a killed run's remains, not
    a finished output: running again completes the set without --force."""
    argv, idx, _ = _preprocess(tmp_path, request)
    idx.parent.mkdir(parents=True)
    (idx.parent / "c_ids.npy").write_bytes(OLD)
    (idx.parent / "c_meta.json").write_bytes(OLD)
    code, _, err = run_cli(*argv)
    assert code == 0, err
    from gptforge.data.indexed import load_token_files

    assert load_token_files(tmp_path / "data" / "c").n_docs == 20


@pytest.mark.parametrize("verb", ["eval", "generate", "infer"])
def test_out_that_is_a_directory_is_refused_even_with_force(verb, tmp_path, request, run_cli, capsys):
    argv, existing, _ = WRITERS[verb](tmp_path, request)
    capsys.readouterr()
    existing.mkdir()
    (existing / "keep.txt").write_text("keep me")
    code, _, err = run_cli(*argv, "--force")
    line = _one_line(code, err)
    assert f"{existing}: is a directory, expected a file" in line, line
    assert (existing / "keep.txt").read_text() == "keep me"


def test_eval_default_output_is_protected_too(model_dir, tmp_path, run_cli, monkeypatch):
    """No --out: ./eval_results_<task>.json in the working directory is not silently replaced."""
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "wiki.txt"
    text.write_text(" The quick brown fox jumps over the lazy dog . \n" * 20)
    (tmp_path / "eval_results_wikitext.json").write_bytes(OLD)
    argv = ["eval", "--ckpt", model_dir, "-o", f"Offline_Eval.eval_path={text}", "-o", "Offline_Eval.max_seq_len=32",
            "--no-progress"]
    line = _one_line(*run_cli(*argv)[::2])
    assert "eval_results_wikitext.json: already exists; pass --force" in line, line
    assert (tmp_path / "eval_results_wikitext.json").read_bytes() == OLD
    code, out, err = run_cli(*argv, "--force")
    assert code == 0, err
    assert json.loads((tmp_path / "eval_results_wikitext.json").read_text())["task"] == "wikitext"


# ------------------------------------------------------------------ analyze: a resumable output directory


def test_analyze_refuses_analysis_files_without_their_state(model_dir, tmp_path, run_cli, monkeypatch):
    """analysis.txt/png/skip_tensor_map.yaml without analysis.json are someone else's: refused
    before a model loads unless --force; a directory that is a file is refused always."""
    out = tmp_path / "an"
    out.mkdir()
    (out / "analysis.txt").write_bytes(OLD)
    calls: list[str] = []
    _poison(monkeypatch, ["gptforge.compress.sensitivity_run.run_analysis"], calls)
    line = _one_line(*run_cli("analyze", "--ckpt", model_dir, "--out", out, "--metric", "cosine")[::2])
    assert f"{out / 'analysis.txt'}: already exists; pass --force" in line and calls == [], line
    assert (out / "analysis.txt").read_bytes() == OLD
    code, _, err = run_cli("analyze", "--ckpt", model_dir, "--out", out, "--metric", "cosine", "--force")
    assert calls == ["gptforge.compress.sensitivity_run.run_analysis"], (code, err)  # --force: it goes on
    f = tmp_path / "file"
    f.write_text("x")
    line = _one_line(*run_cli("analyze", "--ckpt", model_dir, "--out", f, "--force")[::2])
    assert f"{f}: is a file, expected a directory" in line


def test_analyze_force_is_the_start_over_flag(tmp_path):
    """`--force` starts over (`--no-resume`, the older spelling, is the same flag); an analysis
    of other inputs is refused with the --force hint."""
    from gptforge.compress.sensitivity import STATE_FORMAT, read_state

    parser = dict(_verb_parsers())["analyze"]
    assert parser.parse_args(["--no-resume"]).force and parser.parse_args(["--force"]).force
    state = Path(tmp_path / "analysis.json")
    state.write_text(json.dumps({"format": STATE_FORMAT, "fingerprint": {"metric": "loss"}}))
    with pytest.raises(UsageError, match="differs in: metric.*pass --force to start over"):
        read_state(state, {"metric": "kl"})
