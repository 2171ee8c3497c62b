"""How cheap can a batched decode step be on this machine? The floor under `gptforge serve`'s
inter-token latency.

For the GPT-2 124M shape (random weights), in one run:
- our ragged step (`RaggedSlots.step`, what `serve` runs) with R sequences decoding one token
  each (R = 1, 4, 16), and with 16 decoding plus one new prompt's 32-token chunk, every sequence
  at 64 tokens of context; median (min-max) of `--steps` steps;
- the peer: the same step's matrix products alone (12 blocks x qkv, out, fc1, fc2 and the LM
  head over the rows that need logits) as plain `torch.mm` (MKL), median of as many rounds;
- the FLOP floor: the step's matrix-product FLOPs at the best rate `torch.mm` reaches on this
  machine (a 2048^3 product, the most it gets out of these cores).

    python benchmarks/decode_roofline.py --threads 2

A step can only beat its matrix products by being smarter about them, and never its FLOP floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def timed(fn, steps: int) -> list[float]:
    fn()
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from gptforge.config import load_config
    from gptforge.generate.backend import TorchBackend, prefill_chunks
    from gptforge.generate.slots import RaggedSlots, Segment
    from gptforge.model import build_model
    from gptforge.train.metrics import device_name

    cfg = load_config(overrides=["Model.preset=124M"])
    torch.manual_seed(0)
    model = build_model(cfg.Model).eval()
    m = cfg.Model
    h, ffn, vocab, layers = m.hidden_size, m.ffn_hidden_size or 4 * m.hidden_size, m.vocab_size, m.num_layers
    g = torch.Generator().manual_seed(0)
    ctx = 64

    with torch.inference_mode(), TorchBackend(model) as backend:
        slots = RaggedSlots(backend)
        seqs = []
        for _ in range(17):
            slot = slots.new_slot(256)
            prompt = torch.randint(0, vocab, (ctx,), generator=g).tolist()
            for a, b in prefill_chunks(ctx):
                slots.step([Segment(slot, prompt[a:b], a, b == ctx)])
            seqs.append(slot)
        new_prompt = torch.randint(0, vocab, (32,), generator=g).tolist()

        def step(rows: int, chunk: bool):
            segs = [Segment(s, [1], ctx, True) for s in seqs[:rows]]
            if chunk:
                seqs[16].truncate(0)  # a new request: its prompt's first chunk
                segs.append(Segment(seqs[16], new_prompt, 0, True))
            slots.step(segs)
            for s in seqs:
                s.truncate(ctx)  # every step sees the same context

        cases = [(1, False), (4, False), (16, False), (16, True)]
        ours = {c: timed(lambda c=c: step(*c), args.steps) for c in cases}

        def mm_step(rows: int, head_rows: int):
            xs = {k: torch.randn(rows, k) for k in (h, ffn)}
            ws = [torch.randn(h, 3 * h), torch.randn(h, h), torch.randn(h, ffn), torch.randn(ffn, h)]
            hx, head = torch.randn(head_rows, h), torch.randn(h, vocab)

            def run():
                for _ in range(layers):
                    for w in ws:
                        torch.mm(xs[w.shape[0]], w)
                torch.mm(hx, head)
            return run

        peer = {c: timed(mm_step(c[0] + (32 if c[1] else 0), c[0] + (1 if c[1] else 0)), args.steps) for c in cases}
        big = torch.randn(2048, 2048)
        best = 2 * 2048 ** 3 / min(timed(lambda: torch.mm(big, big), 10))

    def flops(c) -> float:
        rows = c[0] + (32 if c[1] else 0)
        head_rows = c[0] + (1 if c[1] else 0)
        return 2.0 * rows * layers * (3 * h * h + h * h + 2 * h * ffn) + 2.0 * head_rows * h * vocab

    base = statistics.median(ours[(1, False)])
    print(f"Machine: {device_name(torch.device('cpu'))}, ISA {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, {args.threads} thread(s). "
          f"Load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    print(f"Command: `python benchmarks/decode_roofline.py --threads {args.threads} --steps {args.steps}`. "
          f"Best torch.mm rate (2048^3): {best / 1e9:.0f} GFLOP/s.\n")
    print("| step | rows through the Linears | ours ms (min-max) | / batch-1 step | torch.mm matmuls only ms "
          "(min-max) | FLOP floor ms | floor / batch-1 step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in cases:
        o, p = ours[c], peer[c]
        name = f"{c[0]} decoding" + (" + a 32-token prompt chunk" if c[1] else "")
        floor = flops(c) / best
        print(f"| {name} | {c[0] + (32 if c[1] else 0)} | {statistics.median(o) * 1e3:.1f} ({min(o) * 1e3:.1f}-"
              f"{max(o) * 1e3:.1f}) | {statistics.median(o) / base:.2f}x | {statistics.median(p) * 1e3:.1f} "
              f"({min(p) * 1e3:.1f}-{max(p) * 1e3:.1f}) | {floor * 1e3:.1f} | {floor / base:.2f}x |")


if __name__ == "__main__":
    main()
