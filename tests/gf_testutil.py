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
    """Whether oneDNN's packed fp32 Linear is batch-invariant on this CPU for `model`'s Linear
    shapes (`generate.backend.packed_rows_invariant`)."""
    import torch

    from gptforge.generate.backend import packed_rows_invariant as differing

    shapes = {tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear}
    shapes.add(tuple(model.wte.weight.shape))
    return not any(differing(n, k) for n, k in shapes)
