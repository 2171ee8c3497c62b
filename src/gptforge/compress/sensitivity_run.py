"""`run_analysis`: checkpoints + config → the metric → `analyze` → analysis.txt / .json / .png and
the skip list (what `gptforge analyze` does; the Python entry point for scripts).

Models: `qat` mode analyses the fake-quant model of `qat_ckpt` (a QAT or PTQ checkpoint), with
the float baseline's weights (`float_ckpt`, optional) restored into each de-quantized layer.
`ptq` mode quantizes the float model of `float_ckpt` as `Compress.Quantization` says and
calibrates its activation scales on `calib_batches` Train batches (`gptforge ptq`'s code), or
takes the fake-quant model of `qat_ckpt` as it is.

Metrics (`metric="auto"`: `acc` or `ppl` when `Offline_Eval.eval_path` is set, as
`Offline_Eval.cloze_eval` says, else `cosine`): `acc` LAMBADA accuracy and `ppl` WikiText
perplexity on `Offline_Eval.eval_path` with the `Offline_Eval` settings; `loss` on `batches`
(default `Engine.eval_iters`) Eval-split batches; `cosine` / `kl` against the float model's
outputs on `batches` (default `Compress.Quantization.calib_batches`) Train-split batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptforge.compress import sensitivity as sens
from gptforge.compress import sensitivity_report as rep
from gptforge.config.schema import Config
from gptforge.errors import ConfigError, UsageError
from gptforge.evaluate.common import write_text_atomic


def _notice(msg: str, echo: bool) -> None:
    if echo:
        print(f"gptforge: {msg}", file=sys.stderr)


@dataclass
class AnalysisRun:
    analysis: sens.Analysis
    out_dir: Path
    files: dict[str, Path]
    suggested_k: int
    top_k: int | None = None
    skip_map: dict[str, list[str]] | None = None
    override: str | None = None
    qat_command: str | None = None
    notes: list[str] = field(default_factory=list)


def resolve_metric(metric: str, cfg: Config) -> str:
    """`auto` → acc / ppl with an eval file (by Offline_Eval.cloze_eval), else the cosine proxy."""
    if metric == "auto":
        if cfg.Offline_Eval.eval_path:
            return "acc" if cfg.Offline_Eval.cloze_eval else "ppl"
        return "cosine"
    if metric not in sens.METRICS:
        raise UsageError(f"--metric {metric!r}: expected auto or one of {', '.join(sens.METRICS)}")
    if metric in ("acc", "ppl") and not cfg.Offline_Eval.eval_path:
        what = "a LAMBADA jsonl" if metric == "acc" else "a WikiText text file"
        raise ConfigError(f"Offline_Eval.eval_path: not set; --metric {metric} needs {what} "
                          "(--eval-path FILE or -o Offline_Eval.eval_path=FILE)")
    return metric


def split_batches(cfg: Config, tokenizer, split: str, n: int) -> list[dict[str, torch.Tensor]]:
    """The first `n` micro-batches of a data split (Global.micro_batch_size samples each)."""
    from gptforge.data.dataset import build_datasets, collate

    if n < 1:
        raise UsageError(f"--batches: must be >= 1, got {n}")
    mbs = cfg.Global.micro_batch_size or 1
    ds = build_datasets(cfg, (split,), num_samples={split: n * mbs}, tokenizer=tokenizer)[split]
    if len(ds) < n * mbs:
        raise ConfigError(f"Data.{split}: {n} batches of {mbs} need {n * mbs} samples, the split has {len(ds)}; "
                          "lower --batches or Global.micro_batch_size")
    return [collate([ds[k * mbs + j] for j in range(mbs)]) for k in range(n)]


def _digest_files(paths: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def checkpoint_digest(path: str | os.PathLike) -> str:
    """A content hash of a model's weight (and config) files: the same model wherever it lies."""
    from gptforge.model_io import resolve_checkpoint_path

    p = resolve_checkpoint_path(path)
    if p.is_file():
        return _digest_files([p])
    files = sorted(f for f in p.iterdir() if f.is_file() and (
        f.suffix in (".safetensors", ".bin", ".pdparams") or f.name in ("config.yaml", "config.json")))
    return _digest_files(files)


def _batches_digest(batches: list[dict]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for b in batches:
        for k in sorted(b):
            h.update(k.encode())
            h.update(b[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def _load_models(cfg: Config, mode: str, qat_ckpt, float_ckpt, tokenizer, device, echo):
    """(fake-quant model to analyse, cfg, tokenizer, float model or None)."""
    from gptforge.compress.ptq import calibrate, calibration_batches
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.model_io import load_model, resolve_checkpoint_path
    from gptforge.transforms.quant import quantize_model, refuse_weight_only, validate_config

    main = resolve_checkpoint_path(qat_ckpt or float_ckpt)
    if mode == "ptq" and qat_ckpt is None:
        model, cfg = load_model(main, cfg, device=device, with_structure=False)
        q = dataclasses.replace(cfg.Compress.Quantization, enable=True, converted=False)
        validate_config(q, len(model.blocks))
        refuse_weight_only(q, "`analyze` (ptq mode)")
        tokenizer = tokenizer or load_tokenizer(cfg.Data.tokenizer, main if main.is_dir() else None)
        quantize_model(model, q)
        calibrate(model, calibration_batches(cfg, tokenizer, q.calib_batches), q.calib_algo)
        cfg = dataclasses.replace(cfg, Compress=dataclasses.replace(cfg.Compress, Quantization=q))
        _notice(f"ptq mode: {len(sens.quant_modules(model))} layers quantized as Compress.Quantization says "
                f"(w{q.weight_bits} {q.weight_quantize_type}, a{q.activation_bits} {q.activation_quantize_type}), "
                f"scales calibrated on {q.calib_batches} Train batches ({q.calib_algo})", echo)
        return model, cfg, tokenizer, None
    model, cfg = load_model(main, cfg, device=device)
    refuse_weight_only(cfg.Compress.Quantization, "`analyze` of a QAT model")
    tokenizer = tokenizer or load_tokenizer(cfg.Data.tokenizer, main if main.is_dir() else None)
    fmodel = None
    if float_ckpt is not None:
        fmodel, _ = load_model(float_ckpt, cfg, device=device, with_structure=False)
    return model, cfg, tokenizer, fmodel


def _build_metric(name: str, cfg: Config, tokenizer, model, fmodel, batches_n, device):
    """(Metric, its data fingerprint)."""
    from gptforge.evaluate.common import amp_dtype_for

    oe = cfg.Offline_Eval
    if name in ("acc", "ppl"):
        amp = amp_dtype_for(cfg, device)
        data = {"file": _digest_files([Path(oe.eval_path)]) if Path(oe.eval_path).is_file() else str(oe.eval_path),
                "batch_size": oe.batch_size, "max_seq_len": oe.max_seq_len}
        if name == "acc":
            return sens.lambada_metric(tokenizer, oe.eval_path, batch_size=oe.batch_size, seq_len=oe.max_seq_len,
                                       amp_dtype=amp), data
        data["overlapping_eval"] = oe.overlapping_eval
        data["detokenize"] = oe.detokenize
        return sens.wikitext_metric(tokenizer, oe.eval_path, seq_len=oe.max_seq_len, stride=oe.overlapping_eval,
                                    batch_size=oe.batch_size, amp_dtype=amp, detokenize=oe.detokenize), data
    if name == "loss":
        n = batches_n or cfg.Engine.eval_iters
        batches = split_batches(cfg, tokenizer, "Eval", n)
        return sens.loss_metric(batches, f"{n} Eval-split batches"), {"eval_batches": _batches_digest(batches)}
    n = batches_n or cfg.Compress.Quantization.calib_batches
    batches = split_batches(cfg, tokenizer, "Train", n)
    if fmodel is not None:
        ref = sens.reference_outputs(fmodel, batches)
    else:  # the analysed model with every quantizer off is the float model (qat: with the QAT weights)
        mods = list(sens.quant_modules(model).values())
        emb = [model.wte] if isinstance(model.wte, sens.QuantEmbedding) else []
        with sens.switched(mods + emb, on=False):
            ref = sens.reference_outputs(model, batches)
    return sens.distance_metric(batches, ref, name), {"calib_batches": _batches_digest(batches)}


def run_analysis(cfg: Config, *, qat_ckpt=None, float_ckpt=None, mode: str = "qat", metric: str = "auto",
                 out_dir: str | os.PathLike = "analysis_results", batches: int | None = None,
                 layers: list[str] | None = None, top_k: int | None = None, resume: bool = True,
                 plot: bool = True, tokenizer=None, progress: bool = True, echo: bool = True,
                 config_file: str | None = None) -> AnalysisRun:
    """Analyse, write `out_dir`/analysis.{txt,json,png} (+ skip_tensor_map.yaml with `top_k`)."""
    from gptforge.device import select_device

    if mode not in sens.MODES:
        raise UsageError(f"--mode {mode!r}: expected one of {', '.join(sens.MODES)}")
    if mode == "qat" and not qat_ckpt:
        raise UsageError("qat mode analyses a QAT model: give --qat-ckpt DIR (and --float-ckpt DIR for the "
                         "float baseline), or use --mode ptq --float-ckpt DIR")
    if mode == "ptq" and bool(qat_ckpt) == bool(float_ckpt):
        raise UsageError("ptq mode takes either --float-ckpt DIR (quantized and calibrated here) or --qat-ckpt DIR "
                         "(a PTQ/QAT model used as it is), not both")
    if top_k is not None and top_k < 1:
        raise UsageError(f"--top-k: must be >= 1, got {top_k}")
    name = resolve_metric(metric, cfg)
    device = select_device(cfg.Global.device)
    model, cfg, tokenizer, fmodel = _load_models(cfg, mode, qat_ckpt, float_ckpt, tokenizer, device, echo)
    notes = [n for n in [sens.embedding_note(model)] if n]
    if mode == "qat" and fmodel is None:
        pre = cfg.Compress.pretrained
        notes.append("no --float-ckpt: de-quantized layers keep their QAT weights (the reference restores the float "
                     "baseline's)" + (f"; the QAT run started from {pre}" if pre else ""))
    names = sens.analysis_layers(model, layers)
    m, data_fp = _build_metric(name, cfg, tokenizer, model, fmodel, batches, device)
    fingerprint = {"qat_ckpt": checkpoint_digest(qat_ckpt) if qat_ckpt else None,
                   "float_ckpt": checkpoint_digest(float_ckpt) if float_ckpt else None,
                   "data": data_fp,
                   "quant": dataclasses.asdict(cfg.Compress.Quantization) if mode == "ptq" and not qat_ckpt else None}
    out = Path(out_dir)
    state_path = out / rep.JSON_FILE
    state = sens.read_state(state_path, sens.full_fingerprint(fingerprint, mode, name, names)) if resume else None
    float_weights, float_value = None, None
    if fmodel is not None:
        float_weights = sens.float_linear_weights(model, fmodel, names, str(float_ckpt))
        if name in ("cosine", "kl"):
            float_value = 0.0
        elif state is not None and state.get("float_value") is not None:
            float_value = state["float_value"]
        else:
            _notice(f"evaluating the float baseline {float_ckpt} ({m.label})", echo)
            float_value = m(fmodel)
        del fmodel
    if state is not None:
        _notice(f"resuming {state_path}: {len(state.get('layers', {}))} of {len(names)} layers done", echo)
    analysis = sens.analyze(model, m, mode=mode, float_weights=float_weights, layers=names, float_value=float_value,
                            state_path=state_path, fingerprint=fingerprint, resume=resume, progress=progress)
    if mode == "ptq":
        analysis.float_value = analysis.base_value
    files = {"json": state_path, "txt": write_text_atomic(out / rep.TXT, "\n".join(rep.analysis_lines(analysis)) + "\n")}
    if plot:
        files["png"] = rep.plot_ranking(analysis, out / rep.PNG)
    run = AnalysisRun(analysis, out, files, rep.suggest_k(analysis), notes=notes)
    if top_k is not None:
        _skip_list(run, cfg, top_k, qat_ckpt, float_ckpt, config_file)
    return run


def _skip_list(run: AnalysisRun, cfg: Config, k: int, qat_ckpt, float_ckpt, config_file) -> None:
    from gptforge.model_io import resolve_checkpoint_path

    ranked = run.analysis.ranked()
    chosen = ranked[:k]
    if k > len(ranked):
        run.notes.append(f"--top-k {k}: only {len(ranked)} layers were analysed; all are listed")
    weak = [r.reference_name for r in chosen if r.sensitivity <= 0]
    if weak:
        run.notes.append(f"--top-k {k}: {', '.join(weak)} gain nothing from staying float (sensitivity <= 0)")
    base = cfg.Compress.Quantization.skip_tensor_map
    run.top_k = k
    run.skip_map = rep.skip_tensor_map([r.name for r in chosen], base)
    if base:
        run.notes.append(f"the analysed model's own skip_tensor_map {rep.flow_map(base)} is kept in the new map")
    run.files["skip_yaml"] = write_text_atomic(run.out_dir / rep.SKIP_YAML,
                                                   rep.skip_yaml(run.skip_map, chosen, run.analysis))
    run.override = rep.override_arg(run.skip_map)
    conf = config_file or (str(resolve_checkpoint_path(qat_ckpt) / "config.yaml") if qat_ckpt else None)
    start = float_ckpt or cfg.Compress.pretrained or "FLOAT_MODEL_DIR"
    run.qat_command = " ".join(
        ["gptforge qat", f"-c {conf}" if conf else "", f"-o Compress.pretrained={start}",
         f"-o Engine.save_load.output_dir={run.out_dir / f'qat_skip_top{k}'}", f"-o {run.override}"]).replace("  ", " ")
