"""Held-out bits per byte of sensitivity-chosen mixed 4/8-bit weights vs uniform int4 (issue #32:
mixed precision at 4.5 average bits <= 50% of uniform int4 GPTQ's increase at equal or fewer bytes).

On the built-in corpus, `lowbit_quality.py`'s model (its tokenizer, training recipe and
held-out text: Eval-split documents no step trains on), in one run:
  1. train (or reuse, when `--work` holds it) the float GPT for `--steps` steps;
  2. `gptforge analyze --weights int4 --group-size 64 --method gptq`: each block Linear's and the
     head's increase in KL to the float model at 4 and 8 bits on `--samples` calibration windows;
  3. `gptforge quantize` (in-process, the command's own code): uniform int4 g64 RTN and GPTQ with
     every layer at 4 bits (head too), int4 g64 GPTQ with the default 8-bit head, and mixed GPTQ
     plans from the analysis: `--avg-bits 4.5`, `--avg-bits 5`, and `--max-bytes` equal to the
     default int4 GPTQ model's bytes;
  4. score every model with `gptforge eval` (WikiText method) on the same held-out text.

    .venv/bin/python benchmarks/mixed_precision.py [--work runs/bench_lowbit] [--steps 1000] [--out FILE]
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


def variants(default_bytes: int | None, sens: Path) -> dict[str, list[str] | None]:
    plan = [*G64, "--method", "gptq", "--sensitivity", str(sens)]
    out = {"float": None,
           "uniform int4 g64 RTN (head int4)": [*G64, "--head-bits", "4"],
           "uniform int4 g64 GPTQ (head int4)": [*G64, "--method", "gptq", "--head-bits", "4"],
           "int4 g64 GPTQ, head int8 (default)": [*G64, "--method", "gptq"],
           "mixed GPTQ --avg-bits 4.5": [*plan, "--avg-bits", "4.5"],
           "mixed GPTQ --avg-bits 5": [*plan, "--avg-bits", "5"]}
    if default_bytes is not None:
        out["mixed GPTQ --max-bytes = default's"] = [*plan, "--max-bytes", str(default_bytes)]
    return out


def tensor_bytes(path: Path) -> int:
    """model.safetensors less its header (8 bytes of length + the JSON): the tensors' bytes, what
    `--max-bytes` counts."""
    f = path / "model.safetensors"
    with open(f, "rb") as fh:
        header = int.from_bytes(fh.read(8), "little")
    return f.stat().st_size - 8 - header


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench_lowbit")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--samples", type=int, default=64, help="calibration windows (analysis and GPTQ)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", help="write the results (JSON) here too")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load0 = os.getloadavg()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok, tok_dir = tokenizer(work)
    ckpt, cfg = train(work, tok, tok_dir, args)
    text = heldout_text(work, tok, cfg)
    calib = ["--samples", args.samples, "--seq-len", args.seq]
    t0 = time.perf_counter()
    cli("analyze", "--ckpt", ckpt, *G64[2:], "--weights", "int4", "--method", "gptq", *calib,
        "--out", work / "mixed_analysis", "--no-progress", "--show", "5")
    analysis_s = time.perf_counter() - t0
    rows: dict[str, dict] = {}
    default_bytes = None
    todo = variants(None, work / "mixed_analysis" / "analysis.json")
    while todo:
        name, flags = next(iter(todo.items()))
        todo.pop(name)
        path, t0 = ckpt, time.perf_counter()
        if flags is not None:
            path = work / ("mixed_" + "".join(c if c.isalnum() else "_" for c in name))
            cli("quantize", "--ckpt", ckpt, "--out", path, "--force", *flags, *calib, "--no-progress")
        secs = time.perf_counter() - t0
        m = score(path, text, work / f"{path.name}_eval.json", args.seq)
        size = tensor_bytes(path)
        plan = json.loads((path / "quant_plan.json").read_text()) if (path / "quant_plan.json").is_file() else None
        rows[name] = {"bits_per_byte": m["bits_per_byte"], "ppl": m["ppl"], "tensor_bytes": size,
                      "file_bytes": (path / "model.safetensors").stat().st_size, "quantize_s": secs,
                      "avg_bits": plan["avg_bits"] if plan else None,
                      "layers_at_8": sorted(n for n, b in plan["layer_bits"].items() if b == 8) if plan else None,
                      "predicted_kl": plan["predicted_increase"] if plan else None}
        print(f"{name:38} bpb {m['bits_per_byte']:.4f}  ppl {m['ppl']:.3f}  {size} B"
              + (f"  avg bits {plan['avg_bits']:.3f}, 8-bit: {', '.join(rows[name]['layers_at_8'])}" if plan else "")
              + f"  ({secs:.0f}s)", flush=True)
        if name.startswith("int4 g64 GPTQ, head int8"):
            default_bytes = size
            todo.update({k: v for k, v in variants(size, work / "mixed_analysis" / "analysis.json").items()
                         if k not in rows and k not in todo})
    f = rows["float"]["bits_per_byte"]
    inc = {k: r["bits_per_byte"] - f for k, r in rows.items()}
    mixed = "mixed GPTQ --avg-bits 4.5"
    verdicts = {}
    for ref in ("uniform int4 g64 GPTQ (head int4)", "int4 g64 GPTQ, head int8 (default)"):
        ratio = inc[mixed] / inc[ref] if inc[ref] > 0 else float("nan")
        fewer = rows[mixed]["tensor_bytes"] <= rows[ref]["tensor_bytes"]
        verdicts[ref] = {"ratio": ratio, "mixed_bytes_le": fewer,
                         "met": bool(inc[ref] > 0 and ratio <= 0.5 and fewer)}
        print(f"{mixed} vs {ref}: increase {inc[mixed]:+.4f} / {inc[ref]:+.4f} = {ratio:.2f}, bytes "
              f"{rows[mixed]['tensor_bytes']} {'<=' if fewer else '>'} {rows[ref]['tensor_bytes']}: "
              f"{'met' if verdicts[ref]['met'] else 'not met'}")
    load1 = os.getloadavg()
    print(f"cpu {cpu_name()} ({cpu_flags()}), torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end; analysis {analysis_s:.0f}s")
    rec = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "load_start": load0, "load_end": load1, "steps": args.steps,
           "samples": args.samples, "seq": args.seq, "heldout_chars": len(text.read_text()), "analysis_s": analysis_s,
           "rows": rows, "increase": inc, "verdicts": verdicts, "default_int4_bytes": default_bytes}
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")


if __name__ == "__main__":
    main()
