"""LoRA fine-tuning: gptforge vs `peft` + `transformers`, same weights, data, batch and threads.

One GPT-2 124M-shape model with seeded random weights (no download) is saved once as our
checkpoint and as its HF export (`transformers.GPT2LMHeadModel` loads it); one seeded batch
of token ids per step goes to both. LoRA r=16, alpha 32, dropout 0 on every block Linear (ours:
`targets: all`; peft: `c_attn`, `c_proj` (attention and MLP), `c_fc`), AdamW at the same lr,
weight decay, betas and kernel, global-norm clipping 1.0, model dropout 0.1 in both.

Every run is its own subprocess, so its peak resident memory (VmHWM) is its own: `load` is the
peak after building the model and optimizer, `train` the peak while stepping (VmHWM reset
after loading, where the kernel allows it). Runs go in interleaved rounds (ours, peft, ... then
the reverse order) so that load from other processes hits all alike; reported: median tokens/s
per run (each run: `--warmup` untimed steps, then `--steps` timed), the ratio of the medians
and its spread (min/max over rounds), the load average before and after.

Two workloads. Plain text: seeded random token rows (`--batch` x `--seq`), every token learned.
Instruction tuning (the SFT use case): `--sft-examples` records per step of the synthetic
instruction set (data/synthetic_instructions.py, as benchmarks/sft_packing.py renders it: the
default chat template, GPT-2's BPE), the same records in the same order for both, the prompt
masked and the answer + EOS learned. Ours gets them as `gptforge sft` builds them (rows of
`--seq`, packing off or on); peft gets what a TRL user's completion-only collator hands
transformers: each record's ids, labels -100 on the prompt, padded to the batch's longest
record (attention_mask 0 on padding). Real (non-padding) tokens/s are counted alike.

Runs (`--runs`): `lora` / `peft` (plain text: ours, `gptforge sft`'s trainer step; peft over
transformers, a plain PyTorch loop), `full` (ours, full fine-tuning), `lora-int8` (ours, LoRA
over the real INT8 base of `quantize --convert`), `padded` / `packed` / `peft-padded`
(instruction tuning: ours with packing off / on, and peft).

    .venv/bin/python benchmarks/finetune_lora.py                       # all runs, 2 rounds, 1 thread
    .venv/bin/python benchmarks/finetune_lora.py --runs lora peft --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))
from qat_quality import cpu_flags, cpu_name  # noqa: E402  (benchmarks/ is on sys.path)

RUNS = ("lora", "peft", "full", "lora-int8", "packed", "padded", "peft-padded")
PEFT_TARGETS = ["c_attn", "c_proj", "c_fc"]  # c_proj: both attn.c_proj and mlp.c_proj
LR, WD, CLIP = 1e-4, 0.01, 1.0


# ---------------------------------------------------------------------------- memory


def vm_kb(field: str) -> int:
    """A VmXXX line of /proc/self/status in kB (ru_maxrss where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: `echo 5 > /proc/self/clear_refs`)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- fixtures


def prepare(root: Path, args) -> None:
    """Our checkpoint, its HF export, its INT8 conversion and the token batches, in `root`."""
    import torch

    from gptforge.compress.int8_convert import convert_checkpoint
    from gptforge.config import load_config
    from gptforge.config.schema import QuantizationConfig
    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.export.hf import save_hf
    from gptforge.model import build_model
    from gptforge.model_io import save_model_dir
    from gptforge.transforms.quant import quantize_model

    cfg = load_config(overrides=["Model.preset=124M", "Model.hidden_dropout_prob=0.1",
                                 "Model.attention_probs_dropout_prob=0.1"])
    torch.manual_seed(0)
    model = build_model(cfg.Model)
    tok = gpt2_tokenizer()
    save_model_dir(model, cfg, root / "ours", tok)
    save_hf(model, root / "hf", tok)
    g = torch.Generator().manual_seed(1)
    n = args.warmup + args.steps
    torch.save(torch.randint(0, tok.vocab_size, (n, args.batch, args.seq + 1), generator=g), root / "batches.pt")
    if "lora-int8" in args.runs:
        # The INT8 base as users make it: fake-quant (PTQ-style calibration on a few batches),
        # then `quantize --convert`.
        quantize_model(model, QuantizationConfig(enable=True))
        model.train()
        with torch.no_grad():
            for _ in range(4):
                model(torch.randint(0, tok.vocab_size, (2, args.seq), generator=g))
        cfg.Compress.Quantization.enable = True
        save_model_dir(model.eval(), cfg, root / "qat", tok)
        convert_checkpoint(root / "qat", root / "int8", check=False, echo=False)


# ------------------------------------------------------------------------------ runs


def _batch(tokens):
    import torch

    B, T1 = tokens.shape
    T = T1 - 1
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(T).expand(B, -1).contiguous(), "loss_mask": torch.ones(B, T),
            "segments": torch.ones(B, T, dtype=torch.long)}


def ours(root: Path, run: str, args):
    """(step(batch) -> real tokens, batches) for one of our runs: the sft trainer's own step."""
    import torch

    from gptforge.config import load_config
    from gptforge.finetune.sft import SFTTrainer, apply_method, load_base

    ckpt = root / ("int8" if run == "lora-int8" else "ours")
    method = "full" if run == "full" else "lora"
    rows = args.sft_examples if run in ("packed", "padded") else args.batch  # at most one row per record
    cfg = load_config(overrides=[
        "Global.device=cpu", f"Global.global_batch_size={rows}", f"Global.micro_batch_size={rows}",
        f"Data.Train.dataset.max_seq_len={args.seq}", "Engine.mix_precision.enable=False",
        f"Engine.save_load.output_dir={root / ('out-' + run + '-' + str(os.getpid()))}",
        "Optimizer.lr.warmup_rate=0", f"Optimizer.lr.max_lr={LR}", f"Optimizer.lr.min_lr={LR}",
        f"Optimizer.weight_decay={WD}", f"Optimizer.grad_clip.clip_norm={CLIP}", "Optimizer.name=FusedAdamW",
        f"Instruct.method={method}", "Instruct.lora.r=16", "Instruct.lora.alpha=32", "Instruct.lora.targets=all",
        "Model.hidden_dropout_prob=0.1", "Model.attention_probs_dropout_prob=0.1"])
    if run == "lora-int8":
        # load_base refuses a converted model for full tuning only in sft's own check; the
        # adapters go over the loaded INT8 layers as `sft --method lora` puts them.
        from gptforge.data.chat_template import ChatTemplate
        from gptforge.data.tokenizer import gpt2_tokenizer
        from gptforge.finetune.sft import Base
        from gptforge.model_io import load_model

        model, cfg = load_model(ckpt, cfg, device="cpu")
        base = Base(model, cfg, gpt2_tokenizer(), ChatTemplate(), ckpt)
    else:
        base = load_base(cfg, ckpt, device=torch.device("cpu"))
    cfg = base.cfg
    apply_method(cfg, base, echo=False)
    trainer = SFTTrainer(cfg, base.model, base.tokenizer, datasets={"Train": [None]}, progress=False, echo=False,
                         verb="sft")
    if run in ("packed", "padded"):
        batches = [_rows(chunk, args.seq, run == "packed") for chunk in instruction_steps(args)]
    else:
        batches = [_batch(t) for t in torch.load(root / "batches.pt")]

    def step(b):
        trainer.train_step(b)
        return int((b["segments"] > 0).sum())

    return step, batches


def instruction_steps(args) -> list[list]:
    """`args.warmup + args.steps` steps of `args.sft_examples` tokenized records each (ids + the
    learned-token mask), in one seeded order: what every instruction run trains on."""
    import random

    from gptforge.data.chat_template import ChatTemplate
    from gptforge.data.synthetic_instructions import make_instances, messages
    from gptforge.data.tokenizer import gpt2_tokenizer

    tok, template = gpt2_tokenizer(), ChatTemplate()
    n = (args.warmup + args.steps) * args.sft_examples
    train, _ = make_instances(n, 0)
    ex = [template.encode(tok, messages(p, a)) for p, a, _ in train[:n]]
    random.Random(0).shuffle(ex)
    return [ex[i:i + args.sft_examples] for i in range(0, n, args.sft_examples)]


def _rows(examples, seq: int, packed: bool) -> dict:
    """The records as `gptforge sft` builds its rows (in their order; packing on or off)."""
    import torch

    from gptforge.data.packing import build_rows

    rows = build_rows(examples, seq, packed, seed=0)
    return {k: torch.as_tensor(getattr(rows, k)) for k in ("tokens", "labels", "loss_mask", "position_ids", "segments")}


def hf_collate(examples, pad_id: int) -> dict:
    """The records as a completion-only collator gives them to transformers: input ids (the
    whole record, its final EOS included), labels -100 where not learned (transformers shifts
    them), padded to the longest record; `n_real` = the tokens ours trains on (ids minus one)."""
    import torch

    T = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), T), -100, dtype=torch.long)
    attn = torch.zeros((len(examples), T), dtype=torch.long)
    for r, e in enumerate(examples):
        k = len(e.ids)
        ids[r, :k] = torch.tensor(e.ids)
        labels[r, :k] = torch.where(torch.tensor(e.mask) > 0, torch.tensor(e.ids), -100)
        attn[r, :k] = 1
    return {"input_ids": ids, "attention_mask": attn, "labels": labels,
            "n_real": sum(len(e.ids) - 1 for e in examples)}


def theirs(root: Path, args, padded: bool = False):
    """(step(batch) -> tokens, batches) for peft over transformers: the loop a peft user writes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(root / "hf"))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PEFT_TARGETS,
                                             fan_in_fan_out=True, task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    if padded:
        from gptforge.data.tokenizer import gpt2_tokenizer

        pad = gpt2_tokenizer().eos_token_id  # GPT-2 has no pad token: users pad with EOS (masked out)
        batches = [hf_collate(chunk, pad) for chunk in instruction_steps(args)]
    else:
        batches = [{"input_ids": t[:, :-1], "labels": t[:, :-1], "n_real": t[:, :-1].numel()}
                   for t in torch.load(root / "batches.pt")]

    def step(b):
        loss = model(**{k: v for k, v in b.items() if k != "n_real"}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return b["n_real"]

    return step, batches


def child(root: Path, run: str, args) -> dict:
    """Build one run, step it, and return its times and memory."""
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    step, batches = theirs(root, args, run == "peft-padded") if run.startswith("peft") else ours(root, run, args)
    load_kb = vm_kb("VmHWM")
    resettable = reset_peak()
    times, cpu, tokens = [], [], []
    for i, b in enumerate(batches):
        t0, c0 = time.perf_counter(), time.process_time()
        n = step(b)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            tokens.append(n)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the parent that forked us.
    end_kb = vm_kb("VmHWM")
    # Process CPU time as well as wall clock: on a machine shared with other jobs the wall
    # clock also counts the time slices others took; CPU time counts only this run's work.
    return {"run": run, "threads": torch.get_num_threads(), "step_s": times, "cpu_s": cpu, "tokens": tokens,
            "tokens_per_s": statistics.median(n / t for n, t in zip(tokens, times, strict=True)),
            "tokens_per_cpu_s": statistics.median(n / t for n, t in zip(tokens, cpu, strict=True)),
            "load_kb": load_kb, "peak_kb": end_kb if resettable else None, "process_peak_kb": max(load_kb, end_kb)}


# ---------------------------------------------------------------------------- parent


def spawn(root: Path, run: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", run, "--root", str(root), "--threads", str(args.threads),
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--sft-examples", str(args.sft_examples), "--runs", *args.runs]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{run} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(results: dict[str, list[dict]], args, loads: list[float]) -> dict:
    mb = 1 / 1024
    print(f"\n{cpu_name()} ({cpu_flags()}), {os.cpu_count()} cores, {args.threads} thread(s); load average "
          f"{loads[0]:.1f} before, {loads[1]:.1f} after; batch {args.batch} x {args.seq} (instruction runs: "
          f"{args.sft_examples} records per step), {args.steps} timed steps "
          f"after {args.warmup} warm-up per run, {args.rounds} round(s)")
    print(f"{'run':>10} | tokens/s median (min-max over rounds) | tokens per CPU s | peak RSS load MB | "
          "peak RSS training MB")
    summary = {}
    for run, rs in results.items():
        tps = [r["tokens_per_s"] for r in rs]
        cps = [r["tokens_per_cpu_s"] for r in rs if "tokens_per_cpu_s" in r] or [float("nan")]
        load = max(r["load_kb"] for r in rs) * mb
        peak = max(r["peak_kb"] or r["process_peak_kb"] for r in rs) * mb
        whole = max(r["process_peak_kb"] for r in rs) * mb
        summary[run] = {"tokens_per_s": tps, "tokens_per_cpu_s": cps, "load_mb": load, "train_peak_mb": peak,
                        "process_peak_mb": whole}
        print(f"{run:>10} | {statistics.median(tps):8.0f} ({min(tps):.0f}-{max(tps):.0f}) | "
              f"{statistics.median(cps):6.0f} ({min(cps):.0f}-{max(cps):.0f}) | {load:8.0f} | "
              f"{peak:8.0f} (whole process {whole:.0f})")
    if "lora" in results and "peft" in results:
        s = summary
        rss = s["lora"]["process_peak_mb"] / s["peft"]["process_peak_mb"]
        train_rss = s["lora"]["train_peak_mb"] / s["peft"]["train_peak_mb"]
        summary["ratio"] = {"process_rss": rss, "train_rss": train_rss}
        for key, what in (("tokens_per_s", "tokens/s (wall clock)"), ("tokens_per_cpu_s", "tokens per CPU second")):
            r = ratios(results["lora"], results["peft"], key)
            summary["ratio"][key] = r
            print(f"ours / peft: {what} {statistics.median(r):.2f}x per round (spread {min(r):.2f}-{max(r):.2f})")
        print(f"ours / peft: peak RSS whole process {rss:.2f}x, training phase {train_rss:.2f}x")
    if "padded" in results and "peft-padded" in results:
        r = ratios(results["padded"], results["peft-padded"], "tokens_per_s")
        c = ratios(results["padded"], results["peft-padded"], "tokens_per_cpu_s")
        print(f"ours / peft on instruction records (loss on answers only): real tokens/s "
              f"{statistics.median(r):.2f}x per round (spread {min(r):.2f}-{max(r):.2f}); per CPU second "
              f"{statistics.median(c):.2f}x (spread {min(c):.2f}-{max(c):.2f})")
        rss = summary["padded"]["process_peak_mb"] / summary["peft-padded"]["process_peak_mb"]
        print(f"ours / peft on instruction records: peak RSS whole process {rss:.2f}x")
        summary["ratio_padded"] = {"tokens_per_s": r, "tokens_per_cpu_s": c, "process_rss": rss}
    if "packed" in results and "padded" in results:
        g = ratios(results["packed"], results["padded"], "tokens_per_s")
        print(f"packing gain (LoRA, real tokens/s): {statistics.median(g):.2f}x (spread {min(g):.2f}-{max(g):.2f})")
        summary["packing_gain"] = g
    return summary


def ratios(ours: list[dict], peer: list[dict], key: str) -> list[float]:
    """Per-round ratios of `key` (the rounds' runs paired in order)."""
    return [a[key] / b[key] for a, b in zip(ours, peer, strict=True) if key in a and key in b] or [float("nan")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every run (order reversed every other round)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sft-examples", type=int, default=32, help="records per step of the instruction runs")
    ap.add_argument("--json", metavar="FILE", help="also write every run's figures as JSON")
    ap.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.root), args.child, args)))
        return 0
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="gf-lora-bench-") as tmp:
        root = Path(tmp)
        prepare(root, args)
        results: dict[str, list[dict]] = {r: [] for r in args.runs}
        for r in range(args.rounds):
            for run in args.runs if r % 2 == 0 else reversed(args.runs):
                res = spawn(root, run, args)
                results[run].append(res)
                print(f"round {r + 1}: {run:>9} {res['tokens_per_s']:7.0f} tokens/s, peak RSS "
                      f"{(res['peak_kb'] or res['process_peak_kb']) / 1024:.0f} MB (load {os.getloadavg()[0]:.1f})",
                      flush=True)
    loads.append(os.getloadavg()[0])
    summary = report(results, args, loads)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
