"""Mixture of Experts (model/moe.py): equality with the dense model, gates, capacity, training."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from gf_testutil import tiny_config
from gptforge.errors import ConfigError
from gptforge.model import build_model
from gptforge.model import moe as moe_mod
from gptforge.model.moe import MoEFFN, layer_experts
from gptforge.train import Trainer, pretrain
from test_train_support import small_tokenizer, state_equal, train_config

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = ("Model.num_experts=4", "Model.expert_interval=1")


def dense_as_one_expert(dense):
    """A copy of `dense` whose every FFN is an MoEFFN with one expert holding the dense weights."""
    cfg = dense.config
    model = build_model(cfg)
    model.load_state_dict(dense.state_dict())
    for blk in model.blocks:
        moe = MoEFFN(cfg.hidden_size, cfg.ffn_hidden_size, 1, cfg)
        with torch.no_grad():
            moe.experts.linear1_weight[0] = blk.linear1.weight.t()
            moe.experts.linear1_bias[0] = blk.linear1.bias
            moe.experts.linear2_weight[0] = blk.linear2.weight.t()
            moe.experts.linear2_bias[0] = blk.linear2.bias
            moe.gate.weight.normal_()
        del blk.linear1, blk.linear2
        blk.moe = moe
    return model


@pytest.mark.parametrize("grouped", [True, False])
def test_one_expert_top1_equals_the_dense_model(tmp_path, monkeypatch, grouped):
    monkeypatch.setattr(moe_mod, "GROUPED_MM", grouped)
    cfg = train_config(tmp_path, "Engine.save_load.save_steps=-1", "Engine.eval_freq=100", steps=1)
    dense = build_model(cfg.Model)
    one = dense_as_one_expert(dense)
    x = torch.randint(0, 300, (2, 16))
    dense.eval(), one.eval()
    assert (dense(x).logits - one(x).logits).abs().max() < 1e-6
    assert moe_mod.load_stats(one)["dropped"] == 0

    # One training step: the same loss (plus weight x aux, which is exactly 1 for one expert)
    # and the same updated weights.
    def step(model, out):
        c = train_config(tmp_path, "Engine.save_load.save_steps=-1", "Engine.eval_freq=100",
                         f"Engine.save_load.output_dir={tmp_path / out}", steps=1)
        return Trainer(c, model=model, tokenizer=small_tokenizer(), progress=False, echo=False).train()

    rd, ro = step(dense, "d"), step(one, "o")
    assert abs(ro.losses[0] - cfg.Model.balance_loss_weight - rd.losses[0]) < 1e-6
    for a, b in zip(dense.blocks, one.blocks, strict=True):
        assert (a.linear1.weight.t() - b.moe.experts.linear1_weight[0]).abs().max() < 1e-6
        assert (a.linear2.bias - b.moe.experts.linear2_bias[0]).abs().max() < 1e-6
    assert (dense.wte.weight - one.wte.weight).abs().max() < 1e-6


def test_reference_layer_placement_and_keys():
    cfg = tiny_config("Model.num_layers=4", "Model.num_experts=2,", "Model.expert_interval=2")
    assert cfg.Model.num_experts == [2] and cfg.Model.moe_gate == "switch"
    assert layer_experts(cfg.Model) == [0, 2, 0, 2]
    model = build_model(cfg.Model)
    assert model.blocks[0].moe is None and model.blocks[1].moe.num_experts == 2
    names = {n for n, _ in model.named_parameters() if n.startswith("blocks.1.")}
    assert "blocks.1.moe.experts.linear1_weight" in names and "blocks.1.linear1.weight" not in names
    assert layer_experts(tiny_config("Model.num_layers=4", "Model.num_experts=[2,8]",
                                     "Model.expert_interval=2").Model) == [0, 2, 0, 8]
    assert layer_experts(tiny_config("Model.num_experts=1").Model) == [0, 0]  # 1 expert = dense, as the reference
    assert tiny_config("Model.num_experts=4", "Model.topk=2").Model.moe_gate == "gshard"


@pytest.mark.parametrize("over, msg", [
    (("Model.num_experts=4", "Model.topk=2", "Model.moe_gate=switch"), "Model.topk: the switch gate"),
    (("Model.num_experts=4", "Model.moe_gate=gshrd"), "did you mean gshard"),
    (("Model.num_experts=[2,2,2]",), "Model.num_experts: 3 values"),
    (("Model.num_experts=2", "Model.enable_expert_tensor_parallelism=true"), "enable_expert_tensor_parallelism"),
    (("Model.num_experts=2", "Model.moe_train_capacity_factor=0"), "moe_train_capacity_factor: must be > 0"),
])
def test_bad_moe_keys_are_one_line(over, msg):
    with pytest.raises(ConfigError, match=msg):
        tiny_config(*over)


@pytest.mark.parametrize("over, msg", [
    (("Model.num_experts=3", "Distributed.ep_degree=2"), "must divide every Model.num_experts"),
    (("Model.num_experts=4", "Distributed.ep_degree=2", "Distributed.mp_degree=2"), "composes with data parallel only"),
    (("Model.num_experts=4", "Distributed.ep_degree=4"), "must divide dp_degree=2"),
    (("Model.num_experts=4", "Distributed.pp_degree=2"), "pipeline parallel does not train MoE models"),
])
def test_bad_expert_parallel_layouts_are_one_line(over, msg):
    from gptforge.config.resolve import check_distributed

    with pytest.raises(ConfigError, match=msg):
        world = 4 if {"Distributed.mp_degree=2", "Distributed.pp_degree=2"} & set(over) else 2
        check_distributed(tiny_config(*over, "Distributed.dp_degree=2"), world_size=world)


def routed(gate: str, k: int, n_tokens: int = 64, experts: int = 4, factor: float = 1.0, drop: bool = True,
           train: bool = False):
    cfg = tiny_config(f"Model.num_experts={experts}", f"Model.topk={k}", f"Model.moe_gate={gate}",
                      f"Model.moe_train_capacity_factor={factor}", f"Model.moe_eval_capacity_factor={factor}",
                      f"Model.moe_token_dropping={drop}", "Model.moe_min_capacity=1").Model
    torch.manual_seed(0)
    m = MoEFFN(16, 32, experts, cfg)
    moe_mod.init_moe_(m, 0.5, 0.5)
    m.train(train)
    x = torch.randn(n_tokens, 16)
    return m, x, m(x)


def reference_ffn(m: MoEFFN, x: torch.Tensor, e: int) -> torch.Tensor:
    e_ = m.experts
    h = torch.nn.functional.gelu(x @ e_.linear1_weight[e] + e_.linear1_bias[e], approximate="tanh")
    return h @ e_.linear2_weight[e] + e_.linear2_bias[e]


def test_switch_gate_capacity_and_token_order():
    """Top-1: p(e)·FFN_e(x); an expert keeps its first `capacity` tokens in token order."""
    m, x, y = routed("switch", 1, factor=1.0)
    probs = torch.softmax(x @ m.gate.weight.t(), -1)
    first = probs.argmax(-1)
    cap = math.ceil(64 / 4 * 1.0)
    want = torch.zeros_like(y)
    seen = [0] * 4
    for t in range(64):
        e = int(first[t])
        if seen[e] < cap:
            want[t] = probs[t, e] * reference_ffn(m, x[t], e)
        seen[e] += 1
    assert (y - want).abs().max() < 1e-5
    dropped = sum(max(0, s - cap) for s in seen)
    assert int(m.dropped) == dropped and m.tokens_per_expert.tolist() == seen
    frac = torch.tensor(seen, dtype=torch.float) / 64
    assert float(m.aux_loss.detach()) == pytest.approx(float((probs.mean(0) * frac).sum().detach() * 4), rel=1e-5)
    # without dropping nothing is lost
    m2, x2, y2 = routed("switch", 1, factor=1.0, drop=False)
    assert int(m2.dropped) == 0


def test_gshard_top2_in_eval_renormalises_the_two_best():
    m, x, y = routed("gshard", 2, factor=4.0)  # capacity 128 >= every queue: nothing dropped
    assert int(m.dropped) == 0
    probs = torch.softmax(x @ m.gate.weight.t(), -1)
    top = probs.topk(2, -1)
    for t in range(0, 64, 7):
        w = top.values[t] / top.values[t].sum()
        want = sum(w[j] * reference_ffn(m, x[t], int(top.indices[t, j])) for j in range(2))
        assert (y[t] - want).abs().max() < 1e-5
    # training samples the second expert; the first stays the best
    m.train()
    torch.manual_seed(1)
    m(x)
    assert int(m.tokens_per_expert.sum()) == 128


def test_naive_gate_is_topk_softmax_without_capacity():
    m, x, y = routed("naive", 2, factor=0.01)
    assert int(m.dropped) == 0 and m.aux_loss is None
    logits = x @ m.gate.weight.t()
    top = logits.topk(2, -1)
    t = 5
    w = torch.softmax(top.values[t], -1)
    want = sum(w[j] * reference_ffn(m, x[t], int(top.indices[t, j])) for j in range(2))
    assert (y[t] - want).abs().max() < 1e-5


def test_grouped_gemm_equals_the_loop(monkeypatch):
    m, x, _ = routed("gshard", 2, factor=1.0)
    x.requires_grad_(True)
    y = m(x)
    (g := torch.randn_like(y))
    y.backward(g)
    grads = [p.grad.clone() for p in m.parameters()]
    gx = x.grad.clone()
    monkeypatch.setattr(moe_mod, "GROUPED_MM", False)
    m.zero_grad()
    x.grad = None
    y2 = m(x)
    y2.backward(g)
    assert (y - y2).abs().max() < 1e-5 and (gx - x.grad).abs().max() < 1e-5
    assert all((a - p.grad).abs().max() < 1e-5 for a, p in zip(grads, m.parameters(), strict=True))


def test_moe_trains_logs_balance_and_resumes_bit_exactly(tmp_path):
    over = (*MOE, "Model.topk=2", "Optimizer.grad_clip.clip_norm=0.5", "Engine.eval_freq=2")
    a = pretrain(train_config(tmp_path / "a", *over, dropout=0.1, steps=6), tokenizer=small_tokenizer(),
                 progress=False, echo=False)
    log = (tmp_path / "a" / "out" / "train.log").read_text()
    assert log.count("[moe] aux_loss:") == 6 and "tokens per expert: [" in log
    rows = [json.loads(x) for x in (tmp_path / "a" / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    # 2 micro-batches x 2 samples x 32 tokens x top-2 assignments per layer and step
    assert all(sum(layer) == 256 for r in train for layer in r["moe_tokens_per_expert"])
    assert all(0 < r["moe_aux_loss"] < 4 for r in train)
    cfg_b = train_config(tmp_path / "b", *over, f"Engine.save_load.ckpt_dir={tmp_path / 'a' / 'out' / 'step_4'}",
                         dropout=0.1, steps=6)
    b = pretrain(cfg_b, tokenizer=small_tokenizer(), progress=False, echo=False)
    assert b.losses == a.losses[4:]
    weights = [load_file(str(tmp_path / r / "out" / "step_6" / "model.safetensors")) for r in "ab"]
    assert state_equal(*weights)


def test_compression_refuses_moe_models_in_one_line():
    from gptforge.train.parallel_wrap import check_tp_modules
    from gptforge.transforms.prune import prune_model
    from gptforge.transforms.quant import quantize_model

    cfg = tiny_config(*MOE)
    model = build_model(cfg.Model)
    with pytest.raises(ConfigError, match="quantization .* of Mixture-of-Experts models is not supported"):
        quantize_model(model, cfg.Compress.Quantization)
    with pytest.raises(ConfigError, match="structured pruning of Mixture-of-Experts models is not supported"):
        prune_model(model, cfg.Compress.Prune)
    with pytest.raises(ConfigError, match="Distributed.mp_degree: blocks.0 is an MoE layer"):
        check_tp_modules(model)


@pytest.mark.parametrize("grouped", [True, False])
def test_bf16_autocast_forward_and_backward(monkeypatch, grouped):
    monkeypatch.setattr(moe_mod, "GROUPED_MM", grouped)
    model = build_model(tiny_config(*MOE, "Model.topk=2").Model)
    x = torch.randint(0, 4000, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, labels=x)
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.blocks[0].moe.experts.linear1_weight.grad.abs().sum() > 0


def test_a_layout_without_any_moe_layer_is_refused_naming_the_keys(run_cli):
    """Issue #33 item 9: 4 experts every 10th layer of a 4-layer model used to train a dense model."""
    code, _, err = run_cli("config", "show", "-o", "Model.preset=tiny", "-o", "Model.num_layers=4",
                           "-o", "Model.num_experts=4", "-o", "Model.expert_interval=10")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("Model.expert_interval: 10 places no MoE layer in Model.num_layers=4" in err
            and "Model.num_experts=4" in err and "expert_interval <= 4" in err)
    assert tiny_config("Model.num_layers=4", "Model.num_experts=4", "Model.expert_interval=4").Model.expert_interval == 4
    assert tiny_config("Model.num_layers=4", "Model.num_experts=1", "Model.expert_interval=10").Model.num_layers == 4
