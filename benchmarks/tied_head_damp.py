"""GPTQ's dampening for the tied embedding / LM head at 4 bits (`compress/gptq.HEAD_DAMP`).

The tied weight is read twice: as the LM head (GPTQ's Hessian, from the final norm's outputs,
sees this use) and as the input embedding (a lookup: every element of a row's error reaches the
residual stream unweighted). With the block Linears float and only the head rounded (int4, the
given group size, symmetric), for each dampening λ (a fraction of mean diag H) of `--damps` and
for round-to-nearest, the held-out KL(float || model) in nats per token:
  - tied: the rounded weight in both uses (what a quantized model does);
  - input use: the rounded weight as the embedding, the float one as the head;
  - output use: the float weight as the embedding, the rounded one as the head;
and the tied KL on the calibration windows themselves (which H was computed from).

Works on a `benchmarks/mixed_precision.py` work directory (its trained float model, tokenizer and
held-out text); the calibration is what `gptforge quantize --method gptq` uses by default (the
built-in corpus's first documents, `--samples` windows of `--seq` tokens).

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/tied_head_damp.py --work W --ckpt W/float_6000/step_6000
"""

from __future__ import annotations

import argparse
import os
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from mixed_precision import kl_to as kl  # noqa: E402  (benchmarks/ is on sys.path)
from qat_quality import cpu_flags, cpu_name, tokenizer  # noqa: E402


def untied(ckpt: Path, emb: torch.Tensor, head: torch.Tensor):
    """The float model at `ckpt` with `emb` as its input embedding and `head` as its LM head."""
    from gptforge.model_io import load_model

    m, _ = load_model(ckpt)
    m.wte.weight.data.copy_(emb)
    m.logits = types.MethodType(lambda self, h: F.linear(h, head), m)
    return m


def main() -> None:
    from gptforge.compress.gptq import gptq_quantize
    from gptforge.compress.weight_only_run import calibration_ids
    from gptforge.model_io import load_model
    from gptforge.transforms import lowbit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="a mixed_precision.py work directory (tokenizer, heldout.txt)")
    ap.add_argument("--ckpt", required=True, help="its float model")
    ap.add_argument("--damps", default="0.01,0.1,0.3,0.5,1,3,10")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work, ckpt = Path(args.work), Path(args.ckpt)
    tok, _ = tokenizer(work)
    ref, _ = load_model(ckpt)
    ids = torch.tensor(tok.encode((work / "heldout.txt").read_text(encoding="utf-8")))
    heldout = ids[: len(ids) // args.seq * args.seq].view(-1, args.seq)
    calib = torch.cat(calibration_ids(tok, None, args.samples, args.seq))
    w = ref.wte.weight.detach().float().clone()
    H = torch.zeros(w.shape[1], w.shape[1], dtype=torch.float64)
    with torch.no_grad():
        for b in calib.split(16):
            h = ref.hidden_states(b).reshape(-1, w.shape[1]).double()
            H += 2 * h.T @ h
    H = (H / calib.numel()).float()
    print(f"cpu {cpu_name()} ({cpu_flags()}), torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load {os.getloadavg()[0]:.1f}; head {tuple(w.shape)}, int4 g{args.group_size} sym; "
          f"held-out {heldout.numel()} tokens, calibration {calib.numel()}")
    print("| rounding | tied (held-out) | input use | output use | tied (calibration) |")
    print("|---|---:|---:|---:|---:|")
    g = args.group_size
    cases = [(f"GPTQ λ={d:g}", d) for d in map(float, args.damps.split(","))] + [("round to nearest", None)]
    for name, damp in cases:
        if damp is None:
            wq = lowbit.fake_quantize(w, 4, g, True)
        else:
            wq = lowbit.dequantize(*gptq_quantize(w, H, 4, g, True, damp=damp), g)
        vals = (kl(ref, untied(ckpt, wq, wq), heldout), kl(ref, untied(ckpt, wq, w), heldout),
                kl(ref, untied(ckpt, w, wq), heldout), kl(ref, untied(ckpt, wq, wq), calib))
        print(f"| {name} | " + " | ".join(f"{v:.5f}" for v in vals) + " |", flush=True)


if __name__ == "__main__":
    main()
