"""Checkpoint-level INT8 conversion (`gptforge quantize --convert`) and a quantization summary.

`convert_checkpoint(src, out)` loads a QAT or PTQ directory (a fake-quant model), converts it
with `int8.convert_model`, checks it against the fake-quant model on a batch (SQNR of the
logits and greedy-argmax agreement) and writes a model directory: `model.safetensors` with
int8 weights + fp32 steps, `config.yaml` with `Compress.Quantization.converted: true` (so
`load_model` rebuilds the INT8 modules), the tokenizer and `int8_report.json`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import torch
from torch import nn

from gptforge.errors import ConfigError
from gptforge.transforms.cpu_kernels import describe, fbgemm_available
from gptforge.transforms.int8 import Int8Embedding, Int8Linear, convert_model, converted_config, kernel_path
from gptforge.transforms.quant import (
    QuantEmbedding,
    QuantLinear,
    quant_modules,
    reference_name,
    refuse_weight_only,
)

REPORT_FILE = "int8_report.json"


def _notice(msg: str, echo: bool = True) -> None:
    if echo:
        print(f"gptforge: {msg}", file=sys.stderr)


def state_bytes(model: nn.Module) -> int:
    """Bytes of the model's state dict (what a checkpoint stores)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """10·log10(Σref² / Σ(test - ref)²) in dB (inf when identical)."""
    ref, test = ref.double(), test.double()
    noise = (test - ref).pow(2).sum().item()
    return math.inf if noise == 0 else 10.0 * math.log10(ref.pow(2).sum().item() / noise)


@torch.no_grad()
def compare_logits(ref: nn.Module, test: nn.Module, ids: torch.Tensor) -> dict:
    """SQNR (dB) of `test`'s logits against `ref`'s and their greedy-argmax agreement."""
    a = ref(ids).logits.float()
    b = test(ids).logits.float()
    return {"sqnr_db": sqnr_db(a, b), "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "tokens": int(ids.numel())}


@dataclass
class ConvertResult:
    out_dir: str
    source: str
    sqnr_db: float
    argmax_agreement: float
    tokens: int
    check_data: str
    int8_embedding: bool
    float_layers: list[str]
    int8_layers: int
    fake_quant_bytes: int
    int8_bytes: int
    check_kernel: str = ""  # the INT8 path the check ran on (`cpu_kernels.py`), and the CPU
    cpu: str = ""


def _kernel_name() -> str:
    if not fbgemm_available():
        return "dequantized fp32 (no fbgemm)"
    path = kernel_path()
    return f"{'gptforge' if path == 'native' else 'fbgemm'} {path}"


CHECK_ROWS, CHECK_TOKENS = 4, 256  # a sample big enough for the statistics, quick on a 345M model


def _check_ids(cfg, tokenizer, vocab: int, echo: bool) -> tuple[torch.Tensor, str]:
    """Up to 4 x 256 tokens of the checkpoint's first Train batch; random ids when it has no data here."""
    from gptforge.compress.ptq import calibration_batches
    from gptforge.errors import GPTForgeError

    try:
        ids = calibration_batches(cfg, tokenizer, 1)[0]["tokens"][:CHECK_ROWS, :CHECK_TOKENS]
        return ids, "Train batch 0"
    except (GPTForgeError, OSError) as e:
        _notice(f"check on random token ids (the Train data is not available: {str(e).splitlines()[0][:120]})", echo)
        g = torch.Generator().manual_seed(0)
        seq = min(cfg.Data.Train.dataset.max_seq_len, cfg.Model.max_position_embeddings, CHECK_TOKENS)
        return torch.randint(0, vocab, (2, seq), generator=g), "random ids"


def convert_checkpoint(src: str | os.PathLike, out_dir: str | os.PathLike, *, cfg=None,
                       int8_embedding: bool | None = None, overwrite: bool = False, check: bool = True,
                       echo: bool = True) -> ConvertResult:
    """Convert the fake-quant model at `src` into an INT8 model directory at `out_dir`.

    `int8_embedding`: None (default) stores the tied embedding / LM head as int8 exactly when
    the model was trained with it quantized (`quantize_embedding`); True / False force it.
    """
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.model_io import atomic_dir, load_model, resolve_checkpoint_path, write_model_files

    path = resolve_checkpoint_path(src)
    model, cfg = load_model(path, cfg, device="cpu")
    q = cfg.Compress.Quantization
    if q.converted:
        raise ConfigError(f"{path}: is already an INT8 model (Compress.Quantization.converted: true)")
    refuse_weight_only(q, "`quantize --convert` (INT8)")
    if not q.enable or not quant_modules(model):
        raise ConfigError(f"{path}: not a fake-quant model (Compress.Quantization.enable is false); "
                          "run `gptforge qat` or `gptforge ptq` first")
    if int8_embedding and not q.quantize_embedding:
        _notice("the embedding / LM head was not quantized during QAT/PTQ; storing it as int8 adds its rounding "
                "error to the INT8 model (QAT with -o Compress.Quantization.quantize_embedding=true avoids that)", echo)
    elif int8_embedding is None and not q.quantize_embedding:
        _notice("the embedding / LM head stays float, as it was trained (`--embedding int8` stores it as int8: "
                "fewer bytes, plus its rounding error; QAT with Compress.Quantization.quantize_embedding=true "
                "trains for it)", echo)
    tokenizer = load_tokenizer(cfg.Data.tokenizer, path if path.is_dir() else None)
    fq_bytes = state_bytes(model)
    ref = copy.deepcopy(model) if check else None
    floats = convert_model(model, int8_embedding=int8_embedding)
    n_int8 = sum(isinstance(m, Int8Linear) for m in model.modules())
    stats = {"sqnr_db": math.nan, "argmax_agreement": math.nan, "tokens": 0}
    data = "none"
    if check:
        ids, data = _check_ids(cfg, tokenizer, model.wte.weight.shape[0], echo)
        stats = compare_logits(ref, model, ids)
        del ref
    qc = converted_config(q, isinstance(model.wte, Int8Embedding), floats)
    out_cfg = dataclasses.replace(cfg, Compress=dataclasses.replace(cfg.Compress, Quantization=qc))
    result = ConvertResult(out_dir=str(out_dir), source=str(path), check_data=data,
                           int8_embedding=isinstance(model.wte, Int8Embedding), float_layers=floats,
                           int8_layers=n_int8, fake_quant_bytes=fq_bytes, int8_bytes=state_bytes(model),
                           check_kernel=_kernel_name() if check else "", cpu=describe(onnxruntime=False) if check else "", **stats)
    with atomic_dir(out_dir, overwrite) as tmp:
        write_model_files(model, out_cfg, tmp, tokenizer)
        (tmp / REPORT_FILE).write_text(json.dumps(asdict(result), indent=2) + "\n", encoding="utf-8")
    return result


def summary(model: nn.Module) -> list[dict]:
    """One row per quantized module: names, kind, bits, activation step / scale, PACT alpha."""
    rows = []
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            rows.append({"name": name, "reference": reference_name(name), "kind": "fake-quant",
                         "weight": f"int{mod.weight_bits} {'channel' if mod.channel_wise else 'tensor'}",
                         "activation": f"int{mod.act_bits} {mod.act_type}",
                         "act_scale": float(mod.act_scale.reshape(())),
                         "pact_alpha": float(mod.pact_alpha.reshape(())) if mod.pact_alpha is not None else None,
                         "enabled": f"w={mod.weight_quant_enabled} a={mod.act_quant_enabled}"})
        elif isinstance(mod, Int8Linear):
            rows.append({"name": name, "reference": reference_name(name), "kind": "int8",
                         "weight": f"int{mod.weight_bits} {'channel' if mod.channel_wise else 'tensor'}",
                         "activation": f"int{mod.act_bits} {'static' if mod.static_act else 'per-call'}",
                         "act_scale": float(mod.input_scale.reshape(())) * (2 ** (mod.act_bits - 1) - 1)
                         if mod.input_scale is not None else None,
                         "pact_alpha": float(mod.pact_alpha.reshape(())) if mod.pact_alpha is not None else None,
                         "enabled": ""})
        elif isinstance(mod, (QuantEmbedding, Int8Embedding)):
            rows.append({"name": name, "reference": "embedding + head", "kind": "int8" if isinstance(
                mod, Int8Embedding) else "fake-quant", "weight": "int8 row", "activation": "float",
                "act_scale": None, "pact_alpha": None, "enabled": ""})
    return rows
