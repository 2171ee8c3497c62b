"""Held-out bits per byte of sensitivity-chosen mixed 4/8-bit weights vs uniform int4 (issue #32:
mixed precision at 4.5 average bits <= 50% of uniform int4 GPTQ's increase at equal or fewer bytes).

On the built-in corpus, `lowbit_quality.py`'s model (its tokenizer, training recipe and
held-out text: Eval-split documents no step trains on), or with `--shape wide` a model whose
block Linears are most of the weights as on real GPTs (hidden 256, 6 layers, FFN 1024: the
tied 4096 x 256 head is 18% of the planned weights; GPT-2 124M's is 31%), in one run:
  1. train (or reuse, when `--work` holds it) the float GPT for `--steps` steps;
  2. `gptforge analyze --weights int4 --group-size 64 --method gptq`: each block Linear's and the
     head's increase in KL to the float model at 4 and 8 bits on `--samples` calibration windows;
  3. `gptforge quantize` (in-process, the command's own code): uniform int4 g64 RTN and GPTQ with
     every layer at 4 bits (head too), int4 g64 GPTQ with the default 8-bit head, int4 g32 GPTQ
     with every layer at 4 bits (the uniform model of exactly the mixed 4.5-bit model's bytes: its
     finer groups' scales cost the same 0.5 bit per weight), and mixed GPTQ plans from the
     analysis: `--avg-bits 4.5`, `--avg-bits 5`, and `--max-bytes` equal to the default int4
     GPTQ model's bytes;
  4. score every model with `gptforge eval` (WikiText method) on the same held-out text.
Each variant's bits per planned weight are read from its weight_only.json: own (what --avg-bits
counts) and stored (with the group scales); bytes are model.safetensors' tensors (--max-bytes).
`--out` is rewritten after every variant, so a stopped run keeps what it measured.

    .venv/bin/python benchmarks/mixed_precision.py [--work runs/bench_lowbit] [--steps 1000] [--shape wide]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from lowbit_quality import cli, heldout_text, score, train  # noqa: E402  (benchmarks/ is on sys.path)
from qat_quality import cpu_flags, cpu_name, tokenizer  # noqa: E402

G64 = ["--weights", "int4", "--group-size", "64"]
SHAPES = {"small": (),  # qat_quality.SHAPE: hidden 128, 4 layers, FFN 512
          "wide": ("Model.hidden_size=256", "Model.num_layers=6", "Model.num_attention_heads=4",
                   "Model.ffn_hidden_size=1024")}
MIXED = "mixed GPTQ --avg-bits 4.5"
WHOLE = "mixed GPTQ --avg-bits 4.5, head whole"  # the plan as before head rows: an analysis without the ladder
REFS = ("uniform int4 g64 GPTQ (head int4)", "int4 g64 GPTQ, head int8 (default)", "uniform int4 g32 GPTQ (head int4)")


def variants(default_bytes: int | None, sens: Path) -> dict[str, list[str] | None]:
    plan = [*G64, "--method", "gptq", "--sensitivity", str(sens)]
    out = {"float": None,
           "uniform int4 g64 GPTQ (head int4)": [*G64, "--method", "gptq", "--head-bits", "4"],
           "int4 g64 GPTQ, head int8 (default)": [*G64, "--method", "gptq"],
           MIXED: [*plan, "--avg-bits", "4.5"],
           "uniform int4 g32 GPTQ (head int4)": ["--weights", "int4", "--group-size", "32", "--method", "gptq",
                                                 "--head-bits", "4"],
           "uniform int4 g64 RTN (head int4)": [*G64, "--head-bits", "4"],
           "mixed GPTQ --avg-bits 5": [*plan, "--avg-bits", "5"],
           WHOLE: [*G64, "--method", "gptq", "--sensitivity", str(whole_head(sens)), "--avg-bits", "4.5"]}
    if default_bytes is not None:
        out["mixed GPTQ --max-bytes = default's"] = [*plan, "--max-bytes", str(default_bytes)]
    return out


def whole_head(sens: Path) -> Path:
    """A copy of the analysis without the head-row ladder: plans from it treat the head as one layer."""
    out = sens.with_name("analysis_head_whole.json")
    if sens.is_file():
        state = json.loads(sens.read_text())
        state.pop("head_rows", None)
        out.write_text(json.dumps(state))
    return out


def tensor_bytes(path: Path) -> int:
    """model.safetensors less its header (8 bytes of length + the JSON): the tensors' bytes, what
    `--max-bytes` counts."""
    f = path / "model.safetensors"
    with open(f, "rb") as fh:
        header = int.from_bytes(fh.read(8), "little")
    return f.stat().st_size - 8 - header


def shape_of(args) -> tuple[tuple[str, ...], str]:
    """(Model overrides, run-directory tag) of --shape / --vocab; the small default has no tag,
    so its old run directories are reused."""
    shape = (*SHAPES[args.shape], *((f"Model.vocab_size={args.vocab}",) if args.vocab != 4096 else ()))
    return shape, ("" if not shape else f"{args.shape}_v{args.vocab}_")


def analysis_summary(path: Path, float_params: int) -> dict:
    """Where the measured 4-bit cost lies: the head's and the block Linears' shares of the
    weights and of the summed increase, and the layers by decreasing increase at 4 bits."""
    state = json.loads(path.read_text())
    params = {r["name"]: r["params"] for r in state["weights"]["rows"]}
    inc = {n: (r["sensitivity"], r.get("sensitivity8")) for n, r in state["layers"].items()}
    blocks = [n for n in inc if n != "wte"]
    planned = sum(params.values())
    return {"metric": state.get("metric"), "planned_params": planned, "float_params": float_params,
            "head_share_of_planned": params["wte"] / planned,
            "blocks_share_of_planned": sum(params[n] for n in blocks) / planned,
            "blocks_share_of_all": sum(params[n] for n in blocks) / float_params,
            "head_increase4": inc["wte"][0], "blocks_increase4": sum(inc[n][0] for n in blocks),
            "head_rows_ladder": (state.get("head_rows") or {}).get("ladder"),
            "layers": sorted(([n, params[n], *inc[n]] for n in inc), key=lambda r: -r[2])}


@torch.no_grad()
def heldout_kl(ckpt: Path, path: Path, text: Path, seq: int, tok) -> float:
    """KL(float || variant) of the next-token distributions, nats per token, over the held-out text
    in windows of `seq` tokens: the variant's damage alone, without the held-out loss's noise
    (a rounded model can score below float by chance; its KL is never negative)."""
    from gptforge.model_io import load_model

    ids = torch.tensor(tok.encode(text.read_text(encoding="utf-8")))
    return kl_to(load_model(ckpt)[0], load_model(path)[0], ids[: len(ids) // seq * seq].view(-1, seq))


@torch.no_grad()
def kl_to(ref, model, windows: torch.Tensor) -> float:
    """KL(ref || model) of the next-token distributions, nats per token, over `windows` [n, seq]."""
    total = 0.0
    for w in windows.split(16):
        lp, lq = (torch.log_softmax(m(w).logits.double(), -1) for m in (ref, model))
        total += float((lp.exp() * (lp - lq)).sum(-1).sum())
    return total / windows.numel()


def measure(name: str, flags, ckpt: Path, work: Path, text: Path, args, calib: Path | None = None) -> dict:
    """Quantize (unless float), score on the held-out text and read the bit counts of one variant
    (calibrated on `calib`, else on the built-in corpus's first documents)."""
    path, t0 = ckpt, time.perf_counter()
    if flags is not None:
        clip = ["--clip-search"] if args.clip_search else []
        path = work / ("mixed_" + "".join(c if c.isalnum() else "_" for c in name) + (f"_{calib.stem}" if calib else "")
                       + ("_clip" if clip else ""))
        cli("quantize", "--ckpt", ckpt, "--out", path, "--force", *flags, *clip, "--samples", args.samples,
            "--seq-len", args.seq, "--no-progress", *(("--calib", calib) if calib else ()))
    secs = time.perf_counter() - t0
    chars = "" if args.heldout_chars == 40_000 else f"_{args.heldout_chars}"  # the earlier runs' files: 40,000
    out = work / f"{path.name}_eval{chars}.json"
    if flags is not None:  # quantized again just now: its old score is stale (the float model's is not)
        out.unlink(missing_ok=True)
    m = json.loads(out.read_text())["metrics"] if out.is_file() else score(path, text, out, args.seq)
    spec_file, plan_file = path / "weight_only.json", path / "quant_plan.json"
    spec = json.loads(spec_file.read_text()) if spec_file.is_file() else {}
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    bits = spec.get("layer_bits") or {}
    return {"bits_per_byte": m["bits_per_byte"], "ppl": m["ppl"], "tensor_bytes": tensor_bytes(path),
            "heldout_kl": heldout_kl(ckpt, path, text, args.seq, args.tok) if flags is not None else 0.0,
            "file_bytes": (path / "model.safetensors").stat().st_size, "quantize_s": secs,
            "avg_bits": spec.get("avg_bits", 32.0), "stored_bits": spec.get("stored_bits", 32.0),
            "head_bits": bits.get("wte", spec.get("head_bits", 32)),
            "layers_at_8": sorted(n for n, b in bits.items() if b == 8) if bits else None,
            "head_rows8": len(spec.get("head_rows8") or []),
            "predicted_kl": plan["predicted_increase"] if plan else None}


def verdicts(rows: dict) -> dict:
    """The acceptance line against each uniform reference: the mixed 4.5-bit model's increase
    over the reference's, and whether it has equal or fewer tensor bytes."""
    f = rows["float"]["bits_per_byte"]
    out = {}
    for ref in REFS:
        if MIXED not in rows or ref not in rows:
            continue
        im, ir = rows[MIXED]["bits_per_byte"] - f, rows[ref]["bits_per_byte"] - f
        ratio = im / ir if ir > 0 else float("nan")
        fewer = rows[MIXED]["tensor_bytes"] <= rows[ref]["tensor_bytes"]
        out[ref] = {"ratio": ratio, "mixed_bytes_le": fewer, "met": bool(ir > 0 and ratio <= 0.5 and fewer)}
        print(f"{MIXED} vs {ref}: increase {im:+.4f} / {ir:+.4f} = {ratio:.2f}, bytes {rows[MIXED]['tensor_bytes']} "
              f"{'<=' if fewer else '>'} {rows[ref]['tensor_bytes']}: {'met' if out[ref]['met'] else 'not met'}")
    return out


def calibration_files(work: Path, tok, cfg, sets: int, samples: int, seq: int) -> list[Path]:
    """`sets - 1` calibration texts beside the default one (the corpus's first documents): runs of
    Train-split documents starting at 1/sets, 2/sets, ... of that range (disjoint from each other,
    from the default set, and from the held-out Eval documents), each ~1.5x the tokens needed."""
    from gptforge.data.corpus import builtin_token_files
    from gptforge.demo.heldout import split_documents

    out = []
    for i in range(1, sets):
        path = work / f"calib_{i}of{sets}.txt"
        if not path.is_file():
            docs = split_documents(builtin_token_files(tok), tok, cfg.Data.Train.dataset.split, 0, first=i / sets,
                                   chars=6 * samples * (seq + 1))  # ~4 characters per token here, with room
            path.write_text("\n\n".join(docs), encoding="utf-8")
        out.append(path)
    return out


def spread_verdicts(per_set: list[dict], float_bpb: float) -> dict:
    """The acceptance line on the means over calibration sets: each GPTQ variant's mean increase
    (and its min / max over the sets); the mixed model against each reference's mean."""
    names = [n for n in (MIXED, WHOLE, *REFS) if all(n in r for r in per_set)]
    inc = {n: [r[n]["bits_per_byte"] - float_bpb for r in per_set] for n in names}
    kls = {n: [r[n].get("heldout_kl") for r in per_set] for n in names}
    out = {"sets": len(per_set), "increase": {n: {"mean": sum(v) / len(v), "min": min(v), "max": max(v), "each": v}
                                              for n, v in inc.items()}, "verdicts": {},
           "heldout_kl": {n: {"mean": sum(v) / len(v), "each": v} for n, v in kls.items() if None not in v}}
    for ref in REFS:
        if MIXED not in inc or ref not in inc:
            continue
        im, ir = out["increase"][MIXED]["mean"], out["increase"][ref]["mean"]
        fewer = per_set[0][MIXED]["tensor_bytes"] <= per_set[0][ref]["tensor_bytes"]
        out["verdicts"][ref] = {"ratio_of_means": im / ir if ir > 0 else float("nan"), "mixed_bytes_le": fewer,
                                "met": bool(ir > 0 and im / ir <= 0.5 and fewer)}
        print(f"over {len(per_set)} calibration sets: {MIXED} mean increase {im:+.4f} vs {ref} {ir:+.4f}: "
              f"{'met' if out['verdicts'][ref]['met'] else 'not met'}")
    return out


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench_lowbit")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small", help="small: lowbit_quality.py's model "
                    "(the head 40%% of the planned weights); wide: hidden 256, 6 layers (the head 18%%)")
    ap.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary learned on the corpus (default 4096)")
    ap.add_argument("--samples", type=int, default=512, help="calibration windows of --seq tokens (analysis and "
                    "GPTQ; 64 left GPTQ short of text, results/2026-11-28-mixed-precision-calibration.md)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="where the float model and the fine-tunes train (cpu, cuda); quantize / eval run where the CLI puts them")
    ap.add_argument("--log", action="store_true", help="print the training run's log lines")
    ap.add_argument("--calib-sets", type=int, default=1, help="repeat the mixed model and the uniform GPTQ references "
                    "with this many disjoint calibration texts (the default one first) and judge on the means")
    ap.add_argument("--clip-search", action="store_true", help="the analysis and every quantized variant on "
                    "clip-searched group grids (quantize --clip-search)")
    ap.add_argument("--heldout-chars", type=int, default=40_000, help="held-out text: whole Eval-split documents up "
                    "to this many characters (400000: ten times steadier than the default's 40,000)")
    ap.add_argument("--out", help="write the results (JSON) here too, after every variant")
    args = ap.parse_args()
    if args.calib_sets < 1:
        ap.error(f"--calib-sets: at least 1 (the default calibration text), got {args.calib_sets}")
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load0 = os.getloadavg()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok, tok_dir = tokenizer(work, args.vocab)
    args.tok = tok
    shape, tag = shape_of(args)
    t0 = time.perf_counter()
    ckpt, cfg = train(work, tok, tok_dir, args, shape, tag, echo=args.log)
    train_s = time.perf_counter() - t0
    text = heldout_text(work, tok, cfg, args.heldout_chars)
    sens = work / f"mixed_{tag}analysis{'_clip' if args.clip_search else ''}"
    t0 = time.perf_counter()
    if not (sens / "analysis.json").is_file() or not json.loads((sens / "analysis.json").read_text()).get("complete"):
        print(f"analysis starts, load average {os.getloadavg()[0]:.1f}", flush=True)
    cli("analyze", "--ckpt", ckpt, "--group-size", "64", "--weights", "int4", "--method", "gptq", "--samples",
        args.samples, "--seq-len", args.seq, "--out", sens, "--no-progress", "--show", "8",
        *(["--clip-search"] if args.clip_search else []))
    analysis_s = time.perf_counter() - t0
    rec = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "load_start": load0, "steps": args.steps, "shape": args.shape,
           "model_overrides": list(shape), "vocab": args.vocab, "samples": args.samples, "seq": args.seq,
           "heldout_chars": len(text.read_text()), "train_s": train_s, "analysis_s": analysis_s, "rows": {}}
    rows = rec["rows"]
    todo = variants(None, sens / "analysis.json")
    while todo:
        name, flags = next(iter(todo.items()))
        todo.pop(name)
        rows[name] = r = measure(name, flags, ckpt, work, text, args)
        print(f"{name:38} bpb {r['bits_per_byte']:.4f}  KL {r['heldout_kl']:.5f}  ppl {r['ppl']:.3f}  {r['tensor_bytes']} B  bits "
              f"{r['avg_bits']:.3f} own / {r['stored_bits']:.3f} stored"
              + (f", 8-bit: {', '.join(r['layers_at_8'])}" if r["layers_at_8"] else "")
              + (f", head rows at 8: {r['head_rows8']}" if r["head_rows8"] else "")
              + f"  ({r['quantize_s']:.0f}s, load {os.getloadavg()[0]:.1f})", flush=True)
        if name == "float":
            rec["analysis"] = analysis_summary(sens / "analysis.json", r["tensor_bytes"] // 4)
        if name.startswith("int4 g64 GPTQ, head int8"):
            rec["default_int4_bytes"] = r["tensor_bytes"]
            todo.update({k: v for k, v in variants(r["tensor_bytes"], sens / "analysis.json").items()
                         if k not in rows and k not in todo})
        rec["increase"] = {k: v["bits_per_byte"] - rows["float"]["bits_per_byte"] for k, v in rows.items()}
        rec["load_end"] = os.getloadavg()
        if args.out:
            Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")
    rec["verdicts"] = verdicts(rows)
    if args.calib_sets > 1:
        per_set = [rows]
        for calib in calibration_files(work, tok, cfg, args.calib_sets, args.samples, args.seq):
            extra = {}
            for name in (MIXED, WHOLE, *REFS):
                flags = variants(rec["default_int4_bytes"], sens / "analysis.json")[name]
                extra[name] = r = measure(name, flags, ckpt, work, text, args, calib=calib)
                print(f"{name:38} {calib.name}: bpb {r['bits_per_byte']:.4f} KL {r['heldout_kl']:.5f} ({r['quantize_s']:.0f}s, "
                      f"load {os.getloadavg()[0]:.1f})", flush=True)
            per_set.append(extra)
        rec["calibration_sets"] = spread_verdicts(per_set, rows["float"]["bits_per_byte"])
        rec["calibration_sets"]["rows"] = per_set[1:]
    a = rec["analysis"]
    print(f"block Linears {100 * a['blocks_share_of_all']:.1f}% of the weights ({100 * a['blocks_share_of_planned']:.1f}% "
          f"of the planned ones); summed 4-bit increase: head {a['head_increase4']:.4g}, blocks {a['blocks_increase4']:.4g}")
    print(f"cpu {cpu_name()} ({cpu_flags()}), torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {load0[0]:.1f} at start, {rec['load_end'][0]:.1f} at end; train {train_s:.0f}s, "
          f"analysis {analysis_s:.0f}s")
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")


if __name__ == "__main__":
    main()
