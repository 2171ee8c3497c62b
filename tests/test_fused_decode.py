"""The fused one-sequence decode step (`generate/fused_step.py`, `csrc/fused_decode.cpp`) against
the Python ragged step it replaces (PyTorch's own ops, module by module): the logits of every step
of a greedy decode equal bit for bit (torch.equal) for fp32 weights (the one-row GEMV, oneDNN's
packed kernel, plain F.linear), weight-only int8 / int4 on the `native` and `native-q8a` kernels
(AWQ's input scale included) and bf16 (block Linears and the head), the real INT8 model on
gptforge's int8 kernel (static activation steps, PACT), float32 and int8 KV slots, on every instruction-set path this CPU
runs; and, with fp32 weights (the batch-invariant case), they equal the same sequence's logits
decoded beside another sequence (the Python path: served output = generate whatever shares the
batch). LoRA, MoE, bf16 slots, two sequences, INT8 layers with per-call steps or on fbgemm's paths and
`GPTFORGE_FUSED_DECODE=off` take the Python path."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from gf_testutil import ISA_ORDER, packed_rows_invariant, skip_unless_runs, tiny_model
from gptforge.adapters.inject import apply_lora
from gptforge.compress.ptq import calibrate
from gptforge.config.schema import LoraConfig, QuantizationConfig
from gptforge.errors import UsageError
from gptforge.generate import fused_step
from gptforge.generate.backend import TorchBackend
from gptforge.generate.slots import RaggedSlots, Segment
from gptforge.transforms import cpu_kernels, native_kernels
from gptforge.transforms import int8 as int8_mod
from gptforge.transforms.quant import quantize_model
from gptforge.transforms.weight_only import KERNEL_ENV, WeightOnlyLinear, WeightOnlySpec, quantize_rtn_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 9, 2, 7, 1, 33, 8]
OTHER = [4, 4, 17, 60, 2]
STEPS = 6


def _varied(model):
    """Weights spread enough that every operand matters (layer-norm affines, biases, residuals)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.3 if name.endswith("bias") else 0.15) * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return _varied(tiny_model()[0])


def _weight_only(model, bits, group, sym=True, awq=False, head_bits=8):
    spec = WeightOnlySpec(bits=bits, group_size=group, sym=sym, head_bits=head_bits)
    m = quantize_rtn_model(copy.deepcopy(model), spec)
    if awq:  # one layer with AWQ's input scale (its input divided before the kernel)
        lin = model.blocks[0].linear1
        s = torch.rand(lin.in_features, generator=torch.Generator().manual_seed(5)) + 0.5
        m.blocks[0].linear1 = WeightOnlyLinear.from_float(lin.weight, lin.bias, bits, group, sym, act_scale=s)
    return m


def _int8(model, **quant):
    """The real INT8 model of `model` (fake-quant, calibrated on random ids, converted; int8 head)."""
    m = copy.deepcopy(model)
    quantize_model(m, QuantizationConfig(enable=True, **quant))
    g = torch.Generator().manual_seed(7)
    calibrate(m, [torch.randint(0, m.wte.num_embeddings, (2, 16), generator=g) for _ in range(3)], "moving_average")
    int8_mod.convert_model(m.eval(), int8_embedding=True)
    return m


def _decode(model, kv="auto", prepack=True, partner=False):
    """Greedy decode of PROMPT through the ragged slots: (logits [V] of every decode step, steps
    that took the fused path). `partner`: another sequence shares every step."""
    with TorchBackend(model, prepack=prepack, kv_cache_dtype=kv) as be:
        slots = RaggedSlots(be)
        slot = slots.new_slot(len(PROMPT) + STEPS + 1)
        segs = [Segment(slot, PROMPT, 0, True)]
        if partner:
            other = slots.new_slot(len(OTHER) + STEPS + 1)
            segs.append(Segment(other, OTHER, 0, True))
        logits = slots.step(segs)
        out = []
        for i in range(STEPS):
            segs = [Segment(slot, [int(logits[0].argmax())], len(PROMPT) + i, True)]
            if partner:
                segs.append(Segment(other, [int(logits[1].argmax())], len(OTHER) + i, True))
            logits = slots.step(segs)
            out.append(logits[0].clone())
        return out, be.fused_steps


def _same_as_python(model, monkeypatch, **kw):
    """The fused decode equals the Python step's, bit for bit, and took the fused path."""
    monkeypatch.setenv(fused_step.FUSED_ENV, "off")
    ref, n_ref = _decode(model, **kw)
    monkeypatch.delenv(fused_step.FUSED_ENV)
    got, n = _decode(model, **kw)
    assert n_ref == 0 and n == STEPS
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    return got


MODELS = {
    "fp32": lambda m: m,
    "wo-int8": lambda m: _weight_only(m, 8, 0),
    "wo-int8-asym-g32-awq": lambda m: _weight_only(m, 8, 32, sym=False, awq=True),
    "wo-int4-g32": lambda m: _weight_only(m, 4, 32),
    "wo-int4-asym-g64-awq": lambda m: _weight_only(m, 4, 64, sym=False, awq=True),
    "wo-bf16": lambda m: _weight_only(m, 16, 0, head_bits=16),  # `quantize --weights bf16 --head-bits 16`
}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("kernel", ["native", "native-q8a"])
def test_fused_equals_the_python_step(built, monkeypatch, base, kind, kernel):
    if kind == "fp32" and kernel == "native-q8a":
        pytest.skip("no weight-only layers")
    monkeypatch.setenv(KERNEL_ENV, kernel)
    model = MODELS[kind](base)
    got = _same_as_python(model, monkeypatch)
    beside, n = _decode(model, partner=True)
    assert n == 0
    if kind == "fp32" and packed_rows_invariant(model):  # the batch-invariant case (docs/serve.md): served
        for a, b in zip(got, beside, strict=True):         # beside another sequence, the same bits
            assert torch.equal(a, b)


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_kv_slot_dtypes(built, monkeypatch, base, kv):
    _same_as_python(_weight_only(base, 8, 0), monkeypatch, kv=kv)


@pytest.mark.parametrize("path", ISA_ORDER)
@pytest.mark.parametrize("kind", ["fp32", "wo-int4-asym-g64-awq", "wo-int8", "wo-bf16"])
def test_every_isa_path(built, monkeypatch, base, path, kind):
    """fp32 takes the one-row GEMV on the vector paths and oneDNN's packed kernel on `scalar`."""
    skip_unless_runs(path, built)
    monkeypatch.setenv(native_kernels.ISA_ENV, path)
    monkeypatch.setenv(KERNEL_ENV, "native")
    _same_as_python(MODELS[kind](base), monkeypatch)


@pytest.mark.parametrize("kv", ["float32", "int8"])
@pytest.mark.parametrize("pact", [None, "PACT"])
def test_the_real_int8_model_on_the_native_kernel(built, monkeypatch, base, kv, pact):
    if not int8_mod.native_ready():
        pytest.skip("gptforge's int8 kernel runs no vector path here")
    monkeypatch.setenv(cpu_kernels.KERNEL_ENV, "native")
    _same_as_python(_int8(base, activation_preprocess_type=pact, pact_init=3.0), monkeypatch, kv=kv)


def _plain_int8(base, monkeypatch):
    """The real INT8 model with its layers on fbgemm's one-call `plain` path (VNNI's `auto`), and
    whether gptforge's int8 kernel gives that path's bits for every layer (the fused step's check)."""
    monkeypatch.setenv(cpu_kernels.KERNEL_ENV, "plain")
    model = _int8(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # forcing plain where the probe finds it inexact warns once
        same = [fused_step._native_gives_plains_bits(m) for m in model.modules() if type(m) is int8_mod.Int8Linear]
    return model, all(same)


def test_the_real_int8_model_on_fbgemm_plain_runs_fused_where_the_int8_kernel_gives_its_bits(built, monkeypatch, base):
    """Where `auto` takes fbgemm's `plain` path (VNNI CPUs), the fused step runs the INT8 layers on
    gptforge's int8 kernel when its check finds plain's bits there: the same logits as the Python step
    (fbgemm) bit for bit; where the check fails, the Python step."""
    if not int8_mod.native_ready() or not int8_mod.fast_kernel_available():
        pytest.skip("gptforge's int8 kernel or fbgemm does not run here")
    model, same = _plain_int8(base, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if same:
            _same_as_python(model, monkeypatch)
        else:
            assert _decode(model)[1] == 0


def test_int8_layers_on_plain_stay_in_python_where_the_int8_kernel_differs(built, monkeypatch, base):
    if not int8_mod.native_ready() or not int8_mod.fast_kernel_available():
        pytest.skip("gptforge's int8 kernel or fbgemm does not run here")
    real = native_kernels.int8_rows
    monkeypatch.setattr(native_kernels, "int8_rows", lambda *a, **k: real(*a, **k).nextafter(torch.tensor(math.inf)))
    model, same = _plain_int8(base, monkeypatch)
    assert not same  # one ulp off anywhere: the check fails
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _decode(model)[1] == 0


def test_plain_linears_without_packing(built, monkeypatch, base):
    _same_as_python(base, monkeypatch, prepack=False)


def test_what_keeps_the_python_path(built, monkeypatch, base):
    lora = copy.deepcopy(base)
    apply_lora(lora, LoraConfig(r=4, alpha=8, targets=["q", "v", "linear2"]))
    moe = _varied(tiny_model("Model.num_experts=4", "Model.expert_interval=1")[0])
    per_call = _int8(base, activation_quantize_type="abs_max")  # its step depends on each call's input
    for model, kw in ((lora, {}), (moe, {}), (base, {"kv": "bfloat16"}), (base, {"partner": True}), (per_call, {})):
        assert _decode(model, **kw)[1] == 0
    monkeypatch.setenv(cpu_kernels.KERNEL_ENV, "split")  # fbgemm's paths stay in Python
    assert _decode(_int8(base))[1] == 0
    monkeypatch.delenv(cpu_kernels.KERNEL_ENV)
    monkeypatch.setenv(native_kernels.ISA_ENV, "off")  # no native kernels: no native attention, no fusion
    assert _decode(base)[1] == 0


def test_the_switch(built, monkeypatch, base):
    monkeypatch.setenv(fused_step.FUSED_ENV, "off")
    assert _decode(base)[1] == 0
    monkeypatch.setenv(fused_step.FUSED_ENV, "auto")
    assert _decode(base)[1] == STEPS
    monkeypatch.setenv(fused_step.FUSED_ENV, "sometimes")
    with pytest.raises(UsageError, match=fused_step.FUSED_ENV):
        _decode(base)


@pytest.mark.parametrize("strategy", ["greedy_search", "sampling"])
def test_generate_is_unchanged(built, monkeypatch, base, strategy):
    """`generate` at batch 1 (the fused step) gives the tokens and scores of the Python step."""
    from gptforge.config.schema import GenerationConfig
    from gptforge.generate import generate_ids

    cfg = GenerationConfig(decode_strategy=strategy, max_dec_len=10, top_k=20, temperature=0.8, seed=4)
    model = _weight_only(base, 4, 32)
    prompts = [PROMPT, OTHER]
    monkeypatch.setenv(fused_step.FUSED_ENV, "off")
    ref = generate_ids(model, prompts, cfg, batch_size=1)
    monkeypatch.delenv(fused_step.FUSED_ENV)
    calls = []
    run = fused_step.FusedDecode.__call__
    monkeypatch.setattr(fused_step.FusedDecode, "__call__", lambda self, b: calls.append(1) or run(self, b))
    got = generate_ids(model, prompts, cfg, batch_size=1)
    assert len(calls) == int((got.lengths - 1).sum())  # every step but the prompts' (one sequence at a time)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.scores, ref.scores)


def test_the_switch_is_read_every_step(built, monkeypatch, base):
    with TorchBackend(base) as be:
        slots = RaggedSlots(be)
        slot = slots.new_slot(len(PROMPT) + 4)
        logits = slots.step([Segment(slot, PROMPT, 0, True)])
        for i, env in enumerate(["auto", "off", "auto"]):
            monkeypatch.setenv(fused_step.FUSED_ENV, env)
            before = be.fused_steps
            logits = slots.step([Segment(slot, [int(logits[0].argmax())], len(PROMPT) + i, True)])
            assert be.fused_steps - before == (env == "auto")
