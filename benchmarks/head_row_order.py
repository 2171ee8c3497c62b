"""Which of the tied head's rows to keep at 8 bits: each ranking's cost on held-out text (issue #32).

`gptforge analyze --weights int4` ranks the head's rows for the mixed plans (compress/head_rows.py)
and measures a ladder: the KL with its top k rows at 8 bits and the rest at 4. This benchmark asks
how well a ranking carries to text it was not made on. On `lowbit_quality.py`'s model (trained,
or reused from `--work`, for `--steps` steps on the built-in corpus), the head rounded by GPTQ at 4
and at 8 bits (the Hessian of the `--samples` calibration windows, as `analyze` does), every other
layer float; for each ranking and k, KL(float || model) in nats per token on the held-out text
(Eval-split documents no step trains on) and on the calibration windows themselves:

- `fisher N`: the second-order estimate of each row's gain from 8 bits (`fisher_row_scores`) on the
  first N calibration windows (N = `--samples`: the ranking `analyze` used before the counts);
- `counts`: the calibration text's token counts over its first `head_rows.COUNT_TOKENS` tokens,
  ties by `fisher --samples` (what `analyze` ranks by now).

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/head_row_order.py --work runs/bench_lowbit --steps 6000
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from lowbit_quality import setup  # noqa: E402  (benchmarks/ is on sys.path)
from mixed_precision import kl_to  # noqa: E402
from qat_quality import cpu_flags, cpu_name  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench_lowbit")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--samples", type=int, default=64, help="calibration windows (GPTQ's Hessian, the Fisher ranking)")
    ap.add_argument("--fisher-windows", type=int, nargs="+", default=[512], help="more windows for fisher N rankings")
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 1536, 2048], help="k: head rows at 8 bits")
    ap.add_argument("--heldout-chars", type=int, default=400_000)
    ap.add_argument("--kl-windows", type=int, default=400, help="held-out windows of --seq tokens scored")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--log", action="store_true")
    ap.add_argument("--out", help="write the results (JSON) here too")
    args = ap.parse_args()
    from gptforge.compress import head_rows
    from gptforge.compress import sensitivity_weights as sw
    from gptforge.compress.gptq import damp_for
    from gptforge.compress.weight_only_run import calibration_ids, calibration_tokens, load_float_model
    from gptforge.transforms.weight_only import WeightOnlySpec

    load0 = os.getloadavg()
    _, _, _, ckpt, _, text = setup(args, args.heldout_chars)
    model, _, tok, _ = load_float_model(ckpt)
    ref = load_float_model(ckpt)[0]
    model.eval()
    seq = args.seq + 1
    tokens = calibration_tokens(tok, None, max(max(args.fisher_windows) * seq, head_rows.COUNT_TOKENS))
    windows = calibration_ids(tok, None, max(args.samples, *args.fisher_windows), seq, tokens=tokens)
    calib = sw.calibration_batches(windows[: args.samples])
    with torch.no_grad():
        H = sw.hessians(model, [sw.HEAD], calib)[sw.HEAD]
    w = model.wte.weight.detach().float().clone()
    spec = WeightOnlySpec(bits=4, group_size=64, sym=True, method="gptq")
    w4, w8 = (sw.rounded_weight(w, b, spec, H, damp_for(sw.HEAD, 0.01)) for b in (4, 8))
    ids = torch.tensor(tok.encode(text.read_text(encoding="utf-8")))
    held = ids[: len(ids) // args.seq * args.seq].view(-1, args.seq)[: args.kl_windows]
    own = torch.cat(windows[: args.samples])[:, :-1]

    orders, secs = {}, {}
    for n in sorted({args.samples, *args.fisher_windows}):
        t0 = time.perf_counter()
        orders[f"fisher {n}"] = head_rows.row_order(model, sw.calibration_batches(windows[:n]), w, w4, w8)
        secs[f"fisher {n}"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    counts = head_rows.token_counts(tokens, len(w))
    orders["counts"] = head_rows.row_order(model, calib, w, w4, w8, counts)
    secs["counts"] = time.perf_counter() - t0

    def kl_with(order: torch.Tensor, k: int) -> tuple[float, float]:
        hot = torch.zeros(len(w), dtype=torch.bool)
        hot[order[:k]] = True
        with torch.no_grad():
            model.wte.weight.copy_(torch.where(hot.unsqueeze(1), w8, w4))
            out = kl_to(ref, model, held), kl_to(ref, model, own)
            model.wte.weight.copy_(w)
        return out

    rec = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "torch": torch.__version__, "steps": args.steps,
           "samples": args.samples, "count_tokens": int(counts.sum()), "heldout_windows": len(held),
           "load_start": load0, "rankings": {}}
    print("| ranking | seconds | " + " | ".join(f"{k} rows: held-out KL (calibration KL)" for k in args.rows) + " |")
    print("|---|---:|" + "---:|" * len(args.rows))
    for name, order in orders.items():
        res = {k: kl_with(order, k) for k in args.rows}
        rec["rankings"][name] = {"seconds": secs[name], "kl": {str(k): v for k, v in res.items()}}
        print(f"| {name} | {secs[name]:.1f} | " + " | ".join(f"{a:.5f} ({b:.5f})" for a, b in res.values()) + " |",
              flush=True)
    whole = kl_with(torch.arange(len(w)), 0)
    rec["head_4bit"] = whole
    rec["load_end"] = os.getloadavg()
    print(f"every row at 4 bits: {whole[0]:.5f} ({whole[1]:.5f}); counts over {int(counts.sum())} tokens; "
          f"cpu {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, load {load0[0]:.1f} -> "
          f"{rec['load_end'][0]:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")


if __name__ == "__main__":
    main()
