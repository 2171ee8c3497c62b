"""One command-line convention (docs/cli.md): `--out` on every verb that writes (old spellings
kept), `--quiet` and `--no-progress` on every verb, and progress that is a bar on a terminal,
plain lines when redirected, and nothing when asked."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios

import pytest

from gptforge.cli import VERBS, build_parser

WRITERS = {  # verb (and sub-command) -> what its help must name as the default output
    ("preprocess",): "PREFIX",
    ("tokenizer", "train"): "DIR",
    ("pretrain",): "Engine.save_load.output_dir",
    ("finetune",): "Engine.save_load.output_dir",
    ("generate",): "stdout",
    ("infer",): "stdout",
    ("eval",): "eval_results_",
    ("ptq",): "DIR",
    ("qat",): "Engine.save_load.output_dir",
    ("quantize",): "DIR",
    ("analyze",): "DIR",
    ("prune",): "DIR",
    ("export",): "DIR",
    ("merge",): "DIR",
    ("convert",): "DIR",
    ("demo",): "runs/demo",
}


def _leaf_parsers(verb: str):
    import argparse

    p = build_parser(verb)
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[verb]
    kids = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
    if not kids:
        return {(verb,): sub}
    return {(verb, name): child for a in kids for name, child in a.choices.items()}


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_has_quiet_and_no_progress(verb):
    for path, parser in _leaf_parsers(verb).items():
        opts = parser._option_string_actions
        assert "--quiet" in opts and "--no-progress" in opts, path


@pytest.mark.parametrize("path,default", list(WRITERS.items()), ids=[" ".join(k) for k in WRITERS])
def test_every_writer_has_out_and_names_its_default(path, default):
    parser = _leaf_parsers(path[0])[path]
    action = parser._option_string_actions.get("--out")
    assert action is not None, f"gptforge {' '.join(path)} has no --out"
    text = parser.format_help()
    assert default in " ".join(text.split()), text


@pytest.mark.parametrize("argv,dest,alias", [
    (["preprocess", "--builtin", "--tokenizer", "gpt2"], "output_prefix", "--output-prefix"),
    (["eval", "--ckpt", "m"], "output", "--output"),
    (["generate", "--ckpt", "m", "--prompt", "x"], "json", "--json"),
])
def test_old_spellings_are_aliases_of_out(argv, dest, alias):
    p = build_parser(argv[0])
    new = p.parse_args([*argv, "--out", "X"])
    old = p.parse_args([*argv, alias, "X"])
    assert getattr(new, dest) == getattr(old, dest) == "X"


def test_training_verbs_out_wins_over_yaml_and_o(tmp_path, run_cli):
    from gptforge.config import save_config
    from test_train_support import train_config

    cfg = train_config(tmp_path, steps=2)
    save_config(cfg, tmp_path / "run.yaml")
    out = tmp_path / "elsewhere"
    code, stdout, err = run_cli("pretrain", "-c", tmp_path / "run.yaml", "-o", f"Engine.save_load.output_dir={tmp_path}/o",
                                "--out", out, "--quiet")
    assert code == 0, err
    assert (out / "step_2").is_dir() and not (tmp_path / "o").exists() and not (tmp_path / "out").exists()
    assert "[train]" not in stdout and "done at step 2" in stdout  # --quiet: the result line only
    assert "[train]" in (out / "train.log").read_text()  # the log lines still reach the run's log


def _text_file(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(3000)))
    return f


def _preprocess(tmp_path, *extra, env=None):
    return [sys.executable, "-m", "gptforge", "preprocess", "--input", str(_text_file(tmp_path)), "--tokenizer",
            "gpt2", "--out", str(tmp_path / "p" / "c"), "--workers", "1", *extra]


def test_redirected_output_has_plain_progress_lines(tmp_path):
    env = dict(os.environ, GPTFORGE_PROGRESS_EVERY="0")  # a line at every update
    r = subprocess.run(_preprocess(tmp_path), capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "\x1b[" not in r.stderr
    assert re.search(r"^\[preprocess\] +\d+% .* elapsed, eta ", r.stderr, flags=re.M), r.stderr


def test_no_progress_and_quiet_print_no_progress(tmp_path):
    env = dict(os.environ, GPTFORGE_PROGRESS_EVERY="0")
    for flag in ("--no-progress", "--quiet"):
        d = tmp_path / flag[2:]
        d.mkdir()
        r = subprocess.run(_preprocess(d, flag), capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "[preprocess]" not in r.stderr and "\r" not in r.stderr, (flag, r.stderr)


def _run_in_pty(argv, timeout=300) -> str:
    """Run `argv` with stdout and stderr on a pseudo-terminal; returns what it printed."""
    leader, follower = pty.openpty()
    # a real terminal has a size; a fresh pseudo-terminal is 0x0, where tqdm draws nothing
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], timeout)
            if not ready:
                proc.kill()
                raise AssertionError("no output from the process in a terminal")
            try:
                data = os.read(leader, 65536)
            except OSError:  # the process closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(leader)
        proc.wait(timeout=60)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")[-2000:]
    return b"".join(chunks).decode(errors="replace")


def test_terminal_gets_a_bar_with_an_eta(tmp_path):
    out = _run_in_pty(_preprocess(tmp_path))
    assert "\r" in out and "preprocess:" in out and "%|" in out  # tqdm's bar
    assert re.search(r"<\d\d:\d\d", out), out  # tqdm's remaining-time field
    (tmp_path / "q").mkdir()
    quiet = _run_in_pty(_preprocess(tmp_path / "q", "--no-progress"))
    assert "%|" not in quiet


def test_plain_progress_unit():
    from gptforge import progress

    os.environ[progress.MODE_ENV] = "plain"
    os.environ[progress.EVERY_ENV] = "0"
    try:
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stderr(buf):
            assert list(progress.bar(range(4), desc="work", unit="item")) == [0, 1, 2, 3]
        lines = buf.getvalue().splitlines()
        assert lines[0].startswith("[work]  25% 1/4 item") and "eta" in lines[0]
        assert lines[-1].startswith("[work] done: 4 item in 0:00:00")
        with progress.settings(no_progress=True):
            assert progress.mode() == "off"
            assert list(progress.bar([1, 2])) == [1, 2]
        assert progress.mode() == "plain"  # restored
    finally:
        os.environ.pop(progress.MODE_ENV, None)
        os.environ.pop(progress.EVERY_ENV, None)


def test_task_lines_only_for_work_that_takes_time(capsys):
    import time

    from gptforge import progress

    os.environ[progress.MODE_ENV] = "plain"
    try:
        with progress.task("quick"):
            pass
        assert capsys.readouterr().err == ""  # a quick step (or a quick error) adds no line
        with progress.task("slow", after=0.05):
            time.sleep(0.2)
        err = capsys.readouterr().err.splitlines()
        assert err[0] == "[slow] ..." and re.fullmatch(r"\[slow\] done in \d+\.\d s", err[-1])
        with pytest.raises(RuntimeError), progress.task("failing", after=0.05):
            time.sleep(0.2)
            raise RuntimeError("x")
        assert "done" not in capsys.readouterr().err  # a failure is not reported as done
    finally:
        os.environ.pop(progress.MODE_ENV, None)


# ------------------------------------------------------------------------------ --out, run for real


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished 2-step tiny training run (out/step_2, with its tokenizer) and a text file."""
    from gptforge.config import save_config
    from gptforge.train import pretrain
    from test_train_support import small_tokenizer, train_config

    root = tmp_path_factory.mktemp("conventions")
    cfg = train_config(root, "Engine.save_load.save_steps=2", "Engine.eval_freq=100", steps=2)
    save_config(cfg, root / "run.yaml")
    pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    (root / "text.txt").write_text("the quick brown fox jumps over the lazy dog. pack my box with five dozen "
                                   "liquor jugs.\n\n" * 40)
    return root


def _writer_cases(root, t):
    """verb -> (argv without the output flag, what `--out` must then hold)."""
    step, cpu = root / "out" / "step_2", ["-o", "Global.device=cpu"]
    return {
        "preprocess": (["preprocess", "--input", root / "text.txt", "--tokenizer", root / "tok", "--workers", "1"],
                       "_ids.npy"),
        "tokenizer train": (["tokenizer", "train", "--input", root / "text.txt", "--vocab-size", "300"],
                            "tokenizer.json"),
        "pretrain": (["pretrain", "-c", root / "run.yaml", "-o", "Engine.max_steps=1",
                      "-o", "Engine.save_load.save_steps=1"], "step_1"),
        "qat": (["qat", "--ckpt", step, "-o", "Engine.max_steps=1", "-o", "Engine.save_load.save_steps=1",
                 "-o", "Compress.Quantization.enable=True", *cpu], "step_1"),
        "eval": (["eval", "--ckpt", step, "-o", f"Offline_Eval.eval_path={root / 'text.txt'}",
                  "-o", "Offline_Eval.max_seq_len=32", *cpu], None),
        "generate": (["generate", "--ckpt", step, "--prompt", "the quick", "-o", "Generation.max_dec_len=4",
                      "--no-stream", *cpu], None),
        "ptq": (["ptq", "--ckpt", step, "-o", "Compress.Quantization.calib_batches=1", *cpu], "model.safetensors"),
        "analyze": (["analyze", "--mode", "ptq", "--float-ckpt", step, "--metric", "cosine", "--batches", "1",
                     "--no-plot", *cpu], "analysis.json"),
        "prune": (["prune", "--ckpt", step, "-o", "Engine.max_steps=1", "-o", "Engine.save_load.save_steps=1",
                   "-o", "Compress.Prune.ratio=0.25", *cpu], "step_1"),
        "export": (["export", "--ckpt", step, "--format", "hf"], "config.json"),
        "convert": (["convert", "--src", step], "model.safetensors"),
    }


OLD_SPELLINGS = {"preprocess": "--output-prefix", "eval": "--output", "generate": "--json"}


@pytest.mark.parametrize("verb", ["preprocess", "tokenizer train", "pretrain", "qat", "eval", "generate", "ptq",
                                  "analyze", "prune", "export", "convert"])
def test_every_writer_writes_where_out_says(tiny_run, run_cli, tmp_path, verb):
    """Each writing verb run for real: its output lands under `--out` (and under its older spelling)."""
    import json
    from pathlib import Path

    argv, made = _writer_cases(tiny_run, tmp_path)[verb]
    for i, flag in enumerate(["--out", *([OLD_SPELLINGS[verb]] if verb in OLD_SPELLINGS else [])]):
        out = tmp_path / (f"o{i}.json" if made is None else f"o{i}")
        code, _, err = run_cli(*argv, "--no-progress", flag, out)
        assert code == 0, (flag, err)
        if made is None:  # a file
            assert json.loads(out.read_text()), flag
        elif verb == "preprocess":  # a file-name prefix
            assert Path(f"{out}{made}").is_file(), flag
        else:
            assert (out / made).exists(), (flag, sorted(p.name for p in out.iterdir()))
    assert not list((tiny_run / "out" / "step_2").glob("eval_results_*"))  # nothing lands in the model


def test_redirected_training_prints_plain_lines_with_an_eta(tiny_run, tmp_path):
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("GPTFORGE_PROGRESS", "GPTFORGE_QUIET")}
    env.update(GPTFORGE_PROGRESS_EVERY="0", PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "gptforge", "pretrain", "-c", str(tiny_run / "run.yaml"),
                           "-o", "Engine.max_steps=4", "-o", "Engine.save_load.save_steps=-1", "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = re.findall(r"^\[training\] +\d+% \d/4 step, \d:\d\d:\d\d elapsed, eta \d:\d\d:\d\d.*$", proc.stderr, re.M)
    assert len(lines) >= 3 and "\r" not in proc.stderr and "\x1b[" not in proc.stderr, proc.stderr
    assert re.search(r"^\[training\] done: 4 step in ", proc.stderr, re.M), proc.stderr
