"""A real INT8 model: int8 weights + fp32 scales, run with fbgemm's int8 GEMM on x86 CPUs.

`convert_model(fake_quant_model)` swaps every `QuantLinear` for an `Int8Linear` holding
`weight` (int8, the exact integers the fake-quant forward uses), `weight_scale` (its step per
output channel or per tensor), `bias`, `input_scale` (the learned activation step; absent for
`abs_max` activations, whose step is max|x|/qmax of each call) and `pact_alpha` (with PACT).
When the fake-quant model quantized the tied word embedding (`quantize_embedding`), or when
asked, it becomes an `Int8Embedding` (int8 rows + a step per row) serving lookup and LM head.

The kernel. fbgemm multiplies unsigned activation bytes by signed weight bytes. On x86 CPUs
without VNNI it uses `vpmaddubsw`, which adds two products into a *saturating* int16: a pair
of bytes near 255 times weights near 127 overflows, and with the usual zero point of 128 that
happens all the time (measured on AVX2: 20 dB against exact int8 arithmetic per layer). Values
of at most 127 cannot overflow (2 x 127 x 127 < 32767). Three paths (`cpu_kernels.py` chooses):

- `split`: each activation row q in ±127 goes through the GEMM as two rows, max(q, 0) and
  max(-q, 0), with zero point 0, and the results are subtracted: exact integer arithmetic on
  every CPU, for twice the rows (decoding is bound by reading the weights, which a second row
  does not change; long prefills pay twice the int8 compute);
- `plain`: one call with zero point 128, exact only where fbgemm's kernel does not saturate
  (e.g. AVX-512 VNNI): the same call on half the rows, 1.2x (1 row) to 2x (8+ rows) faster
  (benchmarks/results/2026-11-23-int8-kernel-choice.md);
- `native`: gptforge's own kernel (`csrc/int8_rows.cpp`), int16 products summed exactly in
  int32 (`vpmaddwd`), one pass per row on any AVX2 CPU, over weights packed for it once; the
  output scaling is `plain`'s, so where `plain` is exact both give the same bits.

`auto` (the default) takes `plain` where a one-time probe of the kernel finds it exact, else
`native` where gptforge's kernels run a vector path, else `split`;
`GPTFORGE_INT8_KERNEL=split|plain|native` or `set_kernel(model, ...)` forces one.

Activations that are not quantized in the fake-quant model (the LM head's input) use two
int8 digits on fbgemm's paths (x ≈ s·q1 + s/254·q2) and one int16 on `native` (x ≈ s/258·q),
i.e. weight-only int8 with ~16-bit activations.

Off x86 (or on GPU) the same integers run through a dequantized fp32 matmul: the same numbers,
no speed-up.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from torch import nn

from gptforge.config.schema import QuantizationConfig
from gptforge.errors import ConfigError
from gptforge.transforms import native_kernels
from gptforge.transforms.cpu_kernels import KERNELS, fbgemm_available, fbgemm_prepack, int8_kernel
from gptforge.transforms.quant import (
    EPS,
    QuantEmbedding,
    QuantLinear,
    fake_quant_weight,
    install_head,
    qmax_for,
    quant_modules,
    selected_layers,
    validate_config,
    weight_step,
)

_DIGIT = 254.0  # second-digit scale: the residual of the first digit is within ±step/2
_WIDE = 32767  # the head's activations on the `native` path: one int16 each


def fast_kernel_available() -> bool:
    """fbgemm's int8 linear with fp32 output can run in this process (x86 CPU build)."""
    return fbgemm_available()


def native_ready() -> bool:
    """gptforge's own int8 kernel runs here on a vector path (built, AVX2 or better, not switched off)."""
    return native_kernels.unavailable() is None and native_kernels.isa() in ("avx2", "avx512")


def kernel_path(requested: str | None = None) -> str:
    """The path INT8 layers take here: `plain`, `native` or `split` (see the module docstring)."""
    return int8_kernel(requested, native_ready)


def pack_panels(w_int8: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [ceil(N/8), K2 * 8], K2 = K rounded up to even: per panel of 8 outputs and
    per input pair, the 8 outputs' two weights (zero-padded), as `csrc/int8_rows.cpp` reads them."""
    n, k = w_int8.shape
    nb, k2 = -(-n // 8), k + k % 2
    padded = torch.zeros(nb * 8, k2, dtype=torch.int8)
    padded[:n, :k] = w_int8.detach().cpu()
    return padded.view(nb, 8, k2 // 2, 2).permute(0, 2, 1, 3).reshape(nb, k2 * 8).contiguous()


class _Int8Weights(nn.Module):
    """int8 weight [out, in] + step, with lazily built packings of them (fbgemm's, or `native`'s panels)."""

    kernel: str | None = None  # fbgemm path: None/auto = $GPTFORGE_INT8_KERNEL, else the probe's choice

    def _register_weights(self, out_f: int, in_f: int, n_scales: int, device) -> None:
        self.register_buffer("weight", torch.zeros(out_f, in_f, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(n_scales, device=device))
        self._packed = None
        self._packed_key = None

    def _use_fast(self, x: torch.Tensor) -> bool:
        # No rows (a ragged step whose segments want no logits): the per-tensor step of an empty
        # input is undefined, and the float path returns the empty product.
        return (x.numel() > 0 and x.device.type == "cpu" and self.weight.device.type == "cpu"
                and fast_kernel_available())

    def packed(self):
        """fbgemm's packing of the weights and steps, rebuilt when either changes."""
        key = (self.weight.data_ptr(), self.weight._version, self.weight_scale.data_ptr(), self.weight_scale._version)
        if self._packed is None or key != self._packed_key:
            self._packed, self._packed_key = fbgemm_prepack(self.weight, self.weight_scale), key
        return self._packed

    def panels(self) -> torch.Tensor:
        """The weights packed for the `native` kernel (`pack_panels`), rebuilt when they change."""
        key = (self.weight.data_ptr(), self.weight._version)
        if getattr(self, "_panels_key", None) != key:
            self._panels, self._panels_key = pack_panels(self.weight), key
        return self._panels

    def dequantized_weight(self) -> torch.Tensor:
        s = self.weight_scale
        return self.weight.float() * (s[:, None] if s.numel() > 1 else s)

    def _matmul_exact(self, rows: torch.Tensor, step: float, bias: torch.Tensor | None = None) -> torch.Tensor:
        """(round(rows/step) @ W_int^T) · step · s_w (+ bias) for rows already within ±qmax·step;
        exact on the `native` and `split` paths (and on `plain` where fbgemm does not saturate)."""
        path = kernel_path(self.kernel)
        if path == "native":
            return native_kernels.int8_rows(rows, self.panels(), self.weight_scale, bias, step, self.weight.shape[0])
        op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
        if path == "plain":
            y = op(rows, step, 128, self.packed())
        else:
            m = rows.shape[0]
            y = op(torch.cat([rows, rows.neg()]), step, 0, self.packed())
            y = y[:m] - y[m:]
        return y if bias is None else y.add_(bias)

    def _matmul_weight_only(self, x: torch.Tensor) -> torch.Tensor:
        """x @ (W_int · s_w)^T with ≈16-bit activations: on the `native` path one 16-bit integer
        per value, on fbgemm's two int8 digits."""
        amax = float(x.detach().abs().amax())
        if kernel_path(self.kernel) == "native":
            return native_kernels.int8_rows(x, self.panels(), self.weight_scale, None, max(amax / _WIDE, EPS),
                                            self.weight.shape[0], qmax=_WIDE)
        step = max(amax / 127.0, EPS)
        q1 = torch.fake_quantize_per_tensor_affine(x, step, 0, -127, 127)
        r = (x - q1).mul_(_DIGIT)  # within ±127 steps: the first digit's residual is within ±step/2
        y = self._matmul_exact(torch.cat([q1, r]), step)
        m = x.shape[0]
        return y[:m].add_(y[m:], alpha=1.0 / _DIGIT)


def set_kernel(model: nn.Module, kernel: str | None) -> nn.Module:
    """Force every INT8 layer of `model` onto the `split`, `plain` or `native` path (None or
    `auto`: the environment's / the probe's choice, see `cpu_kernels.py`)."""
    if kernel is not None and kernel not in KERNELS:
        raise ConfigError(f"int8 kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    for mod in model.modules():
        if isinstance(mod, _Int8Weights):
            mod.kernel = kernel
    return model


class Int8Linear(_Int8Weights):
    """A block Linear as int8 weights + steps; the input is quantized exactly as the fake-quant
    layer it came from quantizes it (PACT clip, static or per-call step, ±qmax)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, channel_wise: bool = True,
                 static_act: bool = True, pact: bool = False, act_bits: int = 8, weight_bits: int = 8, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.act_bits, self.weight_bits = act_bits, weight_bits
        self.channel_wise, self.static_act = channel_wise, static_act
        self._register_weights(out_features, in_features, out_features if channel_wise else 1, device)
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.register_buffer("input_scale", torch.ones(1, device=device) if static_act else None)
        self.register_buffer("pact_alpha", torch.ones(1, device=device) if pact else None)

    @classmethod
    @torch.no_grad()
    def from_quant(cls, mod: QuantLinear) -> Int8Linear:
        """The INT8 twin of a fake-quant layer (in eval mode it computes the same numbers)."""
        if mod.act_bits > 8 or mod.weight_bits > 8:
            raise ConfigError(f"Compress.Quantization: activation_bits {mod.act_bits} / weight_bits "
                              f"{mod.weight_bits}: an INT8 model needs both <= 8")
        w = mod.weight.detach().float()
        out = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, channel_wise=mod.channel_wise,
                  static_act=mod.act_type == "moving_average_abs_max", pact=mod.pact_alpha is not None,
                  act_bits=mod.act_bits, weight_bits=mod.weight_bits, device=w.device)
        out.quantize_weight_(w)
        if mod.bias is not None:
            out.bias.copy_(mod.bias.detach().float())
        if out.input_scale is not None:
            out.input_scale.copy_((mod.act_scale.float() / qmax_for(mod.act_bits)).clamp_min(EPS))
        if out.pact_alpha is not None:
            alpha = float(mod.pact_alpha.detach().reshape(()))
            if alpha <= 0:
                raise ConfigError(f"PACT alpha of this layer is {alpha}; an INT8 model needs alpha > 0")
            out.pact_alpha.fill_(alpha)
        return out

    @torch.no_grad()
    def quantize_weight_(self, w: torch.Tensor) -> None:
        """Store float weights `w` [out, in] as integers + steps (abs-max per channel or tensor),
        exactly as the fake-quant layer rounds them. Also re-quantizes a merged LoRA delta."""
        w = w.detach().float()
        step = weight_step(w, self.weight_bits, self.channel_wise)
        ints = torch.round(fake_quant_weight(w, self.weight_bits, self.channel_wise) /
                           (step[:, None] if self.channel_wise else step))
        self.weight.copy_(ints.to(torch.int8))
        self.weight_scale.copy_(step.reshape(-1))

    def _scalars(self) -> tuple[float, float]:
        """(static step or nan, PACT alpha or inf) as Python floats, re-read when a buffer changes."""
        bufs = (self.input_scale, self.pact_alpha)
        key = tuple((b.data_ptr(), b._version) if b is not None else None for b in bufs)
        if getattr(self, "_scalars_key", None) != key:
            self._scalars_val = (float(self.input_scale.reshape(())) if self.input_scale is not None else math.nan,
                                 float(self.pact_alpha.reshape(())) if self.pact_alpha is not None else math.inf)
            self._scalars_key = key
        return self._scalars_val

    def static_grid(self) -> tuple[float, float] | None:
        """(step, clip) of the input's quantization for a static-step layer (clip: min(qmax · step,
        PACT alpha)), None where the step is taken per call."""
        if not self.static_act:
            return None
        step, alpha = self._scalars()
        return step, min(qmax_for(self.act_bits) * step, alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        qm = qmax_for(self.act_bits)
        grid = self.static_grid()
        if grid is None:  # the step of the PACT-clipped input, as the fake-quant layer computes it
            alpha = self._scalars()[1]
            amax = x2.detach().abs().amax().clamp_max(alpha)
            step = float((amax / qm).clamp_min(EPS))
            clip = min(qm * step, alpha)
        else:
            step, clip = grid
        xc = x2.clamp(-clip, clip)
        if self._use_fast(x2):
            y = self._matmul_exact(xc, step, self.bias)
        else:
            xq = torch.fake_quantize_per_tensor_affine(xc, step, 0, -qm, qm)
            y = F.linear(xq, self.dequantized_weight())
            if self.bias is not None:
                y = y.add_(self.bias)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.weight_bits} "
                f"{'per-channel' if self.channel_wise else 'per-tensor'} weights, int{self.act_bits} "
                f"{'static' if self.static_act else 'per-call'} activations{', PACT' if self.pact_alpha is not None else ''}")


class Int8Embedding(_Int8Weights):
    """The tied word embedding as int8 rows + a step per row: lookup and LM head (`project`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._register_weights(num_embeddings, embedding_dim, num_embeddings, device)

    @classmethod
    @torch.no_grad()
    def from_embedding(cls, emb: nn.Embedding) -> Int8Embedding:
        w = emb.weight.detach().float()
        step = weight_step(w, 8, True)
        ints = torch.round(fake_quant_weight(w, 8, True) / step[:, None])
        out = cls(emb.num_embeddings, emb.embedding_dim, device=w.device)
        out.weight.copy_(ints.to(torch.int8))
        out.weight_scale.copy_(step)
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).float() * self.weight_scale[ids].unsqueeze(-1)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        h = hidden.reshape(-1, shape[-1]).float()
        y = self._matmul_weight_only(h) if self._use_fast(h) else F.linear(h, self.dequantized_weight())
        return y.reshape(*shape[:-1], self.num_embeddings)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per-row weights"


def _float_cache(self, batch_size: int, max_len: int, dtype=None, device=None):
    # GPT.new_cache takes its dtype from wte.weight, which is int8 here; activations are fp32.
    return type(self).new_cache(self, batch_size, max_len, dtype=dtype or self.wpe.weight.dtype,
                                device=device or self.wpe.weight.device)


def _install_int8_embedding(model: nn.Module, emb: Int8Embedding) -> None:
    model.wte = emb
    install_head(model)
    model.new_cache = types.MethodType(_float_cache, model)


# ----------------------------------------------------------------------- conversion


@torch.no_grad()
def convert_model(model: nn.Module, int8_embedding: bool | None = None) -> list[str]:
    """Swap a fake-quant model's layers for INT8 ones in place (eval-mode numerics are kept).

    `int8_embedding`: store the tied embedding / LM head as int8 rows; default (None): when
    the fake-quant model quantizes it (`quantize_embedding`), so the INT8 model computes what
    was trained. True on a model that did not train with it adds that rounding error; False on
    one that did restores the float embedding.
    Layers whose quantization was switched off entirely are restored to float `nn.Linear`s and
    their names returned (record them in `skip_layers`); a layer with only one of weight /
    activation quantization switched off cannot be converted.
    """
    mods = quant_modules(model)
    if not mods and not isinstance(getattr(model, "wte", None), QuantEmbedding):
        raise ConfigError("Compress.Quantization.enable: the model has no fake-quant layers to convert; "
                          "run `gptforge qat` or `gptforge ptq` first")
    floats = []
    for name, mod in mods.items():
        if mod.weight_quant_enabled and mod.act_quant_enabled:
            model.set_submodule(name, Int8Linear.from_quant(mod))
        elif not mod.weight_quant_enabled and not mod.act_quant_enabled:
            lin = nn.Linear(mod.in_features, mod.out_features, mod.bias is not None, device="meta")
            lin.weight, lin.bias = mod.weight, mod.bias
            model.set_submodule(name, lin)
            floats.append(name)
        else:
            raise ConfigError(f"{name}: only one of weight/activation quantization is switched off; "
                              "an INT8 layer needs both on (or both off to keep it float)")
    trained = isinstance(model.wte, QuantEmbedding) and model.wte.weight_quant_enabled
    if int8_embedding if int8_embedding is not None else trained:
        _install_int8_embedding(model, Int8Embedding.from_embedding(model.wte))
    elif isinstance(model.wte, QuantEmbedding):
        emb = nn.Embedding(model.wte.num_embeddings, model.wte.embedding_dim, device="meta")
        emb.weight = model.wte.weight
        model.wte = emb
        model.__dict__.pop("logits", None)  # back to the class's float head
    return floats


def converted_config(qcfg: QuantizationConfig, int8_embedding: bool, float_layers: list[str]) -> QuantizationConfig:
    """The Quantization section a converted checkpoint records (rebuilt by `int8_structure`)."""
    import dataclasses

    return dataclasses.replace(qcfg, enable=True, converted=True, quantize_embedding=bool(int8_embedding),
                               skip_layers=[*qcfg.skip_layers, *(n for n in float_layers if n not in qcfg.skip_layers)])


def int8_structure(model: nn.Module, qcfg: QuantizationConfig) -> nn.Module:
    """Give a float model (typically on the meta device) the empty INT8 structure a converted
    checkpoint was saved with, so its state dict loads with `load_state_dict(assign=True)`."""
    validate_config(qcfg, len(model.blocks))
    dev = model.wte.weight.device
    for name in selected_layers(model, qcfg):
        lin = model.get_submodule(name)
        model.set_submodule(name, Int8Linear(
            lin.in_features, lin.out_features, bias=lin.bias is not None,
            channel_wise=qcfg.weight_quantize_type == "channel_wise_abs_max",
            static_act=qcfg.activation_quantize_type == "moving_average_abs_max",
            pact=qcfg.activation_preprocess_type == "PACT", act_bits=qcfg.activation_bits,
            weight_bits=qcfg.weight_bits, device=dev))
    if qcfg.quantize_embedding:
        _install_int8_embedding(model, Int8Embedding(model.wte.num_embeddings, model.wte.embedding_dim, device=dev))
    return model


def dequantize_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float weights (int8 · step) of a converted checkpoint's state dict, for loading into a
    plain float model; quantizer tensors are dropped."""
    out = {}
    for k, v in sd.items():
        if k.endswith((".weight_scale", ".input_scale", ".pact_alpha")):
            continue
        if k.endswith(".weight") and v.dtype == torch.int8:
            s = sd[k[: -len("weight")] + "weight_scale"].float()
            v = v.float() * (s[:, None] if s.numel() > 1 else s)
        out[k] = v
    return out


def int8_weight_bytes(model: nn.Module) -> int:
    """Bytes of everything the model stores (parameters + buffers), as saved."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
