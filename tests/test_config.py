"""Config: reference layouts load unchanged, derived values match the reference, bad input fails clearly."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gptforge.config import load_config
from gptforge.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "src" / "gptforge" / "recipes"

# The reference's ppfleetx-era 345M recipe (Engine layout, old `use_pure_fp16` key), verbatim shape.
REFERENCE_PPFLEETX = """
Global:
  device: gpu
  seed: 1024
  global_batch_size:
  local_batch_size: 8
  micro_batch_size: 8
Engine:
  max_steps: 500000
  num_train_epochs: 1
  accumulate_steps:
  logging_freq: 1
  eval_freq: 500
  eval_iters: 10
  test_iters:
  mix_precision:
    use_pure_fp16: True
    scale_loss: 32768.0
    custom_black_list: ["reduce_sum", "c_softmax_with_cross_entropy", "elementwise_div"]
    custom_white_list: ["lookup_table", "lookup_table_v2"]
  save_load:
    save_steps: 1000
    save_epoch: 1
    output_dir: ./output
    ckpt_dir:
Model:
  module: "GPTModule"
  name: "GPT"
  vocab_size: 50304
  hidden_size: 1024
  num_layers: 24
  num_attention_heads: 16
  ffn_hidden_size:
  hidden_dropout_prob: 0.1
  attention_probs_dropout_prob: 0.1
  max_position_embeddings: 1024
  type_vocab_size: 16
  initializer_range: 0.02
  use_recompute: False
  recompute_granularity:
  fused_linear: False
  sequence_parallel: False
Data:
  Train:
    dataset: {name: GPTDataset, input_dir: ./data/, split: [949, 50, 1], max_seq_len: 1024}
    sampler: {name: GPTBatchSampler, shuffle: False, drop_last: True}
    loader: {num_workers: 1, return_list: False, collate_fn: gpt_collate_fn}
  Eval:
    dataset: {name: GPTDataset, input_dir: ./data/, split: [949, 50, 1], max_seq_len: 1024}
Optimizer:
  name: FusedAdamW
  weight_decay: 0.01
  beta1: 0.9
  beta2: 0.999
  epsilon: 1.0e-8
  lr: {name: CosineAnnealingWithWarmupDecay, decay_steps: 360000, warmup_rate: 0.01, max_lr: 5.0e-5, min_lr: 1.0e-5}
  grad_clip: {name: "ClipGradByGlobalNorm", clip_norm: 1.0}
  tensor_fusion: False
Profiler: {enable: False, scheduler: [1, 5], profiler_log: profiler_log, detailed: False}
Distributed:
  dp_degree: 1
  mp_degree: 1
  pp_degree: 1
  sharding: {sharding_degree: 1, sharding_stage: 1, sharding_offload: False}
"""

# The examples-era layout: Engine keys under Global, `mix_precision.enable`.
REFERENCE_EXAMPLES = """
Global:
  device: gpu
  seed: 1234
  global_batch_size: 16
  local_batch_size:
  micro_batch_size: 4
  max_steps: 100000
  logging_freq: 10
  eval_freq: 1000
  mix_precision:
    enable: True
    dtype: bfloat16
    level: o2
  save_load:
    save_steps: 500
    output_dir: ./out
Model:
  vocab_size: 50257
  hidden_size: 2048
  num_layers: 24
  num_attention_heads: 16
  use_recompute: True
  no_recompute_layers: [3, 1, 1]
Distributed:
  dp_degree: 2
  mp_degree: 2
"""

# The 2022 layout of the seed document: Data.batch_size, Data.dataset, adam_* keys, scalar grad_clip.
REFERENCE_OLD = """
Data:
  batch_size:
    global_batch_size: 8
    local_batch_size: 8
    micro_batch_size: 2
  dataset:
    input_dir: ./data
    split: '949,50,1'
    max_seq_len: 512
Model:
  vocab_size: 50304
  hidden_size: 1024
  num_layers: 24
  num_attention_heads: 16
Optimizer:
  weight_decay: 0.01
  adam_beta1: 0.9
  adam_beta2: 0.95
  adam_epsilon: 1.0e-8
  lr: {decay_steps: 360000, warmup_rate: 0.01, max_lr: 1.0e-5, min_lr: 5.0e-5}
  grad_clip: 0.5
Engine:
  max_steps: 500000
  mix_precision: {use_pure_fp16: True, scale_loss: 32768.0}
Fused:
  tensor_fusion: True
"""


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_reference_ppfleetx_layout_resolves(tmp_path):
    cfg = load_config(_write(tmp_path, REFERENCE_PPFLEETX))
    assert cfg.Engine.mix_precision.enable is True and cfg.Engine.mix_precision.dtype == "float16"
    assert cfg.Model.ffn_hidden_size == 4096 and cfg.Model.head_dim == 64
    assert cfg.Global.global_batch_size == 8 and cfg.Engine.accumulate_steps == 1
    assert cfg.Engine.test_iters == 100
    assert cfg.Data.Eval.dataset.split == [949, 50, 1]


def test_examples_layout_moves_engine_keys(tmp_path):
    cfg = load_config(_write(tmp_path, REFERENCE_EXAMPLES), world_size=4)
    assert cfg.Engine.max_steps == 100000 and cfg.Engine.logging_freq == 10
    assert cfg.Engine.save_load.save_steps == 500
    assert cfg.Engine.mix_precision.dtype == "bfloat16" and cfg.Engine.mix_precision.level == "O2"
    # dp 2: local = global / dp; accumulate = local / micro.
    assert cfg.Global.local_batch_size == 8 and cfg.Engine.accumulate_steps == 2
    # Vocab padded to a multiple of 128 * mp (2): 50257 -> 50432.
    assert cfg.Model.vocab_size == 50432
    assert cfg.Model.recompute_granularity == "full" and cfg.Model.no_recompute_layers == [1, 3]


def test_old_layout_aliases(tmp_path):
    cfg = load_config(_write(tmp_path, REFERENCE_OLD))
    assert cfg.Global.micro_batch_size == 2 and cfg.Engine.accumulate_steps == 4
    assert cfg.Data.Train.dataset.split == [949, 50, 1] and cfg.Data.Eval.dataset.max_seq_len == 512
    assert cfg.Optimizer.beta2 == 0.95 and cfg.Optimizer.grad_clip.clip_norm == 0.5
    assert cfg.Optimizer.tensor_fusion is True and cfg.Engine.mix_precision.enable is True


def test_vocab_padding_mp8_and_override_paths():
    cfg = load_config(overrides=["Model.vocab_size=50304", "Distributed.mp_degree=8", "Global.max_steps=7",
                                 "Engine.mix_precision.use_pure_fp16=True", "Data.Train.dataset.split=969,30,1"],
                      world_size=8)
    assert cfg.Model.vocab_size == 51200
    assert cfg.Engine.max_steps == 7 and cfg.Engine.mix_precision.enable
    assert cfg.Data.Train.dataset.split == [969, 30, 1]


def test_shipped_configs_resolve():
    for path in sorted(CONFIGS.glob("*.yaml")):
        load_config(path, world_size=None)


def test_base_inheritance_relative_and_override_order(tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path, "Model: {hidden_size: 128, num_layers: 2, num_attention_heads: 2}\nEngine: {max_steps: 5}",
           "base.yaml")
    child = _write(tmp_path / "sub", "_base_: ../base.yaml\nEngine: {max_steps: 9}", "child.yaml")
    cfg = load_config(child, ["Model.num_layers=3"])
    assert (cfg.Model.hidden_size, cfg.Model.num_layers, cfg.Engine.max_steps) == (128, 3, 9)


def test_preset_fills_only_unset_keys():
    cfg = load_config(overrides=["Model.preset=345M", "Model.num_layers=2"])
    assert cfg.Model.hidden_size == 1024 and cfg.Model.num_layers == 2


def test_base_loop_is_an_error(tmp_path):
    _write(tmp_path, "_base_: b.yaml", "a.yaml")
    _write(tmp_path, "_base_: a.yaml", "b.yaml")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "a.yaml")


BAD_CASES = [
    # (yaml text or None, overrides, text that the one-line message must contain)
    ("Model: {hidden_sise: 10}", [], "Model.hidden_sise: unknown key (did you mean Model.hidden_size?)"),
    ("Modle: {hidden_size: 10}", [], "Modle: unknown section (did you mean Model?)"),
    ("Engine: {max_steps: lots}", [], "Engine.max_steps: expected an integer"),
    ("Model: {use_recompute: maybe}", [], "Model.use_recompute: expected true/false"),
    ("Global: {local_batch_size: 8, micro_batch_size: 3}", [], "Global.micro_batch_size: 3 does not divide"),
    ("Global: {global_batch_size: 8, local_batch_size: 2}", [], "Global.global_batch_size: 8 != Global.local_batch_size"),
    ("Model: {hidden_size: 100, num_attention_heads: 3}", [], "Model.num_attention_heads: 3 does not divide"),
    ("Model: {recompute_granularity: ful}", [], "Model.recompute_granularity: 'ful' is not one of"),
    ("Data: {Train: {dataset: {split: [1, 2]}}}", [], "Data.Train.dataset.split: expected three"),
    ("Optimizer: {lr: {max_lr: [1]}}", [], "Optimizer.lr.max_lr: expected a number"),
    ("Model: {preset: 350M}", [], "Model.preset: unknown preset '350M' (did you mean 345M?)"),
    ("Engine:\n  max_steps: 3\n   bad: indent", [], "invalid YAML"),
    ("- just\n- a list", [], "top level must be a mapping"),
    ("_base_: missing.yaml", [], "_base_ file not found: missing.yaml"),
    (None, ["Engine.max_steps"], "expected Section.key=value"),
    (None, ["Engine.max_step=3"], "Engine.max_step: unknown key (did you mean Engine.max_steps?)"),
    (None, ["Model.no_recompute_layers=[99]"], "Model.no_recompute_layers: [99] outside [0, 24)"),
    (None, ["Compress.Prune.ratio=1.5"], "Compress.Prune.ratio: must be in [0, 1)"),
    (None, ["Distributed.mp_degree=3", "Model.num_attention_heads=16"], "Distributed.mp_degree: 3 does not divide"),
]


@pytest.mark.parametrize("text,overrides,expected", BAD_CASES)
def test_bad_config_exit_2_one_line(tmp_path, run_cli, text, overrides, expected):
    argv = ["config", "show"]
    if text is not None:
        argv += ["-c", _write(tmp_path, text)]
    for o in overrides:
        argv += ["-o", o]
    code, out, err = run_cli(*argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err


def test_missing_config_file_names_the_file(tmp_path, run_cli):
    code, _, err = run_cli("config", "show", "-c", tmp_path / "nope.yaml")
    assert code == 2 and f"{tmp_path / 'nope.yaml'}: config file not found" in err


def test_config_show_prints_given_yaml_with_derived_comments(run_cli):
    import yaml

    code, out, _ = run_cli("config", "show", "-c", CONFIGS / "pretrain_gpt_345M_single_card.yaml",
                           "-o", "Engine.max_steps=10")
    assert code == 0
    data = yaml.safe_load(out)
    assert data["Engine"]["max_steps"] == 10 and data["Model"]["ffn_hidden_size"] is None
    assert "  ffn_hidden_size:  # derived: 4096" in out.splitlines()
    code, out, _ = run_cli("config", "show", "--resolved", "-c", "pretrain_gpt_345M_single_card")
    assert code == 0 and yaml.safe_load(out)["Model"]["ffn_hidden_size"] == 4096


def test_config_keys_lists_every_section(run_cli):
    code, out, _ = run_cli("config", "keys")
    assert code == 0
    for key in ("Global.seed", "Model.hidden_size", "Compress.Quantization.skip_tensor_map", "Offline_Eval.cloze_eval"):
        assert f"`{key}`" in out
