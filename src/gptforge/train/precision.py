"""Training precision: fp32, bf16 autocast, or fp16 autocast with a dynamic loss scaler.

Parameters (the master weights) and optimizer state always stay fp32; matmuls run in the low
precision under `torch.autocast` and the loss is computed in fp32 (the model casts the logits).
This is what the reference's O2 gives numerically (fp16 compute, fp32 master weights), so
`level: O1` and `O2` behave the same here. fp16 uses `torch.amp.GradScaler` seeded with
`scale_loss`; an overflow step skips the update and the trainer does not advance the LR.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from gptforge.config.schema import MixPrecisionConfig

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_warned_cpu = False


class Precision:
    """Autocast context, loss scaling and the optimizer step for one precision setting."""

    def __init__(self, cfg: MixPrecisionConfig, device: torch.device):
        self.device = torch.device(device)
        self.enabled = bool(cfg.enable)
        self.dtype = _DTYPES[cfg.dtype] if self.enabled else torch.float32
        self.fp16 = self.dtype == torch.float16
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=cfg.scale_loss) if self.fp16 else None
        if self.enabled and self.device.type == "cpu":
            _warn_cpu_once(cfg.dtype)

    @property
    def name(self) -> str:
        return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]

    def autocast(self):
        """Context for forward passes (a no-op in fp32)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring the gradients back to their true scale (before clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    @property
    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply the update; False when fp16 found inf/nan gradients and skipped it."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # The scaler backs off (×0.5) exactly when it found inf/nan and skipped the step.
        return self.scaler.get_scale() >= before

    def state_dict(self) -> dict:
        return {"dtype": self.name, "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def _warn_cpu_once(dtype: str) -> None:
    global _warned_cpu
    if not _warned_cpu:
        _warned_cpu = True
        print(f"gptforge: warning: Engine.mix_precision: {dtype} on a CPU device is very slow on CPUs "
              "without native low-precision matmuls (about 30x slower than fp32 on AVX2); set "
              "-o Engine.mix_precision.enable=False to train in fp32", file=sys.stderr)
