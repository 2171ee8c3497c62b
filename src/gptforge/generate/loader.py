"""One loader for every runnable model: a model directory of any format `model_io` reads (ours,
HF GPT-2, `.pdparams`, QAT, INT8, pruned, MoE) as our `GPT`, or a `gptforge export --format
onnx` directory as an onnxruntime `OrtBackend`; with the tokenizer that belongs to it. Drafts
for speculative decoding load the same way, with the draft/target tokenizer check. `generate`,
`stream`, `infer`, `serve` and the library API all come here.

    from gptforge.generate.loader import load_runnable, load_draft
    model, cfg, tok = load_runnable("out/model")          # or an ONNX export directory
    draft = load_draft("out/draft_onnx", tokenizer=tok)   # any kind, tokenizer checked
"""

from __future__ import annotations

import os
from pathlib import Path

from gptforge.errors import UsageError
from gptforge.export.export_dir import is_export_dir, load_export_config, read_export_dir
from gptforge.generate.speculative import check_same_tokenizer

ONNX_HINT = "pip install 'gptforge[export]'"


def _need_onnxruntime(what: str) -> None:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        raise UsageError(f"{what} needs onnxruntime, which is not installed: {ONNX_HINT}") from None


def load_runnable(path: str | os.PathLike, cfg=None, *, config_file: str | None = None, overrides=(),
                  device=None, threads: int | None = None, int8_gemm: str = "auto", adapter=None):
    """(our model in eval mode or an `OrtBackend`, its config, its tokenizer) from `path`.
    `cfg` (a resolved config) or `config_file` + `overrides` (`-c` / `-o`) adjust the saved
    config; the shape always comes from the checkpoint. `device`: our models; `threads` and
    `int8_gemm`: onnxruntime; `adapter`: a LoRA/DoRA directory applied over our model."""
    if is_export_dir(path, "onnx"):
        if adapter:
            raise UsageError(f"--adapter {adapter}: adapters apply to model directories, not to the ONNX export "
                             f"{path}; merge it before exporting (gptforge export --adapter)")
        _need_onnxruntime(f"{path} (an ONNX export)")
        from gptforge.generate.ort_backend import load_onnx_dir

        p, _ = read_export_dir(path, "onnx")
        if cfg is None:
            cfg = load_export_config(p, config_file, overrides)
        return load_onnx_dir(p, cfg, int8_gemm=int8_gemm, threads=threads)
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.model_io import load_model, load_run_config, resolve_checkpoint_path

    p = resolve_checkpoint_path(path)
    if cfg is None:
        cfg = load_run_config(config_file, overrides, ckpt_dir=path)
    model, cfg = load_model(p, cfg, device=device)
    if adapter:
        from gptforge.adapters.peft_format import apply_adapter

        model = apply_adapter(model, adapter)
    own = p.is_dir() and ((p / "tokenizer.json").is_file() or (p / "vocab.json").is_file())
    tok = load_tokenizer(None, p) if own else load_tokenizer(cfg.Data.tokenizer, p if p.is_dir() else None)
    return model, cfg, tok


def load_draft(path: str | os.PathLike, *, tokenizer=None, target_name: str = "model", device=None,
               threads: int | None = None):
    """The draft model of speculative decoding (any kind `load_runnable` reads); with `tokenizer`
    (the target's), a different draft tokenizer is a one-line `CheckpointError` naming both."""
    draft, _, dtok = load_runnable(path, device=device, threads=threads)
    if tokenizer is not None:
        check_same_tokenizer(dtok, tokenizer, Path(path), target_name)
    return draft
