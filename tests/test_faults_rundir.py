"""Fault injection, fast subset (issue #16): one owner per output directory, lineage-aware
keep_last, temp files removed only once their writer is dead, durable publication, one metrics
record per step across resumes, shape overrides refused on resume, no orphaned workers.
The slow kill-and-resume suite is tests/test_faults_kill.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gptforge
from gptforge.run_lock import LOCK_NAME, lock_dir, read_holder, writer_alive
from gptforge.train import checkpoint as ckpt
from gptforge.train import pretrain
from test_train_support import small_tokenizer, train_config

# Subprocesses run the gptforge this test imports; one thread, as in-process (same floats).
ENV = {**os.environ, "PYTHONPATH": str(Path(gptforge.__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.usefixtures("one_thread")


def _train(cfg, **kw):
    return pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False, **kw)


def _cfg_file(tmp_path, *over, steps=8):
    from gptforge.config import save_config

    cfg = train_config(tmp_path, *over, steps=steps)
    f = tmp_path / f"run{len(list(tmp_path.glob('run*.yaml')))}.yaml"
    save_config(cfg, f)
    return f


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _wait_for(pred, timeout=60.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(30)


# ------------------------------------------------------------------------- one owner


def test_second_pretrain_into_one_dir_fails_at_once_naming_the_pid(tmp_path, run_cli):
    cfg_file = _cfg_file(tmp_path, "Engine.save_load.save_steps=-1", "Engine.eval_freq=-1", steps=100000)
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-m", "gptforge", "pretrain", "-c", str(cfg_file), "--no-progress"],
                             env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (out / "train.log").is_file() or first.poll() is not None, what="the first run")
        assert first.poll() is None, first.stderr.read()
        t0 = time.monotonic()
        code, _, err = run_cli("pretrain", "-c", cfg_file, "-o", "Engine.max_steps=2", "--no-progress")
        assert time.monotonic() - t0 < 30
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert read_holder(out / LOCK_NAME)["pid"] == first.pid
        assert f"in use by pid {first.pid} (pretrain on " in err and str(out) in err
        assert not list(out.glob("step_*"))
    finally:
        _kill(first)
    # the dead holder's lock is simply taken over
    assert (out / LOCK_NAME).exists() and not writer_alive(first.pid)
    code, _, err = run_cli("pretrain", "-c", cfg_file, "-o", "Engine.max_steps=2", "--no-progress")
    assert code == 0, err
    assert not (out / LOCK_NAME).exists()  # a clean release removes the lock file


def test_lock_is_reentrant_in_one_process_and_refused_to_another(tmp_path):
    with lock_dir(tmp_path / "d", "analyze") as a, lock_dir(tmp_path / "d", "pretrain"):
        assert a.path.exists()
        code = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from gptforge.errors import UsageError
            from gptforge.run_lock import lock_dir
            try:
                lock_dir({str(tmp_path / 'd')!r}, "qat")
            except UsageError as e:
                print(e); sys.exit(3)
        """)], env=ENV, capture_output=True, text=True, timeout=60)
        assert code.returncode == 3 and f"in use by pid {os.getpid()} (analyze on " in code.stdout
    assert not (tmp_path / "d" / LOCK_NAME).exists()


# ------------------------------------------------------------------ a finished run there


def test_pretrain_into_a_dir_with_a_finished_run_refuses_then_force_starts_over(tmp_path, run_cli):
    cfg_file = _cfg_file(tmp_path, "Engine.save_load.save_steps=2", "Engine.save_load.keep_last=3",
                         "Engine.eval_freq=-1", steps=6)
    out = tmp_path / "out"
    code, _, err = run_cli("pretrain", "-c", cfg_file, "--no-progress")
    assert code == 0, err
    before = {p.name: (p / "model.safetensors").read_bytes() for _, p in ckpt.list_checkpoints(out)}
    run_config = (out / "config.yaml").read_text()
    assert sorted(before) == ["step_2", "step_4", "step_6"]

    code, _, err = run_cli("pretrain", "-c", cfg_file, "-o", "Engine.max_steps=2", "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(out) in err and "another run" in err and "--resume auto" in err and "--force" in err
    assert {p.name: (p / "model.safetensors").read_bytes() for _, p in ckpt.list_checkpoints(out)} == before
    assert (out / "config.yaml").read_text() == run_config

    code, _, err = run_cli("pretrain", "-c", cfg_file, "-o", "Engine.max_steps=2", "--force", "--no-progress")
    assert code == 0, err
    assert [p.name for _, p in ckpt.list_checkpoints(out)] == ["step_2"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    code, _, err = run_cli("pretrain", "-c", cfg_file, "--force", "--resume", "auto")
    assert code == 2 and "--force" in err


def test_keep_last_removes_only_the_current_runs_lineage(tmp_path):
    r = _train(train_config(tmp_path, "Engine.save_load.save_steps=1", "Engine.eval_freq=-1", steps=3))
    out = r.output_dir
    ids = {ckpt.run_id_of(p) for _, p in ckpt.list_checkpoints(out)}
    assert len(ids) == 1 and None not in ids
    # checkpoints of another run (say, copied in by hand) next to this run's
    other = tmp_path / "other"
    r2 = _train(train_config(other, "Engine.save_load.save_steps=1", "Engine.eval_freq=-1", steps=2))
    import shutil

    for name in ("step_1", "step_2"):
        shutil.copytree(r2.output_dir / name, out / name.replace("step_", "step_1"))  # step_11, step_12
    t_meta = ckpt.read_meta(out / "step_3")
    from gptforge.train.trainer import Trainer

    cfg = train_config(tmp_path, "Engine.save_load.save_steps=1", "Engine.eval_freq=-1", "Engine.save_load.keep_last=1",
                       steps=3)
    t = Trainer(cfg, tokenizer=small_tokenizer(), progress=False, echo=False, overwrite=True)  # only to build state
    t._release()
    ckpt.save_checkpoint(out, 4, t.model, cfg, small_tokenizer(), t.optimizer, t.scheduler, t.precision,
                         {"run_id": t_meta["run_id"]}, keep_last=1)
    assert [p.name for _, p in ckpt.list_checkpoints(out)] == ["step_4", "step_11", "step_12"]


def test_resume_refuses_a_shape_override_naming_the_key(tmp_path, run_cli):
    cfg_file = _cfg_file(tmp_path, "Engine.save_load.save_steps=2", "Engine.eval_freq=-1", steps=2)
    code, _, err = run_cli("pretrain", "-c", cfg_file, "--no-progress")
    assert code == 0, err
    for argv in (["-c", cfg_file, "--resume", "auto"], ["--ckpt", tmp_path / "out"]):
        code, _, err = run_cli("pretrain", *argv, "-o", "Model.hidden_size=32", "-o", "Engine.max_steps=4",
                               "--no-progress")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("gptforge pretrain: error: Model.hidden_size: 32 differs from the resumed checkpoint")
    code, _, err = run_cli("pretrain", "-c", cfg_file, "--resume", "auto", "-o", "Model.hidden_size=64",
                           "-o", "Engine.max_steps=3", "--no-progress")
    assert code == 0, err  # the same value is no change


def test_qat_resume_refuses_a_shape_override(tmp_path, run_cli):
    r = _train(train_config(tmp_path, "Engine.save_load.save_steps=-1", "Engine.eval_freq=-1", steps=2))
    qout = tmp_path / "qat"
    common = ["-o", f"Engine.save_load.output_dir={qout}", "-o", "Engine.eval_freq=-1", "--no-progress"]
    code, _, err = run_cli("qat", "--ckpt", r.checkpoint_dir, "-o", "Engine.max_steps=1", *common)
    assert code == 0, err
    cfg = _cfg_file(tmp_path, steps=2)
    code, _, err = run_cli("qat", "-c", cfg, "--resume", "auto", "-o", "Model.num_layers=3", "-o", "Engine.max_steps=2",
                           *common)
    assert code == 2 and "Model.num_layers: 3 differs from the resumed checkpoint" in err, err
    assert len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------- metrics.jsonl


def test_metrics_have_one_record_per_step_after_resumes(tmp_path):
    over = ("Engine.save_load.save_steps=3", "Engine.eval_freq=2", "Optimizer.lr.decay_steps=9")
    out = tmp_path / "out"
    _train(train_config(tmp_path, *over, steps=5))  # a run that stopped at 5 (last save step_5)
    # as if killed after logging step 6 and half of step 7, before saving again
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "train", "step": 6, "loss": 1.0}) + "\n" + '{"kind": "train", "st')
    import shutil

    shutil.rmtree(out / "step_5")  # resume from step_3: steps 4 and 5 are logged again
    _train(train_config(tmp_path, *over, steps=7), resume="auto")
    _train(train_config(tmp_path, *over, steps=9), resume="auto")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 10))
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [2, 4, 6, 8]


# ------------------------------------------------------------- temps of dead writers


def test_stale_temps_removed_only_when_their_writer_is_dead(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = _dead_pid()
    try:
        live_tmp = out / f".step_3.tmp-{alive.pid}-abcd"
        dead_tmp = out / f".step_5.tmp-{dead}-abcd"
        legacy_tmp = out / ".step_7.tmp-zz91xk"  # an older version's name (no pid)
        for d in (live_tmp, dead_tmp, legacy_tmp):
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"x")
        # a step_2 that a killed writer had renamed aside while replacing it
        aside = out / f".step_2.old-{dead}"
        aside.mkdir()
        (aside / "marker").write_text("old")
        removed = ckpt.clean_stale_tmp(out)
        assert sorted(p.name for p in removed) == sorted([dead_tmp.name, legacy_tmp.name])
        assert live_tmp.is_dir()
        assert (out / "step_2" / "marker").read_text() == "old" and not aside.exists()
    finally:
        _kill(alive)
    ckpt.clean_stale_tmp(out)
    assert not live_tmp.exists()


def test_preprocess_removes_temps_of_dead_writers_only(tmp_path, run_cli):
    (tmp_path / "a.txt").write_text("A first document that is long enough.\n\nAnd a second one, also long.\n")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = _dead_pid()
    try:
        live = tmp_path / f".c_ids.npy.{alive.pid}.k2j3h4g5.tmp"
        stale = [tmp_path / f".c_ids.npy.{dead}.a1b2c3d4.tmp", tmp_path / f".c_idx.npz.{dead}.q1w2e3r4.tmp",
                 tmp_path / ".c_meta.json.x9y8z7w6.tmp"]
        for p in (live, *stale):
            p.write_bytes(b"\0" * 1000)
        code, _, err = run_cli("preprocess", "--input", tmp_path / "a.txt", "--output-prefix", tmp_path / "c",
                               "--no-progress")
        assert code == 0, err
        assert live.exists() and not any(p.exists() for p in stale)
    finally:
        _kill(alive)


# ----------------------------------------------------------------------- durability


def test_publication_fsyncs_files_and_directory_before_the_rename(tmp_path, monkeypatch):
    from gf_testutil import tiny_model
    from gptforge.model_io import save_model_dir

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b, **kw):
        events.append(("rename", str(a), str(b)))
        return real_replace(a, b, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    model, cfg = tiny_model()
    save_model_dir(model, cfg, tmp_path / "m")
    publish = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(tmp_path / "m"))
    synced = {Path(e[1]).name for e in events[:publish] if e[0] == "fsync"}
    tmp_name = Path(events[publish][1]).name
    assert {"model.safetensors", "config.yaml", tmp_name} <= synced
    assert ("fsync", str(tmp_path)) in events[publish:]  # the parent, after the rename

    from gptforge.evaluate.common import write_json_atomic

    events.clear()
    write_json_atomic(tmp_path / "r.json", {"a": 1})
    kinds = [e[0] for e in events]
    assert kinds == ["fsync", "rename", "fsync"] and events[2][1] == str(tmp_path)


REPLACE_KILLER = textwrap.dedent("""
    import os, signal, sys
    import gptforge.durable as D
    D._exchange = lambda a, b: False          # the fallback path: old copy renamed aside first
    real = os.replace
    def dying(a, b):
        real(a, b)
        if ".old-" in str(b):
            os.kill(os.getpid(), signal.SIGKILL)  # between the two renames
    os.replace = dying
    from gptforge.model_io import atomic_dir
    with atomic_dir(sys.argv[1], overwrite=True) as tmp:
        (tmp / "marker").write_text("new")
""")


def test_replacing_step_n_never_leaves_it_missing(tmp_path):
    out = tmp_path / "out"
    step = out / "step_2"
    step.mkdir(parents=True)
    (step / "marker").write_text("old")
    proc = subprocess.run([sys.executable, "-c", REPLACE_KILLER, str(step)], env=ENV, capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert not step.exists() and list(out.glob(".step_2.old-*"))  # killed in the window
    ckpt.clean_stale_tmp(out)  # what the next run does first
    assert (step / "marker").read_text() == "old" and not list(out.glob(".step_2.*"))

    # the normal path swaps the two directories in one call: step_2 exists at every moment
    from gptforge.model_io import atomic_dir

    with atomic_dir(step, overwrite=True) as tmp:
        (tmp / "marker").write_text("new")
    assert (step / "marker").read_text() == "new" and not [p for p in out.iterdir() if p.name != "step_2"]


# ----------------------------------------------------------------------- orphans


PREPROCESS_HANG = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import gptforge.data.preprocess as P
    real = P.file_chunks
    def chunks(path):
        for k, c in enumerate(real(path)):
            yield c
            if k == 1:  # the workers are busy or idle, the parent is mid-run: hold here
                Path(sys.argv[1]).write_text("ready")
                time.sleep(600)
    P.file_chunks = chunks
    from gptforge.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def test_sigkill_of_preprocess_leaves_no_worker_alive(tmp_path, run_cli):
    import psutil

    line = "The quick brown fox jumps over the lazy dog again and again. " * 4 + "\n\n"
    (tmp_path / "big.txt").write_text(line * 10000)  # ~2.5 MB: a few 1 MB chunks
    marker = tmp_path / "ready"
    argv = ["preprocess", "--input", str(tmp_path / "big.txt"), "--output-prefix", str(tmp_path / "c"),
            "--workers", "2", "--no-progress"]
    proc = subprocess.Popen([sys.executable, "-c", PREPROCESS_HANG, str(marker), *argv], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: list = []
    try:
        _wait_for(lambda: marker.exists() or proc.poll() is not None, what="preprocess to start its workers")
        assert proc.poll() is None, proc.stderr.read()
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert workers
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"orphaned workers: {[p.pid for p in alive]}"
    finally:
        _kill(proc)
        for w in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                w.kill()
    assert list(tmp_path.glob(".c_ids.npy.*.tmp"))  # the killed run's temp ...
    assert not list(tmp_path.glob("c_*"))  # ... and no output that looks complete
    code, _, err = run_cli("preprocess", "--input", tmp_path / "big.txt",
                           "--output-prefix", tmp_path / "c", "--workers", "1", "--no-progress")
    assert code == 0, err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # removed by the later run


# ------------------------------------------------------ every writing verb has one writer


HOLD_OUTPUT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from gptforge.run_lock import lock_output
    with lock_output(sys.argv[1], "export"):
        Path(sys.argv[2]).write_text("held")
        time.sleep(120)
""")


@pytest.mark.parametrize("verb", ["convert", "tokenizer"])
def test_convert_and_tokenizer_train_refuse_a_second_writer(tmp_path, run_cli, verb):
    out, marker = tmp_path / "out", tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_OUTPUT, str(out), str(marker)], env=ENV)
    try:
        _wait_for(lambda: marker.exists() or holder.poll() is not None, what="the holder")
        (tmp_path / "a.txt").write_text("some words to train on\n" * 20)
        argv = (["convert", "--src", tmp_path / "missing", "--out", out] if verb == "convert" else
                ["tokenizer", "train", "--input", tmp_path / "a.txt", "--vocab-size", "300", "--out", out])
        code, _, err = run_cli(*argv)
        assert code == 2 and f"in use by pid {holder.pid} (export on " in err, err
        assert not out.exists()
    finally:
        _kill(holder)


def test_qat_force_starts_over_in_another_runs_directory(tmp_path, run_cli):
    r = _train(train_config(tmp_path, "Engine.save_load.save_steps=-1", "Engine.eval_freq=-1", steps=2))
    qout = tmp_path / "qat"
    common = ["--ckpt", r.checkpoint_dir, "--out", qout, "-o", "Engine.eval_freq=-1", "--no-progress"]
    code, _, err = run_cli("qat", *common, "-o", "Engine.max_steps=2")
    assert code == 0, err
    first = ckpt.run_id_of(qout / "step_2")
    code, _, err = run_cli("qat", *common, "-o", "Engine.max_steps=1")
    assert code == 2 and "already holds checkpoints of another run (step_2)" in err and "--force" in err, err
    code, _, err = run_cli("qat", *common, "-o", "Engine.max_steps=1", "--force")
    assert code == 0, err
    assert [p.name for _, p in ckpt.list_checkpoints(qout)] == ["step_1"] and ckpt.run_id_of(qout / "step_1") != first
    rows = [json.loads(x) for x in (qout / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1]
