"""The scoring engine shared by LAMBADA, WikiText and the lm-eval adapter.

Every evaluation here reduces to: for a token sequence, the log-probability (and whether it is
the greedy choice) of a suffix of its tokens given everything before them. Sequences are sorted
by length and right-padded into batches; causal attention means padding never reaches a real
position, so no attention mask is needed. Only the scored positions are projected onto the
vocabulary (`model.hidden_states` then `model.logits(h[rows])`), which is most of the saving
over scoring every position: the LM head is the largest matmul of a small GPT.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gptforge.errors import ConfigError
from gptforge.fsguard import disk_full_guard
from gptforge.progress import bar as progress_bar

# Rows projected onto the vocabulary at once: bounds the [rows, V] fp32 buffer (~200 MB at
# V=50304) when every position is scored (WikiText with stride = window).
_PROJECT_ROWS = 1024


@dataclass
class Scored:
    """Result for one sequence: its scored suffix of tokens."""

    logprob: float  # Σ log p(token | prefix) over the scored tokens
    greedy: bool  # every scored token is the argmax
    last_greedy: bool  # the last scored token is the argmax (given the true earlier tokens)
    count: int  # number of scored tokens


def model_context(model: torch.nn.Module) -> int:
    """Positions the model can attend over (its position-embedding table)."""
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "max_position_embeddings", None)
    if n is None and hasattr(model, "wpe"):
        n = model.wpe.num_embeddings
    if n is None:
        raise ConfigError("cannot tell the model's context length (no config.max_position_embeddings)")
    return int(n)


def check_window(model: torch.nn.Module, seq_len: int | None, key: str = "Offline_Eval.max_seq_len") -> int:
    """`seq_len` if the model can attend over it, else a ConfigError naming the fix; None (the
    default) is the model's context."""
    ctx = model_context(model)
    if seq_len is None:
        return ctx
    if seq_len < 1:
        raise ConfigError(f"{key}={seq_len}: must be at least 1")
    if seq_len > ctx:
        raise ConfigError(f"{key}={seq_len}: longer than the model's context ({ctx} positions); "
                          f"pass -o {key}={ctx}")
    return seq_len


def check_token_ids(model: torch.nn.Module, seqs: list[list[int]], path) -> None:
    """ConfigError when the tokenizer produces ids the model has no embedding for."""
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "vocab_size", None)
    if n is None and hasattr(model, "wte"):
        n = model.wte.num_embeddings
    top = max((max(s) for s in seqs if s), default=-1)
    if n is not None and top >= n:
        raise ConfigError(f"{path}: the tokenizer produced token id {top} but the model's vocabulary has "
                          f"{n} entries; the tokenizer does not belong to this model (set Data.tokenizer)")


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _hidden_and_project(model):
    """(hidden(ids) -> [B,T,H] or None, project(rows) -> logits) for our model or a wrapper.

    Models without `hidden_states` are scored from their full `model(ids)` logits."""
    if hasattr(model, "hidden_states") and hasattr(model, "logits"):
        return model.hidden_states, model.logits
    return None, None


def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def score_sequences(model: torch.nn.Module, seqs: list[list[int]], first: list[int], *,
                    batch_size: int = 8, max_tokens: int | None = None, pad_id: int = 0,
                    vocab_size: int | None = None, amp_dtype: torch.dtype | None = None,
                    progress: bool = False, desc: str = "scoring") -> list[Scored]:
    """Score `seqs[i][first[i]+1:]` given the tokens before each: one `Scored` per sequence.

    `first[i]` is the index (into the labels `seqs[i][1:]`) of the first scored label, so the
    scored tokens are the last `len(seqs[i]) - 1 - first[i]` ones. A sequence may be at most the
    model's context + 1 tokens long. `vocab_size` limits the softmax/argmax to the first
    columns (default: every column the model outputs). Results come back in input order.

    A batch holds `batch_size` sequences, or more while its padded input stays within
    `max_tokens` positions: callers pass the budget of `batch_size` full windows (what the
    reference's padded batches occupy), so short passages share a forward pass without using
    more memory. On a CPU, per-sequence cost keeps falling up to a few dozen sequences.
    """
    if len(seqs) != len(first):
        raise ValueError("seqs and first differ in length")
    if batch_size < 1:
        raise ConfigError(f"Offline_Eval.batch_size={batch_size}: must be at least 1")
    device = model_device(model)
    hidden, project = _hidden_and_project(model)
    # Longest first (like lm-eval): similar lengths share a batch, and an out-of-memory error
    # shows up in the first batch rather than the last.
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    results: list[Scored | None] = [None] * len(seqs)
    autocast = (torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None
                else contextlib.nullcontext())
    bar = progress_bar(total=len(seqs), desc=desc, unit="seq", enabled=progress)
    with torch.inference_mode(), autocast:
        for idx in _batches(order, [len(s) - 1 for s in seqs], batch_size, max_tokens):
            T = len(seqs[idx[0]]) - 1
            ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
            rows, cols, labels, owner = [], [], [], []
            for r, i in enumerate(idx):
                s = seqs[i]
                n = len(s) - 1
                if n < 1 or not 0 <= first[i] < n:
                    raise ValueError(f"sequence {i}: nothing to score (length {len(s)}, first {first[i]})")
                ids[r, :n] = torch.tensor(s[:-1])
                rows += [r] * (n - first[i])
                cols += range(first[i], n)
                labels += s[first[i] + 1:]
                owner += [i] * (n - first[i])
            ids = ids.to(device)
            rows_t = torch.tensor(rows, device=device)
            cols_t = torch.tensor(cols, device=device)
            labels_t = torch.tensor(labels, device=device)
            if hidden is not None:
                tok_lp, tok_greedy = _score_rows(hidden(ids)[rows_t, cols_t], project, labels_t, vocab_size)
            else:
                tok_lp, tok_greedy = _score_rows(_full_logits(model, ids)[rows_t, cols_t], None, labels_t, vocab_size)
            _collect(results, owner, tok_lp.tolist(), tok_greedy.tolist())
            bar.update(len(idx))
    bar.close()
    return results  # type: ignore[return-value]


def _batches(order: list[int], lengths: list[int], batch_size: int, max_tokens: int | None):
    """Consecutive groups of `order` (longest first): `batch_size` items, or more while
    items × the first (longest) item's length fits in `max_tokens`."""
    b = 0
    while b < len(order):
        longest = max(1, lengths[order[b]])
        n = max(batch_size, (max_tokens or 0) // longest)
        yield order[b:b + n]
        b += n


def _score_rows(states: torch.Tensor, project, labels: torch.Tensor, vocab_size: int | None):
    """Per-row (log p(label), label is argmax) in fp32, `_PROJECT_ROWS` rows at a time.

    `states` are hidden states projected by `project`, or already logits when it is None."""
    lps, greedy = [], []
    for s in range(0, states.shape[0], _PROJECT_ROWS):
        rows = states[s:s + _PROJECT_ROWS]
        logits = (rows if project is None else project(rows)).float()
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        lab = labels[s:s + _PROJECT_ROWS]
        lps.append(-F.cross_entropy(logits, lab, reduction="none").double())
        greedy.append(logits.argmax(-1) == lab)
    return torch.cat(lps).cpu(), torch.cat(greedy).cpu()


def _collect(results: list, owner: list[int], lps: list[float], greedy: list[bool]) -> None:
    """Fold per-token values into one `Scored` per sequence (tokens of a sequence are contiguous)."""
    start = 0
    while start < len(owner):
        i = owner[start]
        end = start
        while end < len(owner) and owner[end] == i:
            end += 1
        results[i] = Scored(logprob=math.fsum(lps[start:end]), greedy=all(greedy[start:end]),
                            last_greedy=bool(greedy[end - 1]), count=end - start)
        start = end


def reference_aggregate(batch_values: list[float], logging_freq: int) -> float:
    """The ppfleetx engine's total (spec §7.3): batch 0 counted `logging_freq` times, then each
    full group of `logging_freq` batches once; a trailing partial group is dropped."""
    if not batch_values:
        return 0.0
    f = max(1, int(logging_freq))
    n_grouped = ((len(batch_values) - 1) // f) * f
    return f * batch_values[0] + math.fsum(batch_values[1:1 + n_grouped])


def batch_sums(values: list[float], batch_size: int) -> list[float]:
    """Per-batch sums of per-item values taken in file order (the reference's DataLoader batches)."""
    return [math.fsum(values[i:i + batch_size]) for i in range(0, len(values), batch_size)]


def amp_dtype_for(cfg, device: torch.device) -> torch.dtype | None:
    """The autocast dtype the config asks for, on CUDA only (fp16/bf16 are slow or unsupported
    on CPU, where evaluation runs in fp32)."""
    mp = cfg.Engine.mix_precision
    if not mp.enable or device.type != "cuda":
        return None
    return torch.bfloat16 if str(mp.dtype).lower() in ("bfloat16", "bf16") else torch.float16


def write_atomic(path: str | os.PathLike, write) -> Path:
    """Call `write(tmp_path)` on a temporary name in the same directory, then rename it to
    `path`: readers see the old file or the new one, never half of one."""
    from gptforge.durable import fsync_path

    p = Path(path)
    if p.is_dir():
        from gptforge.errors import UsageError

        raise UsageError(f"{p}: is a directory, expected a file to write; name a file")
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp" + p.suffix, dir=p.parent)
    os.close(fd)
    try:
        with disk_full_guard(p):
            write(tmp)
            fsync_path(tmp)  # durable before it is published: a power loss leaves the old file or the new
            os.replace(tmp, p)
            fsync_path(p.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """`write_atomic` of a UTF-8 text file."""
    return write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any, default=None) -> Path:
    """`write_atomic` of a JSON file."""
    return write_text_atomic(path, json.dumps(obj, indent=1, ensure_ascii=False, default=default) + "\n")


def read_text(path: str | os.PathLike) -> str:
    """A whole UTF-8 file; DataError naming the file (and line) when missing, empty or not UTF-8."""
    from gptforge.errors import DataError

    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: file not found (evaluation data is never downloaded; give your own file)")
    if p.is_dir():
        raise DataError(f"{p}: is a directory, expected a file")
    if not p.is_file():
        raise DataError(f"{p}: not a regular file")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{p}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x}); "
                        "convert the file to UTF-8") from None
    if not text.strip():
        raise DataError(f"{p}: file is empty")
    return text
