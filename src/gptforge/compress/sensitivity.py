"""Per-layer quantization sensitivity (spec §9, PaddleSlim `AnalysisQAT` semantics).

Two procedures over one loaded fake-quant model, a layer at a time:
- `qat` (leave-one-out de-quantization, the reference's AnalysisQAT): every quantized Linear
  stays quantized except one, whose weight and activation quantization are switched off and
  whose weight is replaced by the float baseline's (the pre-QAT weight, as the reference does)
  when one is given; sensitivity = goodness(model without that layer's quantization) −
  goodness(QAT model).
- `ptq` (the reference's later `Analysis` PTQ mode): every layer is float except one, which is
  quantized; sensitivity = goodness(float model) − goodness(model with only that layer quantized).

goodness is the metric oriented so that larger is better, so in both modes a larger sensitivity
means the layer loses more to quantization:
- `acc` (LAMBADA accuracy ×100, as the reference): goodness = acc, i.e. acc_without − acc_qat;
- `ppl` (WikiText perplexity) and `loss` (mean token loss on held-out batches): goodness =
  −value, i.e. ppl_qat − ppl_without;
- `cosine` (1 − cosine similarity of the logits) and `kl` (KL(float ‖ model) of the next-token
  distributions), distances to the float model's outputs on calibration batches: goodness =
  −distance, i.e. distance_qat − distance_without (how much closer to the float model the
  model gets when the layer is left float).

The model is restored after each layer (switches and weight), so it ends exactly as it began.
Progress (the base metric and every finished layer) is written atomically to a JSON state file
after each evaluation; a run with the same inputs (`fingerprint`) resumes from it.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gptforge.errors import CheckpointError, UsageError
from gptforge.transforms.quant import QuantEmbedding, QuantLinear, _match, quant_modules, reference_name

MODES = ("qat", "ptq")  # `weights` (sensitivity_weights.py) shares the loop and the state file
METRICS = ("acc", "ppl", "loss", "cosine", "kl")
STATE_FORMAT = "gptforge-analysis/1"
_PROJECT_ROWS = 1024  # logit rows formed at once by the distance metrics (bounds the [rows, V] buffers)


# ---------------------------------------------------------------------------- metrics


@dataclass
class Metric:
    """A number computed from a model (in eval mode, without gradients)."""

    name: str  # one of METRICS
    label: str  # what it is, for reports
    higher_is_better: bool
    fn: Callable[[nn.Module], float] = field(repr=False)

    def __call__(self, model: nn.Module) -> float:
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                return float(self.fn(model))
        finally:
            model.train(was)

    def goodness(self, value: float) -> float:
        return value if self.higher_is_better else -value


def sensitivity_value(mode: str, metric: Metric, value: float, base: float) -> float:
    """The layer's sensitivity from its metric `value` and the `base` metric (QAT model in `qat`
    mode, float model in `ptq` mode); larger = more sensitive."""
    if mode == "qat":
        return metric.goodness(value) - metric.goodness(base)
    return metric.goodness(base) - metric.goodness(value)  # ptq and weights: the harm of quantizing it


def lambada_metric(tokenizer, path, *, batch_size: int = 8, seq_len: int | None = None,
                   vocab_size: int | None = None, amp_dtype=None) -> Metric:
    """LAMBADA strict whole-word accuracy ×100 on the user's jsonl (`gptforge eval`'s code)."""
    from gptforge.evaluate.lambada import evaluate_lambada, read_lambada

    read_lambada(path)  # a malformed file fails now, not after the first model evaluation

    def fn(model):
        res = evaluate_lambada(model, tokenizer, path, batch_size, seq_len, vocab_size=vocab_size,
                               amp_dtype=amp_dtype)
        return 100.0 * res["metrics"]["accuracy"]

    return Metric("acc", f"LAMBADA accuracy x100 ({path})", True, fn)


def wikitext_metric(tokenizer, path, *, seq_len: int | None, stride: int | None = None, batch_size: int = 8,
                    vocab_size: int | None = None, amp_dtype=None, detokenize: bool = True) -> Metric:
    """WikiText perplexity on the user's text file (`gptforge eval`'s code)."""
    from gptforge.evaluate.wikitext import evaluate_wikitext

    def fn(model):
        res = evaluate_wikitext(model, tokenizer, path, seq_len, stride, batch_size, vocab_size=vocab_size,
                                amp_dtype=amp_dtype, detokenize=detokenize)
        return res["metrics"]["ppl"]

    return Metric("ppl", f"WikiText perplexity ({path})", False, fn)


def _to(b: dict, device) -> dict:
    return {k: v.to(device) for k, v in b.items()}


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def loss_metric(batches: list[dict], label: str = "held-out batches") -> Metric:
    """Token-weighted mean cross-entropy over `batches` (dicts of tokens/labels/position_ids/loss_mask)."""
    def fn(model):
        dev = _device(model)
        total = count = 0.0
        for b in batches:
            b = _to(b, dev)
            logits = model.logits(model.hidden_states(b["tokens"], b.get("position_ids"))).float()
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].reshape(-1),
                                 reduction="none", ignore_index=-100)
            mask = (b["labels"].reshape(-1) != -100).float()
            if "loss_mask" in b:
                mask = mask * b["loss_mask"].reshape(-1).float()
            total += float((ce.double() * mask.double()).sum())
            count += float(mask.sum())
        return total / max(count, 1.0)

    return Metric("loss", f"mean token loss on {label}", False, fn)


@dataclass
class ReferenceOutputs:
    """The float model's final hidden states on each batch and its output-projection weight:
    its logits, formed on demand (storing [tokens, vocab] logits would not fit for a 50k vocab)."""

    states: list[torch.Tensor]
    head: torch.Tensor


def reference_outputs(model: nn.Module, batches: list[dict]) -> ReferenceOutputs:
    """Record `model`'s outputs on `batches` as the float reference of the distance metrics.
    (The model's `logits` must be the plain tied projection, i.e. its quantization off.)"""
    dev = _device(model)
    model.eval()
    with torch.no_grad():
        states = [model.hidden_states(b["tokens"].to(dev), _pos(b, dev)) for b in batches]
    # a copy: the weight-only analysis rounds the tied embedding in place while this stays the reference
    return ReferenceOutputs(states, model.wte.weight.detach().clone())


def _pos(b: dict, dev):
    p = b.get("position_ids")
    return p.to(dev) if p is not None else None


def distance_metric(batches: list[dict], ref: ReferenceOutputs, kind: str = "cosine") -> Metric:
    """Mean over every position of every batch of the distance between the model's logits and the
    reference's: `cosine` = 1 − cosine similarity of the logit vectors, `kl` = KL(p_ref ‖ p_model)
    of the next-token distributions (nats)."""
    if kind not in ("cosine", "kl"):
        raise ValueError(f"distance kind {kind!r}: expected cosine or kl")

    def fn(model):
        dev = _device(model)
        total, n = 0.0, 0
        for b, ref_h in zip(batches, ref.states, strict=True):
            h = model.hidden_states(b["tokens"].to(dev), _pos(b, dev)).reshape(-1, ref_h.shape[-1])
            rh = ref_h.reshape(-1, ref_h.shape[-1])
            for s in range(0, h.shape[0], _PROJECT_ROWS):
                lm = model.logits(h[s:s + _PROJECT_ROWS]).float()
                lr = F.linear(rh[s:s + _PROJECT_ROWS], ref.head).float()
                if kind == "cosine":
                    d = 1.0 - F.cosine_similarity(lm, lr, dim=-1)
                else:
                    lp_r, lp_m = F.log_softmax(lr, -1), F.log_softmax(lm, -1)
                    d = (lp_r.exp() * (lp_r - lp_m)).sum(-1)
                total += float(d.double().sum())
                n += d.numel()
        return total / n

    label = "1 - cosine similarity of the logits" if kind == "cosine" else "KL(float || model) of the next-token distribution"
    return Metric(kind, f"{label}, vs the float model, on calibration batches", False, fn)


# --------------------------------------------------------------------------- results


@dataclass
class LayerResult:
    name: str  # ours: blocks.3.linear2
    reference_name: str  # linear_15
    value: float  # the metric of the model with this layer changed
    sensitivity: float
    seconds: float
    value8: float | None = None  # weight-only mode: the metric with this layer at 8 bits
    sensitivity8: float | None = None

    @property
    def weight_name(self) -> str:
        """The reference's weight name (`linear_15.w_0`), which its analysis.txt lists."""
        return f"{self.reference_name}.w_0"


@dataclass
class Analysis:
    mode: str
    metric: str
    metric_label: str
    base_value: float  # the QAT model's metric (qat) or the float model's (ptq)
    layers: dict[str, LayerResult]
    order: list[str]  # layers in model order
    float_value: float | None = None  # the float baseline's metric, when measured
    complete: bool = True
    resumed: int = 0  # layers taken from an earlier run's state file
    seconds: float = 0.0
    head_rows: dict | None = None  # weight-only mode: the head's row ranking and ladder (`head_rows`)

    def ranked(self) -> list[LayerResult]:
        """Most sensitive first (ties keep model order)."""
        done = [self.layers[n] for n in self.order if n in self.layers]
        return sorted(done, key=lambda r: -r.sensitivity)

    def to_json(self, fingerprint: dict | None = None) -> dict:
        return {
            "format": STATE_FORMAT,
            "complete": self.complete,
            "mode": self.mode,
            "metric": self.metric,
            "metric_label": self.metric_label,
            "direction": DIRECTION[self.mode],
            "base_value": self.base_value,
            "float_value": self.float_value,
            "order": self.order,
            "layers": {n: asdict(r) | {"weight_name": r.weight_name} for n, r in self.layers.items()},
            "ranking": [{"rank": i + 1, "name": r.name, "reference_name": r.reference_name,
                         "weight_name": r.weight_name, "value": r.value, "sensitivity": r.sensitivity}
                        for i, r in enumerate(self.ranked())],
            "seconds": self.seconds,
            "fingerprint": fingerprint or {},
            **({"head_rows": self.head_rows} if self.head_rows is not None else {}),
        }


DIRECTION = {
    "qat": "sensitivity = goodness(without this layer's quantization) - goodness(QAT model); goodness = acc x100, "
           "-ppl, -loss or -distance to the float model; larger = more sensitive",
    "ptq": "sensitivity = goodness(float model) - goodness(only this layer quantized); goodness = acc x100, "
           "-ppl, -loss or -distance to the float model; larger = more sensitive",
    "weights": "sensitivity = increase of the metric (KL to the float model or loss) with only this layer's weights "
               "rounded to 4 bits (sensitivity8: to 8 bits), everything else float; larger = more sensitive",
}


# ------------------------------------------------------------------------ the state file


def read_state(path: Path, fingerprint: dict) -> dict | None:
    """The saved state when `path` holds one for the same inputs; None when there is none;
    UsageError naming what differs when it belongs to other inputs."""
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON or not UTF-8
        raise UsageError(f"{path}: unreadable analysis state ({e}); delete it or pass --force to start over") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise UsageError(f"{path}: not a gptforge analysis state file; pass --force to replace it, or choose another --out")
    diff = _differences(state.get("fingerprint") or {}, fingerprint)
    if diff:
        raise UsageError(f"{path}: holds an analysis of other inputs (differs in: {', '.join(diff)}); "
                         "pass --force to start over, or choose another --out")
    return state


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The keys whose values differ, dotted down into nested dicts (`weights.head_damp`)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def _write_state(path: Path | None, analysis: Analysis, fingerprint: dict) -> None:
    if path is None:
        return
    from gptforge.evaluate.common import write_json_atomic

    write_json_atomic(path, analysis.to_json(fingerprint))


# ------------------------------------------------------------------------- the procedure


def full_fingerprint(fingerprint: dict | None, mode: str, metric: str, names: list[str]) -> dict:
    """What a resumable state must agree on: the caller's inputs + mode, metric and layers."""
    return dict(fingerprint or {}, mode=mode, metric=metric, layers=list(names))


def analysis_layers(model: nn.Module, layers: Iterable[str] | None = None) -> list[str]:
    """Our names of the quantized Linears to analyse (all by default; names, `linear_N` names or
    globs select), in model order."""
    mods = quant_modules(model)
    if not mods:
        raise CheckpointError("the model has no fake-quant Linear layers to analyse (a float or converted INT8 "
                              "model?); give a QAT/PTQ checkpoint, or --mode ptq with --float-ckpt")
    if layers is None:
        return list(mods)
    try:
        chosen = set(_match(list(layers), mods))
    except KeyError as e:
        raise UsageError(f"--layers: {e.args[0]}; the quantized layers are {', '.join(mods)}") from None
    return [n for n in mods if n in chosen]


@contextlib.contextmanager
def switched(mods: Iterable[nn.Module], on: bool):
    """Temporarily set weight (+ activation) quantization of `mods` to `on`; restored on exit."""
    mods = list(mods)
    flags = [(m.weight_quant_enabled, getattr(m, "act_quant_enabled", None)) for m in mods]
    try:
        for m in mods:
            m.weight_quant_enabled = on
            if isinstance(m, QuantLinear):
                m.act_quant_enabled = on
        yield
    finally:
        for m, (w, a) in zip(mods, flags, strict=True):
            m.weight_quant_enabled = w
            if a is not None:
                m.act_quant_enabled = a


@contextlib.contextmanager
def _weight_replaced(mod: nn.Module, weight: torch.Tensor | None):
    """Temporarily copy `weight` into `mod.weight` (no-op for None); the original is put back."""
    if weight is None:
        yield
        return
    with torch.no_grad():
        saved = mod.weight.detach().clone()
        mod.weight.copy_(weight)
    try:
        yield
    finally:
        with torch.no_grad():
            mod.weight.copy_(saved)


def float_linear_weights(model: nn.Module, float_model: nn.Module, names: Iterable[str],
                        source: str) -> dict[str, torch.Tensor]:
    """{name: float weight (CPU copy)} of the named layers of `float_model`; CheckpointError
    unless each exists in the analysed `model`'s shape."""
    out = {}
    for name in names:
        want = tuple(model.get_submodule(name).weight.shape)
        try:
            w = float_model.get_submodule(name).weight
        except AttributeError:
            raise CheckpointError(f"{source}: has no {name}; give the float model the QAT run started from") from None
        if tuple(w.shape) != want:
            raise CheckpointError(f"{source}: {name}.weight has shape {tuple(w.shape)} but the QAT model's is {want}; "
                                  "give the float model the QAT run started from")
        out[name] = w.detach().to("cpu").clone()
    return out


def analyze(model: nn.Module, metric: Metric, *, mode: str = "qat",
            float_weights: dict[str, torch.Tensor] | None = None, layers: Iterable[str] | None = None,
            float_value: float | None = None, state_path: str | Path | None = None,
            fingerprint: dict | None = None, resume: bool = True, progress: bool = False) -> Analysis:
    """Sensitivity of each quantized Linear of the fake-quant `model` (see the module docstring).

    `float_weights` ({our name: weight}, `qat` mode): the float baseline's weights, copied into a
    layer while its quantization is off. `float_value`: the float baseline's metric, recorded for
    reports. `state_path`: the JSON progress file; with `resume`, a state of the same inputs
    (`fingerprint` + mode, metric and layers) skips what it already holds.
    """
    if mode not in ("qat", "ptq"):
        raise UsageError(f"--mode {mode!r}: expected qat or ptq")
    if float_weights is not None and mode != "qat":
        raise UsageError("float weights replace de-quantized layers in qat mode only")
    names = analysis_layers(model, layers)
    mods = quant_modules(model)
    if float_weights is not None:
        for n in names:
            w = float_weights.get(n)
            if w is None or tuple(w.shape) != tuple(mods[n].weight.shape):
                raise CheckpointError(f"float baseline: no weight of shape {tuple(mods[n].weight.shape)} for {n}")

    def base() -> float:
        # qat: the QAT model as trained; ptq: the float model (every layer's quantization off).
        with switched(mods.values(), on=(mode == "qat")):
            return metric(model)

    def evaluate(name: str) -> tuple[float, None]:
        if mode == "qat":
            w = float_weights.get(name) if float_weights is not None else None
            with switched([mods[name]], on=False), _weight_replaced(mods[name], w):
                return metric(model), None
        with switched(mods.values(), on=False), switched([mods[name]], on=True):
            return metric(model), None

    # ptq: the float model is the starting point, the quantized embedding included.
    emb = [model.wte] if mode == "ptq" and isinstance(getattr(model, "wte", None), QuantEmbedding) else []
    with switched(emb, on=False):
        return run_layers(model, metric, mode, names, base, evaluate, float_value=float_value,
                          state_path=state_path, fingerprint=fingerprint, resume=resume, progress=progress)


def run_layers(model: nn.Module, metric: Metric, mode: str, names: list[str], base: Callable[[], float],
               evaluate: Callable[[str], tuple[float, float | None]], *, float_value: float | None = None,
               state_path: str | Path | None = None, fingerprint: dict | None = None, resume: bool = True,
               progress: bool = False, reference=reference_name) -> Analysis:
    """The loop every mode shares: `base()` is the starting metric, `evaluate(name)` the metric
    with layer `name` changed (and, weight-only mode, at 8 bits too, else None), the model
    restored afterwards; progress is saved after each layer and resumed (see `analyze`)."""
    fingerprint = full_fingerprint(fingerprint, mode, metric.name, names)
    path = Path(state_path) if state_path is not None else None
    state = read_state(path, fingerprint) if path is not None and resume else None
    result = Analysis(mode, metric.name, metric.label, math.nan, {}, names, float_value, complete=False)
    if state is not None:
        result.base_value = state["base_value"]
        if float_value is None:
            result.float_value = state.get("float_value")
        result.layers = {n: LayerResult(**{k: v for k, v in r.items() if k != "weight_name"})
                         for n, r in state["layers"].items() if n in names}
        result.resumed = len(result.layers)
        result.seconds = float(state.get("seconds", 0.0))
    if math.isnan(result.base_value):
        t0 = time.perf_counter()
        result.base_value = base()
        result.seconds += time.perf_counter() - t0
        _write_state(path, result, fingerprint)
    todo = [n for n in names if n not in result.layers]
    bar = None
    if progress and todo:
        from gptforge.progress import bar as progress_bar

        bar = progress_bar(total=len(names), initial=len(names) - len(todo), desc=f"analyze ({mode}, {metric.name})",
                           unit="layer")
    try:
        for name in todo:
            t0 = time.perf_counter()
            value, value8 = evaluate(name)
            dt = time.perf_counter() - t0
            sens = sensitivity_value(mode, metric, value, result.base_value)
            sens8 = None if value8 is None else sensitivity_value(mode, metric, value8, result.base_value)
            result.layers[name] = LayerResult(name, reference(name), value, sens, dt, value8, sens8)
            result.seconds += dt
            _write_state(path, result, fingerprint)
            if bar is not None:
                bar.set_postfix_str(f"{reference(name)} {sens:+.4g}", refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    result.complete = True
    _write_state(path, result, fingerprint)
    return result


def embedding_note(model: nn.Module) -> str | None:
    """A line for reports when the tied embedding is fake-quantized (it is not analysed)."""
    if isinstance(getattr(model, "wte", None), QuantEmbedding):
        return "the tied word embedding is fake-quantized too (quantize_embedding); it is not analysed and stays as configured"
    return None
