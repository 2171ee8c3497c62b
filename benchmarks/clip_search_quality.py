"""Clip-searched group grids (`quantize --clip-search`) vs abs-max grids, for round-to-nearest and
GPTQ, on held-out bits per byte (issue #32's quality lines).

`lowbit_quality.py`'s set-up, imported: the float model it trains on the built-in corpus
(`--steps`, reused from `--work`), held-out text of whole Eval-split documents (`--heldout-chars`,
400,000 by default: on 40,000 the text's chance moves a model's 4-bit loss by as much as the
differences measured here), `gptforge eval`'s WikiText scoring. For each head width in
`--head-bits`: `gptforge quantize --weights int4 --group-size 64` by RTN and by GPTQ (`--samples`
calibration windows of the built-in corpus), each with and without `--clip-search`.

GPTQ's share of RTN's increase moves with the calibration text by as much as the differences
measured (0.40-0.66 of RTN's over five texts of 512 windows on one model), so every GPTQ variant also runs
on `--calib-sets` texts in all (`mixed_precision.calibration_files`: the default one, then
`quantize --calib` runs of Train-split documents from 1/sets, 2/sets, ... of that range on); its row
is their mean, with the range.

    .venv/bin/python benchmarks/clip_search_quality.py [--work runs/bench_lowbit] [--steps 1000] [--head-bits 8 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from lowbit_quality import cli, score, setup  # noqa: E402  (benchmarks/ is on sys.path)
from mixed_precision import calibration_files  # noqa: E402
from qat_quality import cpu_flags, cpu_name  # noqa: E402


def variants(head_bits: int) -> dict[str, list[str]]:
    base = ["--weights", "int4", "--group-size", "64", "--head-bits", str(head_bits)]
    return {f"{m.upper()}{' + clip search' if c else ''}, head {head_bits}":
            [*base, "--method", m, *(["--clip-search"] if c else [])] for m in ("rtn", "gptq") for c in (False, True)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench_lowbit", help="shared with lowbit_quality.py (its float model)")
    ap.add_argument("--steps", type=int, default=1000, help="float pretraining steps (lowbit_quality.py's)")
    ap.add_argument("--head-bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--samples", type=int, default=512, help="GPTQ calibration windows (512 x 128: a quarter of "
                    "the GPTQ paper's 128 x 2048 tokens)")
    ap.add_argument("--calib-sets", type=int, default=5, help="GPTQ variants: this many calibration texts, the "
                    "default one first")
    ap.add_argument("--heldout-chars", type=int, default=400_000)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", help="write the results (JSON) here too")
    args = ap.parse_args(argv)
    work, tok, _, ckpt, cfg, text = setup(args, args.heldout_chars)
    sub = work / f"clip_p{args.steps}"
    sub.mkdir(exist_ok=True)
    calibs = [None, *calibration_files(work, tok, cfg, args.calib_sets, args.samples, args.seq)]

    def scored(tag: str, path: Path) -> float:
        out = sub / f"{tag}_eval_{args.heldout_chars}.json"
        m = json.loads(out.read_text())["metrics"] if out.is_file() else score(path, text, out, args.seq)
        return m["bits_per_byte"]

    f = scored("float", ckpt)
    rows = {"float": {"bits_per_byte": f, "increase": 0.0}}
    print(f"{'float':34} bpb {f:.5f}", flush=True)
    for hb in args.head_bits:
        for name, flags in variants(hb).items():
            gptq = "--method gptq" in " ".join(flags)
            incs, secs = [], []
            for calib in calibs if gptq else calibs[:1]:
                tag = name.replace(" ", "_").replace(",", "").replace("+", "and")
                tag += f"_s{args.samples}" + (f"_{Path(calib).stem}" if calib else "") if gptq else ""
                path = sub / tag
                t0 = time.perf_counter()
                if not (path / "weight_only.json").is_file():
                    cli("quantize", "--ckpt", ckpt, "--out", path, "--force", *flags, "--samples", args.samples,
                        "--seq-len", args.seq, *(["--calib", calib] if calib else []), "--no-progress")
                incs.append(scored(tag, path) - f)
                secs.append(time.perf_counter() - t0)
            inc = sum(incs) / len(incs)
            rows[name] = {"bits_per_byte": f + inc, "increase": inc, "increases": incs, "quantize_s": secs}
            spread = f" (mean of {len(incs)} calibration texts, {min(incs):+.5f} ... {max(incs):+.5f})" if gptq else ""
            print(f"{name:34} bpb {f + inc:.5f}  {inc:+.5f} over float{spread}", flush=True)
        inc = {k: r["increase"] for k, r in rows.items() if k.endswith(f"head {hb}")}
        rtn = inc[f"RTN, head {hb}"]
        for k, r in rows.items():
            if k.endswith(f"head {hb}") and rtn > 0:
                r["share_of_rtn"] = [x / rtn for x in r["increases"]]
        print(f"head {hb}: increase / RTN's: " + ", ".join(
            f"{k.split(',')[0]} {v / rtn:.2f}" + (f" ({min(rows[k]['share_of_rtn']):.2f}-{max(rows[k]['share_of_rtn']):.2f})"
                                                  if len(rows[k]["increases"]) > 1 else "") for k, v in inc.items())
              if rtn > 0 else f"head {hb}: RTN costs nothing measurable here")
    print(f"\nmachine: {cpu_name()} ({cpu_flags()}), {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}; held-out {len(text.read_text())} chars")
    rec = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args),
           "heldout_chars": len(text.read_text()), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")
    return rec


if __name__ == "__main__":
    main()
