"""`gptforge demo --quick`: every stage runs through the real verbs, the report holds finite
numbers and renders (valid HTML whose images exist), a second run resumes instead of redoing
work, and bad arguments or a foreign directory are refused."""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser

import pytest

from gptforge.demo.heldout import cloze_passages
from gptforge.demo.pipeline import ROWS

STAGES = ["tokenizer", "data", "plan", "pretrain", "generate", "ptq", "qat", "analysis", "qat_skip", "prune",
          "pruned_qat", "int8", "evaluate", "export", "report"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(out dir, the stage log on stderr) of one quick demo run (the CLI, in this process); stdout
    holds only the result line."""
    from gptforge.cli import main

    out = tmp_path_factory.mktemp("demo") / "run"
    import contextlib
    import io

    import torch

    threads = torch.get_num_threads()
    buf, log = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(log):
        code = main(["demo", "--quick", "--out", str(out)])
    assert code == 0, log.getvalue()[-3000:]
    # the plan may train with another thread count; the caller's is restored
    assert torch.get_num_threads() == threads
    assert buf.getvalue().startswith("gptforge demo: report ") and buf.getvalue().count("\n") == 1, buf.getvalue()
    return out, log.getvalue()


def test_every_stage_ran_and_recorded_its_commands(demo):
    out, stdout = demo
    state = json.loads((out / "demo_state.json").read_text())
    assert list(state["stages"]) == STAGES
    assert all(s["done"] for s in state["stages"].values())
    verbs = [c[0] for s in state["stages"].values() for c in s["commands"]]
    for verb in ("tokenizer", "preprocess", "pretrain", "generate", "ptq", "qat", "analyze", "prune", "quantize",
                 "eval", "export", "infer"):
        assert verb in verbs, verb
    for i, name in enumerate(STAGES, 1):
        assert f"[{i:2d}/{len(STAGES)}]" in stdout, name
    # the real artefacts exist
    assert (out / "export" / "hf" / "config.json").is_file()
    assert (out / "export" / "onnx_int8" / "model.onnx").is_file()
    assert (out / "analysis" / "skip_tensor_map.yaml").is_file()
    samples = json.loads((out / "samples.json").read_text())["results"]
    assert len(samples) == 5 and all(r["completions"][0]["text"] for r in samples)


def test_report_numbers_are_finite_and_checks_are_stated(demo):
    out, _ = demo
    rows = json.loads((out / "demo_state.json").read_text())["stages"]["evaluate"]["outputs"]
    assert list(rows) == list(ROWS)
    for key, r in rows.items():
        for field in ("ppl", "loss", "cloze_acc", "tokens_per_s", "params", "size_bytes", "bits_per_byte"):
            assert isinstance(r[field], (int, float)) and math.isfinite(r[field]), (key, field)
        assert r["tokens_per_s"] > 0 and r["size_bytes"] > 0 and r["ppl"] > 1
        assert 0 < r["bits_per_byte"] < 16
        assert len(r["tokens_per_s_rounds"]) == 5 and min(r["tokens_per_s_rounds"]) <= r["tokens_per_s"]
    # pruning really made the model smaller; INT8 weights really are smaller on disk
    assert rows["pruned"]["params"] < rows["float"]["params"]
    assert rows["qat"]["size_bytes"] < rows["float"]["size_bytes"]
    md = (out / "report.md").read_text()
    for label in ROWS.values():
        assert f"| {label} |" in md
    checks = re.findall(r"^- (PASS|FAIL|n/a): (.+?):", md, flags=re.M)
    names = [name for _, name in checks]
    assert dict((n, ok) for ok, n in checks)["QAT better than PTQ"] == "n/a"  # a --quick run cannot show it
    assert names[:3] == ["loss falls", "the float model learned the text", "QAT better than PTQ"]
    assert names[3] in ("pruned model faster than dense", "pruned vs dense speed")
    assert names[4:] == ["every number finite", "every stage ran"]
    # a speed check is PASS/FAIL only when the rounds' spreads do not overlap
    speed_verdict = checks[3][0]
    assert (speed_verdict == "n/a") == (names[3] == "pruned vs dense speed")
    assert dict((n, ok) for ok, n in checks)["loss falls"] == "PASS"
    assert dict((n, ok) for ok, n in checks)["every number finite"] == "PASS"
    # every row's reproduction commands are listed, as typed by a user
    assert md.count("gptforge pretrain -c ") >= 2 and "gptforge quantize --ckpt" in md
    assert "gptforge analyze --qat-ckpt" in md and "--top-k" in md


class _Page(HTMLParser):
    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.images, self.errors = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):  # <img ... /> opens and closes itself
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        else:
            self.stack.pop()


def test_html_report_is_well_formed_and_its_images_exist(demo):
    out, _ = demo
    text = (out / "report.html").read_text()
    assert text.startswith("<!DOCTYPE html>")
    page = _Page()
    page.feed(text)
    assert not page.errors and not page.stack
    assert len(page.images) == 3
    for src in page.images:
        data = (out / src).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, src
    assert "<table>" in text and "QAT INT8 after analysis" in text
    # rendered by markdown-it: inline code became <code>, no Markdown syntax is left in the text
    visible = re.sub(r"<pre>.*?</pre>", "", text, flags=re.S)
    visible = re.sub(r"<[^>]+>", "", visible)
    assert "`" not in visible and "**" not in visible
    assert "<code>gptforge quantize --convert</code>" in text


def test_samples_show_whitespace(demo):
    out, _ = demo
    md = (out / "report.md").read_text()
    samples = md.split("## Samples", 1)[1].split("## Export", 1)[0]
    assert "↵" in samples  # the quick model writes newlines: each is visible


def test_visible_whitespace():
    from gptforge.demo.report import visible_whitespace

    assert visible_whitespace("def") == "def"
    assert visible_whitespace("def" + "\n" * 3) == "def↵\n↵\n↵\n"
    assert visible_whitespace("a  \n\tb\x00") == "a␣␣↵\n→b\\x00"


def test_speed_comparison_needs_separate_spreads():
    from gptforge.demo.measure import compare_speeds

    assert compare_speeds([10, 11, 12], [7, 8, 9]) == 1
    assert compare_speeds([7, 8, 9], [10, 11, 12]) == -1
    assert compare_speeds([10, 11, 12], [9, 10.5, 11]) == 0  # overlapping: no measurable difference
    assert compare_speeds([10, 30, 12], [11, 11, 11]) == 0  # a higher median is not enough


def test_refit_lowers_fine_tune_steps_on_a_slower_machine():
    from gptforge.demo.plan import FULL, Settings, refit_finetune

    s = Settings(out="x", minutes=12, shape=FULL)
    done = {"tokenizer", "data", "plan", "pretrain", "generate", "ptq"}
    fast = refit_finetune(s, elapsed=300, step_seconds=0.05, done=done)
    slow = refit_finetune(s, elapsed=300, step_seconds=0.4, done=done)
    late = refit_finetune(s, elapsed=600, step_seconds=0.4, done=done)
    assert fast == 400  # the ceiling
    assert 50 <= late < slow < fast
    assert refit_finetune(s, elapsed=2000, step_seconds=0.4, done=done) == 50  # over budget: the floor
    q = Settings(out="x", quick=True, minutes=2.5)
    assert 20 <= refit_finetune(q, elapsed=10, step_seconds=0.01, done=set()) <= 40


def test_a_second_run_resumes(demo, run_cli):
    out, _ = demo
    before = json.loads((out / "demo_state.json").read_text())["stages"]
    code, _, err = run_cli("demo", "--quick", "--out", out)
    assert code == 0, err
    assert err.count("done in an earlier run") == len(STAGES) - 1  # the report is always rewritten
    after = json.loads((out / "demo_state.json").read_text())["stages"]
    assert {k: v["outputs"] for k, v in before.items() if k != "report"} == \
        {k: v["outputs"] for k, v in after.items() if k != "report"}


def test_refusals(demo, run_cli, tmp_path):
    out, _ = demo
    code, _, err = run_cli("demo", "--out", out)  # the default settings differ from the --quick run there
    assert code == 2 and "other settings" in err and "--force" in err
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    code, _, err = run_cli("demo", "--quick", "--out", foreign)
    assert code == 2 and "not a demo directory" in err and (foreign / "notes.txt").is_file()
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    code, _, err = run_cli("demo", "--quick", "--out", a_file)
    assert code == 2 and "is a file" in err
    for argv, needle in ((["--minutes", "0"], "--minutes"), (["--weight-bits", "9"], "--weight-bits"),
                         (["--prune-ratio", "1"], "--prune-ratio"), (["--top-k", "0"], "--top-k")):
        code, _, err = run_cli("demo", "--quick", "--out", tmp_path / "x", *argv)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_cloze_passages_end_on_a_word_seen_in_their_context():
    doc = "\n".join(f"line {i} alpha beta gamma delta epsilon" for i in range(40)) + "\nfinal words here gamma"
    ps = cloze_passages([doc], n=5, context_words=12)
    assert ps
    for p in ps:
        words = p.split()
        assert re.fullmatch(r"[A-Za-z]{4,}", words[-1]) and words[-1] in words[:-1]
        assert len(words) >= 7 and doc.find(p) >= 0


def test_plan_keeps_the_faster_thread_count(demo):
    from gptforge.demo.plan import fastest_threads

    timed = []

    def time_at(costs):
        def f(n):
            timed.append(n)
            return costs[n]
        return f

    # cores busy with other work: one thread is faster
    assert fastest_threads(time_at({2: 0.30, 1: 0.20}), 2) == (0.20, 1)
    # quiet: every core's thread is faster, and a tie keeps them
    assert fastest_threads(time_at({2: 0.08, 1: 0.13}), 2) == (0.08, 2)
    assert fastest_threads(time_at({4: 0.1, 1: 0.1}), 4) == (0.1, 4)
    timed.clear()
    assert fastest_threads(time_at({1: 0.1}), 1) == (0.1, 1) and timed == [1]  # one core: timed once
    assert fastest_threads(time_at({}), 0) == (0.0, 0)  # not a CPU: nothing timed
    out, stdout = demo
    plan = json.loads((out / "demo_state.json").read_text())["stages"]["plan"]["outputs"]["steps"]
    assert plan["threads"] >= 1 and f"with {plan['threads']} thread" in stdout


def test_pretrained_steps_counts_a_stage_stopped_by_max_time():
    from gptforge.demo.plan import pretrained_steps

    # the checkpoint's step, not the last logged one (the log is written every few steps)
    assert pretrained_steps({"ckpt": "/x/float/step_1196", "train": [(10, 5.0), (1136, 3.9)]}, 1420) == 1196
    assert pretrained_steps({"train": [(10, 5.0), (1230, 3.1)]}, 4780) == 1230
    assert pretrained_steps({}, 4780) == 4780


def test_plan_ladder_picks_each_shape_by_budget():
    from gptforge.demo.plan import FULL, LADDER, LARGE, choose

    assert [c.shape for c in LADDER] == [LARGE, FULL]
    large = LADDER[0].from_full_steps
    assert choose(large).shape == LARGE and choose(large - 1).shape == FULL and choose(0).shape == FULL


def test_plan_follows_the_budget_with_the_model_shape(tmp_path):
    import dataclasses

    import torch
    import yaml

    from gptforge.demo.plan import (
        FULL,
        LADDER,
        LARGE,
        Paths,
        Settings,
        Steps,
        calibrate,
        trained_settings,
        write_configs,
    )

    threads = torch.get_num_threads()
    try:
        short = calibrate(Settings(out=str(tmp_path / "a"), minutes=1.0, device="cpu"))
        long = calibrate(Settings(out=str(tmp_path / "b"), minutes=200.0, device="cpu"))
        fixed = calibrate(Settings(out=str(tmp_path / "c"), minutes=1.0, device="cpu"), adapt_shape=False)
    finally:
        torch.set_num_threads(threads)
    assert short.shape is None and short.pretrain < LADDER[0].from_full_steps
    assert long.shape == dataclasses.asdict(LARGE)
    assert fixed.shape is None
    # the choice survives the state file (JSON) and reaches the recipes
    for steps, shape in ((short, FULL), (long, LARGE)):
        again = Steps(**json.loads(json.dumps(dataclasses.asdict(steps))))
        s = Settings(out=str(tmp_path / "a"), minutes=1.0)
        t = trained_settings(s, again)
        lr = steps.max_lr or s.max_lr
        assert t.shape == shape and t.max_lr == lr and s.shape == FULL
        written = write_configs(t, Paths(t.out), again)
        pre = yaml.safe_load(written["pretrain"].read_text())
        assert pre["Model"]["hidden_size"] == shape.hidden and pre["Optimizer"]["lr"]["max_lr"] == lr
        assert pre["Model"]["vocab_size"] == 4096
        # pretraining with Muon (sweep round 9); the fine-tunes keep the reference's AdamW
        assert pre["Optimizer"]["name"] == "Muon"
        assert [yaml.safe_load(written[k].read_text())["Optimizer"]["name"] for k in ("qat", "prune")] == [
            "FusedAdamW", "FusedAdamW"]
    assert trained_settings(s, fixed) is s


def test_demo_vocabulary_default_depends_on_quick():
    from gptforge.demo.plan import QUICK_VOCAB, VOCAB, Settings

    assert Settings(out="x").vocab_size == VOCAB == 4096
    assert Settings(out="x", quick=True).vocab_size == QUICK_VOCAB
    assert Settings(out="x", vocab_size=1024).vocab_size == 1024


def test_stages_run_their_verbs_through_the_runner_handed_in(tmp_path):
    """The demo sits below the CLI: it runs each verb through the runner its caller hands in
    (`gptforge demo` passes cli.main) and reports a verb's failure as the stage's."""
    from gptforge.demo import QUICK, DemoError, Settings, run_demo

    calls = []

    def runner(argv):
        calls.append(argv)
        print("refused by the test runner")
        return 3

    with pytest.raises(DemoError, match=r"stage 'tokenizer' failed: `gptforge tokenizer train .*` exited with 3"):
        run_demo(Settings(out=str(tmp_path / "run"), quick=True, minutes=2.5, shape=QUICK), runner, echo=False)
    assert len(calls) == 1 and calls[0][:2] == ["tokenizer", "train"] and all(isinstance(a, str) for a in calls[0])
    assert "refused by the test runner" in (tmp_path / "run" / "logs" / "tokenizer.log").read_text()


def test_split_documents_reads_each_part_from_a_fraction_on_up_to_a_length(tmp_path):
    """Train / Eval / Test documents of token files by the split's ranges (Eval: what the demo
    holds out); `first` starts part-way into the range, `chars` stops once that much text is read."""
    import numpy as np

    from gptforge.demo.heldout import eval_documents, split_documents

    class Tok:
        eos_token_id = 0

        def decode(self, ids):
            return " ".join(f"d{i}" for i in ids)

    lens = np.full(10, 2)
    ids = np.array([t for d in range(1, 11) for t in (d, 0)], dtype=np.uint16)  # each document: its number, eos
    np.save(tmp_path / "c_ids.npy", ids)
    np.savez(tmp_path / "c_idx.npz", lens=lens)
    prefix = tmp_path / "c"
    assert split_documents(prefix, Tok(), "6,2,2", 0) == [f"d{i}" for i in range(1, 7)]
    assert split_documents(prefix, Tok(), "6,2,2", 1) == eval_documents(prefix, Tok(), "6,2,2") == ["d7", "d8"]
    assert split_documents(prefix, Tok(), "6,2,2", 2) == ["d9", "d10"]
    assert split_documents(prefix, Tok(), "6,2,2", 0, first=0.5) == ["d4", "d5", "d6"]
    assert split_documents(prefix, Tok(), "6,2,2", 0, first=0.5, chars=3) == ["d4", "d5"]
