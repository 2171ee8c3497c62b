"""Choose the demo's model for its budget: a sweep of shape, tokenizer size and learning rate.

Each point trains the float model the way `gptforge demo` does (the demo's own `calibrate` and
`write_configs`, the real `gptforge pretrain` verb) for the demo's pretraining share of the
budget, then scores the held-out text in **bits per byte** (tokenizer-independent: Σ NLL / ln 2 /
UTF-8 bytes; windows of `seq` tokens with stride `seq / 2`, every token after the first scored
once) and samples a few prompts. `xz -9` on the same text is the bar a model must beat.

Data are prepared once per tokenizer size (`--prepare`): the BPE tokenizer, the token files and
the held-out text cut from the Eval documents, exactly as the demo's stages 1-2 do.

    python benchmarks/demo_sweep.py --data sweepdata --prepare 1024 2048 4096
    python benchmarks/demo_sweep.py --data sweepdata --out sweep --point base --seconds 324
    python benchmarks/demo_sweep.py --data sweepdata --out sweep --all --parallel 7 --cores-per-point 2

`--all` runs every point of GRID at once, each pinned to its own cores (`taskset`), with
`--busy` (or a name `NAME:busy`) adding a process that spins on each of the same cores (the "another process busy" condition).
Each point writes `<out>/<name>/result.json`; `--table` prints them as Markdown.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# name: (hidden, layers, heads, ffn, seq, batch, vocab, max_lr)
GRID: dict[str, tuple] = {
    "base": (128, 4, 4, 512, 128, 8, 4096, 2e-3),      # the demo before this sweep
    "b16_lr3": (128, 4, 4, 512, 128, 16, 4096, 3e-3),
    "v2k_h128": (128, 4, 4, 512, 128, 16, 2048, 3e-3),
    "v1k_h128": (128, 4, 4, 512, 128, 16, 1024, 3e-3),
    "v2k_h96": (96, 3, 3, 384, 128, 16, 2048, 4e-3),
    "v2k_h64": (64, 4, 4, 256, 128, 32, 2048, 5e-3),
    "v2k_l2": (128, 2, 4, 512, 128, 16, 2048, 3e-3),
    "h192_l3": (192, 3, 3, 768, 128, 8, 4096, 2e-3),
    # round 2: around the round-1 winner (2 layers: more tokens in the budget)
    "l2_b32": (128, 2, 4, 512, 128, 32, 2048, 4e-3),
    "l2_lr5": (128, 2, 4, 512, 128, 16, 2048, 5e-3),
    "l2_v4k": (128, 2, 4, 512, 128, 16, 4096, 4e-3),
    "l2_v4k_b32": (128, 2, 4, 512, 128, 32, 4096, 4e-3),
    "l3": (128, 3, 4, 512, 128, 16, 2048, 4e-3),
    "l2_h192": (192, 2, 4, 768, 128, 16, 2048, 3e-3),
    # round 3 (quiet AVX-512 machine): a higher learning rate for the 2-layer winner
    "l2_lr6": (128, 2, 4, 512, 128, 16, 2048, 6e-3),
    "l2_lr10": (128, 2, 4, 512, 128, 16, 2048, 1e-2),
    # round 4 (fixed step counts, two points at a time on one thread each): the schedule's end,
    # AdamW's beta2 and the context length for the 2-layer winner
    "l2_d2z": (128, 2, 4, 512, 128, 16, 2048, 3e-3, {"min_lr": 0.0, "beta2": 0.95}),
    "l2_s256": (128, 2, 4, 512, 256, 8, 2048, 3e-3),
    "l2_s256_d2z": (128, 2, 4, 512, 256, 8, 2048, 3e-3, {"min_lr": 0.0, "beta2": 0.95}),
    "l2_b95": (128, 2, 4, 512, 128, 16, 2048, 3e-3, {"beta2": 0.95}),
    "l2_lr2": (128, 2, 4, 512, 128, 16, 2048, 2e-3),
    # smaller models for the busy machine's budget (~40% of the quiet steps)
    "l2_h96": (96, 2, 3, 384, 128, 16, 2048, 4e-3),
    "l2_f256": (128, 2, 4, 256, 128, 16, 2048, 3e-3),
    "l2_h64": (64, 2, 2, 256, 128, 16, 2048, 5e-3),
    # round 6 (the quiet budget, equal time at 2 threads): a larger tokenizer, a wider or deeper
    # model, twice the batch
    "l2_v4k_lr3": (128, 2, 4, 512, 128, 16, 4096, 3e-3),
    "l2_v3k": (128, 2, 4, 512, 128, 16, 3072, 3e-3),
    "l2_h160": (160, 2, 5, 640, 128, 16, 2048, 3e-3),
    "l3_lr3": (128, 3, 4, 512, 128, 16, 2048, 3e-3),
    "l2_b32_lr4": (128, 2, 4, 512, 128, 32, 2048, 4e-3),
    "h160_v4k": (160, 2, 5, 640, 128, 16, 4096, 3e-3),
    "h192_v4k": (192, 2, 6, 768, 128, 16, 4096, 3e-3),
    # round 7 (a busy machine's budget) with the larger tokenizer
    "h96_v4k": (96, 2, 3, 384, 128, 16, 4096, 4e-3),
    "h128_v4k_busy": (128, 2, 4, 512, 128, 16, 4096, 3e-3),
    # round 9: Muon (torch.optim.Muon, AdamW-matched lr) on the blocks' matrices, both budgets
    "h160_v4k_muon": (160, 2, 5, 640, 128, 16, 4096, 3e-3, {"optimizer": "Muon"}),
    "h128_v4k_muon": (128, 2, 4, 512, 128, 16, 4096, 3e-3, {"optimizer": "Muon"}),
    "h160_v4k_muon_lr15": (160, 2, 5, 640, 128, 16, 4096, 1.5e-3, {"optimizer": "Muon"}),
    "h192_v4k_muon": (192, 2, 6, 768, 128, 16, 4096, 3e-3, {"optimizer": "Muon"}),
    "h160_v4k_muon_d2z": (160, 2, 5, 640, 128, 16, 4096, 3e-3, {"optimizer": "Muon", "min_lr": 0.0}),
    "h160_v4k_muon_wd1": (160, 2, 5, 640, 128, 16, 4096, 3e-3, {"optimizer": "Muon", "weight_decay": 0.1}),
}


@dataclass
class Point:
    name: str
    hidden: int
    layers: int
    heads: int
    ffn: int
    seq: int
    batch: int
    vocab: int
    max_lr: float
    extra: dict = field(default_factory=dict)  # other Settings fields: min_lr (default max_lr / 10), beta2,
    # optimizer and weight_decay (default FusedAdamW and 0.01, as the rounds ran unless a point says
    # otherwise; the demo's own defaults are Muon and 0.1 since round 9)


def point(name: str) -> Point:
    """`NAME` or `NAME:busy` (the same point, run beside processes spinning on its cores)."""
    base = name.split(":")[0]
    return Point(name.replace(":", "@"), *GRID[base])


def prepare(data: Path, vocab: int) -> None:
    """Stages 1-2 of the demo for one tokenizer size, into `data/v<vocab>`."""
    from gptforge import cli
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.demo.heldout import write_heldout
    from gptforge.demo.plan import SPLIT

    d = data / f"v{vocab}"
    d.mkdir(parents=True, exist_ok=True)
    for argv in (["tokenizer", "train", "--builtin", "--vocab-size", str(vocab), "--out", str(d / "tokenizer"),
                  "--force", "--no-progress"],
                 ["preprocess", "--builtin", "--tokenizer", str(d / "tokenizer"), "--output-prefix",
                  str(d / "data" / "builtin"), "--no-progress"]):
        if cli.main(argv) != 0:
            raise SystemExit(f"failed: gptforge {' '.join(argv)}")
    write_heldout(d / "data" / "builtin", load_tokenizer(str(d / "tokenizer")), SPLIT, d / "data",
                  max_chars=40_000, cloze_examples=200)


def bits_per_byte(model, tok, text: str, seq: int, stride: int | None = None) -> tuple[float, int]:
    """Σ NLL (bits) of `text` under `model` / its UTF-8 bytes; windows of `seq`, stride `seq // 2`
    unless given."""
    import torch

    ids = tok.encode(text)
    stride = stride or seq // 2
    total, scored, start = 0.0, 0, 0
    with torch.inference_mode():
        while True:
            win = ids[start:start + seq + 1]
            first = 0 if start == 0 else seq - stride  # positions already scored by the previous window
            x = torch.tensor(win[:-1])[None]
            y = torch.tensor(win[1:])[None]
            logp = torch.log_softmax(model(x).logits.float(), dim=-1)[0]
            nll = -logp.gather(-1, y[0][:, None])[:, 0]
            total += float(nll[first:].sum())
            scored += len(nll) - first
            if start + seq + 1 >= len(ids):
                break
            start += stride
    assert scored == len(ids) - 1, (scored, len(ids))
    return total / math.log(2) / len(text.encode("utf-8")), len(ids)


def run_point(pt: Point, data: Path, out: Path, seconds: float, device: str, steps: int | None = None,
              fit: bool = False) -> dict:
    """Train one point for `seconds` of pretraining (steps from a measured step), or for `steps`,
    and score it. `fit`: as the demo does, stop at `seconds` with the run's length and lr decay
    re-fitted to it as measured (`Engine.fit_to_max_time`)."""
    import torch

    from gptforge import cli
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.demo.plan import PRETRAIN_SHARE, Paths, Settings, Shape, calibrate, write_configs
    from gptforge.model_io import load_model

    d = out / pt.name
    d.mkdir(parents=True, exist_ok=True)
    src = data / f"v{pt.vocab}"
    s = Settings(out=str(d), minutes=seconds / 60 / PRETRAIN_SHARE, vocab_size=pt.vocab, device=device,
                 shape=Shape(pt.hidden, pt.layers, pt.heads, pt.ffn, pt.seq, pt.batch), max_lr=pt.max_lr,
                 **{"min_lr": pt.max_lr / 10, "optimizer": "FusedAdamW", "weight_decay": 0.01, **pt.extra})
    p = Paths(d)
    for link, target in ((p.tokenizer, src / "tokenizer"), (p.data, src / "data")):
        if not link.exists():
            link.symlink_to(target.resolve())
    st = calibrate(s, adapt_shape=False)  # the point's shape, whatever its budget
    steps = steps or max(20, int(seconds / st.step_seconds))
    st.pretrain = steps
    cfg = write_configs(s, p, st)["pretrain"]
    t0 = time.perf_counter()
    limit = ["-o", f"Engine.max_time={seconds:.0f}", "-o", "Engine.fit_to_max_time=true"] if fit else []
    code = cli.main(["pretrain", "-c", str(cfg), "--no-progress", "--force", *limit])
    train_s = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"{pt.name}: pretrain exited {code}")
    last = max((x for x in p.float.iterdir() if x.name.startswith("step_")), key=lambda x: int(x.name[5:]))
    steps = int(last.name[5:])
    model, _ = load_model(str(last))
    tok = load_tokenizer(str(src / "tokenizer"))
    text = (src / "data" / "heldout.txt").read_text(encoding="utf-8")
    torch.manual_seed(0)
    bpb, n_tok = bits_per_byte(model, tok, text, pt.seq)
    xz = len(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME)) * 8 / len(text.encode("utf-8"))
    samples = sample(model, tok, pt.seq)
    res = {"point": asdict(pt), "steps": steps, "calibrated_step_s": st.step_seconds, "train_seconds": train_s,
           "tokens_seen": steps * pt.batch * pt.seq, "params": sum(q.numel() for q in model.parameters()),
           "heldout_bytes": len(text.encode("utf-8")), "heldout_tokens": n_tok, "bpb": bpb, "xz9_bpb": xz,
           "samples": samples, "cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "affinity": sorted(os.sched_getaffinity(0)), "load_end": os.getloadavg()}
    (d / "result.json").write_text(json.dumps(res, indent=1))
    return res


def sample(model, tok, seq: int) -> list[dict]:
    import torch

    out = []
    g = torch.Generator().manual_seed(1)
    for prompt in ("def ", "import ", "class Parser", "Return the", "The following"):
        ids = tok.encode(prompt)
        with torch.inference_mode():
            for _ in range(48):
                logits = model(torch.tensor(ids[-seq:])[None]).logits[0, -1].float() / 0.8
                top = torch.topk(logits, 40)
                probs = torch.softmax(top.values, -1)
                ids.append(int(top.indices[torch.multinomial(probs, 1, generator=g)]))
        out.append({"prompt": prompt, "text": tok.decode(ids)})
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
                isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f" {f}" in flags]
                return f"{line.split(':', 1)[1].strip()} ({', '.join(isa)})"
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_all(args) -> None:
    names = args.names or list(GRID)
    procs = []
    ncpu = os.cpu_count() or 2
    for i, name in enumerate(names):
        cores = [(i * args.cores_per_point + k) % ncpu for k in range(args.cores_per_point)]
        mask = ",".join(map(str, cores))
        env = dict(os.environ, OMP_NUM_THREADS=str(args.cores_per_point))
        cmd = ["taskset", "-c", mask, sys.executable, __file__, "--data", str(args.data), "--out", str(args.out),
               "--point", name, "--seconds", str(args.seconds), "--device", args.device]
        if args.steps:
            cmd += ["--steps", str(args.steps)]
        if args.fit:
            cmd += ["--fit"]
        log = open(Path(args.out) / f"{name.replace(':', '@')}.log", "w")  # noqa: SIM115 (held by the child until it exits)
        procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)))
        if args.busy or name.endswith(":busy"):
            spin = "import time\nwhile True: pass"
            for c in cores:
                procs.append((f"busy{c}", subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", spin])))
    for name, pr in procs:
        if not name.startswith("busy"):
            pr.wait()
            print(f"{name}: exit {pr.returncode}", flush=True)
    for name, pr in procs:
        if name.startswith("busy"):
            pr.kill()


def table(out: Path) -> str:
    rows = []
    for f in sorted(out.glob("*/result.json")):
        r = json.loads(f.read_text())
        q = r["point"]
        rows.append((r["bpb"], f"| {q['name']} | {q['hidden']}x{q['layers']} h{q['heads']} ffn{q['ffn']} | "
                     f"{q['seq']}x{q['batch']} | {q['vocab']} | {q['max_lr']:g} | {r['params'] / 1e6:.2f}M | "
                     f"{r['steps']} | {r['tokens_seen'] / 1e6:.2f}M | {r['train_seconds']:.0f} | "
                     f"**{r['bpb']:.3f}** | {r['xz9_bpb']:.3f} |"))
    head = ("| point | shape | seq x batch | vocab | max lr | params | steps | tokens | train s | bits/byte | xz -9 |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head] + [r for _, r in sorted(rows)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--prepare", type=int, nargs="*")
    ap.add_argument("--point")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--names", nargs="*")
    ap.add_argument("--seconds", type=float, default=324.0,
                    help="pretraining seconds (the sweeps of 2026-11-24 used 324: 45%% of the demo's 12 min)")
    ap.add_argument("--steps", type=int, help="train this many steps instead of --seconds' worth (round 4)")
    ap.add_argument("--fit", action="store_true",
                    help="train --seconds as the demo does: Engine.max_time with Engine.fit_to_max_time (round 8)")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--cores-per-point", type=int, default=2)
    ap.add_argument("--busy", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    for v in args.prepare or []:
        prepare(args.data, v)
    if args.point:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        print(json.dumps(run_point(point(args.point), args.data, args.out, args.seconds, args.device,
                                          args.steps, args.fit), indent=1))
    if args.all:
        args.out.mkdir(parents=True, exist_ok=True)
        run_all(args)
    if args.table:
        print(table(args.out))


if __name__ == "__main__":
    main()
