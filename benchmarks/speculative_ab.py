"""Speculative vs plain greedy decoding, timed in whichever gptforge tree is first on PYTHONPATH,
on models made once by `benchmarks/speculative.py --work W` (the same weights for both trees).

Before/after comparisons of the decoding code (issue #30) run this file from one checkout with
`PYTHONPATH=<tree>/src`, alternating the trees. An older tree may not know config keys added
since: `--copy-for-old-tree DST` (run with the old tree on PYTHONPATH) copies W to DST and drops
the keys that tree rejects (they are at their defaults in these models), then time DST with it.

    PYTHONPATH=src python benchmarks/speculative.py --work /tmp/spec --target-steps 80 --draft-steps 30
    PYTHONPATH=src python benchmarks/speculative_ab.py /tmp/spec --write-prompts
    PYTHONPATH=/tmp/before/src python benchmarks/speculative_ab.py /tmp/spec --copy-for-old-tree /tmp/spec_b
    for tree in . /tmp/before . /tmp/before; do ... done   # W for ours, /tmp/spec_b for the old tree
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import time
from pathlib import Path

import torch


def _drafts(work: Path) -> dict[str, Path]:
    return {"int8": work / "int8", "dropped+distilled": Path((work / "distilled" / "done").read_text())}


def copy_for_old_tree(work: Path, dst: Path) -> None:
    import yaml

    from gptforge.errors import CheckpointError
    from gptforge.model_io import load_model

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(work, dst, symlinks=True)
    for f in (dst / "target" / "done", dst / "distilled" / "done"):
        f.write_text(f.read_text().replace(str(work), str(dst)))
    for d in [Path((dst / "target" / "done").read_text()), *_drafts(dst).values()]:
        for _ in range(100):
            try:
                load_model(d)
                break
            except CheckpointError as e:
                m = re.search(r": ([A-Za-z_.]+): unknown (key|section)", str(e))
                if not m:
                    raise
                cfg = yaml.safe_load((d / "config.yaml").read_text())
                *path, last = m.group(1).split(".")
                node = cfg
                for k in path:
                    node = node[k]
                node.pop(last)
                (d / "config.yaml").write_text(yaml.safe_dump(cfg))
                print(f"{d}: dropped {m.group(1)}")


def _spec(tm, d, p, cfg):
    from gptforge.generate import generate_ids

    try:
        out = generate_ids(tm, [p], cfg, draft=d)
        if hasattr(out, "speculative"):
            return out.tokens
    except TypeError:
        pass
    # trees before the one engine (00dcffe) ran speculative decoding through their own decoder
    from gptforge.generate.api import _search, special_ids
    from gptforge.generate.backend import TorchBackend
    from gptforge.generate.search import left_pad

    with TorchBackend(tm) as tb, TorchBackend(d) as db:
        e, pad = special_ids(cfg, None)
        return _search(tb, left_pad([p], pad), cfg, e, pad, None, (), db).run().tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write-prompts", action="store_true", help="write W/prompts.json (3 corpus prompts of 64)")
    ap.add_argument("--copy-for-old-tree", metavar="DST")
    args = ap.parse_args()
    work = Path(args.work)
    if args.copy_for_old_tree:
        copy_for_old_tree(work, Path(args.copy_for_old_tree))
        return 0
    if args.write_prompts:
        import speculative as S

        tok, _ = S.tokenizer(work)
        (work / "prompts.json").write_text(json.dumps(S.prompts_from_corpus(tok, 3, 64)))
        return 0
    torch.set_num_threads(args.threads)
    import gptforge
    from gptforge.config import GenerationConfig
    from gptforge.generate import generate_ids
    from gptforge.model_io import load_model

    prompts = json.loads((work / "prompts.json").read_text())
    tm, _ = load_model(Path((work / "target" / "done").read_text()))
    n = args.new_tokens
    cases = {"plain greedy": None}
    for name, p in _drafts(work).items():
        d = load_model(p)[0]
        for k in ("4", "auto"):
            cases[f"{name}, K={k}"] = (d, k)

    def run(how, p):
        if how is None:
            g = GenerationConfig(decode_strategy="greedy_search", max_dec_len=n, min_dec_len=n)
            return generate_ids(tm, [p], g).tokens
        g = GenerationConfig(decode_strategy="greedy_search", max_dec_len=n, min_dec_len=n, num_draft_tokens=how[1])
        return _spec(tm, how[0], p, g)

    want = [run(None, p) for p in prompts]
    times = {c: [] for c in cases}
    for _ in range(args.repeats):
        for c, how in cases.items():
            t = time.perf_counter()
            outs = [run(how, p) for p in prompts]
            times[c].append(time.perf_counter() - t)
            if any(not torch.equal(o, w) for o, w in zip(outs, want, strict=True)):
                print(f"WARNING {c}: output differs from plain greedy")
    tok = n * len(prompts)
    print(f"tree {Path(gptforge.__file__).parents[2]}, {torch.get_num_threads()} thread(s), "
          f"load average {os.getloadavg()[0]:.2f}")
    for c, ts in times.items():
        print(f"  {c:28s} {tok / statistics.median(ts):7.1f} tok/s (rounds {tok / max(ts):.1f}-{tok / min(ts):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
