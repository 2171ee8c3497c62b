"""Instruction tuning end to end on the built-in corpus (issue 31's acceptance), through the CLI.

    PYTHONPATH=src python benchmarks/sft_end_to_end.py --work /tmp/e2e [--pretrain-steps 300] ...

1. `gptforge tokenizer train --builtin`: a small BPE learned from the built-in corpus (a small
   vocabulary keeps the head cheap; the synthetic tasks give every character its own token in
   any byte-level BPE).
2. `gptforge pretrain -c pretrain_gpt_tiny_cpu` with that tokenizer on the built-in corpus mixed
   with unlabelled skill text (data/pretrain_mix.py, `Plan.skill_fraction` of the tokens), then
   `Plan.skill_steps` steps on skill-text lines as separate documents (`gptforge sft` on
   prompt/completion records with an empty prompt: every token learned, positions restarting),
   so that the base holds the skills as a real pretrained model does and instruction tuning only
   connects the instructions to them (benchmarks/results/2026-11-26-sft-end-to-end.md).
3. The synthetic instruction set (gptforge.data.synthetic_instructions): training instances,
   held-out test instances and preference pairs (written before pretraining: the skill text
   never holds a held-out instance).
4. `gptforge sft` three ways from the pretrained model: full fine-tuning; LoRA r=16 on all
   Linears; the same LoRA over the INT8 model (`gptforge ptq` + `gptforge quantize --convert`).
   Each is scored on the held-out instances with greedy answers (the model's chat template):
   exact match, per task, and the share ending with EOS within the token limit.
5. `gptforge dpo` from the fully tuned model (the reference too) on the style preference pairs:
   held-out preference accuracy before and after.

Prints one JSON line per stage and a table; writes WORK/results.json. The slow test
tests/test_sft_end_to_end.py runs `run_pipeline` (this file is its one implementation).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Plan:
    """The sizes of a run (the defaults are the acceptance run's)."""

    vocab: int = 2048
    pretrain_steps: int = 800
    pretrain_lr: float = 3e-3
    pretrain_dropout: float = 0.0  # the tiny CPU recipe has 0.1; a base this briefly trained underfits
    pretrain_save_steps: int = -1  # checkpoints during pretraining (to probe the base as it learns)
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    train: int = 6000
    test: int = 200
    seq_len: int = 64
    batch: int = 16
    sft_epochs: int = 4
    sft_lr: float = 3e-3
    lora_epochs: int = 6  # 0: sft_epochs; at 4 epochs LoRA was 0.04 below full, at 6 level (results file)
    lora_lr: float = 3e-3  # 1e-2 reached the same plateau more slowly (results file)
    lora_alpha: int = 32
    # every Linear: q/k/v/out_proj/linear1/linear2 of every block, and the (tied) vocabulary
    # projection, without which a LoRA over a briefly pretrained base barely moves its outputs
    lora_targets: str = "all,head"
    dpo_steps: int = 60  # style pairs: 0.500 -> 1.000 in 60 steps (results file)
    dpo_lr: float = 1e-3
    dpo_beta: float = 0.1
    # style: both answers right, a full stop after word answers only (synthetic_instructions.style_pair);
    # pref: the right answer against a plausible wrong one
    dpo_pairs: str = "style"
    dpo_from: str = "sft"  # sft: the fully tuned model (needs method full) | pretrained
    max_new: int = 24
    methods: tuple = ("full", "lora", "lora_int8")
    min_len: int = 3  # items per reverse / sort / format task
    max_len: int = 5
    save_steps: int = -1  # checkpoints during SFT (for learning curves)
    pretrained: str = ""  # an existing pretrained (and skill-tuned) model directory: skip steps 1-2
    # share of skill text in the pretraining corpus (data/pretrain_mix.py; 0: the built-in corpus alone)
    skill_fraction: float = 0.7
    # then this many steps on skill-text documents packed one per segment (positions restarting, as
    # SFT packs examples): the skills at fixed positions, which a pretrained base of this size and
    # budget does not reach on running text (no copying circuit); 0: none
    skill_steps: int = 500
    skill_docs: int = 40000


def cli(*argv) -> str:
    """`gptforge ARGV` in this process; returns its stdout, raises with its stderr on failure."""
    from gptforge.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    if code != 0:
        raise RuntimeError(f"gptforge {' '.join(map(str, argv))} failed ({code}): {err.getvalue()[-2000:]}")
    return out.getvalue()


def greedy_answers(ckpt, prompts: list[str], max_new: int, adapter=None) -> dict:
    """Greedy answers of the model at `ckpt` (+ `adapter`) with its own chat template."""
    from gptforge.config.schema import GenerationConfig
    from gptforge.data.chat_template import template_for
    from gptforge.data.synthetic_instructions import messages
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.generate.api import generate_ids
    from gptforge.generate.loader import load_runnable

    model, _, _ = load_runnable(ckpt, adapter=adapter)
    tok = load_tokenizer(None, adapter or ckpt)  # the adapter directory carries the template it was tuned with
    template = template_for(tok)
    ids = [template.prompt_ids(tok, messages(p)) for p in prompts]
    out = generate_ids(model, ids, GenerationConfig(decode_strategy="greedy_search", max_dec_len=max_new),
                       eos_token_id=tok.eos_token_id)
    return {"answers": [tok.decode(s) for s in out.sequences()], "finished": out.finished.tolist()}


def score(ckpt, files: dict, max_new: int, adapter=None) -> dict:
    from gptforge.data.synthetic_instructions import score_answers

    test = [json.loads(line)["messages"] for line in Path(files["test"]).read_text().splitlines()]
    prompts = [m[0]["content"] for m in test]
    got = greedy_answers(ckpt, prompts, max_new, adapter)
    out = score_answers(got["answers"], got["finished"], [m[1]["content"] for m in test], prompts)
    out["examples"] = [[p, a] for p, a in zip(prompts[:8], got["answers"][:8], strict=True)]
    return out


def _common(plan: Plan) -> list[str]:
    return ["-o", f"Global.global_batch_size={plan.batch}", "-o", f"Data.Train.dataset.max_seq_len={plan.seq_len}",
            "-o", "Model.hidden_dropout_prob=0", "-o", "Model.attention_probs_dropout_prob=0", "-o",
            "Engine.save_load.save_steps=-1", "-o", "Engine.logging_freq=100", "--no-progress"]


def pretrain(work: Path, plan: Plan, corpus: str) -> Path:
    """`gptforge pretrain` of the tiny CPU recipe's shape on `corpus` (token files, or builtin)."""
    o = [f"Data.Train.dataset.input_dir={corpus}", f"Data.Eval.dataset.input_dir={corpus}",
         f"Engine.max_steps={plan.pretrain_steps}", "Engine.eval_freq=-1",
         "Global.global_batch_size=16", "Global.local_batch_size=16", "Global.micro_batch_size=16",
         f"Data.tokenizer={work / 'tok'}", f"Model.vocab_size={plan.vocab}", f"Model.hidden_size={plan.hidden}",
         f"Model.num_layers={plan.layers}", f"Model.num_attention_heads={plan.heads}",
         f"Model.ffn_hidden_size={4 * plan.hidden}", "Data.Train.dataset.max_seq_len=128",
         "Data.Eval.dataset.max_seq_len=128", f"Optimizer.lr.max_lr={plan.pretrain_lr}", "Engine.logging_freq=50",
         f"Model.hidden_dropout_prob={plan.pretrain_dropout}", f"Model.attention_probs_dropout_prob={plan.pretrain_dropout}",
         f"Engine.save_load.save_steps={plan.pretrain_save_steps}", "Engine.save_load.keep_last=100", "Global.device=cpu"]
    cli("pretrain", "-c", "pretrain_gpt_tiny_cpu", *[x for k in o for x in ("-o", k)], "--out", work / "pre",
        "--no-progress")
    return work / "pre" / f"step_{plan.pretrain_steps}"


def skill_tune(work: Path, plan: Plan, pre: Path, files: dict) -> Path:
    """`plan.skill_steps` of full training of `pre` on skill-text documents (every token learned, no
    template, no instruction words, no held-out instance), at the SFT rows' length."""
    from gptforge.data.synthetic_instructions import write_skill_docs
    from gptforge.data.tokenizer import load_tokenizer

    docs = write_skill_docs(work / "skill_docs.jsonl", load_tokenizer(None, pre), files, plan.skill_docs,
                            lengths=(plan.min_len, plan.max_len))
    cli("sft", "--ckpt", pre, "--data", docs, "--out", work / "skill", "-o", f"Instruct.max_steps={plan.skill_steps}",
        "-o", f"Optimizer.lr.max_lr={plan.sft_lr}", "-o", f"Optimizer.lr.min_lr={plan.sft_lr / 20}", *_common(plan))
    return last_step(work / "skill")


def int8_base(work: Path, pre: Path) -> Path:
    """The pretrained model as a real INT8 model: PTQ's calibrated fake-quant, then --convert."""
    # calibrated on the built-in corpus (without -o: the pretraining mix the skill-tuned base keeps in its config)
    cli("ptq", "--ckpt", pre, "--out", work / "ptq", "-o", "Data.Train.dataset.input_dir=builtin", "-o",
        "Data.Eval.dataset.input_dir=builtin", "--no-progress")
    cli("quantize", "--ckpt", work / "ptq", "--convert", "--out", work / "int8")
    return work / "int8"


def sft(work: Path, plan: Plan, base: Path, method: str, files: dict) -> dict:
    out = work / f"sft_{method}"
    lr = plan.sft_lr if method == "full" else plan.lora_lr
    epochs = plan.lora_epochs if method != "full" and plan.lora_epochs else plan.sft_epochs
    extra = [] if method == "full" else ["--method", "lora", "-o", "Instruct.lora.r=16", "-o",
                                         f"Instruct.lora.alpha={plan.lora_alpha}", "-o", f"Instruct.lora.targets=[{plan.lora_targets}]"]
    t = time.time()
    log = cli("sft", "--ckpt", base, "--data", files["train"], "--out", out, "-o", f"Instruct.epochs={epochs}",
              "-o", f"Optimizer.lr.max_lr={lr}", "-o", f"Optimizer.lr.min_lr={lr / 20}", *extra, *_common(plan),
              "-o", f"Engine.save_load.save_steps={plan.save_steps}")
    minutes = (time.time() - t) / 60
    if method == "full":
        res = score(last_step(out), files, plan.max_new)
    else:
        res = score(base, files, plan.max_new, adapter=out / "adapter")
    res.update(method=method, minutes=round(minutes, 1), trainable=next(
        (ln.split(": ", 2)[2] for ln in log.splitlines() if "trainable parameters" in ln), "all"))
    return res


def last_step(run: Path) -> Path:
    return sorted(run.glob("step_*"), key=lambda p: int(p.name[5:]))[-1]


def dpo(work: Path, plan: Plan, base: Path, files: dict) -> dict:
    """`gptforge dpo` from `base` (the reference too) on the `plan.dpo_pairs` pairs."""
    t = time.time()
    pairs = plan.dpo_pairs
    cli("dpo", "--ckpt", base, "--data", files[f"{pairs}_train"], "--eval-data", files[f"{pairs}_test"],
        "--out", work / "dpo",
        "-o", f"Instruct.max_steps={plan.dpo_steps}", "-o", f"Instruct.beta={plan.dpo_beta}", "-o",
        f"Optimizer.lr.max_lr={plan.dpo_lr}", "-o", f"Optimizer.lr.min_lr={plan.dpo_lr / 20}", *_common(plan))
    res = json.loads((work / "dpo" / "dpo_results.json").read_text())
    res.update(minutes=round((time.time() - t) / 60, 1), base=str(base), pairs=pairs)
    return res


def run_pipeline(work: str | os.PathLike, plan: Plan | None = None, echo=print) -> dict:
    """Every stage in `work`; returns {"plan", "pretrain_minutes", "sft": {method: score}, "dpo"}."""
    from gptforge.data.synthetic_instructions import write_set, write_skill_mix
    from gptforge.data.tokenizer import load_tokenizer

    plan = plan or Plan()
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    t = time.time()
    if not plan.pretrained:
        cli("tokenizer", "train", "--builtin", "--vocab-size", plan.vocab, "--out", work / "tok", "--no-progress")
    tok = load_tokenizer(str(work / "tok")) if not plan.pretrained else load_tokenizer(None, plan.pretrained)
    lengths = (plan.min_len, plan.max_len)
    files = write_set(work / "data", plan.train, plan.test, lengths=lengths, tokenizer=tok)
    results: dict = {"plan": asdict(plan), "sft": {}}
    if plan.pretrained:
        pre = Path(plan.pretrained)
    else:
        corpus = "builtin"
        if plan.skill_fraction:  # the corpus + skill text that never holds a test instance
            results["pretrain_mix"] = write_skill_mix(work / "mix" / "corpus", tok, files, plan.skill_fraction,
                                                      lengths=lengths)
            corpus = str(work / "mix" / "corpus")
        pre = pretrain(work, plan, corpus)
        if plan.skill_steps:
            pre = skill_tune(work, plan, pre, files)
    results["pretrain_minutes"] = round((time.time() - t) / 60, 1)
    echo(json.dumps({"pretrain": results["pretrain_minutes"], "mix": results.get("pretrain_mix")}), flush=True)
    for method in plan.methods:
        base = int8_base(work, pre) if method == "lora_int8" else pre
        results["sft"][method] = sft(work, plan, base, method, files)
        echo(json.dumps({method: results["sft"][method]}), flush=True)
    if plan.dpo_steps:  # after SFT, from the fully tuned model when there is one (reference = that model)
        start = last_step(work / "sft_full") if "full" in results["sft"] and plan.dpo_from == "sft" else pre
        results["dpo"] = dpo(work, plan, start, files)
        echo(json.dumps({"dpo": results["dpo"]}), flush=True)
    (work / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def table(results: dict) -> str:
    """The results as a markdown table."""
    rows = ["| measure | " + " | ".join(results["sft"]) + " |", "|---|" + "---|" * len(results["sft"])]
    sft = list(results["sft"].values())
    rows.append("| ended with EOS | " + " | ".join(f"{r['ended_with_eos']:.3f}" for r in sft) + " |")
    rows.append("| exact match | " + " | ".join(f"**{r['exact_match']:.3f}**" for r in sft) + " |")
    for task in sft[0]["by_task"] if sft else ():
        rows.append(f"| - {task} | " + " | ".join(f"{r['by_task'][task]:.2f}" for r in sft) + " |")
    rows.append("| minutes | " + " | ".join(str(r["minutes"]) for r in sft) + " |")
    if "dpo" in results:
        d = results["dpo"]
        rows.append(f"\nDPO held-out preference accuracy {d['before']['accuracy']:.3f} -> {d['after']['accuracy']:.3f} "
                    f"(reward accuracy {d['after']['reward_accuracy']:.3f}, {d['after']['pairs']} pairs)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="working directory (models, data, results.json)")
    for f, v in asdict(Plan()).items():
        if f != "methods":
            p.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    p.add_argument("--methods", default="full,lora,lora_int8", help="comma-separated: full, lora, lora_int8")
    p.add_argument("--threads", type=int, default=1)
    args = vars(p.parse_args(argv))
    import torch

    torch.set_num_threads(args.pop("threads"))
    work = args.pop("work")
    args["methods"] = tuple(m for m in args["methods"].split(",") if m)
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} thread(s)", flush=True)
    results = run_pipeline(work, Plan(**args))
    print(table(results))
    print(f"load average {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
