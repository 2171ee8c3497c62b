"""What a training run reports: the reference's log lines, tokens/s, model FLOPs and MFU, and
where they go (stdout, `train.log`, `metrics.jsonl`, TensorBoard events, a progress bar).

MFU = model FLOPs per second / the device's dense peak. Model FLOPs per token are
6·(matmul parameters, the tied LM head counted once) + 12·L·T·d_attn (the attention score and
value products), the usual convention (PaLM appendix B, Megatron); recompute is not counted.
The peak comes from a table keyed by GPU name; on a CPU there is no honest peak to look up, so
MFU is reported as n/a unless the caller passes a measured one (the benchmarks measure sgemm).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

# Dense peak TFLOP/s by dtype: bf16/fp16 tensor cores, tf32, and plain fp32 (no tensor cores).
# Matched as a substring of torch.cuda.get_device_name(), first match wins (order matters).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM ("H100 80GB HBM3")
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return f"CPU {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
        except OSError:
            pass
        return f"CPU ({os.cpu_count()} cores)"
    return device.type


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Dense peak FLOP/s of `device` for `precision` (fp32 | bf16 | fp16), or None if unknown."""
    if device.type != "cuda":
        return None
    key = precision
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        key = "tf32"
    name = torch.cuda.get_device_name(device)
    for pattern, table in PEAK_TFLOPS:
        if pattern in name:
            return table[key] * 1e12 if key in table else None
    return None


def train_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward), independent of recompute."""
    matmul = 0
    for name, p in model.named_parameters():
        # Every 2-D weight is a matmul operand except the position table (a lookup). The word
        # table is the tied LM head: counted once, as the head's matmul.
        if p.ndim == 2 and not name.endswith("wpe.weight") and not name.endswith("_bias"):
            matmul += p.numel()
        elif p.ndim == 3:  # stacked MoE experts [E, in, out]: a token runs through topk of them
            k = getattr(getattr(model, "config", None), "topk", 1)
            matmul += p.numel() * min(k, p.shape[0]) // p.shape[0]
    cfg = getattr(model, "config", None)
    attn = 0
    if cfg is not None:
        from gptforge.model.gpt import layer_shapes

        heads, _ = layer_shapes(cfg)
        attn = sum(h * cfg.head_dim for h in heads)
    return 6.0 * matmul + 12.0 * seq_len * attn


# ------------------------------------------------------------------------------- lines


def train_line(epoch: int, epochs: int, step: int, total_steps: int, loss: float, batch_cost: float,
               tokens_per_step: int, data_world: int, lr: float, found_inf: int,
               loss_scale: float | None = None) -> str:
    """The reference's `[train]` line (LanguageModule.training_step_end)."""
    speed = 1.0 / batch_cost if batch_cost > 0 else 0.0
    ips_total = speed * tokens_per_step
    scale = f"loss_scale: {loss_scale:.9f}, " if loss_scale is not None else ""
    return (f"[train] epoch: [{epoch}/{epochs}], batch: [{step}/{total_steps}], loss: {loss:.9f}, "
            f"avg_batch_cost: {batch_cost:.5f} sec, speed: {speed:.2f} step/s, "
            f"ips_total: {ips_total:.0f} tokens/s, ips: {ips_total / data_world:.0f} tokens/s, "
            f"{scale}learning rate: {lr:.5e}, found_inf: {found_inf:.0f}")


class MoEWindow:
    """Routing statistics of an MoE model summed over a logging window (this rank's tokens):
    assignments per expert per MoE layer, dropped assignments, the mean balancing loss."""

    def __init__(self):
        self.counts: list[list[int]] | None = None
        self.dropped, self.aux, self.n = 0, 0.0, 0

    def add(self, stats: dict | None) -> None:
        """One forward's `gptforge.model.moe.load_stats`."""
        if stats is None:
            return
        if self.counts is None:
            self.counts = [list(c) for c in stats["tokens_per_expert"]]
        else:
            self.counts = [[a + b for a, b in zip(x, y, strict=True)]
                           for x, y in zip(self.counts, stats["tokens_per_expert"], strict=True)]
        self.dropped += stats["dropped"]
        self.aux += stats["aux_loss"] or 0.0
        self.n += 1

    def values(self) -> dict:
        total = sum(sum(c) for c in self.counts or [])
        return {"moe_tokens_per_expert": self.counts, "moe_dropped": self.dropped,
                "moe_dropped_frac": self.dropped / total if total else 0.0,
                "moe_aux_loss": self.aux / self.n if self.n else 0.0}

    def line(self) -> str:
        """`[moe] aux_loss: …, dropped: N (p%), tokens per expert: [..] [..]` (one list per MoE layer)."""
        v = self.values()
        lists = " ".join("[" + " ".join(str(c) for c in layer) + "]" for layer in self.counts or [])
        return (f"[moe] aux_loss: {v['moe_aux_loss']:.6f}, dropped: {v['moe_dropped']} "
                f"({100 * v['moe_dropped_frac']:.2f}%), tokens per expert: {lists}")

    def reset(self) -> None:
        self.__init__()


def eval_line(epoch: int, batch: int, total: int, loss: float, cost: float) -> str:
    """The reference's `[eval]` line; `batch` counts finished eval batches over the run."""
    speed = 1.0 / cost if cost > 0 else 0.0
    return (f"[eval] epoch: {epoch}, batch: {batch}/{total}, loss: {loss:.9f}, "
            f"avg_eval_cost: {cost:.5f} sec, speed: {speed:.2f} step/s")


def fmt_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory (CUDA) or peak resident set size of this process (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM from /proc, else getrusage)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ------------------------------------------------------------------------------ sinks


class RunLogger:
    """Writes log lines to stdout + `train.log` and records to `metrics.jsonl` + TensorBoard.

    Only the main process writes; others get a logger whose methods do nothing (`enabled=False`).
    Progress on stderr as `gptforge.progress` says: a bar with an ETA on a terminal, plain lines
    with the ETA when redirected.
    """

    def __init__(self, run_dir: Path | None, enabled: bool = True, tensorboard: bool = True,
                 total_steps: int = 0, start_step: int = 0, progress: bool | None = None, echo: bool = True,
                 truncate_after: int | None = None, trackers: Callable[[], list] | None = None):
        self.enabled = enabled and run_dir is not None
        self.echo = echo
        self.run_dir = run_dir
        self._log = self._jsonl = self._tb = self._bar = None
        self._trackers: list = []
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if truncate_after is not None:
            truncate_metrics(run_dir / "metrics.jsonl", truncate_after)
        self._log = open(run_dir / "train.log", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        if trackers is not None:  # W&B / MLflow (train/trackers.py): opened by the process that logs
            self._trackers = trackers()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            except ImportError:
                self.info("gptforge: TensorBoard events not written (pip install tensorboard)")
        from gptforge import progress as _progress

        if _progress.quiet():
            self.echo = False  # --quiet: the log lines go to train.log only
        # A bar on a terminal; redirected, a plain line with the ETA every GPTFORGE_PROGRESS_EVERY
        # seconds (the log lines come every logging_freq steps, however long that takes).
        if progress is not False and total_steps > start_step and _progress.mode() != "off":
            self._bar = _progress.bar(total=total_steps, initial=start_step, unit="step", desc="training")

    def info(self, line: str) -> None:
        """One human-readable line to stdout (above the bar) and train.log."""
        if not self.enabled:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        if self.echo:
            if self._bar is not None:
                self._bar.write(line, file=sys.stdout)
            else:
                print(line, flush=True)
        self._log.write(f"{stamp} {line}\n")
        self._log.flush()

    def record(self, kind: str, step: int, values: dict) -> None:
        """A metrics record: one JSON line, and TensorBoard scalars under `kind/`."""
        if not self.enabled:
            return
        row = {"kind": kind, "step": step, "time": round(time.time(), 3)}
        row.update({k: _jsonable(v) for k, v in values.items()})
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        for t in self._trackers:
            t.log(kind, step, values)
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)

    def progress(self, step: int, loss: float | None = None) -> None:
        """Advance the bar to `step` (redraws are rate-limited by tqdm)."""
        if self._bar is not None:
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self._bar.update(step - self._bar.n)

    def set_total(self, total_steps: int) -> None:
        """The run's length changed (`Engine.fit_to_max_time`): the bar's total follows."""
        if self._bar is not None:
            self._bar.total = total_steps
            self._bar.refresh()

    def close(self, ok: bool = True) -> None:
        """Flush and close every sink; `ok=False` marks tracker runs failed (an error ended them)."""
        trackers, self._trackers = self._trackers, []
        for t in trackers:
            t.close(ok)
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        for f in (self._log, self._jsonl):
            if f is not None:
                f.close()
        self._bar = self._tb = self._log = self._jsonl = None


def truncate_metrics(path: Path, step: int) -> int:
    """Drop the records of `path` logged after `step` (and a torn last line), so that a run
    resumed from `step_N` logs every later step exactly once. Returns the records dropped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    keep = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if line.endswith("\n") and isinstance(row, dict) and int(row.get("step", 0)) <= step:
            keep.append(line)
    if len(keep) == len(lines):
        return 0
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)
    return len(lines) - len(keep)


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, Path):
        return str(v)
    return v
