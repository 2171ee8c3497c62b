"""`gptforge quantize --weights ...`: a model directory -> a weight-only quantized one.

Round-to-nearest needs only the weights; GPTQ and AWQ calibrate on `samples` windows of `seq_len`
tokens from a text file or the built-in corpus. The output is an ordinary model directory
(config.yaml, model.safetensors with int8 / packed int4 / bf16 weights and fp32 scales and
zeros, the tokenizer) plus `weight_only.json`, which `model_io.load_model` reads to rebuild
the modules: `generate`, `eval` and the rest load it unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gptforge.compress.gptq import damp_for
from gptforge.compress.head_rows import COUNT_TOKENS, token_counts
from gptforge.errors import DataError
from gptforge.transforms.weight_only import WeightOnlySpec, quantize_rtn_model


@dataclass
class WeightOnlyResult:
    out_dir: str
    spec: WeightOnlySpec
    float_bytes: int
    quantized_bytes: int
    calibration: str
    plan: object = None  # bit_plan.Plan of a mixed-precision run
    avg_bits: float = 0.0  # own bits per planned weight (bit_plan.planned_bits)
    stored_bits: float = 0.0  # stored bits per planned weight, group scales and zeros included
    learned_scales: bool = False  # a weight-only QAT checkpoint's learned grid (`learn_scales`) was stored


def calibration_tokens(tokenizer, text_file: str | os.PathLike | None, upto: int) -> list[int]:
    """Token ids of `text_file` (all of it) or of the built-in corpus's documents in order, each
    followed by the end-of-text token, until there are at least `upto` (fewer when the corpus ends)."""
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"--calib {text_file}: cannot read it as UTF-8 text ({e.__class__.__name__})") from None
        return tokenizer.encode(text)
    from gptforge.data.corpus import builtin_documents

    ids, eos = [], tokenizer.eos_token_id
    for doc in builtin_documents():
        ids += tokenizer.encode(doc) + ([eos] if eos is not None else [])
        if len(ids) >= upto:
            break
    return ids


def calibration_ids(tokenizer, text_file: str | os.PathLike | None, samples: int, seq_len: int,
                    tokens: list[int] | None = None) -> list[torch.Tensor]:
    """`samples` windows [1, seq_len] of token ids, consecutive, from the start of `tokens` or of
    `calibration_tokens(tokenizer, text_file, ...)`."""
    ids = tokens if tokens is not None else calibration_tokens(tokenizer, text_file, samples * seq_len)
    if len(ids) < samples * seq_len:
        where = f"--calib {text_file}" if text_file is not None else "the built-in corpus"
        raise DataError(f"{where}: {len(ids)} tokens, fewer than --samples {samples} x --seq-len {seq_len}; "
                        "lower --samples / --seq-len or give a longer text")
    t = torch.tensor(ids[: samples * seq_len], dtype=torch.long).reshape(samples, 1, seq_len)
    return list(t)


def sensitivity_inputs(tokenizer, text_file: str | os.PathLike | None, samples: int, seq_len: int,
                       vocab: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What a weight-only sensitivity analysis reads: the calibration windows (`calibration_ids`)
    and the same text's token counts over its first COUNT_TOKENS tokens, which rank the head's
    rows (`head_rows.token_counts`; tokenized once for both)."""
    tokens = calibration_tokens(tokenizer, text_file, max(samples * seq_len, COUNT_TOKENS))
    return calibration_ids(tokenizer, text_file, samples, seq_len, tokens=tokens), token_counts(tokens, vocab)


def _bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _qat_config(src: str | os.PathLike):
    """The `Compress.Quantization` of a weight-only QAT checkpoint; None for any other model."""
    from gptforge.config.schema import QuantizationConfig
    from gptforge.config.typed import build_section
    from gptforge.model_io import read_checkpoint_config, resolve_checkpoint_path

    raw = (read_checkpoint_config(resolve_checkpoint_path(src)).get("Compress") or {}).get("Quantization") or {}
    if not (raw.get("enable") and raw.get("weight_only")):
        return None
    return build_section(QuantizationConfig, raw, "Compress.Quantization")


def qat_weight_spec(src: str | os.PathLike) -> WeightOnlySpec | None:
    """The weight-only format a weight-only QAT checkpoint (`Compress.Quantization.weight_only`)
    was trained for; None for any other model."""
    q = _qat_config(src)
    if q is None:
        return None
    return WeightOnlySpec(bits=q.weight_bits, group_size=q.group_size, sym=q.weight_sym, head_bits=q.head_bits,
                          method="rtn")


def qat_grids(src: str | os.PathLike) -> dict | None:
    """{layer name ("wte": the head): (q, scale, zero)} of a weight-only QAT checkpoint trained
    with `learn_scales`, the grids its fake-quant model computes with; None for any other model."""
    from gptforge.model_io import load_model
    from gptforge.transforms.weight_qat import layers

    q = _qat_config(src)
    if q is None or not q.learn_scales:
        return None
    fq, _ = load_model(src, device="cpu")
    quantized = {id(mod) for mod in layers(fq)}
    grids = {name: mod.grid() for name, mod in fq.named_modules() if id(mod) in quantized}
    return {name: g for name, g in grids.items() if g is not None}


def check_qat_spec(spec: WeightOnlySpec, trained: WeightOnlySpec, path, budget: bool = False) -> None:
    """UsageError naming the flag where `spec` differs from the format the QAT model at `path`
    trained for: anything but its own round-to-nearest grid would undo what QAT learned."""
    from gptforge.errors import UsageError

    if spec.method != "rtn":
        raise UsageError(f"--method {spec.method}: {path} is a weight-only QAT model; {spec.method.upper()} would "
                         "re-round its weights and undo QAT: leave --method out (rtn on the trained grid)")
    if budget or spec.layer_bits:
        raise UsageError(f"--avg-bits / --max-bytes: {path} is a weight-only QAT model trained at fixed bit-widths; "
                         "leave the budget out")
    flags = (("bits", "--weights", lambda s: f"int{s.bits}" if s.bits < 16 else "bf16"),
             ("group_size", "--group-size", lambda s: str(s.group_size)),
             ("sym", "--asym", lambda s: "absent" if s.sym else "given"),
             ("head_bits", "--head-bits", lambda s: str(s.head_bits)))
    for field, flag, show in flags:
        if getattr(spec, field) != getattr(trained, field):
            fix = f"give {flag} {show(trained)}" + ("" if flag == "--weights" else f" or leave {flag} out")
            raise UsageError(f"{flag} {show(spec)}: {path} was trained by weight-only QAT for {flag} "
                             f"{show(trained)} (Compress.Quantization); {fix}")


def load_float_model(src: str | os.PathLike, cfg=None):
    """(float model on CPU in fp32, cfg, tokenizer, path) of a model directory; ConfigError for a
    weight-only, QAT/PTQ/INT8 or MoE model (weight-only quantization starts from a float model).
    A weight-only QAT model gives its float master weights and a config without quantization."""
    from gptforge.config.schema import QuantizationConfig
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.errors import ConfigError
    from gptforge.model_io import load_model, resolve_checkpoint_path
    from gptforge.transforms.quant import is_fake_quantized, refuse_moe
    from gptforge.transforms.weight_only import read_spec

    path = resolve_checkpoint_path(src)
    if path.is_dir() and read_spec(path) is not None:
        raise ConfigError(f"{path}: is already weight-only quantized ({path / 'weight_only.json'}); "
                          "quantize the float model it came from")
    qat = qat_weight_spec(path) is not None
    model, cfg = load_model(path, cfg, device="cpu", with_structure=not qat)
    if qat:
        cfg = dataclasses.replace(cfg, Compress=dataclasses.replace(cfg.Compress, Quantization=QuantizationConfig()))
    elif is_fake_quantized(model) or cfg.Compress.Quantization.converted:
        raise ConfigError(f"{path}: a QAT/PTQ/INT8 model (Compress.Quantization.enable); weight-only "
                          "quantization starts from a float model (or use `quantize --convert`)")
    refuse_moe(model, "weight-only quantization")
    model.float()
    tokenizer = load_tokenizer(cfg.Data.tokenizer, path if path.is_dir() else None)
    return model, cfg, tokenizer, path


@dataclass
class Budget:
    """A mixed-precision budget (`--avg-bits` or `--max-bytes`) and where the increases come from:
    `sensitivity` (an analysis.json) or, when None, measured here with `metric` on the calibration text."""

    avg_bits: float | None = None
    max_bytes: int | None = None
    sensitivity: str | os.PathLike | None = None
    metric: str = "kl"


def quantize_weights(src: str | os.PathLike, out_dir: str | os.PathLike, spec: WeightOnlySpec, *, cfg=None,
                     calib: str | os.PathLike | None = None, samples: int = 32, seq_len: int = 256,
                     damp: float = 0.01, act_order: bool = False, overwrite: bool = False,
                     progress: bool = True, budget: Budget | None = None) -> WeightOnlyResult:
    """Quantize the float model at `src` to `spec` and write it to `out_dir`; with `budget`, each
    layer's bit-width (4 or 8) from a sensitivity plan (`bit_plan`), written beside the model."""
    from gptforge.model_io import atomic_dir, write_model_files

    trained = qat_weight_spec(src)
    model, cfg, tokenizer, path = load_float_model(src, cfg)
    if trained is not None:
        check_qat_spec(spec, trained, path, budget=budget is not None)
    fbytes = _bytes(model)
    plan = None
    if budget is not None:
        plan = _plan(model, cfg, tokenizer, path, spec, budget, calib=calib, samples=samples, seq_len=seq_len,
                     damp=damp, act_order=act_order, progress=progress)
        # head_bits follows the plan too: weight_only.json must not say 8 where the head is at 4
        spec = dataclasses.replace(spec, layer_bits=plan.layer_bits, head_bits=plan.layer_bits["wte"],
                                   head_rows8=tuple(plan.head_rows8))
    calibration, grids = "none", None
    if spec.method in ("gptq", "awq"):
        seq = min(seq_len, cfg.Model.max_position_embeddings)
        batches = calibration_ids(tokenizer, calib, samples, seq)
        calibration = f"{samples} x {seq} tokens of {calib or 'the built-in corpus'}"
        if spec.method == "gptq":
            from gptforge.compress.gptq import gptq_model

            gptq_model(model, spec, batches, damp=damp, act_order=act_order, progress=progress)
        else:
            from gptforge.compress.awq import awq_model

            awq_model(model, spec, batches, progress=progress)
    else:
        grids = qat_grids(path) if trained is not None else None
        quantize_rtn_model(model, spec, grids)
    from gptforge.compress import bit_plan

    own, stored = bit_plan.planned_bits(model)
    with atomic_dir(out_dir, overwrite) as tmp:
        write_model_files(model, cfg, tmp, tokenizer)
        spec.save(tmp, {"calibration": calibration, "damp": damp, "act_order": act_order, "source": str(path),
                        "head_damp": damp_for("wte", damp) if spec.method == "gptq" and spec.bits_for("wte") in (4, 8) else None,
                        "qat": trained is not None, "learned_scales": bool(grids), "avg_bits": own,
                        "stored_bits": stored})
        if plan is not None:
            bit_plan.write_plan(plan, tmp, budget.metric, {"source": str(path), "sensitivity": plan.source})
    return WeightOnlyResult(str(out_dir), spec, fbytes, _bytes(model), calibration, plan, own, stored, bool(grids))


def _plan(model, cfg, tokenizer, path, spec: WeightOnlySpec, budget: Budget, **calib):
    """The plan of `budget` for the float `model`: increases from the given analysis or measured now."""
    from gptforge.compress import bit_plan
    from gptforge.compress.head_rows import read_head_rows
    from gptforge.compress.sensitivity_run import checkpoint_digest
    from gptforge.compress.sensitivity_weights import calibration_batches, weight_sensitivity
    from gptforge.transforms.weight_only import planned_layers

    if spec.bits != 4:
        from gptforge.errors import UsageError

        raise UsageError("--avg-bits / --max-bytes plan 4- or 8-bit layers: give --weights int4")
    # an impossible budget fails now, not after minutes of measuring (the bytes need no increases)
    zero = {n: (0.0, 0.0) for n, _ in planned_layers(model)}
    dry = bit_plan.layer_rows(model, spec, zero)
    bit_plan.make_plan(dry, bit_plan.fixed_bytes(model, dry), avg_bits=budget.avg_bits, max_bytes=budget.max_bytes)
    if budget.sensitivity is not None:
        increases, state = bit_plan.read_sensitivity(budget.sensitivity, checkpoint_digest(path), spec)
        budget.metric = state.get("metric", budget.metric)
        source = str(budget.sensitivity)
    else:
        method = spec.method if spec.method == "gptq" else "rtn"  # AWQ's layers are measured rounded to nearest
        seq = min(calib["seq_len"], cfg.Model.max_position_embeddings) + 1
        windows, counts = sensitivity_inputs(tokenizer, calib["calib"], calib["samples"], seq,
                                             model.wte.num_embeddings)
        with torch.no_grad():
            a = weight_sensitivity(model, spec, calibration_batches(windows), metric=budget.metric, method=method,
                                   damp=calib["damp"], act_order=calib["act_order"], progress=calib["progress"],
                                   row_counts=counts)
        increases = {n: (r.sensitivity, r.sensitivity8) for n, r in a.layers.items()}
        state = {"head_rows": a.head_rows}
        source = f"measured by this run ({budget.metric}, {method})"
    head = read_head_rows(state, model.wte.num_embeddings,
                          f"--sensitivity {budget.sensitivity}" if budget.sensitivity else "the analysis")
    rows = bit_plan.layer_rows(model, spec, increases, head)
    plan = bit_plan.make_plan(rows, bit_plan.fixed_bytes(model, rows), avg_bits=budget.avg_bits,
                              max_bytes=budget.max_bytes, head_order=head["order"] if head else None)
    if head is None:
        plan.notes.append("the analysis has no head-row ladder (made by an older gptforge): the head is planned "
                          "as one layer; analyse again to let the plan keep its most used rows at 8 bits")
    plan.source = source
    return plan
