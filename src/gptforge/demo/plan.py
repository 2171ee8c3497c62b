"""What the demo trains: the model shape, the step counts that fit the time budget, and the YAML
recipes it writes into `<out>/configs/` (the reproduction commands in the report use them).

Step counts come from a measured training step of the demo's shape on this machine
(`calibrate`), so a slower machine trains fewer steps instead of overrunning the budget, and a
GPU trains more (up to a cap). The shares of the budget are fixed: pretraining 64%, each of the
four fine-tuning runs (QAT, QAT after analysis, pruning, pruned + QAT) 5%; everything else
(data preparation, evaluations, analysis, exports) takes the rest.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

# 64%: with the 2-layer models the stages other than training take ~35 s on 2 quiet cores (a run
# with 58% ended at 10:56 of its 12 minutes, its four fine-tunes taking 190 s); the rest of the
# budget is kept for a busier machine. The float model is what the demo's quality rests on, so
# pretraining gets the time the fine-tunes can spare (they start from it and need few steps).
PRETRAIN_SHARE = 0.64
FINETUNE_SHARE = 0.05
QAT_STEP_COST = 1.4  # a fake-quant training step costs about this many float steps (measured: 1.1-1.3)
PRETRAIN_MAX = 6000  # pretraining steps at most (~2.6 passes over the built-in corpus' training split)
TRAINER_OVERHEAD = 1.15  # the trainer's step (data, clipping, logging, evals, checkpoints) vs the bare step timed


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    ffn: int
    seq: int
    batch: int


# Chosen by benchmarks/demo_sweep.py (benchmarks/results/2026-11-24-demo-sweep.md): for a few minutes of
# pretraining on 2 cores, 2 layers that see twice the tokens beat 4 layers (1.66 vs 1.74-1.78 bits/byte).
FULL = Shape(hidden=128, layers=2, heads=4, ffn=512, seq=128, batch=16)
QUICK = Shape(hidden=64, layers=2, heads=2, ffn=256, seq=64, batch=8)
# The model follows the budget, measured in planned steps of FULL (sweep rounds 6-8, with the
# 4096-token vocabulary): a quiet 2-core machine's budget (3100-4000 steps of FULL) is best spent
# on a wider model, LARGE (1.632 vs 1.639 bits/byte time-fitted, 1.588 vs 1.598 at fixed steps), a
# busy one's (~1400) on FULL (1.793; hidden 96: 1.888).
LARGE = Shape(hidden=160, layers=2, heads=5, ffn=640, seq=128, batch=16)


@dataclass(frozen=True)
class Choice:
    """A shape the plan may train, its max learning rate, and the budget it is trained from."""

    shape: Shape
    max_lr: float
    from_full_steps: int  # trained when the budget buys at least this many steps of FULL


LADDER = (Choice(LARGE, 3.0e-3, 2500), Choice(FULL, 3.0e-3, 0))
VOCAB, QUICK_VOCAB = 4096, 2048  # sweep round 6: 4096 tokens beat 2048 at equal time (1.598 vs 1.619)


@dataclass
class Settings:
    """Everything the user chooses (a different choice starts a fresh demo directory)."""

    out: str
    quick: bool = False
    minutes: float = 12.0  # the time budget for the whole demo
    vocab_size: int = 0  # 0: the demo's choice, VOCAB (QUICK_VOCAB with --quick)
    weight_bits: int = 8
    prune_ratio: float = 0.25
    top_k: int | None = None  # layers left float after the analysis (default: the analysis' suggestion)
    device: str = "auto"
    seed: int = 1024
    shape: Shape = field(default_factory=lambda: FULL)
    # The pretraining schedule (chosen by benchmarks/demo_sweep.py for the default budget).
    max_lr: float = 3.0e-3
    min_lr: float = 3.0e-4
    warmup_rate: float = 0.02
    beta2: float = 0.999
    # Sweep round 9: Muon on the blocks' matrices learns far more per step than AdamW at this
    # size (1.510 vs 1.619 bits/byte after 2900 steps of LARGE) for ~5% more time a step; weight
    # decay 0.1, Muon's published setting, measured 1.495 vs 0.01's 1.502 (inside one run's noise).
    optimizer: str = "Muon"
    weight_decay: float = 0.1

    def __post_init__(self) -> None:
        if not self.vocab_size:
            self.vocab_size = QUICK_VOCAB if self.quick else VOCAB

    def fingerprint(self) -> dict:
        d = asdict(self)
        d.pop("out")
        return d


@dataclass
class Steps:
    step_seconds: float  # one float training step of the demo's shape, measured (with the trainer's overhead)
    pretrain: int
    finetune: int
    device: str
    threads: int = 0  # CPU threads the demo trains with (0: torch's default; states written before it)
    shape: dict | None = None  # the shape trained when the plan chose another rung of LADDER (None: the settings' shape)
    max_lr: float | None = None
    min_lr: float | None = None


def calibrate(s: Settings, adapt_shape: bool = True) -> Steps:
    """Time a few float training steps of the demo's shape and derive the step counts.

    On a CPU the step is timed with every core's thread and with one: on a machine whose cores
    are busy with other work, threads that wait for each other at every operator lose to a single
    one (measured on 2 cores with two other busy processes: 264-305 ms a step with 2 threads,
    198-206 ms with 1). The faster count is kept for the whole demo (`Steps.threads`).

    With the default shape and `adapt_shape`, the budget measured in steps of FULL picks the
    shape from LADDER (`Steps.shape`): wider on a fast machine, narrower on a slow or busy one."""
    import torch

    from gptforge.device import select_device, tune_cpu_allocator

    dev = select_device(s.device)
    if dev.type == "cpu":
        tune_cpu_allocator()  # as the trainer does: without it every step page-faults its buffers in
    timed = _step_timer(s, dev)

    def time_at(n: int) -> float:
        torch.set_num_threads(n)
        return timed()

    step_s, threads = fastest_threads(time_at, torch.get_num_threads() if dev.type == "cpu" else 0)
    if threads:
        torch.set_num_threads(threads)
    else:
        step_s = timed()
    steps = _fit(s, step_s * TRAINER_OVERHEAD, str(dev), threads)
    if adapt_shape and not s.quick and s.shape == FULL:
        pick = choose(steps.pretrain)
        if pick.shape != FULL:
            other = replace(s, shape=pick.shape, max_lr=pick.max_lr, min_lr=pick.max_lr / 10)
            steps = _fit(other, _step_timer(other, dev)() * TRAINER_OVERHEAD, str(dev), threads)
            steps.shape, steps.max_lr, steps.min_lr = asdict(pick.shape), pick.max_lr, pick.max_lr / 10
    return steps


def choose(full_steps: int) -> Choice:
    """The rung of LADDER for a budget of `full_steps` pretraining steps of FULL."""
    return next(c for c in LADDER if full_steps >= c.from_full_steps)


def trained_settings(s: Settings, steps: Steps) -> Settings:
    """The settings the demo trains with: the plan may have chosen the smaller shape."""
    if not steps.shape:
        return s
    return replace(s, shape=Shape(**steps.shape), max_lr=steps.max_lr, min_lr=steps.min_lr)


def _step_timer(s: Settings, dev):
    """A function that returns the median time of a float training step of `s`'s shape."""
    import torch

    from gptforge.config import load_config
    from gptforge.model import build_model
    from gptforge.train.optim import build_optimizer

    cfg = load_config(overrides=[*model_overrides(s), f"Optimizer.name={s.optimizer}"])
    torch.manual_seed(0)
    model = build_model(cfg.Model).to(dev).train()
    opt = build_optimizer(model, cfg.Optimizer)
    for g in opt.param_groups:
        g["lr"] = 1e-4
    sh = s.shape
    ids = torch.randint(0, s.vocab_size, (sh.batch, sh.seq + 1), device=dev)

    def step():
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed() -> float:
        step()
        step()
        times = []
        for _ in range(8):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        # The median: on a shared machine a low value is a lucky step (measured: 203 ms calibrated,
        # 380-480 ms in training with two other processes busy on the 2 cores).
        return statistics.median(times)

    return timed


def _fit(s: Settings, sec: float, device: str, threads: int) -> Steps:
    """Step counts that fit the budget's shares at `sec` seconds a float training step."""
    budget = 60.0 * s.minutes
    lo, hi = (60, 300) if s.quick else (300, PRETRAIN_MAX)
    ft_lo, ft_hi = finetune_range(s.quick)
    pretrain = int(min(hi, max(lo, PRETRAIN_SHARE * budget / sec)))
    finetune = int(min(ft_hi, max(ft_lo, FINETUNE_SHARE * budget / (sec * QAT_STEP_COST))))
    return Steps(step_seconds=sec, pretrain=_round(pretrain), finetune=_round(finetune), device=device,
                 threads=threads)


def threads_text(n: int) -> str:
    """' with N thread(s)' for the plan's thread count; '' when none was chosen (not a CPU)."""
    return f" with {n} thread{'s' if n != 1 else ''}" if n else ""


def fastest_threads(time_at, threads: int) -> tuple[float, int]:
    """(seconds, thread count) of the faster of `threads` and 1 thread; `time_at(n)` times a step
    with n threads. `threads` 0 (not a CPU): (0.0, 0), nothing timed. Ties keep the larger count."""
    if threads <= 0:
        return 0.0, 0
    best = None
    for n in sorted({threads, 1}, reverse=True):
        t = time_at(n)
        if best is None or t < best[0]:
            best = (t, n)
    return best


# What the stages other than training take, relative to each other (measured on 2 cores: analysis
# and evaluation dominate); together they get the budget's share that training leaves.
REST_SHARE = 1.0 - PRETRAIN_SHARE - 4 * FINETUNE_SHARE
REST_WEIGHTS = {"tokenizer": 0.3, "data": 0.3, "plan": 0.2, "generate": 0.5, "ptq": 1.0, "analysis": 5.0,
                "int8": 1.0, "evaluate": 3.0, "export": 2.0, "report": 0.5}
FINETUNE_STAGES = ("qat", "qat_skip", "prune", "pruned_qat")


def pretrain_seconds(s: Settings) -> float:
    """The most the pretraining stage may take (`Engine.max_time`): its share of the budget."""
    return PRETRAIN_SHARE * 60.0 * s.minutes


def pretrained_steps(out: dict, planned: int) -> int:
    """Steps the pretraining stage ran: the plan's, or fewer when `Engine.max_time` stopped it
    (read off its last checkpoint, `step_N`: the training log is written every few steps)."""
    name = Path(str(out.get("ckpt") or "")).name
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    train = out.get("train") or []
    return int(train[-1][0]) if train else planned


def finetune_range(quick: bool) -> tuple[int, int]:
    return (20, 40) if quick else (50, 400)


def refit_finetune(s: Settings, elapsed: float, step_seconds: float, done: set[str]) -> int:
    """Steps for each fine-tune still to run, re-fitted to the budget that is left.

    `elapsed`: seconds the demo has run; `step_seconds`: a float training step as measured by
    the pretraining stage (its wall time / its steps, evaluations and checkpoints included), so a
    machine that got slower since the plan trains fewer steps. Time is kept for the other
    stages still to come by their weights in REST_WEIGHTS.
    """
    budget = 60.0 * s.minutes
    rest_left = sum(w for k, w in REST_WEIGHTS.items() if k not in done) / sum(REST_WEIGHTS.values())
    reserve = REST_SHARE * budget * rest_left
    left = [k for k in FINETUNE_STAGES if k not in done]
    lo, hi = finetune_range(s.quick)
    if not left:
        return lo
    per = (budget - elapsed - reserve) / len(left) / (step_seconds * QAT_STEP_COST)
    return max(lo, _round(int(min(hi, max(lo, per)))))


def _round(n: int) -> int:
    """Step counts in round tens (readable configs, checkpoints every quarter)."""
    return max(20, (n // 20) * 20)


def model_overrides(s: Settings) -> list[str]:
    sh = s.shape
    return [f"Model.vocab_size={s.vocab_size}", f"Model.hidden_size={sh.hidden}", f"Model.num_layers={sh.layers}",
            f"Model.num_attention_heads={sh.heads}", f"Model.ffn_hidden_size={sh.ffn}",
            f"Model.max_position_embeddings={sh.seq}", "Model.hidden_dropout_prob=0",
            "Model.attention_probs_dropout_prob=0"]


class Paths:
    """Where every stage writes, under the demo directory."""

    def __init__(self, out: str | Path):
        o = Path(out)
        self.out = o
        self.tokenizer = o / "tokenizer"
        self.data = o / "data"
        self.prefix = o / "data" / "builtin"
        self.heldout = o / "data" / "heldout.txt"
        self.cloze = o / "data" / "cloze.jsonl"
        self.prompts = o / "data" / "prompts.txt"
        self.configs = o / "configs"
        self.logs = o / "logs"
        self.evals = o / "evals"
        self.float = o / "float"
        self.ptq = o / "ptq"
        self.qat = o / "qat"
        self.analysis = o / "analysis"
        self.qat_skip = o / "qat_skip"
        self.pruned = o / "pruned"
        self.pruned_qat = o / "pruned_qat"
        self.int8 = o / "int8"
        self.export = o / "export"
        self.samples = o / "samples.json"
        self.state = o / "demo_state.json"

    def config(self, name: str) -> Path:
        return self.configs / f"{name}.yaml"


SPLIT = [949, 50, 1]


def _abs(path: Path) -> str:
    # Absolute, so the recipes and every config.yaml trained from them work from any directory.
    return os.path.abspath(path)


def _common(s: Settings, p: Paths, steps: int, out_dir: Path, logging: int) -> dict:
    sh = s.shape
    data = {"dataset": {"input_dir": _abs(p.prefix), "split": SPLIT, "max_seq_len": sh.seq},
            "loader": {"num_workers": 0}}
    return {
        "Global": {"device": s.device, "seed": s.seed, "global_batch_size": sh.batch, "local_batch_size": sh.batch,
                   "micro_batch_size": sh.batch},
        "Engine": {"max_steps": steps, "logging_freq": logging, "eval_freq": max(steps // 4, 1), "eval_iters": 4,
                   "mix_precision": {"enable": False},
                   "save_load": {"save_steps": max(steps // 4, 1), "output_dir": _abs(out_dir), "keep_last": 1}},
        "Data": {"tokenizer": _abs(p.tokenizer), "Train": data, "Eval": json.loads(json.dumps(data))},
    }


def write_configs(s: Settings, p: Paths, steps: Steps) -> dict[str, Path]:
    """pretrain.yaml, qat.yaml, prune.yaml: complete recipes (no _base_, absolute paths), so they run
    from any directory."""
    sh = s.shape
    pre = _common(s, p, steps.pretrain, p.float, max(steps.pretrain // 20, 1))
    pre["Model"] = {"vocab_size": s.vocab_size, "hidden_size": sh.hidden, "num_layers": sh.layers,
                    "num_attention_heads": sh.heads, "ffn_hidden_size": sh.ffn, "max_position_embeddings": sh.seq,
                    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    pre["Optimizer"] = {"name": s.optimizer, "weight_decay": s.weight_decay, "beta2": s.beta2, "lr": {"decay_steps": steps.pretrain, "warmup_rate": s.warmup_rate,
                                                     "max_lr": s.max_lr, "min_lr": s.min_lr},
                        "grad_clip": {"clip_norm": 1.0}}

    ft_log = max(steps.finetune // 4, 1)
    qat = _common(s, p, steps.finetune, p.qat, ft_log)
    qat["Model"] = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    # The reference's QAT recipe: weight decay 0.02, no warmup, a small lr decaying 10x.
    qat["Optimizer"] = {"name": "FusedAdamW", "weight_decay": 0.02, "lr": {"decay_steps": steps.finetune, "warmup_rate": 0.0,
                                                     "max_lr": 2.0e-4, "min_lr": 2.0e-5}}
    # The reference's quantizer (qat_gpt_345M_single_card.yaml), INT8 unless --weight-bits says otherwise.
    qat["Compress"] = {"Quantization": {
        "enable": True, "weight_quantize_type": "abs_max", "activation_quantize_type": "moving_average_abs_max",
        "activation_preprocess_type": "PACT", "weight_bits": s.weight_bits, "activation_bits": 8,
        "onnx_format": True, "freeze_embedding": True, "calib_batches": 8}}

    prune = _common(s, p, steps.finetune, p.pruned, ft_log)
    prune["Model"] = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    # The reference's pruning recipe: no warmup, no weight decay, dropout 0.
    prune["Optimizer"] = {"name": "FusedAdamW", "weight_decay": 0.0, "lr": {"decay_steps": steps.finetune, "warmup_rate": 0.0,
                                                      "max_lr": 5.0e-4, "min_lr": 5.0e-5}}
    prune["Compress"] = {"Prune": {"enable": True, "criterion": "l1_norm", "ratio": s.prune_ratio,
                                   "scope": "uniform"}}
    p.configs.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, doc in (("pretrain", pre), ("qat", qat), ("prune", prune)):
        path = p.config(name)
        head = f"# written by `gptforge demo` ({'--quick' if s.quick else 'default'}); see docs/demo.md\n"
        path.write_text(head + yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
        out[name] = path
    return out


PROMPTS = ["def", "import", "class Parser", "Return the", "The following"]
