"""Speculative decoding with drafts made by gptforge's own stages, vs plain greedy and vs
`transformers` assisted generation (`assistant_model=`) with the same target/draft pair.

In one run, on the built-in corpus (this Python's standard library, byte-level BPE of 8192
tokens learned from it):
  1. pretrain a target (hidden 384, 6 layers, 6 heads, vocabulary 8192: 14M parameters, 56 MB
     of fp32 weights, far beyond the L3 cache) for a CPU budget of `--target-steps` steps;
  2. derive drafts: INT8 (`gptforge ptq` + `quantize --convert`: self-speculation), pruned
     (`gptforge prune`, 50 % of heads and FFN, a short fine-tune), and layers dropped (the first
     and last blocks kept) + a short distillation from the target (`Engine.distill`), and that
     distilled draft made INT8 as well (its blocks; then its LM head too);
  3. greedy batch 1, prompts of 64 tokens from the corpus, 64 new tokens (EOS suppressed):
     tokens/s of plain greedy and of speculative decoding with each draft (K fixed and auto),
     acceptance rates; every output must equal plain greedy's;
  4. the peer: `transformers` greedy and assisted generation with the HF exports
     (`gptforge export --format hf`) of the target and of the float drafts (the INT8 draft has
     no HF form; the pruned draft's HF export is padded back to full width);
  5. the target's fp32 weight-streaming limit (weight bytes / bandwidth of a 256 MB fp32 GEMV,
     as benchmarks/decode_speed.py) and each result as a fraction of it.

Timings: `--repeats` interleaved rounds (every decoder once per round); each figure is the
median round with the rounds' min-max beside it (the machine may be shared: the load average is
printed). A ratio whose spreads overlap is not a measured difference.

    .venv/bin/python benchmarks/speculative.py [--work runs/bench_spec] [--target-steps 80]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from decode_speed import gemv_bandwidth  # noqa: E402
from gptforge.cli import main as cli  # noqa: E402
from gptforge.config import load_config  # noqa: E402
from gptforge.config.schema import GenerationConfig  # noqa: E402
from gptforge.generate import generate_ids  # noqa: E402
from gptforge.model_io import load_model, save_model_dir  # noqa: E402

# GPT-2 small's width/depth ratio at a size a shared 2-core CPU trains in minutes; its 56 MB of
# fp32 weights are far larger than the L3 cache, so batch-1 decoding streams them from memory.
SHAPE = ["Model.hidden_size=384", "Model.num_layers=6", "Model.num_attention_heads=6", "Model.ffn_hidden_size=1536",
         "Model.vocab_size=8192", "Model.max_position_embeddings=512"]
LAYERS = 6
SEQ, BATCH = 64, 8


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in have)
    except OSError:
        pass
    return ""


def _ok(*argv) -> None:
    code = cli([str(a) for a in argv])
    if code:
        raise SystemExit(f"gptforge {' '.join(map(str, argv))}: exit {code}")


def tokenizer(work: Path):
    from gptforge.data.corpus import builtin_documents
    from gptforge.data.tokenizer import load_tokenizer, train_tokenizer

    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        tok = train_tokenizer(builtin_documents(), vocab_size=8192, show_progress=False)
        tok.save(tok_dir)
    return load_tokenizer(str(tok_dir)), tok_dir


def data_overrides(tok_dir: Path) -> list[str]:
    return ["Global.device=cpu", f"Global.global_batch_size={BATCH}", f"Global.micro_batch_size={BATCH}",
            "Engine.mix_precision.enable=False", "Engine.eval_freq=0", "Engine.logging_freq=10",
            "Engine.save_load.save_steps=-1", f"Data.tokenizer={tok_dir}",
            *(f"Data.{s}.dataset.{k}" for s in ("Train", "Eval") for k in ("input_dir=builtin", f"max_seq_len={SEQ}")),
            "Data.Train.loader.num_workers=0", "Data.Eval.loader.num_workers=0",
            "Model.hidden_dropout_prob=0", "Model.attention_probs_dropout_prob=0"]


def train(out: Path, tok, overrides: list[str], steps: int, lr: float = 2e-3) -> Path:
    from gptforge.train import pretrain

    if (out / "done").is_file():
        return Path((out / "done").read_text())
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(overrides=[*overrides, f"Engine.max_steps={steps}", f"Engine.save_load.output_dir={out}",
                                 f"Optimizer.lr.max_lr={lr}", f"Optimizer.lr.min_lr={lr / 10}",
                                 "Optimizer.lr.warmup_rate=0.05", f"Optimizer.lr.decay_steps={steps}"])
    t0 = time.perf_counter()
    r = pretrain(cfg, tokenizer=tok, progress=False, echo=False)
    print(f"{out.name}: {steps} steps in {time.perf_counter() - t0:.0f}s, last loss {r.losses[-1]:.3f}",
          file=sys.stderr)
    (out / "done").write_text(str(r.checkpoint_dir))
    return r.checkpoint_dir


def drop_layers(src: Path, keep: list[int], out: Path, tok) -> Path:
    """A model of the blocks `keep` of `src` (embeddings and final norm shared)."""
    from gptforge.model import build_model

    model, cfg = load_model(src)
    cfg.Model.num_layers = len(keep)
    small = build_model(cfg.Model)
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("blocks.")}
    for new, old in enumerate(keep):
        sd.update({f"blocks.{new}.{k}": v for k, v in model.blocks[old].state_dict().items()})
    small.load_state_dict(sd)
    save_model_dir(small, cfg, out, tokenizer=tok)
    return out


def prompts_from_corpus(tok, n: int, length: int) -> list[list[int]]:
    from gptforge.data.corpus import builtin_documents

    docs = list(builtin_documents())
    out = []
    for text in docs[-200:]:
        ids = tok.encode(text)
        if len(ids) >= length + 1:
            out.append(ids[:length])
        if len(out) == n:
            break
    return out


def _weights_mib(model_dir: Path) -> float:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2**20


def rate(tokens: int, times: list[float]) -> tuple[float, float, float]:
    """(median, slowest, fastest) tokens/s over the rounds."""
    return tokens / statistics.median(times), tokens / max(times), tokens / min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/bench_spec")
    ap.add_argument("--target-steps", type=int, default=80)
    ap.add_argument("--draft-steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", default="4,auto")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tok, tok_dir = tokenizer(work)
    base = [*SHAPE, *data_overrides(tok_dir)]

    # 1-2. target and drafts
    target = train(work / "target", tok, base, args.target_steps)
    drafts: dict[str, Path] = {}
    if not (work / "int8" / "model.safetensors").is_file():
        shutil.rmtree(work / "ptq", ignore_errors=True)
        shutil.rmtree(work / "int8", ignore_errors=True)
        _ok("ptq", "--ckpt", target, "--out", work / "ptq", "--calib-batches", 4, "--no-progress")
        _ok("quantize", "--ckpt", work / "ptq", "--out", work / "int8", "--convert", "--no-check")
    drafts["int8"] = work / "int8"
    if not (work / "pruned" / "done").is_file():
        shutil.rmtree(work / "pruned", ignore_errors=True)
        _ok("prune", "--ckpt", target, "--out", work / "pruned", "--no-progress", "-o", "Compress.Prune.ratio=0.5",
            "-o", f"Engine.max_steps={args.draft_steps}", "-o", "Engine.save_load.save_steps=-1",
            *(a for o in data_overrides(tok_dir) if not o.startswith("Model.") for a in ("-o", o)))
        from gptforge.train import checkpoint as ckpt

        (work / "pruned" / "done").write_text(str(ckpt.latest_checkpoint(work / "pruned")))
    drafts["pruned"] = Path((work / "pruned" / "done").read_text())
    dropped = work / "dropped"
    if not (dropped / "model.safetensors").is_file():
        drop_layers(target, [0, LAYERS - 1], dropped, tok)
    drafts["dropped"] = dropped
    shape2 = [o for o in SHAPE if not o.startswith("Model.num_layers")] + ["Model.num_layers=2"]
    drafts["dropped+distilled"] = train(
        work / "distilled", tok,
        [*shape2, *data_overrides(tok_dir), f"Compress.pretrained={dropped}", f"Engine.distill.teacher={target}",
         "Engine.distill.alpha=0.5", "Engine.distill.temperature=1.0"], args.draft_steps, lr=1e-3)
    # Both compressions at once: the distilled 2-layer draft made INT8 (a cheaper draft step, the
    # same proposals up to INT8 rounding).
    dd_int8 = work / "distilled_int8"
    if not (dd_int8 / "model.safetensors").is_file():
        shutil.rmtree(work / "distilled_ptq", ignore_errors=True)
        _ok("ptq", "--ckpt", drafts["dropped+distilled"], "--out", work / "distilled_ptq", "--calib-batches", 4,
            "--no-progress")
        _ok("quantize", "--ckpt", work / "distilled_ptq", "--out", dd_int8, "--convert", "--no-check")
    drafts["dropped+distilled int8"] = dd_int8
    # ... with the tied embedding / LM head int8 too: in a 2-layer draft the 8192 x 384 head is
    # most of the weights a draft step reads.
    dd_int8e = work / "distilled_int8_head"
    if not (dd_int8e / "model.safetensors").is_file():
        _ok("quantize", "--ckpt", work / "distilled_ptq", "--out", dd_int8e, "--convert", "--no-check",
            "--embedding", "int8")
    drafts["dropped+distilled int8+head"] = dd_int8e
    prep_s = time.perf_counter() - t_start

    # 3. decode speed
    torch.manual_seed(0)
    tmodel, _ = load_model(target)
    dmodels = {name: load_model(p)[0] for name, p in drafts.items()}
    n_params = sum(p.numel() for p in tmodel.parameters())
    weight_bytes = (n_params - tmodel.wpe.weight.numel()) * 4
    bw = statistics.median(gemv_bandwidth() for _ in range(3))
    limit_tps = bw / weight_bytes
    prompts = prompts_from_corpus(tok, args.prompts, 64)
    new = args.new_tokens
    g = GenerationConfig(decode_strategy="greedy_search", max_dec_len=new, min_dec_len=new)
    eos = tok.eos_token_id

    def plain(p):
        return generate_ids(tmodel, [p], g, eos_token_id=eos).tokens

    def spec(p, draft, k):
        cfg = GenerationConfig(decode_strategy="greedy_search", max_dec_len=new, min_dec_len=new,
                               num_draft_tokens=k)
        out = generate_ids(tmodel, [p], cfg, eos_token_id=eos, draft=draft)
        return out.tokens, out.speculative  # SpecStats: drafted, accepted

    cases = {"plain greedy": None}
    ks = args.ks.split(",")
    for name in dmodels:
        for k in ks:
            cases[f"{name}, K={k}"] = (name, k)
    want = [plain(p) for p in prompts]  # warm-up + reference outputs
    times = {c: [] for c in cases}
    accept = {}
    for _ in range(args.repeats):
        for case, how in cases.items():
            total = 0.0
            acc_n = acc_d = 0
            for i, p in enumerate(prompts):
                t = time.perf_counter()
                if how is None:
                    out = plain(p)
                else:
                    out, dec = spec(p, dmodels[how[0]], how[1])
                    acc_n += dec.accepted
                    acc_d += dec.drafted
                total += time.perf_counter() - t
                if not torch.equal(out, want[i]):
                    print(f"WARNING {case}: prompt {i} differs from plain greedy", file=sys.stderr)
            times[case].append(total)
            if how is not None:
                accept[case] = acc_n / max(acc_d, 1)
    toks = new * len(prompts)
    rows = {c: rate(toks, t) for c, t in times.items()}

    # 4. transformers
    hf = {}
    if not args.no_hf:
        import transformers

        hf_dirs = {}
        for name, p in (("target", target), ("dropped+distilled", drafts["dropped+distilled"]),
                        ("pruned", drafts["pruned"])):
            d = work / "hf" / name.replace("+", "_")
            if not (d / "config.json").is_file():
                _ok("export", "--format", "hf", "--ckpt", p, "--out", d, "--force")
            hf_dirs[name] = d
        ht = transformers.GPT2LMHeadModel.from_pretrained(hf_dirs["target"]).eval()
        assistants = {n: transformers.GPT2LMHeadModel.from_pretrained(d).eval()
                      for n, d in hf_dirs.items() if n != "target"}

        def hf_gen(p, assistant=None):
            ids = torch.tensor([p])
            kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=eos)
            if assistant is not None:
                kw["assistant_model"] = assistant
            with torch.inference_mode():
                return ht.generate(ids, attention_mask=torch.ones_like(ids), **kw)[:, len(p):]

        hf_cases = {"transformers greedy": None, **{f"transformers assisted, {n}": a for n, a in assistants.items()}}
        hf_gen(prompts[0])
        hf_times = {c: [] for c in hf_cases}
        for _ in range(args.repeats):
            for case, a in hf_cases.items():
                total = 0.0
                for i, p in enumerate(prompts):
                    t = time.perf_counter()
                    out = hf_gen(p, a)
                    total += time.perf_counter() - t
                    if not torch.equal(out, want[i]):
                        print(f"WARNING {case}: prompt {i} differs from gptforge greedy", file=sys.stderr)
                hf_times[case].append(total)
        hf = {c: rate(toks, t) for c, t in hf_times.items()}

    # 5. report
    print(f"machine: {cpu_name()} ({cpu_flags()}), {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"target: {n_params / 1e6:.1f}M params ({args.target_steps} steps), drafts: "
          # weight file sizes: an INT8 model keeps its weights in buffers, not parameters
          + ", ".join(f"{n} {_weights_mib(p):.1f} MiB" for n, p in drafts.items())
          + f" (target {_weights_mib(target):.1f} MiB)")
    print(f"preparation (training, drafts): {prep_s:.0f}s; bandwidth {bw / 1e9:.1f} GB/s -> fp32 limit "
          f"{limit_tps:.1f} tokens/s; {len(prompts)} prompts x 64 tokens -> {new} new, batch 1, greedy\n")
    base, base_lo, base_hi = rows["plain greedy"]

    def line(name, acc, r):
        med, lo, hi = r
        apart = "" if name.endswith("plain greedy") else (" (spreads apart)" if lo > base_hi or hi < base_lo
                                                          else " (spreads overlap)")
        print(f"| {name} | {acc} | {med:.1f} ({lo:.0f}-{hi:.0f}) | {med / base:.2f}x{apart} | {med / limit_tps:.0%} |")

    print("| decoder | acceptance | tokens/s, median (min-max) | vs plain greedy | vs fp32 limit |")
    print("|---|---|---|---|---|")
    for c, r in rows.items():
        line(f"gptforge {c}", f"{accept[c]:.0%}" if c in accept else "-", r)
    for c, r in hf.items():
        line(c, "-", r)
    pair = "transformers assisted, dropped+distilled"
    if pair in hf:
        ours = rows.get(f"dropped+distilled, K={ks[-1]}")
        if ours is not None:
            print(f"\nsame pair (target + dropped+distilled, K={ks[-1]}): gptforge {ours[0]:.1f} vs transformers "
                  f"assisted {hf[pair][0]:.1f} tokens/s: {ours[0] / hf[pair][0]:.2f}x")
    (work / "speculative.json").write_text(json.dumps({"ours": rows, "acceptance": accept, "transformers": hf,
                                                       "limit_tps": limit_tps, "load": os.getloadavg()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
