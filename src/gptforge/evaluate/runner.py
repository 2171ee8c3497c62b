"""`run_eval`: the `Offline_Eval` section → LAMBADA or WikiText → printed lines + results JSON."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

from gptforge.errors import ConfigError
from gptforge.evaluate.common import amp_dtype_for, model_device, write_json_atomic
from gptforge.evaluate.lambada import evaluate_lambada
from gptforge.evaluate.wikitext import evaluate_wikitext


def default_output(kind: str, ckpt: str | os.PathLike | None = None) -> Path:
    """`./eval_results_<kind>.json` in the working directory. Never the checkpoint's directory: a
    model directory holds the model, and an evaluation must not change it (give `--out` for
    another place). `ckpt` is accepted for callers that pass it; it does not decide the place."""
    return Path.cwd() / f"eval_results_{kind}.json"


def results_path(cfg, kind: str, output: str | os.PathLike | None = None) -> Path:
    """Where the results JSON of `kind` (lambada, wikitext, glue, harness) goes: `output`, else
    `Offline_Eval.output`, else `default_output(kind)`; known before the evaluation starts, so
    `gptforge eval` can refuse to overwrite it first."""
    return Path(output or cfg.Offline_Eval.output or default_output(kind))


def task_kind(cfg) -> str:
    """The task `run_eval` runs for `cfg`: lambada (Offline_Eval.cloze_eval) or wikitext."""
    return "lambada" if cfg.Offline_Eval.cloze_eval else "wikitext"


def model_identity(model: torch.nn.Module, cfg, ckpt=None) -> dict:
    """What was evaluated: class, size, shape keys, checkpoint, dtype, device."""
    m = cfg.Model
    p = next(iter(model.parameters()), None)
    return {
        "class": type(model).__name__,
        "checkpoint": str(ckpt) if ckpt is not None else None,
        "parameters": sum(x.numel() for x in model.parameters()),
        "dtype": str(p.dtype).replace("torch.", "") if p is not None else None,
        "device": str(p.device) if p is not None else None,
        "shape": {k: getattr(m, k) for k in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                                             "ffn_hidden_size", "max_position_embeddings",
                                             "layer_num_heads", "layer_ffn_sizes")},
    }


def tokenizer_identity(tokenizer) -> dict:
    return {"name": getattr(tokenizer, "name", type(tokenizer).__name__),
            "vocab_size": getattr(tokenizer, "vocab_size", None),
            "eos_token_id": getattr(tokenizer, "eos_token_id", None)}


def run_eval(cfg, model: torch.nn.Module, tokenizer, *, output: str | os.PathLike | None = None,
             ckpt: str | os.PathLike | None = None, emulate_reference_aggregation: bool = False,
             restrict_vocab: bool = False, progress: bool = True, echo: bool = True) -> dict:
    """Evaluate as `cfg.Offline_Eval` says (cloze_eval: LAMBADA, else WikiText); print the
    reference's final line (and labelled extra metrics) and write the results JSON.

    `restrict_vocab` limits the argmax/softmax to the tokenizer's ids (default: every column
    the model outputs, like the reference and HF on an exported model).
    """
    oe = cfg.Offline_Eval
    if not oe.eval_path:
        raise ConfigError("Offline_Eval.eval_path: not set; pass -o Offline_Eval.eval_path=FILE "
                          "(a LAMBADA jsonl with cloze_eval=True, or a WikiText text file)")
    device = model_device(model)
    common = dict(vocab_size=tokenizer.vocab_size if restrict_vocab else None,
                  amp_dtype=amp_dtype_for(cfg, device), progress=progress,
                  logging_freq=oe.logging_freq, emulate_reference_aggregation=emulate_reference_aggregation)
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        if oe.cloze_eval:
            res = evaluate_lambada(model, tokenizer, oe.eval_path, oe.batch_size, oe.max_seq_len,
                                   split_rule=oe.lambada_split, **common)
        else:
            res = evaluate_wikitext(model, tokenizer, oe.eval_path, oe.max_seq_len, oe.overlapping_eval,
                                    oe.batch_size, detokenize=oe.detokenize, **common)
    finally:
        model.train(was_training)
    res["seconds"] = time.perf_counter() - t0
    res["config"] = {**dataclasses.asdict(oe), "restrict_vocab": restrict_vocab,
                     "amp_dtype": str(common["amp_dtype"]).replace("torch.", "") if common["amp_dtype"] else None}
    res["model"] = model_identity(model, cfg, ckpt)
    res["tokenizer"] = tokenizer_identity(tokenizer)
    out = results_path(cfg, res["task"], output)
    res["output"] = str(out)
    write_json_atomic(out, res)
    if echo:
        for line in summary_lines(res):
            print(line)
    return res


def summary_lines(res: dict) -> list[str]:
    """The reference's final line first, then our extra metrics, each labelled."""
    m = res["metrics"]
    lines = [res["final_line"]]
    if res["task"] == "lambada":
        lines.append(f"lambada target perplexity (lm-eval style): {m['target_perplexity']:.4f} | "
                     f"last-token accuracy (GPT-2 paper's looser rule): {m['last_token_accuracy']:.4f}"
                     + (f" | contexts truncated to the window: {m['truncated_contexts']}"
                        if m["truncated_contexts"] else ""))
    else:
        lines.append(f"wikitext tokens: {m['num_tokens']} | original words: {m['num_original_tokens']} | "
                     f"windows scored: {m['windows']} | bits per byte: {m['bits_per_byte']:.4f}")
    ref = res.get("reference_aggregation")
    if ref:
        lines.append("EMULATED reference aggregation (x logging_freq batch 0, dropped tail; not correct): "
                     + ref["final_line"])
    lines.append(f"results written to {res['output']} ({res['seconds']:.1f} s)")
    return lines
