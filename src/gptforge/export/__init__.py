"""Export our models to other runtimes, and run the exports.

- `save_hf(model, dir, tokenizer, generation=cfg.Generation)`: an HF `transformers` GPT-2
  directory (dense, pruned, QAT/INT8 folded to float), sharded above `max_shard_size`;
- `export_onnx(model, dir, tokenizer, cfg=cfg, precision="auto")`: ONNX fp32, or INT8 QDQ
  from a quantized checkpoint, with past keys/values for decoding;
- `export_torch(...)`: the same step function as a `torch.export` program (`model.pt2`);
- `save_gguf(model, "model.gguf", tokenizer, "q8_0")`: one GGUF file for llama.cpp (gpt2
  architecture; f32, f16, q8_0, q4_0), tokenizer included;
- `load_program(dir)` reloads a `.pt2` export (ONNX exports run through
  `gptforge.generate.load_runnable(dir)`, an onnxruntime `StepBackend`).

onnx / onnxruntime / gguf are imported only by the functions that need them (extra `export`).
"""

from gptforge.export.common import META_FILE, PRECISIONS, fold_quantization, model_kind
from gptforge.export.hf import save_hf, save_pruned_hf_dir

FORMATS = ("hf", "onnx", "torch", "gguf")


def __getattr__(name: str):
    # The ONNX / torch.export modules register custom ops and pull in more: load on first use.
    lazy = {"export_onnx": "gptforge.export.onnx", "ExportReport": "gptforge.export.program",
            "export_torch": "gptforge.export.torch_export", "load_program": "gptforge.export.torch_export",
            "to_qdq": "gptforge.export.qdq", "save_gguf": "gptforge.export.gguf"}
    if name in lazy:
        import importlib

        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(f"module 'gptforge.export' has no attribute {name!r}")


__all__ = ["FORMATS", "META_FILE", "PRECISIONS", "ExportReport", "export_onnx", "export_torch",
           "fold_quantization", "load_program", "model_kind", "save_gguf", "save_hf", "save_pruned_hf_dir",
           "to_qdq"]
