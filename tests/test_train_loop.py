"""The training loop: learning, exact resume, crash safety, overflow/non-finite handling, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gptforge.errors import CheckpointError
from gptforge.model_io import load_run_config
from gptforge.train import NonFiniteLossError, Trainer, pretrain
from gptforge.train import checkpoint as ckpt
from gptforge.train.optim import LRSchedule
from test_train_support import small_tokenizer, state_equal, train_config

ROOT = Path(__file__).resolve().parents[1]



pytestmark = pytest.mark.usefixtures("one_thread")

def _train(cfg, **kw):
    return pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False, **kw)


def test_loss_falls_and_lr_follows_the_schedule(tmp_path):
    cfg = train_config(tmp_path, "Engine.save_load.save_steps=-1", steps=40)
    t = Trainer(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    r = t.train()
    assert r.step == 40 and len(r.losses) == 40
    assert sum(r.losses[-5:]) / 5 < 0.6 * sum(r.losses[:5]) / 5
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in rows if x["kind"] == "train"]
    sched = LRSchedule.from_config(cfg)
    # update k (0-based) uses lr(k * global_batch_size)
    assert [x["lr"] for x in train] == pytest.approx([sched(k * 4) for k in range(40)])
    assert train[0]["lr"] == 0.0
    assert [x["step"] for x in rows if x["kind"] == "eval"] == list(range(4, 41, 4))
    # the only checkpoint is the final one, and it is a loadable model directory
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path / "out")] == ["step_40"]
    from gptforge.model_io import load_model

    model, _ = load_model(tmp_path / "out")
    assert state_equal(model.state_dict(), t.model.state_dict())
    assert (tmp_path / "out" / "train.log").read_text().count("[train]") == 40
    assert list((tmp_path / "out" / "tensorboard").iterdir())


@pytest.mark.parametrize("optimizer", ["FusedAdamW", "Muon"])
def test_exact_resume_is_bit_identical(tmp_path, optimizer):
    """N steps straight == N/2, then a new Trainer resuming from the step-N/2 checkpoint."""
    over = ("Optimizer.grad_clip.clip_norm=0.5", "Engine.eval_freq=2", "Data.Train.loader.num_workers=1",
            f"Optimizer.name={optimizer}")
    a = _train(train_config(tmp_path / "a", *over, dropout=0.1, steps=8))
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path / "a" / "out")] == ["step_4", "step_8"]

    torch.manual_seed(12345)  # resume must not depend on the state of the process
    import random

    import numpy as np
    random.seed(1)
    np.random.seed(1)
    cfg_b = train_config(tmp_path / "b", *over, f"Engine.save_load.ckpt_dir={tmp_path / 'a' / 'out' / 'step_4'}",
                         dropout=0.1, steps=8)
    b = _train(cfg_b)
    assert b.losses == a.losses[4:]  # exact float equality
    assert b.eval_losses == a.eval_losses[2:]
    sd = lambda p: __import__("safetensors.torch").torch.load_file(str(p / "model.safetensors"))  # noqa: E731
    assert state_equal(sd(tmp_path / "a" / "out" / "step_8"), sd(tmp_path / "b" / "out" / "step_8"))
    oa = torch.load(tmp_path / "a" / "out" / "step_8" / ckpt.STATE_FILE, weights_only=True)["optimizer"]["state"]
    ob = torch.load(tmp_path / "b" / "out" / "step_8" / ckpt.STATE_FILE, weights_only=True)["optimizer"]["state"]
    assert all(state_equal(oa[k], ob[k]) for k in oa)
    meta = ckpt.read_meta(tmp_path / "b" / "out" / "step_8")
    assert meta["consumed_samples"] == 32 and meta["eval_batches"] == 8
    if optimizer == "Muon":  # its momentum buffers were saved and restored, not restarted
        assert sum("momentum_buffer" in v for v in ob.values()) == 4 * 2
        other = train_config(tmp_path / "c", f"Engine.save_load.ckpt_dir={tmp_path / 'a' / 'out' / 'step_4'}",
                             steps=8)  # resumed with another optimizer: one line naming the file
        with pytest.raises(CheckpointError, match=r"training_state.pt: optimizer state does not fit .*parameter groups"):
            _train(other)


KILLER = textwrap.dedent("""
    import os, signal, sys
    import gptforge.train.checkpoint as C
    real = C.write_model_files
    def dying(model, cfg, dest, tokenizer=None):
        real(model, cfg, dest, tokenizer)
        if dest.name.startswith(".step_4."):
            os.kill(os.getpid(), signal.SIGKILL)  # mid-write: model files written, state not yet
    C.write_model_files = dying
    from gptforge.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_sigkill_during_checkpoint_write_then_resume_auto(tmp_path, run_cli):
    from gptforge.config import save_config

    cfg = train_config(tmp_path, "Engine.save_load.save_steps=2", steps=6)
    cfg_file = tmp_path / "run.yaml"
    save_config(cfg, cfg_file)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}  # same threads as here: same floats
    proc = subprocess.run([sys.executable, "-c", KILLER, "pretrain", "-c", str(cfg_file), "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    out = tmp_path / "out"
    assert [p.name for _, p in ckpt.list_checkpoints(out)] == ["step_2"]
    assert any(p.name.startswith(".step_4.tmp-") for p in out.iterdir())  # the torn write
    assert ckpt.latest_checkpoint(out).name == "step_2"

    code, stdout, stderr = run_cli("pretrain", "-c", cfg_file, "--resume", "auto", "--no-progress")
    assert code == 0, stderr
    assert f"resumed from {out / 'step_2'} at step 2" in stdout
    assert "batch: [3/6]" in stdout and "batch: [2/6]" not in stdout
    assert [p.name for _, p in ckpt.list_checkpoints(out)] == ["step_2", "step_4", "step_6"]
    assert not any(p.name.startswith(".") for p in out.iterdir())

    # and the result equals an uninterrupted run
    straight = _train(train_config(tmp_path / "straight", "Engine.save_load.save_steps=2", steps=6))
    from safetensors.torch import load_file

    assert state_equal(load_file(str(out / "step_6" / "model.safetensors")),
                       load_file(str(straight.checkpoint_dir / "model.safetensors")))


def test_keep_last_and_resume_auto_without_checkpoint(tmp_path, capsys):
    cfg = train_config(tmp_path, "Engine.save_load.save_steps=1", "Engine.save_load.keep_last=2", steps=5)
    r = _train(cfg, resume="auto")
    assert "no complete checkpoint" in capsys.readouterr().err
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path / "out")] == ["step_4", "step_5"]
    assert r.checkpoint_dir == tmp_path / "out" / "step_5"


def _inject(trainer, step, value):
    """Make the gradient of one parameter `value` during update number `step` (1-based)."""
    p = trainer.model.blocks[0].linear1.weight
    calls = {"n": 0}

    def hook(grad):
        calls["n"] += 1
        if calls["n"] in range((step - 1) * trainer.acc + 1, step * trainer.acc + 1):
            return torch.full_like(grad, value)
        return grad

    p.register_hook(hook)


def test_fp16_overflow_skips_update_and_lr_advance(tmp_path):
    cfg = train_config(tmp_path, "Engine.mix_precision.enable=True", "Engine.mix_precision.dtype=float16",
                       "Engine.mix_precision.scale_loss=256", "Engine.save_load.save_steps=-1", "Engine.eval_freq=-1",
                       steps=4)
    t = Trainer(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    _inject(t, 3, float("inf"))
    it = t._batches("Train", 0)
    stats, snaps = [], []
    for _ in range(4):
        before = {k: v.clone() for k, v in t.model.state_dict().items()}
        samples = t.scheduler.samples
        stats.append(t.train_step(next(it)))
        snaps.append((before, samples))
        t.step += 1
    assert [s["found_inf"] for s in stats] == [0, 0, 1, 0]
    assert [s["loss_scale"] for s in stats] == [256.0, 256.0, 128.0, 128.0]
    assert state_equal(snaps[2][0], snaps[3][0])  # step 3 changed nothing
    assert not state_equal(snaps[1][0], snaps[2][0])
    assert t.scheduler.samples == 3 * 4  # 4 steps, one skipped: the LR advanced 3 times
    assert stats[3]["lr"] == stats[2]["lr"]  # the retry uses the LR the skipped step would have used
    assert all(torch.isfinite(v).all() for v in t.model.state_dict().values())


def test_fp16_and_bf16_train_end_to_end_on_cpu(tmp_path):
    for dtype in ("float16", "bfloat16"):
        cfg = train_config(tmp_path / dtype, "Engine.mix_precision.enable=True", f"Engine.mix_precision.dtype={dtype}",
                           steps=4)
        r = _train(cfg)
        assert torch.isfinite(torch.tensor(r.losses)).all()
        assert r.metrics["precision"] == {"float16": "fp16", "bfloat16": "bf16"}[dtype]
        line = (tmp_path / dtype / "out" / "train.log").read_text()
        assert ("loss_scale: 32768.000000000" in line) == (dtype == "float16")
        st = torch.load(r.checkpoint_dir / ckpt.STATE_FILE, weights_only=True)
        assert (st["precision"]["scaler"] is not None) == (dtype == "float16")


def test_nonfinite_fp32_stops_and_keeps_last_checkpoint(tmp_path):
    cfg = train_config(tmp_path, "Engine.save_load.save_steps=2", "Engine.eval_freq=-1", steps=6)
    t = Trainer(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    _inject(t, 3, float("nan"))
    with pytest.raises(NonFiniteLossError, match="step 3: gradient norm is nan .*last good checkpoint") as e:
        t.train()
    assert e.value.step == 3 and e.value.last_checkpoint == tmp_path / "out" / "step_2"
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path / "out")] == ["step_2"]

    cfg = train_config(tmp_path / "skip", "Engine.on_nonfinite=skip", "Engine.eval_freq=-1", steps=4)
    t = Trainer(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    _inject(t, 3, float("nan"))
    r = t.train()
    assert r.step == 4 and t.scheduler.samples == 3 * 4
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    rows = [json.loads(x) for x in (tmp_path / "skip" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x["found_inf"] for x in rows if x["kind"] == "train"] == [0, 0, 1, 0]


def test_pretrained_weights_then_transform_order(tmp_path):
    from gptforge.model import build_model
    from gptforge.model_io import save_model_dir

    cfg = train_config(tmp_path, steps=2)
    src = build_model(cfg.Model)
    save_model_dir(src, cfg, tmp_path / "pre", tokenizer=small_tokenizer())
    cfg.Compress.pretrained = str(tmp_path / "pre")
    seen = {}

    def transform(model):
        seen["equal"] = state_equal(model.state_dict(), src.state_dict())
        model.wpe.weight.requires_grad_(False)
        return model

    t = Trainer(cfg, tokenizer=small_tokenizer(), transform=transform, progress=False, echo=False)
    assert seen["equal"]
    assert all(p is not t.model.wpe.weight for p in t.params)
    before = t.model.wpe.weight.clone()
    t.train()
    assert torch.equal(before, t.model.wpe.weight)


def test_cli_pretrain_and_ckpt_continue(tmp_path, run_cli):
    from gptforge.config import save_config

    cfg = train_config(tmp_path, "Engine.save_load.save_steps=-1", steps=3)
    save_config(cfg, tmp_path / "run.yaml")
    code, out, err = run_cli("pretrain", "-c", tmp_path / "run.yaml", "-o", "Engine.max_steps=2", "--no-progress")
    assert code == 0, err
    assert "[train] epoch: [0/1], batch: [2/2], loss:" in out and "done at step 2" in out
    # --ckpt without -c: config and tokenizer come from the checkpoint, -o still applies
    code, out, err = run_cli("pretrain", "--ckpt", tmp_path / "out", "-o", "Engine.max_steps=3", "--no-progress")
    assert code == 0, err
    assert "at step 2" in out and "batch: [3/3]" in out
    code, out, err = run_cli("pretrain", "--ckpt", tmp_path / "nope")
    assert code == 2 and "not found" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli("pretrain")
    assert code == 2 and "-c FILE" in err


def test_tiny_cpu_recipe_learns_on_the_builtin_corpus(tmp_path):
    """The shipped recipe, shrunk to a tiny shape: the built-in corpus is prepared on first use
    (cached under ~/.cache/gptforge) and the loss falls within a few dozen steps."""
    from gptforge.config import load_config

    cfg = load_config(ROOT / "configs" / "pretrain_gpt_tiny_cpu.yaml", [
        "Global.device=cpu", "Engine.max_steps=24", "Model.hidden_size=64", "Model.num_layers=2",
        "Model.num_attention_heads=2", "Model.ffn_hidden_size=256", "Global.global_batch_size=4",
        "Global.local_batch_size=4", "Global.micro_batch_size=4", "Data.Train.dataset.max_seq_len=32",
        "Data.Eval.dataset.max_seq_len=32", "Engine.eval_freq=12", "Engine.eval_iters=2",
        f"Engine.save_load.output_dir={tmp_path / 'out'}", "Optimizer.lr.max_lr=3e-3"])
    assert cfg.Data.Train.dataset.input_dir == "builtin" and not cfg.Engine.mix_precision.enable
    r = pretrain(cfg, progress=False, echo=False)
    first, last = sum(r.losses[:4]) / 4, sum(r.losses[-4:]) / 4
    assert first > 10.0 and last < first - 1.5, (first, last)
    assert r.eval_losses[1][1] < r.eval_losses[0][1]
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path / "out")] == ["step_24"]


def test_profiler_window_and_run_mode(tmp_path):
    cfg = train_config(tmp_path, "Profiler.enable=True", "Profiler.scheduler=[2, 4]", "Engine.eval_freq=-1",
                       "Engine.save_load.save_steps=-1", steps=4)
    _train(cfg)
    prof = tmp_path / "out" / "profiler_log"
    assert (prof / "steps_2-3.trace.json").stat().st_size > 0
    assert "aten::" in (prof / "steps_2-3.txt").read_text()
    from gptforge.errors import ConfigError

    cfg.Engine.run_mode = "epoch"
    with pytest.raises(ConfigError, match="Engine.run_mode"):
        Trainer(cfg, tokenizer=small_tokenizer())


def test_resume_takes_shape_and_structure_from_the_checkpoint(tmp_path):
    from gptforge.errors import ConfigError

    _train(train_config(tmp_path, "Engine.eval_freq=-1", steps=2))
    # a config asking for another shape is refused (issue #16: it used to be ignored silently)
    cfg = train_config(tmp_path, "Engine.eval_freq=-1", "Model.hidden_size=32", "Model.ffn_hidden_size=128",
                       f"Engine.save_load.ckpt_dir={tmp_path / 'out'}", steps=3)
    with pytest.raises(ConfigError, match=r"^Model.hidden_size: 32 differs from the resumed checkpoint .*step_2 \(64\)"):
        Trainer(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    cfg = train_config(tmp_path, "Engine.eval_freq=-1", f"Engine.save_load.ckpt_dir={tmp_path / 'out'}", steps=3)
    t = Trainer(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    assert t.step == 2 and t.model.wte.weight.shape[1] == 64 and cfg.Model.hidden_size == 64
    r = t.train()

    assert load_run_config(ckpt_dir=r.checkpoint_dir).Model.hidden_size == 64


def test_eval_iterator_is_persistent(tmp_path):
    t = Trainer(train_config(tmp_path, steps=2), tokenizer=small_tokenizer(), progress=False, echo=False)
    ds = t.datasets["Eval"]
    first, second = t.evaluate(1), t.evaluate(1)
    assert (t.eval_consumed, t.eval_batches_done) == (8, 2)
    from gptforge.data.dataset import collate

    t.model.eval()
    with torch.no_grad():
        expect = [t.model(**{"input_ids": b["tokens"], "labels": b["labels"]}).loss.item()
                  for b in (collate([ds[i] for i in range(k, k + 4)]) for k in (0, 4))]
    assert [first, second] == pytest.approx(expect, rel=1e-6)


def test_max_time_saves_and_stops_then_resume_continues(tmp_path, monkeypatch):
    """Engine.max_time: training stops at the first step past the limit with a checkpoint of that
    step and a `stop` record; a resumed run goes on to max_steps from there."""
    import gptforge.train.trainer as T

    clock = {"t": 0.0}

    def fake_perf_counter():
        clock["t"] += 0.1  # every reading of the clock advances it: a deterministic slow machine
        return clock["t"]

    monkeypatch.setattr(T.time, "perf_counter", fake_perf_counter)
    cfg = train_config(tmp_path, "Engine.save_load.save_steps=-1", "Engine.max_time=2", steps=40)
    r = _train(cfg)
    assert 0 < r.step < 40
    names = [p.name for _, p in ckpt.list_checkpoints(tmp_path / "out")]
    assert names == [f"step_{r.step}"]  # saved at the stop although save_steps=-1
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    stop = [x for x in rows if x["kind"] == "stop"]
    assert len(stop) == 1 and stop[0]["reason"] == "max_time" and stop[0]["step"] == r.step
    assert "[stop] Engine.max_time: 2 s" in (tmp_path / "out" / "train.log").read_text()

    monkeypatch.undo()
    cfg2 = train_config(tmp_path, "Engine.save_load.save_steps=-1", steps=40)
    r2 = _train(cfg2, resume="auto")
    assert r2.step == 40 and len(r2.losses) == 40 - r.step


def test_fit_to_max_time_refits_the_length_and_the_lr_decay():
    from gptforge.train.optim import LRSchedule
    from gptforge.train.time_fit import TimeFit

    sched = LRSchedule("CosineAnnealingWithWarmupDecay", 1e-3, 1e-4, decay_samples=100 * 4, warmup_samples=8)
    fit = TimeFit(sched, max_steps=100, max_time=10.0, gbs=4, start_step=0)
    assert fit.fit(20, 4.0) == 50  # slower than planned: 50 steps fit in 10 s
    assert fit.apply(50, 0.2).startswith("[fit] Engine.fit_to_max_time: 50 steps fit in 10 s at 0.200 s/step (was 100)")
    assert fit.apply(52) is None and fit.apply(53).endswith("(was 50); lr decay refitted")  # drift past 5% is logged
    fit.apply(50)
    assert sched.decay == 50 * 4 and sched(49 * 4) < 1.1e-4  # the decay ends with the shorter run
    assert fit.fit(20, 1.0) == 200  # faster: more steps, and the decay stretches with them
    fit.apply(200)
    assert sched.decay == 200 * 4 and sched.warmup == 8
    assert fit.fit(30, 50.0) == 31  # past the time already: the next step ends the run
    resumed = TimeFit(sched, max_steps=100, max_time=10.0, gbs=4, start_step=60)
    assert resumed.fit(70, 2.0) == 110  # this run's steps and seconds only
    capped = TimeFit(sched, max_steps=100, max_time=10.0, gbs=4, start_step=0, cap=150)
    assert capped.fit(20, 1.0) == 150 and capped.fit(20, 4.0) == 50  # Engine.fit_max_steps bounds a longer run


def test_fit_to_max_time_ends_the_run_with_its_schedule_decayed(tmp_path, monkeypatch):
    """A machine slower than planned: with Engine.max_time alone the run stops with lr still
    high; with fit_to_max_time it ends earlier than planned with the lr decayed."""
    import gptforge.train.trainer as T

    def run(sub, *extra):
        clock = {"t": 0.0}

        def fake_perf_counter():
            clock["t"] += 0.1
            return clock["t"]

        monkeypatch.setattr(T.time, "perf_counter", fake_perf_counter)
        cfg = train_config(tmp_path / sub, "Engine.save_load.save_steps=-1", "Engine.eval_freq=-1",
                           "Engine.max_time=3", "Optimizer.lr.warmup_rate=0.05", *extra, steps=60)
        r = _train(cfg)
        rows = [json.loads(x) for x in (tmp_path / sub / "out" / "metrics.jsonl").read_text().splitlines()]
        return r, [x["lr"] for x in rows if x["kind"] == "train"], (tmp_path / sub / "out" / "train.log").read_text()

    plain, plain_lr, _ = run("plain")
    fitted, fit_lr, text = run("fit", "Engine.fit_to_max_time=true")
    assert 0 < plain.step < 60 and 0 < fitted.step < 60
    assert plain_lr[-1] > 5e-4  # stopped part-way through the decay (max 2e-3, min 1e-4)
    assert fit_lr[-1] < 4e-4 and "[fit] Engine.fit_to_max_time:" in text
    assert "--resume auto continues" not in text.split("[stop]")[-1]
    assert max(fit_lr) <= 2e-3 + 1e-12


def test_fit_to_max_time_needs_max_time(tmp_path):
    from gptforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^Engine.fit_to_max_time: needs Engine.max_time"):
        train_config(tmp_path, "Engine.fit_to_max_time=true", steps=4)
    with pytest.raises(ConfigError, match=r"^Engine.fit_max_steps: 0 must be a step count >= 1"):
        train_config(tmp_path, "Engine.max_time=5", "Engine.fit_to_max_time=true", "Engine.fit_max_steps=0", steps=4)


def test_max_time_must_be_positive(tmp_path):
    from gptforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"Engine.max_time: 0.0 must be a number of seconds > 0"):
        train_config(tmp_path, "Engine.max_time=0", steps=4)


def test_a_checkpoints_time_limits_are_not_inherited():
    """A fine-tune started from a model directory (--ckpt) must not stretch to fill the time
    limits of the run that wrote it (the demo's prune stage did: 3458 steps instead of 300)."""
    from gptforge.config.loader import CheckpointConfig, merge_layers

    ck = CheckpointConfig(source="x", raw={"Engine": {"max_time": 418.0, "fit_to_max_time": True,
                                                      "fit_max_steps": 6000, "logging_freq": 7}})
    e = merge_layers(None, [], ck)["Engine"]
    assert e.get("logging_freq") == 7  # other keys still come from the checkpoint
    assert not {"max_time", "fit_to_max_time", "fit_max_steps"} & set(e)
    e = merge_layers(None, ["Engine.max_time=30"], ck)["Engine"]
    assert e["max_time"] == 30  # the new run's own limit


def test_a_checkpoint_trained_on_cuda_runs_on_a_machine_without_one(tmp_path, monkeypatch, capsys):
    """A model directory records Global.device of the run that trained it; where there is no CUDA
    device a recorded `cuda` gives way to `auto` (a note on stderr) unless -c/-o asks for it again."""
    import torch
    import yaml

    from gf_testutil import tiny_model
    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.model_io import load_run_config, save_model_dir

    m, cfg = tiny_model()
    save_model_dir(m, cfg, tmp_path / "m", gpt2_tokenizer())
    f = tmp_path / "m" / "config.yaml"
    raw = yaml.safe_load(f.read_text())
    raw["Global"]["device"] = "cuda:0"
    f.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_run_config(ckpt_dir=tmp_path / "m").Global.device == "auto"
    assert "was trained with Global.device=cuda:0" in capsys.readouterr().err
    assert load_run_config(overrides=["Global.device=cpu"], ckpt_dir=tmp_path / "m").Global.device == "cpu"
    assert load_run_config(overrides=["Global.device=cuda"], ckpt_dir=tmp_path / "m").Global.device == "cuda"
    assert capsys.readouterr().err == ""  # asked for on this run: no note (and select_device says the rest)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert load_run_config(ckpt_dir=tmp_path / "m").Global.device == "cuda:0"  # where CUDA is there, as recorded
