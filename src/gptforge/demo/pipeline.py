"""`run_demo`: the whole life cycle on the built-in corpus, one stage after another.

Every stage that a user would run by hand runs the real CLI verb in this process, through the
runner its caller hands in (`gptforge demo` passes `cli.main`; the demo never imports the CLI),
so the commands the report prints are exactly what ran. A verb's output goes to
`<out>/logs/<stage>.log`; training stages also echo their log lines.

Nothing is lost on a crash: `<out>/demo_state.json` records each finished stage (written
atomically), training stages checkpoint every quarter of their steps and run with
`--resume auto`, and running the demo again with the same `--out` and settings continues at the
first unfinished stage. Other settings in an existing directory are refused unless `--force`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gptforge.demo.plan import (
    PRETRAIN_MAX,
    PROMPTS,
    SPLIT,
    Paths,
    Settings,
    Steps,
    calibrate,
    pretrain_seconds,
    pretrained_steps,
    refit_finetune,
    threads_text,
    trained_settings,
    write_configs,
)
from gptforge.demo.stages import ROWS, STAGES, command_line
from gptforge.errors import GPTForgeError, UsageError
from gptforge.evaluate.common import write_json_atomic

STATE_FORMAT = "gptforge-demo/1"
VerbRunner = Callable[[list[str]], int]  # runs one verb in this process: argv -> exit code (cli.main)


class DemoError(GPTForgeError):
    """A demo stage failed; the message names the stage, its log and how to continue."""


class _Tee(io.TextIOBase):
    """Writes to a log file; with `echo`, also the lines that pass `keep` to the console."""

    def __init__(self, log, console, keep: Callable[[str], bool] | None):
        self.log, self.console, self.keep, self.buf = log, console, keep, ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.log.write(s)
        if self.keep is not None:
            self.buf += s
            while "\n" in self.buf:
                line, self.buf = self.buf.split("\n", 1)
                if self.keep(line):
                    self.console.write(f"      {line}\n")
                    self.console.flush()
        return len(s)

    def flush(self) -> None:
        self.log.flush()


def _loss_summary(o: dict) -> str:
    steps = f"{o['steps']} steps, " if o.get("steps") else ""
    return f"{steps}loss {o['train'][0][1]:.3f} -> {o['train'][-1][1]:.3f}"


def _train_lines(line: str) -> bool:
    return line.startswith(("[train]", "[eval]", "[Training]", "[fit]", "[stop]"))


@dataclass
class StageRecord:
    name: str
    title: str
    commands: list[list[str]] = field(default_factory=list)
    seconds: float = 0.0
    outputs: dict = field(default_factory=dict)
    done: bool = False


class Demo:
    """The stages, their state file and the context they run in."""

    def __init__(self, settings: Settings, run_verb: VerbRunner, force: bool = False, echo: bool = True):
        self.s = settings
        self.run_verb = run_verb
        self.p = Paths(settings.out)
        self.echo = echo
        self.console = sys.stderr  # the stage log; stdout keeps the result line (docs/cli.md)
        self.records: dict[str, StageRecord] = {}
        self.refits: dict[str, int] = {}  # fine-tune steps re-fitted to the budget left, per stage
        self._current: StageRecord | None = None
        self._stage_t0: float | None = None  # when the running stage started (perf_counter)
        self._open_state(force)

    # ------------------------------------------------------------------ state

    def _open_state(self, force: bool) -> None:
        p = self.p
        if p.out.exists() and not p.out.is_dir():
            raise UsageError(f"{p.out}: is a file; --out must name a directory")
        missing = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
        if missing:  # the export stage needs them: say so now, not after the training stages
            raise UsageError(f"the demo exports to ONNX and needs {' and '.join(missing)}: "
                             "pip install 'gptforge[export]' (make demo installs it)")
        if p.state.is_file():
            try:
                doc = json.loads(p.state.read_text())
            except ValueError:
                doc = {}
            if doc.get("format") == STATE_FORMAT and doc.get("settings") == _jsonable(self.s.fingerprint()) and not force:
                self.records = {k: StageRecord(**v) for k, v in doc.get("stages", {}).items()}
                self.refits = {k: int(v) for k, v in doc.get("refits", {}).items()}
                return
            if not force:
                raise UsageError(f"{p.out}: holds a demo run with other settings; pass --force to start it over, "
                                 "or choose another --out")
        elif p.out.exists() and any(p.out.iterdir()) and not force:
            raise UsageError(f"{p.out}: exists and is not a demo directory; choose another --out or pass --force")
        if force and p.out.exists():
            shutil.rmtree(p.out)
        p.out.mkdir(parents=True, exist_ok=True)
        self._save()

    def _save(self) -> None:
        doc = {"format": STATE_FORMAT, "settings": _jsonable(self.s.fingerprint()),
               "stages": {k: asdict(v) for k, v in self.records.items()}, "refits": self.refits}
        write_json_atomic(self.p.state, doc, default=str)

    def out(self, stage: str) -> dict:
        return self.records[stage].outputs

    # ------------------------------------------------------------------ running

    def elapsed(self) -> float:
        """Seconds the finished stages took (over every run of this demo directory)."""
        return sum(r.seconds for r in self.records.values() if r.done)

    def running_elapsed(self) -> float:
        """`elapsed()` plus the time the running stage has taken so far."""
        t0 = self._stage_t0
        return self.elapsed() + (time.perf_counter() - t0 if t0 is not None else 0.0)

    def _clock(self) -> str:
        from gptforge.demo.overall import budget_text

        return budget_text(self.elapsed(), 60.0 * self.s.minutes)

    def say(self, line: str) -> None:
        if self.echo:
            print(line, file=self.console, flush=True)

    def stage(self, index: int, total: int, name: str, title: str, fn: Callable[[], dict],
              summary: Callable[[dict], str] | None = None, clean: tuple[Path, ...] = ()) -> dict:
        """Run `fn` as stage `name` unless an earlier run finished it; record its outputs."""
        rec = self.records.get(name)
        tag = f"[{index:2d}/{total}] {title}"
        if rec is not None and rec.done:
            self.say(f"{tag}: done in an earlier run")
            return rec.outputs
        for d in clean:  # a stage that stopped half-way starts over (training stages resume instead)
            shutil.rmtree(d, ignore_errors=True)
        self.say(f"{tag} ... ({self._clock()})")
        rec = StageRecord(name, title)
        self.records[name] = rec
        self._current = rec
        t0 = self._stage_t0 = time.perf_counter()
        try:
            rec.outputs = fn() or {}
        finally:
            self._stage_t0 = None
        rec.seconds = time.perf_counter() - t0
        rec.done = True
        self._current = None
        self._save()
        extra = f": {summary(rec.outputs)}" if summary is not None else ""
        self.say(f"      done in {rec.seconds:.0f}s{extra}")
        return rec.outputs

    def cli(self, *argv, show: Callable[[str], bool] | None = None) -> str:
        """Run `gptforge <argv>` in this process; its output goes to the stage's log. Returns stdout."""
        argv = [str(a) for a in argv]
        rec = self._current
        rec.commands.append(argv)
        self.p.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.p.logs / f"{rec.name}.log"
        captured = io.StringIO()
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"$ {command_line(argv)}\n")
            log.flush()
            tee_out = _Tee(_Both(log, captured), self.console, show if self.echo else None)
            tee_err = _Tee(log, self.console, None)
            with contextlib.redirect_stdout(tee_out), contextlib.redirect_stderr(tee_err):
                try:
                    code = self.run_verb(argv)
                except SystemExit as e:  # argparse errors
                    code = e.code if isinstance(e.code, int) else 2
            log.write(f"[exit {code}]\n\n")
        if code != 0:
            tail = [ln for ln in log_path.read_text(encoding="utf-8").splitlines() if ln.strip()][-3:-1]
            raise DemoError(f"stage {rec.name!r} failed: `{command_line(argv)}` exited with {code} "
                            f"({' | '.join(tail)}); see {log_path}. Fix the cause and run the demo again: "
                            "finished stages are kept")
        return captured.getvalue()


class _Both(io.TextIOBase):
    def __init__(self, a, b):
        self.a, self.b = a, b

    def write(self, s: str) -> int:
        self.a.write(s)
        self.b.write(s)
        return len(s)

    def flush(self) -> None:
        self.a.flush()


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def _latest(run_dir: Path) -> str:
    from gptforge.train import checkpoint as ckpt

    last = ckpt.latest_checkpoint(run_dir)
    if last is None:
        raise DemoError(f"{run_dir}: the run finished without a checkpoint")
    return str(last)


def _metrics(run_dir: Path) -> dict:
    """Train/eval curves of a training run's metrics.jsonl."""
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]
    evals = [(r["step"], r["loss"]) for r in rows if r["kind"] == "eval"]
    summary = next((r for r in reversed(rows) if r["kind"] == "summary"), {})
    return {"train": train, "eval": evals, "tokens_per_s": summary.get("tokens_per_s"),
            "train_time_s": summary.get("train_time_s")}


# ---------------------------------------------------------------------- the stages


def run_demo(settings: Settings, run_verb: VerbRunner, force: bool = False, echo: bool = True) -> dict:
    """Run (or continue) the demo in `settings.out`, the verbs through `run_verb`; returns the report's data."""
    import torch

    from gptforge.demo.overall import OverallBar, wanted

    d = Demo(settings, run_verb, force=force, echo=echo)
    threads = torch.get_num_threads()  # the plan may choose another count; the caller gets its own back
    try:
        if not wanted(echo, d.console):
            return _run_stages(d)
        with OverallBar(d.running_elapsed, 60.0 * settings.minutes, d.console) as bar:
            d.console = bar.console
            try:
                return _run_stages(d)
            finally:
                d.console = bar.real
    finally:
        torch.set_num_threads(threads)


def _run_stages(d: Demo) -> dict:
    s, p = d.s, d.p
    t_start = time.perf_counter()
    N = STAGES
    d.say(f"gptforge demo: {'quick, ' if s.quick else ''}budget {s.minutes:g} min, output {p.out}")

    d.stage(1, N, "tokenizer", f"learn a {s.vocab_size}-token BPE on the built-in corpus", lambda: (
        d.cli("tokenizer", "train", "--builtin", "--vocab-size", s.vocab_size, "--out", p.tokenizer, "--force",
              "--no-progress"), {"dir": str(p.tokenizer)})[1])

    def data():
        from gptforge.data.indexed import load_token_files
        from gptforge.data.tokenizer import load_tokenizer
        from gptforge.demo.heldout import write_heldout, xz_bits_per_byte

        # --force on the demo's own outputs: a stage that runs again (it stopped half-way) redoes them
        d.cli("preprocess", "--builtin", "--tokenizer", p.tokenizer, "--output-prefix", p.prefix, "--force",
              "--no-progress")
        tf = load_token_files(p.prefix)
        tok = load_tokenizer(str(p.tokenizer))
        h = write_heldout(p.prefix, tok, SPLIT, p.data, max_chars=12_000 if s.quick else 40_000,
                          cloze_examples=60 if s.quick else 200)
        p.prompts.write_text("".join(x + "\n" for x in PROMPTS), encoding="utf-8")
        return {"tokens": int(len(tf.ids)), "documents": tf.n_docs, "eval_documents": h.documents,
                "heldout_chars": h.text_chars, "cloze_examples": h.cloze_examples,
                "xz_bits_per_byte": xz_bits_per_byte(p.heldout.read_bytes())}

    d.stage(2, N, "data", "tokenize the corpus; cut held-out text and a cloze set from the Eval documents", data,
            lambda o: f"{o['tokens']:,} tokens in {o['documents']:,} documents; held-out {o['heldout_chars']:,} "
                      f"chars, {o['cloze_examples']} cloze passages", clean=(p.data,))

    def plan():
        st = calibrate(s)
        files = write_configs(trained_settings(s, st), p, st)
        return {"steps": asdict(st), "configs": {k: str(v) for k, v in files.items()}}

    steps = Steps(**d.stage(3, N, "plan", "time a training step; fit the step counts to the budget", plan,
                            lambda o: f"{o['steps']['step_seconds'] * 1e3:.0f} ms/step on {o['steps']['device']}"
                                      f"{threads_text(o['steps'].get('threads', 0))}: "
                                      f"pretrain {o['steps']['pretrain']} steps, fine-tunes "
                                      f"{o['steps']['finetune']} steps")["steps"])
    s = trained_settings(s, steps)
    if steps.threads:
        import torch

        torch.set_num_threads(steps.threads)  # the count the plan timed faster, also when continuing a demo
    cfg_pre, cfg_qat, cfg_prune = (str(p.config(n)) for n in ("pretrain", "qat", "prune"))

    def pretrain():
        # The step timed by the plan is a guess on a shared machine (measured: 173 ms timed, 145 ms
        # trained; 203 ms timed, 380-480 ms trained): the trainer re-fits the run's length and its
        # lr decay to the pretraining share of the budget as it goes, and stops there at the latest.
        # Not in --quick (a smoke test that should end as soon as it can); never past the plan's
        # cap on steps (more passes over the small corpus would not help).
        fit = () if s.quick else ("-o", "Engine.fit_to_max_time=true", "-o", f"Engine.fit_max_steps={PRETRAIN_MAX}")
        d.cli("pretrain", "-c", cfg_pre, "--resume", "auto", "-o", f"Engine.max_time={pretrain_seconds(s):.0f}",
              *fit, "--no-progress", show=_train_lines)
        out = {"ckpt": _latest(p.float), **_metrics(p.float)}
        return {**out, "steps": pretrained_steps(out, steps.pretrain)}

    fl = d.stage(4, N, "pretrain", f"pretrain {steps.pretrain} steps", pretrain,
                 _loss_summary)
    FLOAT = fl["ckpt"]

    def generate():
        d.cli("generate", "--ckpt", FLOAT, "--prompt-file", p.prompts, "-o", "Generation.decode_strategy=sampling",
              "-o", "Generation.top_k=40", "-o", "Generation.temperature=0.8", "-o", "Generation.max_dec_len=48",
              "-o", "Generation.seed=1", "--json", p.samples, "--force", "--no-stream")
        doc = json.loads(p.samples.read_text())
        return {"samples": [{"prompt": r.get("prompt"), "text": r.get("text")} for r in _sample_rows(doc)]}

    d.stage(5, N, "generate", "sample text from the float model", generate,
            lambda o: f"{len(o['samples'])} samples -> {p.samples}")

    d.stage(6, N, "ptq", "PTQ: calibrate INT8 activation scales, no training", lambda: (
        d.cli("ptq", "-c", cfg_qat, "--ckpt", FLOAT, "--out", p.ptq, "--force", "--no-progress"),
        {"dir": str(p.ptq)})[1], clean=(p.ptq,))

    def finetune_steps(stage: str) -> int:
        """The stage's step count, re-fitted to the budget left (kept once chosen, so a resumed
        stage continues with the same count)."""
        if stage not in d.refits:
            done = {k for k, r in d.records.items() if r.done}
            per_step = (d.records["pretrain"].seconds / max(pretrained_steps(d.out("pretrain"), steps.pretrain), 1)
                        if "pretrain" in d.records else 0.0)
            if per_step <= 0 or not d.records["pretrain"].seconds:  # pretrained by an earlier version: keep the plan
                d.refits[stage] = steps.finetune
            else:
                d.refits[stage] = refit_finetune(s, d.elapsed(), per_step, done)
            d._save()
        return d.refits[stage]

    def ft_overrides(n: int) -> tuple[str, ...]:
        q4 = str(max(n // 4, 1))
        return ("-o", f"Engine.max_steps={n}", "-o", f"Optimizer.lr.decay_steps={n}", "-o",
                f"Engine.save_load.save_steps={q4}", "-o", f"Engine.eval_freq={q4}", "-o", f"Engine.logging_freq={q4}")

    def qat(stage: str, out_dir: Path, start: str, extra: tuple[str, ...] = ()):
        def fn():
            d.cli("qat", "-c", cfg_qat, "-o", f"Compress.pretrained={start}",
                  "-o", f"Engine.save_load.output_dir={out_dir}", *ft_overrides(finetune_steps(stage)), *extra,
                  "--resume", "auto", "--no-progress", show=_train_lines)
            return {"ckpt": _latest(out_dir), "steps": finetune_steps(stage), **_metrics(out_dir)}
        return fn

    q = d.stage(7, N, "qat", "QAT: INT8 quantization-aware training", qat("qat", p.qat, FLOAT),
                _loss_summary)
    QAT = q["ckpt"]

    def analysis():
        from gptforge.compress.sensitivity_report import flow_map, skip_tensor_map, suggest_k

        base = ["analyze", "--qat-ckpt", QAT, "--float-ckpt", FLOAT, "--metric", "loss",
                "--batches", 4 if s.quick else 8, "--out", p.analysis, "--no-progress"]
        d.cli(*base)
        doc = json.loads((p.analysis / "analysis.json").read_text())
        ranking = doc["ranking"]
        if s.top_k is not None:
            k = s.top_k
        else:
            # the analysis' suggestion, at most a quarter of the layers (the seed left 7 of 96 float)
            from gptforge.compress.sensitivity import Analysis, LayerResult

            an = Analysis(doc["mode"], doc["metric"], doc.get("metric_label", ""), doc["base_value"],
                          {r["name"]: LayerResult(r["name"], r["reference_name"], r["value"], r["sensitivity"], 0.0)
                           for r in ranking}, [r["name"] for r in ranking])
            k = min(max(1, suggest_k(an)), max(1, len(ranking) // 4))
        d.cli(*base, "--top-k", k, "--no-plot")  # resumes: every layer is done, only the skip list is written
        top = [r["name"] for r in ranking[:k]]
        return {"k": k, "top": top, "skip_map": flow_map(skip_tensor_map(top)), "ranking": ranking,
                "base_value": doc["base_value"], "float_value": doc.get("float_value"),
                "png": str(p.analysis / "analysis.png")}

    an = d.stage(8, N, "analysis", "sensitivity analysis of every quantized Linear", analysis,
                 lambda o: f"most sensitive: {', '.join(o['top'])} (k = {o['k']})", clean=(p.analysis,))

    qs = d.stage(9, N, "qat_skip", f"QAT again with the top {an['k']} layers left float",
                 qat("qat_skip", p.qat_skip, FLOAT,
                     ("-o", f"Compress.Quantization.skip_tensor_map={an['skip_map']}")),
                 _loss_summary)

    def prune():
        d.cli("prune", "-c", cfg_prune, "--ckpt", FLOAT, *ft_overrides(finetune_steps("prune")), "--resume", "auto",
              "--no-progress", show=_train_lines)
        return {"ckpt": _latest(p.pruned), "steps": finetune_steps("prune"), **_metrics(p.pruned)}

    pr = d.stage(10, N, "prune", f"prune {s.prune_ratio:.0%} of heads and FFN neurons, fine-tune", prune,
                 _loss_summary)
    PRUNED = pr["ckpt"]

    pq = d.stage(11, N, "pruned_qat", "QAT of the pruned model", qat("pruned_qat", p.pruned_qat, PRUNED),
                 _loss_summary)

    sources = {"ptq": str(p.ptq), "qat": QAT, "qat_skip": qs["ckpt"], "pruned_qat": pq["ckpt"]}

    def convert():
        for row, src in sources.items():
            d.cli("quantize", "--ckpt", src, "--convert", "--out", p.int8 / row, "--force")
        return {row: str(p.int8 / row) for row in sources}

    conv = d.stage(12, N, "int8", "convert the fake-quant models into real INT8 models", convert,
                   lambda o: f"{len(o)} INT8 models in {p.int8}", clean=(p.int8,))
    models = {"float": FLOAT, "pruned": PRUNED, **conv}
    models = {k: models[k] for k in ROWS}

    def evaluate():
        from gptforge.demo.measure import measure_models

        sh = s.shape
        res = {}
        for row, path in models.items():
            common = ["-o", f"Offline_Eval.max_seq_len={sh.seq}", "-o", "Offline_Eval.batch_size=16", "--force", "--no-progress"]
            d.cli("eval", "--ckpt", path, "-o", f"Offline_Eval.eval_path={p.heldout}", "-o", "Offline_Eval.cloze_eval=False",
                  "-o", f"Offline_Eval.overlapping_eval={sh.seq // 2}", "-o", "Offline_Eval.detokenize=False", *common, "--output", p.evals / f"{row}_ppl.json")
            d.cli("eval", "--ckpt", path, "-o", f"Offline_Eval.eval_path={p.cloze}", "-o", "Offline_Eval.cloze_eval=True",
                  *common, "--output", p.evals / f"{row}_cloze.json")
            ppl = json.loads((p.evals / f"{row}_ppl.json").read_text())["metrics"]
            cloze = json.loads((p.evals / f"{row}_cloze.json").read_text())["metrics"]
            res[row] = {"dir": path, "ppl": ppl["ppl"], "loss": ppl["avg_loss"], "cloze_acc": cloze["accuracy"],
                        "bits_per_byte": ppl["bits_per_byte"]}
        for row, m in measure_models(models, sh.batch, sh.seq, s.device).items():
            res[row].update(m)
        return res

    ev = d.stage(13, N, "evaluate", "evaluate every model: held-out perplexity, cloze accuracy, size, speed",
                 evaluate, lambda o: ", ".join(f"{k} {v['bits_per_byte']:.3f} bits/byte" for k, v in o.items()),
                 clean=(p.evals,))

    def export():
        d.cli("export", "--format", "hf", "--ckpt", FLOAT, "--out", p.export / "hf", "--force")
        d.cli("export", "--format", "onnx", "--ckpt", QAT, "--out", p.export / "onnx_int8", "--force")
        text = d.cli("infer", "--onnx", p.export / "onnx_int8", "--prompt", PROMPTS[0],
                     "-o", "Generation.decode_strategy=greedy_search", "-o", "Generation.max_dec_len=24", "--no-stream")
        return {"hf": str(p.export / "hf"), "onnx_int8": str(p.export / "onnx_int8"),
                "hf_bytes": sum(f.stat().st_size for f in (p.export / "hf").rglob("*") if f.is_file()),
                "onnx_bytes": sum(f.stat().st_size for f in (p.export / "onnx_int8").rglob("*") if f.is_file()),
                "infer_text": text.strip()}

    d.stage(14, N, "export", "export: HF directory (float) and ONNX INT8 (QAT), generate with onnxruntime", export,
            lambda o: f"{o['hf']}, {o['onnx_int8']}", clean=(p.export,))

    def report():
        from gptforge.demo.report import write_report

        files = write_report(d, ev, time.perf_counter() - t_start)
        return {k: str(v) for k, v in files.items()}

    # The report is always rewritten: it also tells how long this run took.
    d.records.pop("report", None)
    rep = d.stage(15, N, "report", "write the report", report, lambda o: f"{o['md']}, {o['html']}")
    return {"report": rep, "rows": ev, "stages": {k: asdict(v) for k, v in d.records.items()}}


def _sample_rows(doc: dict) -> list[dict]:
    """(prompt, first completion) pairs of a `gptforge generate --json` file."""
    return [{"prompt": r["prompt"], "text": (r.get("completions") or [{}])[0].get("text", "")}
            for r in doc.get("results", [])]
