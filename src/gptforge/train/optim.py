"""AdamW with the reference's parameter groups (or Muon on the blocks' matrices), its learning-rate
schedules (measured in samples) and global-norm gradient clipping (spec §3).

The schedule is a pure function of *consumed samples* `t`: optimizer step k uses `lr(k·gbs)`,
and a step whose update was skipped (fp16 overflow) does not advance `t`. Parameter groups
carry an `lr_mult` key so that a caller can give some parameters their own learning rate
(QAT's PACT alpha uses ×1000) by setting `param.lr_mult` before the optimizer is built.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from gptforge.config.schema import Config, OptimizerConfig
from gptforge.errors import ConfigError

SCHEDULES = ("CosineAnnealingWithWarmupDecay", "LinearDecayWithWarmup", "Constant")
OPTIMIZERS = ("FusedAdamW", "AdamW", "Muon")
# Muon orthogonalizes the update of the transformer blocks' 2-D weights; embeddings, the LM head,
# biases, norms, scalars and 3-D (stacked MoE) tensors stay with AdamW, as Muon's authors use it.
_MUON_PARAM = re.compile(r"(^|\.)blocks\.\d+\.")


# ------------------------------------------------------------------------- param groups


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters split into AdamW groups.

    Decay every parameter with ndim >= 2 (Linear weights and both embedding tables); never
    biases, LayerNorm parameters or scalars. `requires_grad=False` parameters are left out.
    Parameters with a `lr_mult` attribute go into groups of their own (one per multiplier and
    decay setting). Each group records `lr_mult`, `weight_decay` and the parameter `names`.
    """
    groups: dict[tuple[float, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # Stacked MoE expert biases ([E, out], model/moe.py) are biases too: no decay; nor a
        # weight-only QAT layer's learned scales (decay would pull their logarithm to 0).
        decay = p.ndim >= 2 and not name.endswith(("_bias", "_log_scale"))
        mult = float(getattr(p, "lr_mult", 1.0))
        key = (mult, decay)
        if key not in groups:
            groups[key] = {"params": [], "names": [], "weight_decay": weight_decay if decay else 0.0,
                           "lr_mult": mult}
        groups[key]["params"].append(p)
        groups[key]["names"].append(name)
    if not groups:
        raise ConfigError("the model has no trainable parameters (every parameter has requires_grad=False)")
    # Deterministic order: the plain decay/no-decay groups first, then multipliers ascending.
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0] != 1.0, k[0], not k[1]))]


def _fused_ok(params: Iterable[torch.Tensor]) -> bool:
    """torch's fused AdamW kernels cover floating-point tensors on CPU, CUDA, MPS and XPU."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda", "mps", "xpu")
               and type(p) is nn.Parameter for p in params)


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer over the trainable parameters, lr 0 until the schedule sets it.

    `FusedAdamW` uses torch's fused kernel when every parameter is a plain tensor on a
    supported device (else the foreach kernel); `AdamW` always uses foreach. Both are the
    decoupled-weight-decay update of the reference. `Muon`: `torch.optim.Muon` on the blocks'
    2-D weights with its lr scaled to match AdamW's update size (so `max_lr` and `weight_decay`
    carry over), AdamW on everything else (`MuonAdamW`).
    """
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"Optimizer.name: {cfg.name!r} is not supported; choose one of {', '.join(OPTIMIZERS)}")
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "Muon":
        return _muon_adamw(groups, cfg)
    return _adamw(groups, cfg, fused=cfg.name == "FusedAdamW")


def _adamw(groups: list[dict], cfg: OptimizerConfig, fused: bool) -> torch.optim.AdamW:
    fused = fused and _fused_ok(p for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=0.0, betas=(cfg.beta1, cfg.beta2), eps=cfg.epsilon,
                             weight_decay=cfg.weight_decay, fused=fused or None, foreach=None if fused else True)


def _muon_adamw(groups: list[dict], cfg: OptimizerConfig) -> MuonAdamW:
    muon, adamw = [], []
    for g in groups:
        picked = [_MUON_PARAM.search(n) is not None and p.ndim == 2 for n, p in zip(g["names"], g["params"], strict=True)]
        for into, want in ((muon, True), (adamw, False)):
            names = [n for n, k in zip(g["names"], picked, strict=True) if k == want]
            if names:
                into.append({**g, "names": names,
                             "params": [p for p, k in zip(g["params"], picked, strict=True) if k == want]})
    if not muon:
        raise ConfigError("Optimizer.name: Muon found no 2-D weights in the model's blocks to orthogonalize; "
                          "use FusedAdamW")
    if any(type(p) is not nn.Parameter for g in muon for p in g["params"]):
        raise ConfigError("Optimizer.name: Muon needs whole weight matrices and this run shards them "
                          "(tensor or sharding parallel); use FusedAdamW, or data / pipeline parallel")
    return MuonAdamW(_adamw(adamw, cfg, fused=True) if adamw else None,
                     torch.optim.Muon(muon, lr=0.0, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                                      adjust_lr_fn="match_rms_adamw"))


class _States(Mapping):
    """The parts' per-parameter states as one read-only mapping (theirs are defaultdicts, which
    would answer a parameter of the other part with an empty state)."""

    def __init__(self, states: list[dict]):
        self.states = states

    def __getitem__(self, p):
        for s in self.states:
            if p in s:
                return s[p]
        raise KeyError(p)

    def __iter__(self) -> Iterator:
        return (p for s in self.states for p in s)

    def __len__(self) -> int:
        return sum(len(s) for s in self.states)


class MuonAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` and `torch.optim.AdamW` stepped as one optimizer.

    `param_groups` are the two optimizers' own group dicts (AdamW's first), so a schedule that
    sets `lr` reaches both; `state_dict` is torch's format over that order (parameter indices
    run through AdamW's groups, then Muon's), so checkpoints and resumes work as for AdamW.
    """

    def __init__(self, adamw: torch.optim.AdamW | None, muon: torch.optim.Muon):
        self.parts = [o for o in (adamw, muon) if o is not None]
        super().__init__([g for o in self.parts for g in o.param_groups], {})
        # Optimizer.__init__ re-registers the same dicts; the state lives in the two parts.
        self.param_groups = [g for o in self.parts for g in o.param_groups]
        self.state = _States([o.state for o in self.parts])

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for o in self.parts:
            o.step()
        return loss

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for o in self.parts:
            sd = o.state_dict()
            state.update({k + offset: v for k, v in sd["state"].items()})
            groups += [{**g, "params": [i + offset for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in o.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"the saved optimizer has {len(saved)} parameter groups, this Muon + AdamW one "
                             f"{len(self.param_groups)} (was it saved by another Optimizer.name?)")
        first = 0
        for o in self.parts:
            # Keys are indices (ours) or parameter names (torch.distributed.checkpoint): torch
            # pairs a group's saved keys with its own parameters by position either way.
            mine = saved[first:first + len(o.param_groups)]
            keys = {k for g in mine for k in g["params"]}
            o.load_state_dict({"state": {k: v for k, v in state_dict["state"].items() if k in keys},
                               "param_groups": mine})
            first += len(o.param_groups)
        # load_state_dict gives each part new group dicts and a new state: share them again.
        self.param_groups = [g for o in self.parts for g in o.param_groups]
        self.state = _States([o.state for o in self.parts])


# ------------------------------------------------------------------------------ schedule


class LRSchedule:
    """lr as a function of consumed samples `t` (`use_increments: True`, spec §3).

    CosineAnnealingWithWarmupDecay: linear warmup 0 → max_lr over `warmup` samples, cosine to
    min_lr at `decay` samples, min_lr after. LinearDecayWithWarmup: the same warmup, then
    linear to 0 at `decay`. Constant: max_lr. decay = decay_steps·gbs; warmup = warmup_steps·gbs
    when set, else warmup_rate·decay.
    """

    def __init__(self, name: str, max_lr: float, min_lr: float, decay_samples: int, warmup_samples: float,
                 use_increments: bool = True):
        if name not in SCHEDULES:
            raise ConfigError(f"Optimizer.lr.name: {name!r} is not one of {', '.join(SCHEDULES)}")
        self.name, self.max_lr, self.min_lr = name, max_lr, min_lr
        self.decay, self.warmup = float(decay_samples), float(warmup_samples)
        self.use_increments = use_increments

    @classmethod
    def from_config(cls, cfg: Config) -> LRSchedule:
        lr = cfg.Optimizer.lr
        gbs = cfg.Global.global_batch_size
        decay = (lr.decay_steps or cfg.Engine.max_steps or 1) * gbs
        warmup = lr.warmup_steps * gbs if lr.warmup_steps is not None else lr.warmup_rate * decay
        if warmup > decay:
            raise ConfigError(f"Optimizer.lr.warmup_steps: {lr.warmup_steps} exceeds decay_steps {lr.decay_steps}")
        return cls(lr.name, lr.max_lr, lr.min_lr, decay, warmup, lr.use_increments)

    def __call__(self, t: float) -> float:
        if not self.use_increments or self.name == "Constant":
            # use_increments False: the reference's scheduler never moves (lr stuck at 0); we hold max_lr.
            return self.max_lr
        if self.warmup > 0 and t <= self.warmup:
            return self.max_lr * t / self.warmup
        if self.name == "LinearDecayWithWarmup":
            if t >= self.decay:
                return 0.0
            return self.max_lr * (self.decay - t) / max(self.decay - self.warmup, 1e-12)
        if t > self.decay:
            return self.min_lr
        progress = (t - self.warmup) / max(self.decay - self.warmup, 1e-12)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.max_lr - self.min_lr)


class Scheduler:
    """Applies an `LRSchedule` to an optimizer's groups (lr = schedule × group lr_mult) and
    tracks the samples the schedule has advanced by (updates skipped on overflow do not count)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule):
        self.optimizer, self.schedule = optimizer, schedule
        self.samples = 0
        self.apply()

    @property
    def lr(self) -> float:
        """The base learning rate the next update uses."""
        return self.schedule(self.samples)

    def apply(self) -> None:
        base = self.lr
        for g in self.optimizer.param_groups:
            g["lr"] = base * g.get("lr_mult", 1.0)

    def advance(self, samples: int) -> None:
        self.samples += int(samples)
        self.apply()

    def state_dict(self) -> dict:
        return {"samples": self.samples, "last_lr": self.lr}

    def load_state_dict(self, state: dict) -> None:
        self.samples = int(state["samples"])
        self.apply()


# ----------------------------------------------------------------------------- clipping


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], clip_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (accumulated in fp32); with clip_norm > 0 scale them by
    clip/max(norm, clip), the reference's `ClipGradByGlobalNorm`. Returns the pre-clip norm
    as a tensor (no host sync)."""
    grads = grads_of(params)
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads, 2.0)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
    if clip_norm > 0:
        coef = clip_norm / torch.clamp(total, min=clip_norm)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
