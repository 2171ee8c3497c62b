"""Fake quantization for QAT and PTQ (spec §8), applied from outside the model by module swap.

`quantize_model(model, qcfg)` replaces each selected block Linear (`blocks.{i}.attn.qkv_proj`,
`.attn.out_proj`, `.linear1`, `.linear2`) by a `QuantLinear`, an `nn.Linear` subclass that keeps
`weight`/`bias` (so float checkpoints load into it) and adds the activation-quantizer state:

    forward(x) = linear(FQ_act(PACT(x)), FQ_w(W), b)

Numerics (the core `torch.fake_quantize_*` ops; their gradient is the straight-through
estimator, 1 inside the clip range and 0 outside):
- symmetric integers in ±qmax, qmax = 2^(bits-1) - 1; round half to even (`nearbyint`; the
  reference's kernels round half away from zero: the two differ only on exact ties);
- weights `abs_max`: step max|W|/qmax per tensor, recomputed every forward;
  `channel_wise_abs_max`: one step per output channel (row of our [out, in] weight);
- activations `moving_average_abs_max`: in training `accum = r*accum + max|x|`,
  `state = r*state + 1`, `scale = accum/state` (accum = state = 1 and scale 0.001 at start),
  then quantize with step scale/qmax; in eval the stored scale is used. `abs_max`: the
  current batch's max|x| in training and eval;
- PACT: x is clipped to [-alpha, alpha] (`x - relu(x - a) + relu(-a - x)`, which gives alpha
  its gradient) before the activation fake-quant; alpha has `lr_mult = pact_lr_mult`.

The LM head, embeddings and attention matmuls stay float, unless `quantize_embedding` asks for
the tied embedding (lookup and head) to be weight-quantized per row. Every quantized module
has per-layer switches (`weight_quant_enabled`, `act_quant_enabled`) for sensitivity analysis.
Reference layer names are `linear_{4i+j}` (j: 0 qkv_proj, 1 out_proj, 2 linear1, 3 linear2).
`weight_only: true` (4-bit QAT) swaps in `weight_qat`'s weight-only fake quant instead.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gptforge.config.schema import QuantizationConfig
from gptforge.errors import ConfigError
from gptforge.model.gpt import BLOCK_LINEARS
from gptforge.transforms import weight_qat
from gptforge.transforms.head import install_head

# The reference's short layer kinds (skip_tensor_map, LAYER_TYPES) -> the model's paths in a block.
_KIND_PATH = {path.rpartition(".")[2]: path for path in BLOCK_LINEARS}
LAYER_KINDS = tuple(_KIND_PATH)
WEIGHT_TYPES = ("abs_max", "channel_wise_abs_max")
ACT_TYPES = ("moving_average_abs_max", "abs_max")
PREPROCESS_TYPES = ("PACT",)
CALIB_ALGOS = ("avg", "abs_max", "moving_average")
# Which of our projections each reference layer type covers (Column/Row = the TP layers).
LAYER_TYPES = {"Linear": LAYER_KINDS, "ColumnParallelLinear": ("qkv_proj", "linear1"),
               "RowParallelLinear": ("out_proj", "linear2")}
INIT_ACT_SCALE = 0.001  # the reference's initial stored activation scale
EPS = 1e-12  # smallest quantization step: an all-zero row quantizes to zeros, not NaN
_KEY = "Compress.Quantization"


def qmax_for(bits: int) -> int:
    """Largest integer of the symmetric signed range ±(2^(bits-1) - 1)."""
    return 2 ** (bits - 1) - 1


# ---------------------------------------------------------------------------- names


def linear_name(block: int, kind: str) -> str:
    """Our module name of projection `kind` in block `block`."""
    return f"blocks.{block}.{_KIND_PATH[kind]}"


def linear_names(num_layers: int) -> list[str]:
    """Our names of every block Linear, in the reference's order (linear_0, linear_1, ...)."""
    return [linear_name(i, k) for i in range(num_layers) for k in LAYER_KINDS]


_OURS = re.compile(r"^blocks\.(\d+)\.(?:attn\.)?(" + "|".join(LAYER_KINDS) + r")$")
_REF = re.compile(r"^linear_(\d+)(?:\.w_0)?$")


def reference_name(name: str) -> str:
    """`blocks.3.linear2` -> `linear_15` (the reference's Linear counter: 4 per block)."""
    m = _OURS.match(name)
    if not m or linear_name(int(m.group(1)), m.group(2)) != name:
        raise ValueError(f"{name!r} is not a block Linear name (blocks.i.{'|'.join(BLOCK_LINEARS)})")
    return f"linear_{4 * int(m.group(1)) + LAYER_KINDS.index(m.group(2))}"


def our_name(ref: str) -> str:
    """`linear_15` (or `linear_15.w_0`) -> `blocks.3.linear2`."""
    m = _REF.match(ref)
    if not m:
        raise ValueError(f"{ref!r} is not a reference Linear name (linear_N)")
    i, j = divmod(int(m.group(1)), 4)
    return linear_name(i, LAYER_KINDS[j])


# ------------------------------------------------------------------------- config


def validate_config(q: QuantizationConfig, num_layers: int | None = None) -> None:
    """Raise ConfigError naming the key for any value quantization cannot honour."""
    def bad(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{_KEY}.{key}: {msg}")

    if q.weight_quantize_type not in WEIGHT_TYPES:
        raise bad("weight_quantize_type", f"{q.weight_quantize_type!r} is not one of {', '.join(WEIGHT_TYPES)}")
    if q.activation_quantize_type not in ACT_TYPES:
        raise bad("activation_quantize_type", f"{q.activation_quantize_type!r} is not one of {', '.join(ACT_TYPES)}")
    if q.activation_preprocess_type not in (None, *PREPROCESS_TYPES):
        raise bad("activation_preprocess_type", f"{q.activation_preprocess_type!r} is not PACT or blank")
    if q.weight_preprocess_type is not None:
        raise bad("weight_preprocess_type", f"{q.weight_preprocess_type!r}: only blank (None) is supported")
    for key in ("weight_bits", "activation_bits"):
        if not 2 <= getattr(q, key) <= 16:
            raise bad(key, f"must be in [2, 16], got {getattr(q, key)}")
    if not 0.0 <= q.moving_rate < 1.0:
        raise bad("moving_rate", f"must be in [0, 1), got {q.moving_rate}")
    if q.pact_init <= 0:
        raise bad("pact_init", f"must be > 0, got {q.pact_init}")
    if q.pact_lr_mult < 0:
        raise bad("pact_lr_mult", f"must be >= 0, got {q.pact_lr_mult}")
    if q.calib_algo not in CALIB_ALGOS:
        raise bad("calib_algo", f"{q.calib_algo!r} is not one of {', '.join(CALIB_ALGOS)}")
    if q.calib_batches < 1:
        raise bad("calib_batches", f"must be >= 1, got {q.calib_batches}")
    if q.dtype not in ("int8", "uint8"):
        raise bad("dtype", f"{q.dtype!r}: only int8 is supported")
    unknown = [t for t in q.quantizable_layer_type if t not in LAYER_TYPES]
    if unknown:
        raise bad("quantizable_layer_type", f"{unknown} not among {', '.join(LAYER_TYPES)}")
    for key, kinds in q.skip_tensor_map.items():
        m = re.fullmatch(r"block_(\d+)", str(key))
        if not m:
            raise bad(f"skip_tensor_map.{key}", "keys are block_<i> (e.g. block_3)")
        if num_layers is not None and int(m.group(1)) >= num_layers:
            raise bad(f"skip_tensor_map.{key}", f"the model has {num_layers} blocks (block_0 .. block_{num_layers - 1})")
        odd = [k for k in kinds if k not in LAYER_KINDS]
        if odd:
            raise bad(f"skip_tensor_map.{key}", f"{odd} not among {', '.join(LAYER_KINDS)}")
    for pat in q.skip_layers:
        if not isinstance(pat, str) or not pat:
            raise bad("skip_layers", f"entries are name globs like blocks.3.linear2, got {pat!r}")
    if q.weight_only:
        weight_qat.validate(q)
    elif q.learn_scales:
        raise bad("learn_scales", "learns the groups' scales of weight-only QAT; set weight_only: true too "
                                  "(INT8 QAT's weight scales are abs-max, its activation scales observed)")


def refuse_weight_only(q: QuantizationConfig, what: str) -> None:
    """INT8-activation tools (PTQ, sensitivity analysis, INT8 conversion) stop in one line on a
    weight-only QAT config (docs/qat.md, 4-bit QAT)."""
    if q.weight_only:
        raise ConfigError(f"{_KEY}.weight_only: {what} works on INT8 fake quant (weights and activations); a "
                          "weight-only QAT model becomes a weight-only model with `gptforge quantize --weights "
                          f"int{q.weight_bits}`, a float model with `gptforge quantize --weights` (rtn|gptq|awq)")


def skipped(name: str, q: QuantizationConfig) -> bool:
    """Whether block Linear `name` stays float under `skip_tensor_map`, `skip_layers` and
    `quantizable_layer_type`."""
    m = _OURS.match(name)
    if m is None:
        return True
    block, kind = int(m.group(1)), m.group(2)
    if kind in q.skip_tensor_map.get(f"block_{block}", ()):
        return True
    ref = reference_name(name)
    if any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(ref, p) for p in q.skip_layers):
        return True
    return not any(kind in LAYER_TYPES[t] for t in q.quantizable_layer_type)


def selected_layers(model: nn.Module, q: QuantizationConfig) -> list[str]:
    """Names of the block Linears `q` quantizes, in reference order."""
    return [n for n in linear_names(len(model.blocks)) if not skipped(n, q)]


# -------------------------------------------------------------------------- numerics


def weight_step(w: torch.Tensor, bits: int, channel_wise: bool) -> torch.Tensor:
    """Quantization step of `w`: max|W|/qmax per tensor ([]) or per output channel ([out])."""
    w = w.detach()
    amax = w.abs().amax(dim=tuple(range(1, w.dim()))) if channel_wise else w.abs().amax()
    return (amax.float() / qmax_for(bits)).clamp_min(EPS)


def fake_quant_weight(w: torch.Tensor, bits: int, channel_wise: bool) -> torch.Tensor:
    """Symmetric abs-max fake quantization of a weight (STE gradient)."""
    q, step = qmax_for(bits), weight_step(w, bits, channel_wise)
    if channel_wise:
        zero = torch.zeros(step.shape, dtype=torch.int32, device=w.device)
        return torch.fake_quantize_per_channel_affine(w, step, zero, 0, -q, q)
    zero = torch.zeros((), dtype=torch.int32, device=w.device)
    return torch.fake_quantize_per_tensor_affine(w, step, zero, -q, q)


def fake_quant_act(x: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per-tensor fake quantization of an activation with step `step` (computed in
    fp32, returned in x's dtype)."""
    q = qmax_for(bits)
    zero = torch.zeros((), dtype=torch.int32, device=x.device)
    y = torch.fake_quantize_per_tensor_affine(x.float(), step.float().reshape(()), zero, -q, q)
    return y.to(x.dtype)


def pact_clip(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """PACT: clip to [-alpha, alpha] in the form that gives alpha a gradient."""
    a = alpha.to(x.dtype)
    return x - F.relu(x - a) + F.relu(-a - x)


# --------------------------------------------------------------------------- modules


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation recompute re-runs forwards there)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class QuantLinear(nn.Linear):
    """An `nn.Linear` with fake-quantized input and weight (see the module docstring).

    State dict = `weight`, `bias` + `act_scale` (and `act_accum`, `act_state` for the moving
    average; `pact_alpha` with PACT). `weight_quant_enabled` / `act_quant_enabled` switch this
    layer's quantization off (PACT belongs to the activation side). `observer` is set by PTQ
    calibration: the layer then records max|x| and runs in float.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 qcfg: QuantizationConfig | None = None, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        q = qcfg or QuantizationConfig()
        self.weight_bits, self.act_bits = q.weight_bits, q.activation_bits
        self.channel_wise = q.weight_quantize_type == "channel_wise_abs_max"
        self.act_type = q.activation_quantize_type
        self.moving_rate = q.moving_rate
        self.pact_lr_mult = q.pact_lr_mult
        self.weight_quant_enabled = True
        self.act_quant_enabled = True
        self.observer: dict | None = None
        self._init_state(q, self.weight.device)

    def _init_state(self, q: QuantizationConfig, dev) -> None:
        self.register_buffer("act_scale", torch.full((1,), INIT_ACT_SCALE, device=dev))
        if self.act_type == "moving_average_abs_max":
            self.register_buffer("act_accum", torch.ones(1, device=dev))
            self.register_buffer("act_state", torch.ones(1, device=dev))
        if q.activation_preprocess_type == "PACT":
            self.pact_alpha = nn.Parameter(torch.full((1,), float(q.pact_init), device=dev))
            self.pact_alpha.lr_mult = q.pact_lr_mult
        else:
            self.pact_alpha = None

    @classmethod
    def from_linear(cls, lin: nn.Linear, qcfg: QuantizationConfig) -> QuantLinear:
        """A QuantLinear sharing `lin`'s weight and bias Parameters (no copy; works on meta)."""
        mod = cls(lin.in_features, lin.out_features, lin.bias is not None, qcfg=qcfg, device="meta")
        mod.weight = lin.weight
        mod.bias = lin.bias
        mod._init_state(qcfg, lin.weight.device)
        mod.train(lin.training)
        return mod

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # load_state_dict(assign=True) swaps in a new Parameter: keep the optimizer's multiplier.
        if self.pact_alpha is not None:
            self.pact_alpha.lr_mult = self.pact_lr_mult

    def act_step(self, x: torch.Tensor) -> torch.Tensor:
        """The activation quantization step for this call (updates the moving average in training,
        once per step: a recompute pass in backward reuses the forward's scale)."""
        qm = qmax_for(self.act_bits)
        update = self.training and not _in_backward()
        if self.act_type == "abs_max":
            cur = x.detach().abs().amax().float().reshape(1)
            if update:
                self.act_scale.copy_(cur)
            return (cur / qm).clamp_min(EPS)
        if update:
            with torch.no_grad():
                r = self.moving_rate
                self.act_state.mul_(r).add_(1.0)
                self.act_accum.mul_(r).add_(x.detach().abs().amax().float())
                self.act_scale.copy_(self.act_accum / self.act_state)
        return (self.act_scale / qm).clamp_min(EPS)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """PACT clip + activation fake-quant, as this layer's forward applies them."""
        if self.pact_alpha is not None:
            x = pact_clip(x, self.pact_alpha)
        return fake_quant_act(x, self.act_step(x), self.act_bits)

    def quantized_weight(self) -> torch.Tensor:
        return fake_quant_weight(self.weight, self.weight_bits, self.channel_wise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.observer is not None:
            _observe(self.observer, x if self.pact_alpha is None else pact_clip(x, self.pact_alpha))
            return F.linear(x, self.weight, self.bias)
        if self.act_quant_enabled:
            x = self.quantize_input(x)
        w = self.quantized_weight() if self.weight_quant_enabled else self.weight
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        w = "channel_wise_abs_max" if self.channel_wise else "abs_max"
        on = "" if self.weight_quant_enabled and self.act_quant_enabled else \
            f", weight_quant={self.weight_quant_enabled}, act_quant={self.act_quant_enabled}"
        return (f"{super().extra_repr()}, w{self.weight_bits} {w}, a{self.act_bits} {self.act_type}"
                f"{', PACT' if self.pact_alpha is not None else ''}{on}")


class QuantEmbedding(nn.Embedding):
    """The tied word embedding with its weight fake-quantized per row (weight only), in the
    lookup and in the LM head (`project`, installed as the model's `logits`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, bits: int = 8, device=None, dtype=None):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.weight_bits = bits
        self.weight_quant_enabled = True

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, bits: int) -> QuantEmbedding:
        mod = cls(emb.num_embeddings, emb.embedding_dim, bits=bits, device="meta")
        mod.weight = emb.weight
        return mod

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight)
        if not self.weight_quant_enabled:
            return rows
        # A row's step depends on that row only, so quantizing the gathered rows is exact.
        flat = rows.reshape(-1, rows.shape[-1])
        return fake_quant_weight(flat, self.weight_bits, True).reshape(rows.shape)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        w = fake_quant_weight(self.weight, self.weight_bits, True) if self.weight_quant_enabled else self.weight
        return F.linear(hidden, w)


# ------------------------------------------------------------------------ the swap


def _get(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)


def refuse_moe(model: nn.Module, what: str) -> None:
    """Compression handles dense FFNs only: an MoE model stops in one line (docs/moe.md)."""
    from gptforge.model.moe import moe_layers

    if moe_layers(model):
        raise ConfigError(f"Model.num_experts: {what} of Mixture-of-Experts models is not supported; "
                          "compress a dense model (num_experts=1)")


def quantize_model(model: nn.Module, qcfg: QuantizationConfig) -> nn.Module:
    """Insert fake-quant modules into `model` in place (see the module docstring); returns it.

    Works on a model built on the meta device (buffers are created where the weights are).
    Parameter names do not change, so float weights load before or after the swap, and a QAT
    state dict is the float names plus `act_scale`/`act_accum`/`act_state`/`pact_alpha`.
    `freeze_embedding` sets requires_grad=False on wte/wpe (the tied head with them).
    """
    if not hasattr(model, "blocks"):
        raise TypeError(f"quantize_model expects a gptforge GPT, got {type(model).__name__}")
    refuse_moe(model, "quantization (QAT, PTQ, analyze)")
    validate_config(qcfg, len(model.blocks))
    if is_fake_quantized(model):
        raise ValueError("the model is already quantized")
    if qcfg.weight_only:  # 4-bit QAT: weights only, on the weight-only format's grid
        weight_qat.apply(model, qcfg)
    for name in [] if qcfg.weight_only else selected_layers(model, qcfg):
        lin = _get(model, name)
        if type(lin) is not nn.Linear:
            raise TypeError(f"{name}: expected nn.Linear, found {type(lin).__name__}")
        model.set_submodule(name, QuantLinear.from_linear(lin, qcfg))
    if qcfg.quantize_embedding:
        model.wte = QuantEmbedding.from_embedding(model.wte, 8)
        install_head(model)
    if qcfg.freeze_embedding:
        model.wte.weight.requires_grad_(False)
        model.wpe.weight.requires_grad_(False)
    return model


def quant_modules(model: nn.Module) -> dict[str, QuantLinear]:
    """{our name: QuantLinear} of a quantized model, in reference order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def is_fake_quantized(model: nn.Module) -> bool:
    """INT8 fake quant (QuantLinear / QuantEmbedding) or weight-only fake quant (4-bit QAT)."""
    return any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules()) or bool(weight_qat.layers(model))


def set_quant_enabled(model: nn.Module, names: Iterable[str] | None = None, *, weight: bool | None = None,
                      act: bool | None = None) -> list[str]:
    """Switch weight and/or activation quantization of the named layers (our names, reference
    `linear_N` names or globs; default all quantized layers, plus `wte` for the embedding).
    Returns the names changed; an unknown name raises KeyError."""
    mods: dict[str, nn.Module] = dict(quant_modules(model))
    if isinstance(getattr(model, "wte", None), QuantEmbedding):
        mods["wte"] = model.wte
    chosen = list(mods) if names is None else _match(names, mods)
    for n in chosen:
        if weight is not None:
            mods[n].weight_quant_enabled = bool(weight)
        if act is not None and isinstance(mods[n], QuantLinear):
            mods[n].act_quant_enabled = bool(act)
    return chosen


def _match(names: Iterable[str], mods: dict[str, nn.Module]) -> list[str]:
    out: list[str] = []
    for pat in names:
        pat = our_name(pat) if _REF.match(pat) else pat
        hit = [n for n in mods if fnmatch.fnmatchcase(n, pat)]
        if not hit:
            raise KeyError(f"{pat!r} matches no quantized layer")
        out.extend(h for h in hit if h not in out)
    return out


# ------------------------------------------------------------------------ observers


def _observe(obs: dict, x: torch.Tensor) -> None:
    m = float(x.detach().abs().amax())
    obs["n"] += 1
    obs["max"] = max(obs["max"], m)
    obs["sum"] += m
    if obs["algo"] == "moving_average":
        r = obs["rate"]
        obs["state"] = r * obs["state"] + 1.0
        obs["accum"] = r * obs["accum"] + m


def start_observers(model: nn.Module, algo: str) -> None:
    """Put every QuantLinear into observing mode (float forward; records max|x| per call)."""
    if algo not in CALIB_ALGOS:
        raise ConfigError(f"{_KEY}.calib_algo: {algo!r} is not one of {', '.join(CALIB_ALGOS)}")
    for mod in quant_modules(model).values():
        acc = mod.act_accum if hasattr(mod, "act_accum") else None
        st = mod.act_state if hasattr(mod, "act_state") else None
        mod.observer = {"algo": algo, "n": 0, "max": 0.0, "sum": 0.0, "rate": mod.moving_rate,
                        "accum": float(acc) if acc is not None else 1.0, "state": float(st) if st is not None else 1.0}


@torch.no_grad()
def finish_observers(model: nn.Module) -> dict[str, float]:
    """Store the observed activation scales and leave observing mode; returns {name: scale}."""
    scales = {}
    for name, mod in quant_modules(model).items():
        obs, mod.observer = mod.observer, None
        if obs is None or obs["n"] == 0:
            continue
        if obs["algo"] == "abs_max":
            accum, state = obs["max"], 1.0
        elif obs["algo"] == "avg":
            accum, state = obs["sum"] / obs["n"], 1.0
        else:
            accum, state = obs["accum"], obs["state"]
        mod.act_scale.fill_(accum / state)
        if hasattr(mod, "act_accum"):
            mod.act_accum.fill_(accum)
            mod.act_state.fill_(state)
        scales[name] = accum / state
    return scales
