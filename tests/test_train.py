"""Training components: param groups, LR schedule, clipping, recompute, precision, metrics."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gf_testutil import tiny_config, tiny_model
from gptforge.config import load_config
from gptforge.errors import ConfigError
from gptforge.model import build_model
from gptforge.train import metrics
from gptforge.train.optim import LRSchedule, Scheduler, build_optimizer, clip_grad_norm_, param_groups
from gptforge.train.parallel import ParallelContext, setup_parallel
from gptforge.train.recompute import apply_recompute, remove_recompute

pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------------------- param groups


def test_param_groups_follow_the_reference_rule():
    model, cfg = tiny_model()
    pact = nn.Parameter(torch.tensor(100.0))
    pact.lr_mult = 1000.0
    model.blocks[0].register_parameter("pact_alpha", pact)
    model.wpe.weight.requires_grad_(False)  # frozen like QAT's embeddings
    groups = param_groups(model, 0.01)
    by_name = {n: (g["weight_decay"], g["lr_mult"]) for g in groups for n in g["names"]}
    # Hand-written expectation (spec §3): every Linear weight and the word embedding decay;
    # biases, LayerNorm and scalars do not; frozen parameters are left out.
    expected = {}
    for i in range(cfg.Model.num_layers):
        b = f"blocks.{i}."
        for lin in ("attn.qkv_proj", "attn.out_proj", "linear1", "linear2"):
            expected[b + lin + ".weight"] = (0.01, 1.0)
            expected[b + lin + ".bias"] = (0.0, 1.0)
        for ln in ("norm1", "norm2"):
            expected[b + ln + ".weight"] = (0.0, 1.0)
            expected[b + ln + ".bias"] = (0.0, 1.0)
    expected.update({"wte.weight": (0.01, 1.0), "norm.weight": (0.0, 1.0), "norm.bias": (0.0, 1.0),
                     "blocks.0.pact_alpha": (0.0, 1000.0)})
    assert by_name == expected
    assert [g["lr_mult"] for g in groups] == [1.0, 1.0, 1000.0]

    cfg.Optimizer.lr.warmup_rate = 0.0
    opt = build_optimizer(model, cfg.Optimizer)
    sched = Scheduler(opt, LRSchedule("Constant", 1e-4, 0.0, 100, 0))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-4, 1e-4, 0.1])
    assert sched.lr == 1e-4


def test_adamw_step_equals_torch_adamw_with_hand_made_groups():
    """One step of our optimizer equals torch.optim.AdamW over groups built by hand."""
    cfg = tiny_config()
    a = build_model(cfg.Model)
    b = build_model(cfg.Model)
    b.load_state_dict(a.state_dict())
    opt_a = build_optimizer(a, cfg.Optimizer)
    Scheduler(opt_a, LRSchedule("Constant", 3e-3, 0, 1, 0))
    decay = [p for n, p in b.named_parameters() if p.ndim == 2]
    rest = [p for n, p in b.named_parameters() if p.ndim < 2]
    opt_b = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                              lr=3e-3, betas=(0.9, 0.999), eps=1e-8, foreach=False)
    x = torch.randint(0, 4096, (2, 16))
    for m, o in ((a, opt_a), (b, opt_b)):
        m(x, labels=x).loss.backward()
        o.step()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-7, rtol=0), n


def test_muon_steps_equal_torch_muon_and_adamw_on_their_parameters():
    """`Optimizer.name: Muon` equals torch.optim.Muon (AdamW-matched lr) on the blocks' 2-D weights
    plus torch.optim.AdamW on the rest, groups built by hand; three steps, bit for bit (the same
    fused AdamW kernel: Newton-Schulz turns a last-bit difference into 1e-4 within two steps)."""
    cfg = tiny_config("Optimizer.name=Muon", "Optimizer.muon_momentum=0.9")
    a = build_model(cfg.Model)
    b = build_model(cfg.Model)
    b.load_state_dict(a.state_dict())
    opt_a = build_optimizer(a, cfg.Optimizer)
    Scheduler(opt_a, LRSchedule("Constant", 3e-3, 0, 1, 0))
    named = dict(b.named_parameters())
    matrices = [n for n, p in named.items() if n.startswith("blocks.") and p.ndim == 2]
    assert len(matrices) == 4 * cfg.Model.num_layers and "wte.weight" not in matrices
    muon = torch.optim.Muon([named[n] for n in matrices], lr=3e-3, weight_decay=0.01, momentum=0.9,
                            adjust_lr_fn="match_rms_adamw")
    rest = [n for n in named if n not in matrices]
    adamw = torch.optim.AdamW([{"params": [named[n] for n in rest if named[n].ndim == 2], "weight_decay": 0.01},
                               {"params": [named[n] for n in rest if named[n].ndim < 2], "weight_decay": 0.0}],
                              lr=3e-3, betas=(0.9, 0.999), eps=1e-8, fused=True)
    x = torch.randint(0, 4096, (2, 16))
    for _ in range(3):
        for m, step in ((a, [opt_a]), (b, [muon, adamw])):
            m(x, labels=x).loss.backward()
            for o in step:
                o.step()
                o.zero_grad()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    # The two optimizers' moments are one state_dict, in param_groups order, loadable again.
    sd = opt_a.state_dict()
    assert len(sd["state"]) == len(named) and len(sd["param_groups"]) == len(opt_a.param_groups) == 3
    fresh = build_optimizer(a, cfg.Optimizer)
    fresh.load_state_dict(sd)
    assert all(torch.equal(fresh.state[p]["momentum_buffer"], opt_a.state[p]["momentum_buffer"])
               for p in opt_a.parts[1].param_groups[0]["params"])
    assert fresh.param_groups[2] is fresh.parts[1].param_groups[0]  # a schedule still reaches Muon


def test_muon_errors_name_the_key():
    model, cfg = tiny_model("Optimizer.name=Muon")
    with pytest.raises(ValueError, match="parameter groups"):  # an AdamW state into Muon: load refuses
        build_optimizer(model, cfg.Optimizer).load_state_dict(
            build_optimizer(model, tiny_config().Optimizer).state_dict())
    # config errors come at load time, before any data or model is built
    with pytest.raises(ConfigError, match=r"^Optimizer.muon_momentum: must be in \[0, 1\), got 1.0"):
        tiny_config("Optimizer.name=Muon", "Optimizer.muon_momentum=1.0")
    with pytest.raises(ConfigError, match=r"^Optimizer.name: Muon needs whole weight matrices, and Distributed.mp_degree"):
        tiny_config("Optimizer.name=Muon", "Distributed.mp_degree=2")

    class Shard(nn.Parameter):  # stands for a DTensor shard: not a whole matrix
        pass

    model.blocks[0].linear1.weight = Shard(model.blocks[0].linear1.weight.detach())
    with pytest.raises(ConfigError, match=r"^Optimizer.name: Muon needs whole weight matrices"):
        build_optimizer(model, cfg.Optimizer)
    with pytest.raises(ConfigError, match=r"^Optimizer.name: 'Lion' is not supported; choose one of .*Muon"):
        build_optimizer(model, tiny_config("Optimizer.name=Lion").Optimizer)


# -------------------------------------------------------------------------------- schedule


def reference_lr(t, max_lr, min_lr, decay, warmup):
    """CosineAnnealingWithWarmupDecay written out from spec §3."""
    if warmup > 0 and t <= warmup:
        return max_lr * t / warmup
    if t > decay:
        return min_lr
    return min_lr + 0.5 * (1 + math.cos(math.pi * (t - warmup) / (decay - warmup))) * (max_lr - min_lr)


def test_cosine_schedule_in_samples_equals_the_reference():
    cfg = load_config(overrides=["Global.global_batch_size=8", "Optimizer.lr.decay_steps=360000",
                                 "Optimizer.lr.warmup_rate=0.01"])
    s = LRSchedule.from_config(cfg)
    gbs, decay = 8, 360000 * 8
    warmup = 0.01 * decay
    assert s.warmup == warmup and s.decay == decay
    for k in (0, 1, 2, 1799, 3599, 3600, 3601, 100000, 359999, 360000, 360001, 500000):
        assert s(k * gbs) == pytest.approx(reference_lr(k * gbs, 5e-5, 1e-5, decay, warmup), rel=1e-12, abs=1e-20)
    assert s(0) == 0.0  # the first update uses lr 0, like the reference
    assert s(3600 * gbs) == pytest.approx(5e-5)
    # warmup_steps overrides warmup_rate; decay_steps defaults to max_steps
    cfg = load_config(overrides=["Global.global_batch_size=4", "Optimizer.lr.decay_steps=", "Engine.max_steps=50",
                                 "Optimizer.lr.warmup_steps=5"])
    s = LRSchedule.from_config(cfg)
    assert (s.decay, s.warmup) == (200, 20)


def test_linear_and_constant_schedules():
    lin = LRSchedule("LinearDecayWithWarmup", 1.0, 0.0, 100, 10)
    assert [lin(t) for t in (0, 5, 10, 55, 100, 150)] == pytest.approx([0, 0.5, 1.0, 0.5, 0.0, 0.0])
    assert LRSchedule("Constant", 0.3, 0.0, 100, 10)(57) == 0.3
    assert LRSchedule("CosineAnnealingWithWarmupDecay", 0.3, 0.1, 100, 10, use_increments=False)(57) == 0.3
    with pytest.raises(ConfigError, match="Optimizer.lr.name"):
        LRSchedule("Cosine", 1, 0, 1, 0)


def test_scheduler_state_round_trip():
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=0.0)
    s = Scheduler(opt, LRSchedule("CosineAnnealingWithWarmupDecay", 1.0, 0.1, 100, 10))
    s.advance(8)
    s.advance(8)
    s2 = Scheduler(opt, LRSchedule("CosineAnnealingWithWarmupDecay", 1.0, 0.1, 100, 10))
    s2.load_state_dict(s.state_dict())
    assert s2.samples == 16 and opt.param_groups[0]["lr"] == pytest.approx(reference_lr(16, 1.0, 0.1, 100, 10))


# ------------------------------------------------------------------------------------ loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_lm_loss_equals_torch_cross_entropy(dtype):
    """model.gpt.lm_loss (gradient formed in the forward) == F.cross_entropy, value and gradient."""
    import torch.nn.functional as F

    from gptforge.model.gpt import lm_loss

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 301, generator=g) * 4).to(dtype)
    logits[0, 2, 5] = -1e4  # this row's target probability underflows: the exact path
    labels = torch.randint(0, 301, (3, 7), generator=g)
    labels[0, 2] = 5
    labels[1, 3] = -100
    mask = torch.ones(3, 7)
    mask[2, 4:] = 0
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    ours = lm_loss(a, labels, mask)
    ce = F.cross_entropy(b.float().reshape(-1, 301), labels.reshape(-1), ignore_index=-100, reduction="none")
    keep = mask.reshape(-1) * (labels.reshape(-1) != -100)
    ref = (ce * keep).sum() / keep.sum()
    assert torch.isfinite(ours) and torch.allclose(ours, ref, rtol=1e-6)
    (ours * 3).backward()
    (ref * 3).backward()
    assert a.grad.dtype == dtype
    tol = 1e-7 if dtype == torch.float32 else 1e-4
    assert torch.allclose(a.grad.float(), b.grad.float(), atol=tol, rtol=1e-3)
    with torch.no_grad():
        assert torch.allclose(lm_loss(logits, labels, mask), ref, rtol=1e-6)


# -------------------------------------------------------------------------------- clipping


def _grads(seed, scale):
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.zeros(s)) for s in ((3, 4), (7,), (2, 2, 2))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return ps


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_global_norm_clip_matches_torch(scale):
    ours, peer = _grads(0, scale), _grads(0, scale)
    norm = clip_grad_norm_(ours, 1.0)
    peer_norm = torch.nn.utils.clip_grad_norm_(peer, 1.0)
    assert torch.allclose(norm, peer_norm)
    for a, b in zip(ours, peer, strict=True):
        # torch divides by norm + 1e-6, the reference by max(norm, clip): equal to ~1e-6 relative
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=0)
    if scale > 1:
        total = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours]))
        assert total == pytest.approx(1.0, rel=1e-6)


def test_clip_zero_is_off():
    ps, ref = _grads(1, 10.0), _grads(1, 10.0)
    norm = clip_grad_norm_(ps, 0.0)
    assert norm > 1 and all(torch.equal(a.grad, b.grad) for a, b in zip(ps, ref, strict=True))


# ------------------------------------------------------------------------------- recompute


def _saved_bytes(model, x):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, labels=x).loss
    return loss, total


@pytest.mark.parametrize("granularity", ["full", "full_attn", "core_attn"])
def test_recompute_keeps_gradients_and_keys_and_saves_memory(granularity):
    cfg = tiny_config("Model.hidden_dropout_prob=0.1", "Model.attention_probs_dropout_prob=0.1")
    model = build_model(cfg.Model).train()
    keys = list(model.state_dict())
    x = torch.randint(0, 4096, (2, 32))
    torch.manual_seed(5)
    loss0, saved0 = _saved_bytes(model, x)
    loss0.backward()
    g0 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    wrapped = apply_recompute(model, granularity, no_recompute_layers=[1])
    suffix = {"full": "", "full_attn": ".attn", "core_attn": ".attn.core"}[granularity]
    assert wrapped == ["blocks.0" + suffix]
    assert list(model.state_dict()) == keys
    torch.manual_seed(5)
    loss1, saved1 = _saved_bytes(model, x)
    loss1.backward()
    assert torch.equal(loss0, loss1)  # dropout masks replay exactly
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, g0[n], atol=1e-6, rtol=1e-5), n
    assert saved1 < saved0
    remove_recompute(model)
    assert _saved_bytes(model, x)[1] == saved0


def test_recompute_is_skipped_for_eval_no_grad_and_cache(monkeypatch):
    import gptforge.train.recompute as rc

    calls = []
    monkeypatch.setattr(rc, "checkpoint", lambda fn, *a, **k: calls.append(1) or fn(*a, **{
        kk: v for kk, v in k.items() if kk != "use_reentrant"}))
    model, _ = tiny_model()
    apply_recompute(model, "full")
    x = torch.randint(0, 4096, (1, 8))
    model.train()
    model(x)
    assert len(calls) == 2
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    model.train()
    with torch.enable_grad():
        model(x, cache=model.new_cache(1, 16))
    assert len(calls) == 2
    import copy

    clone = copy.deepcopy(model)  # the patched forward is re-bound to the copy
    assert clone.blocks[0].forward.__self__ is clone.blocks[0]


# ------------------------------------------------------------------------------- precision


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_autocast_on_cpu_keeps_fp32_weights(dtype, capsys):
    from gptforge.train.precision import Precision

    cfg = tiny_config("Engine.mix_precision.enable=True", f"Engine.mix_precision.dtype={dtype}",
                      "Engine.mix_precision.scale_loss=1024")
    p = Precision(cfg.Engine.mix_precision, torch.device("cpu"))
    model = build_model(cfg.Model)
    x = torch.randint(0, 4096, (2, 8))
    with p.autocast():
        out = model(x, labels=x)
    assert out.logits.dtype == getattr(torch, dtype) and out.loss.dtype == torch.float32
    assert p.loss_scale == (1024.0 if dtype == "float16" else None)
    assert all(q.dtype == torch.float32 for q in model.parameters())


# --------------------------------------------------------------------------------- metrics


def test_train_line_matches_the_reference_format():
    line = metrics.train_line(0, 1, 10, 100, 2.5, 0.5, 8 * 1024, 1, 5e-5, 0)
    assert line == ("[train] epoch: [0/1], batch: [10/100], loss: 2.500000000, avg_batch_cost: 0.50000 sec, "
                    "speed: 2.00 step/s, ips_total: 16384 tokens/s, ips: 16384 tokens/s, "
                    "learning rate: 5.00000e-05, found_inf: 0")
    fp16 = metrics.train_line(0, 1, 10, 100, 2.5, 0.5, 8192, 2, 5e-5, 1, loss_scale=32768.0)
    assert "ips: 8192 tokens/s, loss_scale: 32768.000000000, learning rate" in fp16 and fp16.endswith("found_inf: 1")
    assert metrics.eval_line(0, 20, 40, 3.0, 0.25) == (
        "[eval] epoch: 0, batch: 20/40, loss: 3.000000000, avg_eval_cost: 0.25000 sec, speed: 4.00 step/s")


def test_flops_per_token_and_peak_table(monkeypatch):
    cfg = load_config(overrides=["Model.preset=345M"])
    model = build_model(cfg.Model, device="meta")
    h, L, V, T = 1024, 24, 50304, 1024
    assert metrics.train_flops_per_token(model, T) == 6 * (V * h + L * 12 * h * h) + 12 * L * T * h
    assert metrics.peak_flops(torch.device("cpu"), "fp32") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert metrics.peak_flops(torch.device("cuda"), "bf16") == pytest.approx(989.4e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-40GB")
    assert metrics.peak_flops(torch.device("cuda"), "fp16") == pytest.approx(312e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 PCIe")
    assert metrics.peak_flops(torch.device("cuda"), "bf16") == pytest.approx(756e12)
    assert metrics.peak_rss_bytes() > 10 * 2**20


# -------------------------------------------------------------------------------- parallel


def test_single_process_parallel_seam():
    model, cfg = tiny_model()
    out, ctx = setup_parallel(model, cfg, torch.device("cpu"))
    assert out is model and isinstance(ctx, ParallelContext)
    assert (ctx.data_rank, ctx.data_world_size, ctx.is_main) == (0, 1, True)
    assert ctx.unwrap(out) is model
    cfg.Distributed.mp_degree = 2
    with pytest.raises(ConfigError, match="Distributed.mp_degree=2"):
        setup_parallel(model, cfg, torch.device("cpu"))


def test_run_logger_writes_log_jsonl_tensorboard_and_bar(tmp_path, capsys, monkeypatch):
    import json

    monkeypatch.setenv("GPTFORGE_PROGRESS", "bar")  # as on a terminal (redirected: plain lines)

    log = metrics.RunLogger(tmp_path, total_steps=3, progress=True)
    log.info("[train] hello")
    log.record("train", 1, {"loss": 2.5, "mfu": None, "lr": float("nan")})
    log.progress(1, 2.5)
    log.progress(3)
    log.close()
    out = capsys.readouterr()
    assert "[train] hello" in out.out and "/3 [" in out.err  # the bar (with ETA) is drawn on stderr
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["kind"] == "train" and row["loss"] == 2.5 and row["mfu"] is None and row["lr"] == "nan"
    assert "[train] hello" in (tmp_path / "train.log").read_text()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())
    metrics.RunLogger(tmp_path / "other", enabled=False).info("x")  # non-main ranks write nothing
    assert not (tmp_path / "other").exists()
