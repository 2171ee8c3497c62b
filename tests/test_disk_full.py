"""A full disk, simulated without root: the CLI runs in a child whose file-size limit
(RLIMIT_FSIZE) is below the size of what it writes, so the write fails with EFBIG (or a short
write) just as it would with ENOSPC. Every verb must answer with one line naming the path and
the free space, exit 2, leave the previous output byte-identical and no temporaries behind."""

from __future__ import annotations

import errno
import hashlib
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gptforge.errors import DiskFullError
from gptforge.fsguard import SHORT_WRITE, disk_full_errno, disk_full_error, disk_full_guard

ROOT = Path(__file__).resolve().parents[1]

TEXT = "\n\n".join(
    f"Document {i}: the quick brown fox jumps over the lazy dog, and pack my box with five dozen "
    f"liquor jugs while sphinx of black quartz judges my vow number {i}." for i in range(600)
)


def run_limited(limit: int, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`gptforge ARGV` in a child that may not grow any file beyond `limit` bytes."""

    def limit_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "gptforge", *map(str, argv)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300, preexec_fn=limit_files)


def snapshot(*roots: Path) -> dict[str, str]:
    """Relative path -> sha1 of every file under `roots` (hidden temporaries included)."""
    out = {}
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            out[str(f)] = hashlib.sha1(f.read_bytes()).hexdigest()
    return out


def assert_disk_full(proc: subprocess.CompletedProcess, path: Path) -> None:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if ": error: " in x]
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    assert "disk full" in line and " free on that file system" in line, line
    assert str(path) in line, line


def no_temps(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if ".tmp" in p.name or ".old-" in p.name]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished tiny training run (out/step_2) and its tokenizer."""
    from gptforge.config import save_config
    from gptforge.train import pretrain
    from test_train_support import small_tokenizer, train_config

    root = tmp_path_factory.mktemp("diskfull")
    cfg = train_config(root, "Engine.save_load.save_steps=2", "Engine.eval_freq=100", steps=2)
    save_config(cfg, root / "run.yaml")
    pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    assert (root / "out" / "step_2" / "model.safetensors").is_file()
    return root


# ------------------------------------------------------------------------------ unit level


@pytest.mark.parametrize("exc, code", [
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), errno.EDQUOT),
    (OSError(errno.EFBIG, "File too large"), errno.EFBIG),
    (Exception("No space left on device (os error 28)"), errno.ENOSPC),  # tokenizers
    (Exception("Error while serializing: I/O error: File too large (os error 27)"), errno.EFBIG),  # safetensors
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 25774016 vs 25773904"), SHORT_WRITE),
    (OSError("100000 requested and 496 written"), SHORT_WRITE),  # numpy
    (OSError(errno.EACCES, "Permission denied"), None),
    (RuntimeError("shape mismatch"), None),
])
def test_every_shape_of_a_full_disk_is_recognised(exc, code):
    assert disk_full_errno(exc) == code
    wrapped = RuntimeError("while saving")
    wrapped.__cause__ = exc
    assert disk_full_errno(wrapped) == code


def test_guard_names_path_and_free_space(tmp_path):
    with pytest.raises(DiskFullError) as e, disk_full_guard(tmp_path / "x" / "y.json"):
        raise OSError(errno.ENOSPC, "No space left on device")
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'x' / 'y.json'}: disk full") and " free on that file system" in msg
    assert "\n" not in msg
    with pytest.raises(PermissionError), disk_full_guard(tmp_path):
        raise PermissionError(errno.EACCES, "denied")
    assert "ulimit -f" in str(disk_full_error(tmp_path, errno.EFBIG))


# ------------------------------------------------------------------------------ CLI level


@pytest.mark.parametrize("limit", [1_000_000, 2_000_000], ids=["weights", "optimizer_state"])
def test_pretrain_checkpoint_on_a_full_disk(run_dir, limit):
    """1 MB: model.safetensors (1.5 MB) fails; 2 MB: torch.save of the 3 MB training state fails."""
    out = run_dir / "out"
    before = snapshot(out / "step_2")
    proc = run_limited(limit, "pretrain", "-c", run_dir / "run.yaml", "--resume", "auto", "--no-progress",
                       "-o", "Engine.max_steps=4", "-o", "Optimizer.lr.decay_steps=4")
    assert_disk_full(proc, out / "step_4")
    assert snapshot(out / "step_2") == before
    assert not (out / "step_4").exists() and no_temps(out) == []


def test_export_hf_on_a_full_disk(run_dir, tmp_path):
    ckpt, dest = run_dir / "out" / "step_2", tmp_path / "hf"
    dest.mkdir()
    (dest / "previous.txt").write_text("an earlier export")
    before = snapshot(dest)
    proc = run_limited(500_000, "export", "--format", "hf", "--ckpt", ckpt, "--out", dest, "--force")
    assert_disk_full(proc, dest)
    assert snapshot(dest) == before and no_temps(tmp_path) == []


def test_tokenizer_train_on_a_full_disk(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT)
    dest = tmp_path / "tok"
    dest.mkdir()
    (dest / "tokenizer.json").write_text("{}")
    before = snapshot(dest)
    proc = run_limited(2000, "tokenizer", "train", "--input", tmp_path / "text.txt", "--vocab-size", "300",
                       "--out", dest, "--force", "--no-progress")
    assert_disk_full(proc, dest)
    assert snapshot(dest) == before and no_temps(tmp_path) == []


def test_preprocess_on_a_full_disk(run_dir, tmp_path):
    (tmp_path / "text.txt").write_text(TEXT)
    tok = run_dir / "tok"
    ok = run_limited(10_000_000, "preprocess", "--input", tmp_path / "text.txt", "--output-prefix",
                     tmp_path / "out" / "corpus", "--tokenizer", tok, "--no-progress")
    assert ok.returncode == 0, ok.stderr
    before = snapshot(tmp_path / "out")
    proc = run_limited(4096, "preprocess", "--input", tmp_path / "text.txt", "--output-prefix",
                       tmp_path / "out" / "corpus", "--tokenizer", tok, "--no-progress", "--workers", "1", "--force")
    assert_disk_full(proc, tmp_path / "out" / "corpus")
    assert snapshot(tmp_path / "out") == before and no_temps(tmp_path / "out") == []


def test_eval_results_on_a_full_disk(run_dir, tmp_path):
    (tmp_path / "wiki.txt").write_text(TEXT[:3000])
    results = tmp_path / "results.json"
    results.write_text('{"previous": true}\n')
    proc = run_limited(100, "eval", "--ckpt", run_dir / "out" / "step_2", "--output", results, "--force", "--no-progress",
                       "-o", f"Offline_Eval.eval_path={tmp_path / 'wiki.txt'}", "-o", "Offline_Eval.max_seq_len=32",
                       "-o", "Global.device=cpu")
    assert_disk_full(proc, results)
    assert results.read_text() == '{"previous": true}\n' and no_temps(tmp_path) == []


def test_generate_json_on_a_full_disk(run_dir, tmp_path):
    out = tmp_path / "gen.json"
    proc = run_limited(200, "generate", "--ckpt", run_dir / "out" / "step_2", "--prompt", "the quick",
                       "--json", out, "-o", "Generation.max_dec_len=4", "-o", "Global.device=cpu", "--no-stream")
    assert_disk_full(proc, out)
    assert not out.exists() and no_temps(tmp_path) == []


def test_tokenizer_save_does_not_swallow_a_full_disk(tmp_path):
    """vocab.json/merges.txt are optional extras, but a full disk while writing them must fail
    the save (else a truncated vocab.json would be published)."""
    from gptforge.data.tokenizer import Tokenizer
    from test_train_support import small_tokenizer

    class Model:
        def __init__(self, error):
            self.error = error

        def save(self, folder):
            raise self.error

    class Backend:
        def __init__(self, real, error):
            self.real, self.model = real, Model(error)

        def __getattr__(self, name):
            return getattr(self.real, name)

    real = small_tokenizer().backend
    with pytest.raises(Exception, match="os error 28"):
        Tokenizer(Backend(real, Exception("No space left on device (os error 28)"))).save(tmp_path / "a")
    Tokenizer(Backend(real, Exception("this model has no vocab files"))).save(tmp_path / "b")
    assert (tmp_path / "b" / "tokenizer.json").is_file()
