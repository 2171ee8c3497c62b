"""Helpers shared by tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

from gptforge.config import Config, load_config
from gptforge.model import GPT, build_model


def tiny_config(*overrides: str, preset: str = "tiny") -> Config:
    """A resolved config for a tiny model; extra `Section.key=value` overrides apply last."""
    return load_config(overrides=[f"Model.preset={preset}", "Model.hidden_dropout_prob=0",
                                  "Model.attention_probs_dropout_prob=0", *overrides])


def tiny_model(*overrides: str) -> tuple[GPT, Config]:
    cfg = tiny_config(*overrides)
    return build_model(cfg.Model).eval(), cfg


def spread_gpt2_vocab_dir(path):
    """A tiny model with GPT-2's vocabulary and weights spread enough to give varied text, saved
    with the GPT-2 tokenizer as a model directory at `path`."""
    import torch

    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.model_io import save_model_dir

    torch.manual_seed(0)
    m, cfg = tiny_model("Model.vocab_size=50257")
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    save_model_dir(m, cfg, path, gpt2_tokenizer())
    return path


ISA_ORDER = ("scalar", "avx2", "avx512")  # the native kernels' paths, each running on the CPUs the next one does


def skip_unless_runs(path: str, best: str) -> None:
    """Skip a test of native-kernel path `path` on a CPU whose best path is `best` (it would stop
    on an illegal instruction)."""
    import pytest

    if ISA_ORDER.index(path) > ISA_ORDER.index(best):
        pytest.skip(f"this CPU runs at most the {best} path, not {path}")


def within_fp32_rounding(y, x, wf, b) -> None:
    """Assert |y - ref| within fp32 rounding of the float64 reference x · wfᵀ + b: relative to the
    result and to the sum of |x|·|w| (the size of the terms summed)."""
    ref = x.double() @ wf.double().T + (b.double() if b is not None else 0)
    bound = 1e-5 * ref.abs() + 2e-6 * (x.double().abs() @ wf.double().abs().T) + 1e-7
    err = (y.double() - ref).abs()
    assert y.shape == ref.shape and bool((err <= bound).all()), float((err / bound).max())


def packed_rows_invariant(model) -> bool:
    """Whether the decode backend's fp32 products are batch-invariant on this CPU for `model`: always
    where gptforge's native kernels run (the backend routes every row count through their one order),
    else where oneDNN's packed fp32 Linear is for the model's shapes (`generate.backend.packed_rows_invariant`)."""
    import torch

    from gptforge.generate.backend import packed_rows_invariant as differing
    from gptforge.transforms import fp32_gemv

    if fp32_gemv.available():
        return True
    shapes = {tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear}
    shapes.add(tuple(model.wte.weight.shape))
    return not any(differing(n, k) for n, k in shapes)


def chosen_kernels(model, rows: int) -> set[str]:
    """The kernels a weight-only model's layers take for a batch of `rows` float32 rows on this CPU
    (`auto` picks `bf16` beyond the native rows where oneDNN has native bf16, `fp32` elsewhere)."""
    import torch

    from gptforge.transforms.weight_only import weight_only_layers

    return {layer.kernel_for(torch.zeros(rows, layer.in_features)) for _, layer in weight_only_layers(model)}


# bf16 rounds every activation and weight to 8 significant bits (relative 2^-9) before an fp32
# accumulation: logits move by about that fraction of their norm, never more than 1%
BF16_REL_NORM = 1e-2


def assert_close_for_kernels(got, ref, kernels: set[str], tol: float) -> None:
    """`got` equals `ref` within `tol` where every layer computes in fp32 (`fp32`, `native`, `packed`),
    within bf16's rounding (relative norm `BF16_REL_NORM`) where some layer runs in bf16."""
    import torch

    if "bf16" in kernels:
        rel = float((got - ref).detach().norm() / ref.detach().norm())
        assert rel < BF16_REL_NORM, (kernels, rel)
    else:
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def assert_equal_if_invariant(got, ref, invariant: bool, tol: float = 1e-4) -> None:
    """Bit-equal where the backend's products are batch-invariant on this CPU (`packed_rows_invariant`:
    always with the native kernels); elsewhere (oneDNN alone on a Xeon with AMX under torch 2.11:
    benchmarks/results/2026-11-26-avx512-check.md) the same values within `tol`: a sequence's numbers
    then move in their last bits with its batch."""
    import torch

    if invariant:
        assert torch.equal(got, ref), float((got - ref).abs().max())
    else:
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
