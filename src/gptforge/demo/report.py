"""The demo's report: `report.md` and `report.html` (the same content), and their PNG plots.

The table follows the seeds' (model | precision / shape | params | size on disk | tokens/s | eval
loss / ppl / acc); the checks state what the run demonstrates; every command that produced a
row is listed, so each row can be reproduced by hand.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
from pathlib import Path

import torch

from gptforge import __version__
from gptforge.demo.plan import FULL, LADDER, Shape, Steps, pretrained_steps, threads_text, trained_settings

PLOTS = {"loss": "loss_curve.png", "sensitivity": "sensitivity.png", "tradeoff": "speed_quality.png"}


def machine() -> str:
    """CPU model and cores, plus the GPU when one is used."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        text += f"; GPU {torch.cuda.get_device_name()}"
    return text


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# ------------------------------------------------------------------------------ plots


def _plots(d, rows: dict, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gptforge.demo.stages import ROWS

    files = {}
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for key, label, style in (("pretrain", "pretrain", "-"), ("qat", "QAT", "-"), ("prune", "pruned fine-tune", "-")):
        o = d.out(key)
        offset = 0 if key == "pretrain" else d.out("pretrain")["train"][-1][0]
        if o["train"]:
            xs, ys = zip(*o["train"], strict=True)
            ax.plot([x + offset for x in xs], ys, style, label=f"{label} (train)")
        if o["eval"]:
            xs, ys = zip(*o["eval"], strict=True)
            ax.plot([x + offset for x in xs], ys, "o--", label=f"{label} (eval)")
    ax.set_xlabel("step (fine-tunes continue from the pretrained model)")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files["loss"] = out / PLOTS["loss"]
    fig.savefig(files["loss"], dpi=110)
    plt.close(fig)

    an = d.out("analysis")
    ranking = an["ranking"]
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.28 * len(ranking) + 1)), layout="constrained")
    names = [f"{r['reference_name']}  {r['name']}" for r in ranking][::-1]
    vals = [r["sensitivity"] for r in ranking][::-1]
    colors = ["tab:red" if r["name"] in an["top"] else "tab:blue" for r in ranking][::-1]
    ax.barh(names, vals, color=colors)
    ax.set_xlabel("sensitivity: QAT loss - loss with this layer float\n(larger = more sensitive)")
    ax.set_title(f"quantization sensitivity\n(red: the top {an['k']}, left float in the next QAT)")
    ax.tick_params(axis="y", labelsize=8)
    ax.tick_params(axis="x", labelrotation=30)
    files["sensitivity"] = out / PLOTS["sensitivity"]
    fig.savefig(files["sensitivity"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for key, r in rows.items():
        rates = r.get("tokens_per_s_rounds") or [r["tokens_per_s"]]
        med = r["tokens_per_s"]
        ax.errorbar([med], [r["bits_per_byte"]], xerr=[[med - min(rates)], [max(rates) - med]], fmt="o", capsize=3)
        ax.annotate(ROWS[key], (med, r["bits_per_byte"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("tokens/s (forward pass; median and min-max of the rounds)")
    ax.set_ylabel("held-out bits per byte (lower is better)")
    ax.set_title("speed vs quality")
    ax.tick_params(axis="x", labelrotation=30)
    ax.grid(alpha=0.3)
    files["tradeoff"] = out / PLOTS["tradeoff"]
    fig.savefig(files["tradeoff"], dpi=110)
    plt.close(fig)
    return files


# ----------------------------------------------------------------------------- content


def _checks(d, rows: dict) -> list[tuple[str, str, str]]:
    """(verdict, name, detail): verdict PASS, FAIL or "n/a" (a speed difference inside the noise, or
    a comparison a --quick run cannot make)."""
    from gptforge.demo.measure import compare_speeds
    from gptforge.demo.stages import STAGES

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    pre = d.out("pretrain")
    first, last = pre["train"][0][1], pre["train"][-1][1]
    ev = pre["eval"]
    eval_note = f"; eval loss {ev[0][1]:.3f} -> {ev[-1][1]:.3f}" if len(ev) >= 2 else ""
    ptq, qat = rows["ptq"]["ppl"], rows["qat"]["ppl"]
    stages = [r for r in d.records.values() if r.name != "report"]
    done = sum(1 for r in stages if r.done)
    numbers = [v for r in rows.values() for k, v in r.items()
               if k in ("ppl", "loss", "cloze_acc", "tokens_per_s", "bits_per_byte")]
    out = [(verdict(last < first), "loss falls", f"pretraining loss {first:.3f} -> {last:.3f}{eval_note}")]
    xz = d.out("data").get("xz_bits_per_byte")
    if xz is not None:
        bpb = rows["float"]["bits_per_byte"]
        out.append((verdict(bpb < xz), "the float model learned the text",
                    f"{bpb:.3f} bits per byte on the held-out text vs {xz:.3f} for xz -9e on the same bytes"))
    ppls = f"held-out ppl {qat:.3f} (QAT) vs {ptq:.3f} (PTQ)"
    if d.s.quick:  # a few dozen QAT steps on a tiny model: either order is noise, not evidence
        out.append(("n/a", "QAT better than PTQ", f"not measured: a --quick run is too short to show it; {ppls}"))
    else:
        out.append((verdict(qat < ptq), "QAT better than PTQ", ppls))
    dense, pruned = rows["float"], rows["pruned"]
    cmp = compare_speeds(pruned.get("tokens_per_s_rounds") or [pruned["tokens_per_s"]],
                         dense.get("tokens_per_s_rounds") or [dense["tokens_per_s"]])
    speeds = f"median {pruned['tokens_per_s']:,.0f} vs {dense['tokens_per_s']:,.0f} tokens/s ({_spread(pruned)} vs {_spread(dense)})"
    if cmp == 0:
        out.append(("n/a", "pruned vs dense speed", f"no measurable difference: the rounds' spreads overlap; {speeds}"))
    else:
        out.append((verdict(cmp > 0), "pruned model faster than dense", speeds))
    out += [(verdict(all(_finite(x) for x in numbers)), "every number finite", f"{len(numbers)} figures"),
            (verdict(done == len(stages) == STAGES - 1), "every stage ran",
             f"{done} of {STAGES - 1} stages before this report")]
    return out


def _shape_note(steps: dict) -> str:
    """Why the plan trained another shape than the default (empty when it did not)."""
    if not steps.get("shape"):
        return ""
    shape = Shape(**steps["shape"])
    pick = next((c for c in LADDER if c.shape == shape), None)
    if pick is None:  # a demo planned by another version
        return " (the shape the plan chose for this machine's budget)"
    return (f" (the wider shape: this machine's budget bought at least {pick.from_full_steps} steps of the "
            f"default hidden-{FULL.hidden} model, where the wider one learns more in the same time)")


def _threads(steps: dict) -> str:
    n = steps.get("threads", 0)
    return f"{threads_text(n)} (the faster count on this machine)" if n else ""


def _refits(d, steps: dict) -> str:
    refits = getattr(d, "refits", {}) or {}
    return ", ".join(f"{k} {refits.get(k, steps['finetune'])}" for k in ("qat", "qat_skip", "prune", "pruned_qat"))


def _spread(r: dict) -> str:
    rates = r.get("tokens_per_s_rounds") or [r["tokens_per_s"]]
    return f"{min(rates):,.0f}-{max(rates):,.0f}"


def visible_whitespace(text: str) -> str:
    """Whitespace made visible: a newline is shown as ↵ (then a line break), a tab as →, trailing
    spaces of a line as ␣, other control characters as Python escapes."""
    lines = []
    for line in text.split("\n"):
        body = line.rstrip(" ")
        line = body + "␣" * (len(line) - len(body))
        line = "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in line).replace("\t", "→")
        lines.append(line)
    return "↵\n".join(lines)


def _table(rows: dict) -> tuple[list[str], list[list[str]]]:
    from gptforge.demo.stages import ROWS

    head = ["model", "precision / shape", "params", "size on disk", "tokens/s (min-max)", "bits/byte",
            "held-out loss", "ppl", "cloze acc"]
    body = []
    for key, r in rows.items():
        body.append([ROWS[key], r["description"], f"{r['params'] / 1e6:.2f} M", _fmt_bytes(r["size_bytes"]),
                     f"{r['tokens_per_s']:,.0f} ({_spread(r)})", f"{r['bits_per_byte']:.3f}", f"{r['loss']:.4f}",
                     f"{r['ppl']:.3f}", f"{100 * r['cloze_acc']:.1f}%"])
    return head, body


def _row_commands() -> dict[str, list[str]]:
    """Stage names whose commands produce each row (in order)."""
    return {"float": ["tokenizer", "data", "pretrain"], "ptq": ["ptq", "int8:ptq"], "qat": ["qat", "int8:qat"],
            "qat_skip": ["analysis", "qat_skip", "int8:qat_skip"], "pruned": ["prune"],
            "pruned_qat": ["prune", "pruned_qat", "int8:pruned_qat"]}


def _commands_for(d, ref: str) -> list[list[str]]:
    from gptforge.demo.stages import command_line

    stage, _, row = ref.partition(":")
    cmds = d.records[stage].commands
    if row:
        cmds = [c for c in cmds if str(d.p.int8 / row) in c]
    return [command_line(c) for c in cmds]


_CSS = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}"
        "th{background:#f4f4f4}pre{background:#f6f8fa;padding:1em;overflow-x:auto;font-size:13px}"
        "code{background:#f6f8fa;padding:0 3px}img{max-width:100%}")


class _Doc:
    """Collects the report as Markdown; the HTML page is rendered from it by markdown-it-py."""

    def __init__(self):
        self.md: list[str] = []

    def h(self, level: int, text: str) -> None:
        self.md += [f"{'#' * level} {text}", ""]

    def p(self, text: str) -> None:
        self.md += [text, ""]

    def items(self, lines: list[str]) -> None:
        self.md += [f"- {x}" for x in lines] + [""]

    def table(self, head: list[str], body: list[list[str]]) -> None:
        self.md += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        self.md += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body] + [""]

    def code(self, lines: list[str]) -> None:
        fence = "````" if any("```" in x for x in lines) else "```"
        self.md += [fence, *lines, fence, ""]

    def image(self, alt: str, name: str) -> None:
        self.md += [f"![{alt}]({name})", ""]

    def markdown(self) -> str:
        return "\n".join(self.md)

    def html(self) -> str:
        from markdown_it import MarkdownIt

        body = MarkdownIt("commonmark", {"html": False}).enable("table").render(self.markdown())
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>gptforge demo report"
                f"</title><style>{_CSS}</style></head><body>\n{body}</body></html>\n")


def write_report(d, rows: dict, seconds: float) -> dict[str, Path]:
    """Write report.md, report.html and the plots into the demo directory."""
    s, p = d.s, d.p
    s = trained_settings(s, Steps(**d.out("plan")["steps"]))  # the shape the plan chose
    plots = _plots(d, rows, p.out)
    data, steps = d.out("data"), d.out("plan")["steps"]
    an = d.out("analysis")
    doc = _Doc()
    doc.h(1, "gptforge demo report")
    doc.items([
        f"date: {datetime.date.today().isoformat()}; gptforge {__version__}, torch {torch.__version__}",
        f"machine: {machine()}; device used: {steps['device']}",
        f"mode: {'--quick' if s.quick else 'default'}, budget {s.minutes:g} min; this run took {seconds / 60:.1f} min "
        f"(stages finished by earlier runs not counted)",
        f"corpus: the built-in corpus (this Python's standard library), {data['tokens']:,} tokens in "
        f"{data['documents']:,} documents, BPE of {s.vocab_size} tokens learned from it",
        f"model: {s.shape.layers} layers, hidden {s.shape.hidden}, {s.shape.heads} heads, FFN {s.shape.ffn}, "
        f"seq {s.shape.seq}, batch {s.shape.batch}{_shape_note(steps)}; a training step measured at "
        f"{steps['step_seconds'] * 1e3:.0f} ms{_threads(steps)}; pretraining ({_optimizer(s)}, lr {s.max_lr:g} to "
        f"{s.min_lr:g}): {_pretrained(d, steps)}; "
        f"fine-tunes re-fitted to the budget left: {_refits(d, steps)}",
    ])
    doc.h(2, "Results")
    doc.table(*_table(rows))
    doc.p(f"tokens/s: forward-pass (scoring) throughput at batch {s.shape.batch} x {s.shape.seq} tokens on "
          f"{steps['device']}: the median of 5 interleaved rounds over the six models (each round the best of 3 "
          "passes), with the rounds' min-max; two speeds differ only where those ranges do not overlap. "
          "Bits/byte: the held-out text's total negative log-likelihood in bits over its UTF-8 bytes, which "
          "compares models whatever their tokenizer. INT8 rows are the real INT8 "
          "models (`gptforge quantize --convert`): their quality, size and speed are those of the same files. Held-out loss / ppl: `gptforge eval` with the "
          f"WikiText method on {data['heldout_chars']:,} characters of Eval-split documents (never trained on). "
          f"Cloze acc: LAMBADA-style strict whole-word accuracy on {data['cloze_examples']} passages cut from the "
          "same documents. The QAT and pruned rows fine-tuned the float model further "
          f"({_refits(d, steps)} steps), as in the reference's recipes.")
    from gptforge.demo.measure import compare_speeds

    def rounds(r: dict) -> list[float]:
        return r.get("tokens_per_s_rounds") or [r["tokens_per_s"]]

    if compare_speeds(rounds(rows["qat"]), rounds(rows["float"])) < 0:
        doc.p(f"INT8 is slower than fp32 here: at hidden size {s.shape.hidden} a Linear's matrix product is too "
              "small for the int8 kernel's saving to pay for quantizing its input and dequantizing its output. "
              "At the 345M shape the same INT8 path decodes 2.0x faster than fp32 on this kind of CPU "
              "(benchmarks/results/2026-11-22-int8_speed.md).")
    doc.h(2, "Checks")
    doc.items([f"{verdict}: {name}: {detail}" for verdict, name, detail in _checks(d, rows)])
    doc.h(2, "Plots")
    doc.image("training loss", PLOTS["loss"])
    doc.image("speed vs quality", PLOTS["tradeoff"])
    doc.image("quantization sensitivity ranking", PLOTS["sensitivity"])
    doc.h(2, "Sensitivity analysis")
    doc.p(f"qat mode (PaddleSlim AnalysisQAT): each quantized Linear in turn left float (weight restored from the "
          f"float model), metric = mean loss on Eval batches; QAT model {an['base_value']:.4f}, float model "
          f"{an['float_value']:.4f}. The top {an['k']} were left float in the next QAT run: "
          f"skip_tensor_map {an['skip_map']}.")
    doc.table(["rank", "layer", "reference name", "sensitivity"],
              [[str(i), r["name"], r["reference_name"], f"{r['sensitivity']:+.3e}"]
               for i, r in enumerate(an["ranking"][:10], 1)])
    doc.h(2, "Samples (float model, top-k 40, temperature 0.8)")
    doc.p("Whitespace is shown: ↵ ends a line, → is a tab, ␣ a trailing space; the prompt is in [brackets].")
    for x in d.out("generate")["samples"]:
        text = x["text"] or ""
        rest = text[len(x["prompt"]):] if text.startswith(x["prompt"]) else text
        doc.code(visible_whitespace(f"[{x['prompt']}]{rest}").split("\n"))
    ex = d.out("export")
    doc.h(2, "Export")
    doc.items([f"HF transformers directory (float model): {ex['hf']} ({_fmt_bytes(ex['hf_bytes'])})",
               f"ONNX INT8 QDQ (QAT model, learned scales): {ex['onnx_int8']} ({_fmt_bytes(ex['onnx_bytes'])})",
               f"`gptforge infer` on the ONNX INT8 model, greedy: {ex['infer_text']!r}"])
    doc.h(2, "Reproduce")
    doc.p("Each row's commands (run after the data commands of the first row):")
    from gptforge.demo.stages import ROWS

    for key, refs in _row_commands().items():
        doc.h(3, ROWS[key])
        doc.code([c for ref in refs for c in _commands_for(d, ref)])
    doc.h(3, "every stage, in order")
    lines = []
    for rec in d.records.values():
        if rec.name == "report":
            continue
        lines.append(f"# {rec.title} ({rec.seconds:.0f}s)")
        lines += [_commands_for(d, rec.name)[i] for i in range(len(rec.commands))] or ["# (Python: gptforge.demo)"]
    doc.code(lines)

    md = p.out / "report.md"
    md.write_text(doc.markdown(), encoding="utf-8")
    page = p.out / "report.html"
    page.write_text(doc.html(), encoding="utf-8")
    return {"md": md, "html": page, **plots}


def _optimizer(s) -> str:
    if s.optimizer == "Muon":
        return "Muon on the blocks' matrices, AdamW on the rest"
    return s.optimizer


def _pretrained(d, steps: dict) -> str:
    ran = pretrained_steps(d.out("pretrain"), steps["pretrain"])
    if ran == steps["pretrain"]:
        return f"{ran} steps"
    return (f"{ran} steps, {steps['pretrain']} planned (steps ran {'slower' if ran < steps['pretrain'] else 'faster'} "
            "than the timed one: `Engine.fit_to_max_time` re-fitted the run and its lr decay to its share of the budget)")
