"""Held-out bits per byte of weight-only low-bit models (issue #32's first acceptance line).

On the built-in corpus (this Python's standard library, byte-level BPE of 4096 tokens learned
from it; `qat_quality.py`'s tokenizer and training recipe), in one run:
  1. pretrain a small float GPT for `--steps` steps on the Train split;
  2. quantize it with `gptforge quantize --weights ...` (in-process, the command's own code):
     int8 per-row RTN, int4 g64 RTN, int4 g64 GPTQ (calibration: `--samples` windows of the
     built-in corpus's first documents, which are Train documents), the embedding / head at
     8 bits in each (plus int4 g64 with the head at 4 bits, RTN and GPTQ, and int4 g64 AWQ);
  3. score every model with `gptforge eval` (WikiText method, no cloze) on the same held-out
     text: the Eval-split documents of the corpus, which no step trains on.
Goal: int4 g64 GPTQ's increase in bits per byte over float <= 50% of RTN's.

    .venv/bin/python benchmarks/lowbit_quality.py [--work runs/bench_lowbit] [--steps 400] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from gptforge.config import load_config  # noqa: E402
from qat_quality import cpu_name, overrides, run_dir, tokenizer  # noqa: E402  (benchmarks/ is on sys.path)

VARIANTS = {  # name: quantize flags (None: the float model)
    "float": None,
    "int8 RTN (per row)": ["--weights", "int8"],
    "int4 g64 RTN": ["--weights", "int4", "--group-size", "64"],
    "int4 g64 GPTQ": ["--weights", "int4", "--group-size", "64", "--method", "gptq"],
    "int4 g64 RTN, head int4": ["--weights", "int4", "--group-size", "64", "--head-bits", "4"],
    "int4 g64 GPTQ, head int4": ["--weights", "int4", "--group-size", "64", "--method", "gptq", "--head-bits", "4"],
    "int4 g64 AWQ": ["--weights", "int4", "--group-size", "64", "--method", "awq"],
}


def cli(*argv) -> None:
    from gptforge.cli import main

    code = main([str(a) for a in argv])
    if code:
        raise SystemExit(f"gptforge {' '.join(map(str, argv[:3]))} ... exited {code}")


def heldout_text(work: Path, tok, cfg, chars: int = 40_000) -> Path:
    """Whole Eval-split documents until at least `chars` characters (a smaller text gets its own
    file, so that a quick check never shortens the benchmark's)."""
    from gptforge.data.corpus import builtin_token_files
    from gptforge.demo.heldout import eval_documents

    path = work / ("heldout.txt" if chars == 40_000 else f"heldout_{chars}.txt")
    if not path.is_file():
        docs = eval_documents(builtin_token_files(tok), tok, cfg.Data.Eval.dataset.split)
        text, n = "", 0
        for d in docs:
            if len(text) >= chars:
                break
            text, n = text + d + "\n\n", n + 1
        path.write_text(text, encoding="utf-8")
    return path


def train(work: Path, tok, tok_dir: Path, args, shape: tuple[str, ...] = (), tag: str = "",
          echo: bool = False) -> tuple[Path, object]:
    """The float run of `--steps` steps (reused when `work` holds it); `shape`: Model overrides
    after the default SHAPE, `tag`: its name in the run directory (float_{tag}{steps})."""
    from gptforge.train import pretrain

    out = work / f"float_{tag}{args.steps}"
    cfg = load_config(overrides=[*overrides(tok_dir, args, out, args.steps, 2e-3, 2e-4, 0.02), *shape])
    if run_dir(out, args.steps) is None:
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        pretrain(cfg, tokenizer=tok, progress=False, echo=echo)
        print(f"float: {args.steps} steps in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return run_dir(out, args.steps), cfg


def score(ckpt: Path, text: Path, out: Path, seq: int) -> dict:
    cli("eval", "--ckpt", ckpt, "-o", f"Offline_Eval.eval_path={text}", "-o", "Offline_Eval.cloze_eval=False",
        "-o", f"Offline_Eval.max_seq_len={seq}", "-o", f"Offline_Eval.overlapping_eval={seq // 2}",
        "-o", "Offline_Eval.batch_size=16", "--no-progress", "--output", out)
    return json.loads(out.read_text())["metrics"]


def setup(args, chars: int = 40_000):
    """Threads and seed, then `args.work`'s tokenizer, float model (trained when missing) and
    held-out text: (work, tok, tok_dir, ckpt, cfg, text)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok, tok_dir = tokenizer(work)
    ckpt, cfg = train(work, tok, tok_dir, args)
    return work, tok, tok_dir, ckpt, cfg, heldout_text(work, tok, cfg, chars)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench_lowbit")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--samples", type=int, default=64, help="GPTQ / AWQ calibration windows")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", help="write the results (JSON) here too")
    args = ap.parse_args()
    work, tok, tok_dir, ckpt, cfg, text = setup(args)
    rows = {}
    for name, flags in VARIANTS.items():
        path = ckpt
        t0 = time.perf_counter()
        if flags is not None:
            path = work / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
            cli("quantize", "--ckpt", ckpt, "--out", path, "--force", *flags, "--samples", args.samples,
                "--seq-len", args.seq, "--no-progress")
        secs = time.perf_counter() - t0
        m = score(path, text, work / f"{path.name}_eval.json", args.seq)
        size = (path / "model.safetensors").stat().st_size
        rows[name] = {"bits_per_byte": m["bits_per_byte"], "ppl": m["ppl"], "bytes": size, "quantize_s": secs}
        print(f"{name:28} bpb {m['bits_per_byte']:.4f}  ppl {m['ppl']:.3f}  {size / 2**20:.2f} MiB  "
              f"({secs:.0f}s)", flush=True)
    f = rows["float"]["bits_per_byte"]
    rtn, gptq = rows["int4 g64 RTN"]["bits_per_byte"] - f, rows["int4 g64 GPTQ"]["bits_per_byte"] - f
    ratio = gptq / rtn if rtn > 0 else float("nan")
    verdict = ("not assessable: RTN costs nothing measurable on this model (train it longer)" if rtn <= 0
               else "met" if ratio <= 0.5 else "not met")
    print(f"int4 g64: RTN {rtn:+.4f} bpb, GPTQ {gptq:+.4f} bpb over float: GPTQ/RTN = {ratio:.2f} "
          f"(goal <= 0.50: {verdict})")
    rec = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(), "steps": args.steps, "batch": args.batch, "seq": args.seq,
           "samples": args.samples, "heldout_chars": len(text.read_text()), "rows": rows, "gptq_over_rtn": ratio}
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")


if __name__ == "__main__":
    main()
