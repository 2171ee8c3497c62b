"""The reference's pretrain_moe recipe layout runs as written with -o overrides for size only;
its checkpoint generates, evaluates, reloads, and the compression/export verbs that have no MoE
form refuse it in one line. The YAML is written here in the recipe's layout (not copied)."""

from __future__ import annotations

import json

import pytest
import torch

from gptforge.model.moe import moe_layers
from gptforge.model_io import load_model
from test_layouts_run import TINY_MODEL, metrics, train_args, w  # noqa: F401 - w is a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = """\
Global:
  device: gpu
  seed: 1234
  global_batch_size:
  local_batch_size: 1
  micro_batch_size: 1
  max_steps: 500000
  num_train_epochs: 1
  accumulate_steps:
  logging_freq: 1
  eval_freq: 1000
  eval_iters: 10
  test_iters:
  mix_precision:
    enable: True
    scale_loss: 32768.0
    custom_black_list: ["reduce_sum", "c_softmax_with_cross_entropy", "elementwise_div"]
    custom_white_list: ["lookup_table", "lookup_table_v2"]
  save_load:
    save_steps: 1000
    save_epoch: 1
    output_dir: ./output
    ckpt_dir:
Model:
  name: "GPT"
  fused_linear: False
  fuse_attn_qkv: True
  sequence_parallel: False
  no_recompute_layers:
Data:
  Train:
    dataset: {name: GPTDataset, input_dir: ./data/, split: [949, 50, 1], max_seq_len: 1024}
    sampler: {name: GPTBatchSampler, shuffle: False, drop_last: True}
    loader: {num_workers: 1, return_list: False, collate_fn: gpt_collate_fn}
  Eval:
    dataset: {name: GPTDataset, input_dir: ./data/, split: [949, 50, 1], max_seq_len: 1024}
    sampler: {name: GPTBatchSampler, shuffle: False, drop_last: True}
    loader: {num_workers: 1, return_list: False, collate_fn: gpt_collate_fn}
Optimizer:
  name: FusedAdamW
  weight_decay: 0.1
  beta1: 0.9
  beta2: 0.95
  epsilon: 1.0e-8
  lr: {name: CosineAnnealingWithWarmupDecay, decay_steps: 20000, warmup_rate: 0.01, max_lr: 4.5e-4, min_lr: 4.5e-6}
  grad_clip: {name: "ClipGradByGlobalNorm", clip_norm: 1.0}
  tensor_fusion: False
Profiler: {enable: False, scheduler: [1, 5], profiler_log: profiler_log, detailed: False}
Distributed:
  fuse_sequence_parallel_allreduce: False
"""

# The single-card MoE recipe: 345M-class shape, two experts every second layer, Switch top-1.
# `num_experts: 2,` is written as the reference writes it (YAML reads the string "2,").
MAIN = """\
_base_: ./moe_base.yaml
Global:
  global_batch_size:
  local_batch_size: 8
  micro_batch_size: 2
  max_steps: 20000
  logging_freq: 10
  mix_precision:
    use_pure_fp16: True
Data:
  Train: {dataset: {split: [98, 2, 0]}, loader: {num_workers: 0}}
  Eval: {dataset: {split: [98, 2, 0]}}
Model:
  vocab_size: 50304
  hidden_size: 768
  num_layers: 12
  num_attention_heads: 12
  ffn_hidden_size: 3072
  hidden_dropout_prob: 0.1
  attention_probs_dropout_prob: 0.1
  max_position_embeddings: 1024
  type_vocab_size: 16
  initializer_range: 0.014
  use_recompute: True
  recompute_granularity:
  no_recompute_layers:
  num_experts: 2,
  expert_interval: 2
  topk: 1
  moe_use_residual: False
  moe_train_capacity_factor: 1.0
  moe_eval_capacity_factor: 1.0
  moe_min_capacity: 4
  moe_token_dropping: True
  balance_loss_weight: 0.01
  enable_expert_tensor_parallelism: False
Distributed:
  dp_degree: 1
  mp_degree: 1
  pp_degree: 1
  sharding: {sharding_degree: 1, sharding_stage: 1, sharding_offload: False, reduce_overlap: False,
             broadcast_overlap: False}
"""


@pytest.fixture(scope="module")
def moe_run(w):  # noqa: F811 - the imported fixture
    from gptforge.cli import main

    (w["root"] / "moe_base.yaml").write_text(BASE, encoding="utf-8")
    recipe = w["root"] / "pretrain_moe_single_card.yaml"
    recipe.write_text(MAIN, encoding="utf-8")
    out = w["root"] / "runs" / "moe"
    assert "Model.num_layers=2" in TINY_MODEL
    code = main(["pretrain", "-c", str(recipe), "--no-progress", *train_args(w, out, steps=4),
                 "-o", "Engine.save_load.save_steps=2"])
    assert code == 0
    return recipe, out


def test_pretrain_moe_recipe_runs_and_reloads(moe_run):
    _, out = moe_run
    rows = [r for r in metrics(out) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # 2 layers, expert_interval 2: layer 1 has 2 experts; 4 samples x 32 tokens, top-1
    assert all(len(r["moe_tokens_per_expert"]) == 1 and sum(r["moe_tokens_per_expert"][0]) == 128 for r in rows)
    assert "[moe] aux_loss:" in (out / "train.log").read_text()
    model, cfg = load_model(out / "step_4")
    assert cfg.Model.num_experts == [2] and cfg.Model.moe_gate == "switch" and cfg.Model.balance_loss_weight == 0.01
    assert [blk.moe is not None for blk in model.blocks] == [False, True]
    assert model.blocks[1].moe.experts.linear1_weight.shape == (2, 32, 64)
    assert cfg.Model.use_recompute  # the recipe's recompute ran with the experts inside
    x = torch.randint(0, 300, (1, 8))
    again, _ = load_model(out / "step_4")
    assert torch.equal(model.eval()(x).logits, again.eval()(x).logits)


def test_moe_checkpoint_generates_and_evaluates(w, moe_run, run_cli):  # noqa: F811
    _, out = moe_run
    ckpt = out / "step_4"
    code, text, err = run_cli("generate", "--ckpt", ckpt, "--prompt", "the quick brown", "-o", "Global.device=cpu",
                              "-o", "Generation.max_dec_len=6", "-o", "Generation.decode_strategy=greedy_search",
                              "--json", w["root"] / "moe_gen.json")
    assert code == 0, err
    assert text.startswith("the quick brown")
    ids = json.loads((w["root"] / "moe_gen.json").read_text())["results"][0]["completions"][0]["token_ids"]
    assert 1 <= len(ids) <= 6
    res = w["root"] / "moe_eval.json"
    code, _, err = run_cli("eval", "--ckpt", ckpt, "--output", res, "--no-progress", "-o", "Global.device=cpu",
                           "-o", "Offline_Eval.cloze_eval=False", "-o", f"Offline_Eval.eval_path={w['wiki']}",
                           "-o", "Offline_Eval.max_seq_len=32")
    assert code == 0, err
    ppl = json.loads(res.read_text())["metrics"]
    assert 1.0 < ppl["ppl"] < 1e4


def test_moe_resume_from_the_recipe_checkpoint(w, moe_run, run_cli):  # noqa: F811
    recipe, out = moe_run
    again = w["root"] / "runs" / "moe_resumed"
    code, _, err = run_cli("pretrain", "-c", recipe, "--no-progress", *train_args(w, again, steps=4),
                           "-o", "Engine.save_load.save_steps=2", "-o", f"Engine.save_load.ckpt_dir={out / 'step_2'}")
    assert code == 0, err
    a = [r["loss"] for r in metrics(out) if r["kind"] == "train"][2:]
    b = [r["loss"] for r in metrics(again) if r["kind"] == "train"]
    assert a == b


@pytest.mark.parametrize("argv, msg", [
    (("export", "--format", "onnx"), "Mixture-of-Experts layer: the ONNX export has no MoE form"),
    (("export", "--format", "hf"), "Mixture-of-Experts layer: the HF export has no MoE form"),
])
def test_verbs_without_an_moe_form_refuse_in_one_line(w, moe_run, run_cli, argv, msg):  # noqa: F811
    _, out = moe_run
    code, _, err = run_cli(*argv, "--ckpt", out / "step_4", "--out", w["root"] / "x_export", "-o", "Global.device=cpu")
    assert code == 2 and len(err.strip().splitlines()) == 1 and msg in err, err
    assert moe_layers(load_model(out / "step_4")[0])
