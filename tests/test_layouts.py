"""Every PaddleFleetX GPT recipe layout loads and means what it meant in the reference.

Table-driven: each case is a minimal YAML of one layout (written here, shaped after what
that era's files contained; no reference file is copied), the world size its recipe runs at,
and the canonical values its keys must turn into. docs/recipes-reference.md lists the layouts
and the reference commits they come from.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gptforge.config import load_config
from gptforge.config.loader import config_to_yaml
from gptforge.config.resolve import check_train_shapes
from gptforge.errors import ConfigError

SHAPE = {"vocab_size": 50304, "hidden_size": 64, "num_layers": 4, "num_attention_heads": 4,
         "max_position_embeddings": 128}

# --- examples/gpt, 2022-07/08: everything under PreTraining, read by leaf name -----------------
PRETRAINING = {"PreTraining": {
    "device": "gpu", "max_steps": 50, "num_train_epochs": 1, "seed": 7, "use_recompute": True,
    "batch_size": {"global_batch_size": 16, "local_batch_size": None, "micro_batch_size": 2},
    "quantization": {"use_qat": False, "weight_bits": 8, "activation_bits": 6},
    "mix_precision": {"use_pure_fp16": True, "scale_loss": 1024.0},
    "logging_freq": 3, "eval_freq": 20, "eval_iters": 2,
    "dataset": {"input_dir": "./data", "split": "949,50,1", "max_seq_len": 64},
    "save_load": {"save_steps": 25, "output_dir": "./out", "ckpt_dir": None},
    "Model": {**SHAPE, "ffn_hidden_size": None, "recompute_granularity": "only_attn", "fused_linear": True},
    "Distributed": {"dp_degree": 2, "mp_degree": 1, "pp_degree": 1,
                    "sharding": {"sharding_degree": 1, "sharding_stage": 1, "sharding_offload": False}},
    "Optimizer": {"weight_decay": 0.02, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6,
                  "lr": {"decay_steps": 40, "warmup_rate": 0.1, "max_lr": 3e-4, "min_lr": 3e-5},
                  "grad_clip": 0.5},
}}

# --- examples/gpt + fleetx, 2022-08/09: Engine layout with the old side sections --------------
EXAMPLES_2022 = {
    "Engine": {"max_steps": 30, "mix_precision": {"use_pure_fp16": False},
               "save_load": {"save_by_steps": 10, "save_by_epoch": 2, "output_dir": "./o"}},
    "Data": {"batch_size": {"global_batch_size": 8, "local_batch_size": 8, "micro_batch_size": 4},
             "dataset": {"input_dir": "./data", "split": "969,30,1", "max_seq_len": 64}},
    "Model": {**SHAPE, "use_recompute": False},
    "Distributed": {"dp_degree": 1, "seed": 99, "virtual_pp_degree": 1},
    "Fused": {"fused_linear": True, "tensor_fusion": False},
    "Optimizer": {"name": "Adam", "adam_beta1": 0.9, "lr": {"decay_steps": 30, "max_lr": 1e-4, "min_lr": 1e-5}},
    "Gradclip": {"name": "Glabal", "grad_clip": 0.7},
    "Eval": {"eval_path": "None", "cloze_eval": True, "overlapping_eval": 16, "ckpt_dir": "None",
             "batch_size": 4, "max_seq_len": 64, "logging_freq": 5},
}

# --- ppfleetx 2022-09: gpt_base with per-split dataset keys the engine later derived ----------
GPT_BASE_2022_09 = {
    "Global": {"device": "gpu", "seed": 1024, "global_batch_size": 2, "local_batch_size": 2, "micro_batch_size": 1},
    "Engine": {"max_steps": 10},
    "Data": {"Train": {"dataset": {"name": "GPTDataset", "input_dir": "./data/", "split": [949, 50, 1],
                                   "max_seq_len": 64, "num_samples": 32000, "eos_id": 50256, "mode": "Train"},
                       "sampler": {"name": "DistributedBatchSampler", "batch_size": 2, "shuffle": False,
                                   "drop_last": True, "num_replicas": 1, "rank": 0}}},
    "Model": SHAPE,
    "Optimizer": {"name": "AdamW"},
    "Gradclip": {"name": "ClipGradByGlobalNorm", "grad_clip": 1.0},
}

# --- QAT / prune side sections (top level) and the later Compress layout ----------------------
QAT_TOP_LEVEL = {
    "Global": {"global_batch_size": 8, "local_batch_size": 8, "micro_batch_size": 1},
    "Model": {**SHAPE, "num_attention_heads": 8},
    "Distributed": {"dp_degree": 1, "mp_degree": 8},
    "Quantization": {"enable": True, "ckpt_dir": "None", "weight_quantize_type": "abs_max",
                     "activation_quantize_type": "moving_average_abs_max", "weight_bits": 8, "activation_bits": 8,
                     "quantizable_layer_type": ["Conv2D", "Linear", "Conv2DTranspose", "ColumnParallelLinear",
                                                "RowParallelLinear"],
                     "not_quant_pattern": ["skip_quant"], "for_tensorrt": False, "is_full_quantize": False,
                     "onnx_format": False, "pretrained": "./ckpt/base"},
}
PRUNE_TOP_LEVEL = {"Model": SHAPE, "Prune": {"enable": True, "criterion": "l2_norm", "ratio": 0.25}}

# --- recompute layer lists (2022-09 branches) --------------------------------------------------
RECOMPUTE_LAYERS = {"Model": {**SHAPE, "use_recompute": True, "recompute_layers": [1, 3]}}
RECOMPUTE_ALL = {"Model": {**SHAPE, "use_recompute": True, "recompute_layers": None}}
RECOMPUTE_START = {"Model": {**SHAPE, "use_recompute": True, "recompute_start_layer": 1}}

# --- examples/transformer (2022-12+): Engine keys under Global ---------------------------------
EXAMPLES_GLOBAL = {
    "Global": {"device": "gpu", "seed": 3, "local_batch_size": 4, "micro_batch_size": 2, "max_steps": 12,
               "logging_freq": 2, "mix_precision": {"enable": False, "level": "o1"},
               "save_load": {"save_steps": 6, "save_epoch": 1, "output_dir": "./x", "ckpt_dir": None}},
    "Model": SHAPE,
    "Optimizer": {"lr": {"max_lr": 1e-3}, "grad_clip": {"name": "ClipGradByGlobalNorm", "clip_norm": 1.0,
                                                          "multi_precision": True}},
}

# --- examples/transformer offline-eval: eval settings also under Data.Eval.dataset -------------
OFFLINE_EVAL_EXAMPLES = {
    "Global": {"local_batch_size": 8, "micro_batch_size": 8, "max_steps": 500000,
               "mix_precision": {"enable": True}, "save_load": {"ckpt_dir": None}},
    "Model": SHAPE,
    "Data": {"Eval": {"dataset": {"name": "LM_Eval_Dataset", "input_dir": "./data/", "split": [949, 50, 1],
                                  "max_seq_len": 64, "overlapping_eval": None},
                      "sampler": {"name": "GPTBatchSampler", "shuffle": False, "drop_last": True},
                      "loader": {"num_workers": 1, "return_list": False, "collate_fn": "gpt_collate_fn"}}},
    "Offline_Eval": {"eval_path": "./wiki.valid.tokens", "cloze_eval": False, "overlapping_eval": 16,
                     "batch_size": 2, "max_seq_len": 64, "logging_freq": 10},
}
OFFLINE_EVAL_CKPT = {"Model": SHAPE, "Offline_Eval": {"eval_path": "./l.jsonl", "cloze_eval": True,
                                                      "ckpt_dir": "./ckpt/step_5"}}

# --- ppfleetx auto/ (auto-parallel engine) -----------------------------------------------------
AUTO_BASE = {
    "Global": {"device": "gpu", "seed": 1024, "global_batch_size": None, "local_batch_size": 1,
               "micro_batch_size": 1},
    "Engine": {"max_steps": 100, "num_train_epochs": 1, "eval_freq": 1, "eval_iters": 10, "test_iters": None,
               "mix_precision": {"enable": True, "dtype": "float16", "level": "o2", "scale_loss": 32768.0,
                                 "custom_black_list": ["reduce_sum", "where"], "use_fp16_guard": False},
               "save_load": {"output_dir": "./output", "ckpt_dir": None}},
    "Model": {"module": "GPTModuleAuto", "name": "GPT", "fuse_attn_qkv": False},
    "Data": {s: {"collate_fn": "gpt_collate_fn", "sample_split": 2,
                 "dataset": {"name": "GPTDataset", "input_dir": "./data/", "split": [949, 50, 1],
                             "max_seq_len": 64}} for s in ("Train", "Eval")},
    "Optimizer": {"name": "AdamW", "lr": {"name": "CosineAnnealingWithWarmupDecay", "decay_steps": 100}},
    "FusedPasses": {"enable": False, "fused_passes_list": []},
}
AUTO_SHARDING = {"_base_": "./auto_base.yaml", "Model": {**SHAPE, "use_recompute": True},
                 "Distributed": {"dp_degree": None, "mp_degree": 1, "pp_degree": 1,
                                 "sharding": {"sharding_degree": 4, "sharding_stage": 2}}}
AUTO_TUNING = {"_base_": "./auto_base.yaml", "Model": {**SHAPE, "use_recompute": True,
                                                        "recompute_granularity": "full_attn"},
               "Distributed": {"dp_degree": 8},
               "Tuning": {"enable": True, "tuning_recompute": True, "profile_start_step": 1, "profile_end_step": 5}}
AUTO_QAT_GENERATION = {
    "_base_": "./auto_base.yaml",
    "Model": {**SHAPE, "module": "GPTGenerationModuleAuto"},
    "Generation": {"top_k": 50, "top_p": 0.75, "max_dec_len": 20, "use_topp_sampling": True, "early_finish": True},
    "Distributed": {"dp_degree": 1, "mp_degree": 2},
    "Quantization": {"enable": True, "channel_wise_abs_max": False, "weight_bits": 8, "onnx_format": True},
}
AUTO_EXPORT = {  # no _base_: export recipes give every Engine count as -1 (unused)
    "Global": {"device": "gpu", "local_batch_size": 1, "micro_batch_size": 1},
    "Engine": {"max_steps": -1, "num_train_epochs": -1, "eval_freq": -1, "eval_iters": -1, "test_iters": -1,
               "mix_precision": {"enable": True, "level": "o2", "use_fp16_guard": False},
               "save_load": {"output_dir": None, "ckpt_dir": None}},
    "Distributed": {"dp_degree": 1, "mp_degree": 1},
}
AUTO_2022_09 = {  # the first auto/ base: keys the auto engine later renamed
    "Global": {"local_batch_size": 2, "micro_batch_size": 2},
    "Engine": {"max_steps": 10, "auto_mode": "semi", "verbose": 2,
               "mix_precision": {"use_pure_fp16": True, "init_loss_scaling": 1024.0, "use_fp16_guard": False}},
    "Model": {**SHAPE, "module": "GPTModuleAuto"},
    "Data": {"collate_fn": "gpt_collate_fn", "sample_split": 2, "dataset": {"input_dir": "./data/",
                                                                            "max_seq_len": 64}},
}
AUTO_EXAMPLES_2022_08 = {  # examples/gpt/auto_parallel: dp counts the sharding ranks
    "Engine": {"max_steps": 10, "use_recompute": True, "mix_precision": {"use_pure_fp16": True}},
    "Data": {"batch_size": {"global_batch_size": 64}, "dataset": {"max_seq_len": 64}},
    "Model": SHAPE,
    "Distributed": {"dp_degree": 16, "mp_degree": 1, "pp_degree": 1,
                    "sharding": {"sharding_degree": 16, "sharding_stage": 2}},
}

# --- GLUE fine-tuning (ppfleetx and examples/transformer) --------------------------------------
FINETUNE_BASE = {
    "Global": {"device": "gpu", "seed": 42, "global_batch_size": None, "local_batch_size": 1, "micro_batch_size": 1},
    "Engine": {"run_mode": "epoch", "max_steps": -1, "eval_freq": 1, "eval_iters": -1, "test_iters": -1,
               "save_load": {"save_steps": -1, "save_epoch": 1, "output_dir": "./output", "ckpt_dir": None}},
    "Model": {"use_flash_attn": False},
}
FINETUNE_GLUE = {
    "_base_": "./finetune_base.yaml",
    "Global": {"local_batch_size": 32, "micro_batch_size": 32},
    "Engine": {"run_mode": "epoch", "num_train_epochs": 3, "logging_freq": 10, "eval_freq": 1,
               "save_load": {"save_epoch": 2}},
    "Model": {**SHAPE, "module": "GPTFinetuneModule", "num_classes": 2,
              "pretrained": "./ckpt/PaddleFleetX_GPT_345M_220826/model",
              "loss": {"train": {"name": "CrossEntropyLoss"}, "eval": {"name": "CrossEntropyLoss"}},
              "metric": {"eval": {"name": "Accuracy"}}},
    "Optimizer": {"name": "FusedAdamW", "weight_decay": 0.0, "epsilon": 1e-6, "multi_precision": True,
                  "lr": {"name": "LinearDecayWithWarmup", "warmup": 0.1, "learning_rate": 2e-5}},
    "Data": {"Train": {"dataset": {"name": "SST2", "root": "./dataset/SST-2/", "split": "train", "max_length": 128},
                       "sampler": {"name": "DistributedBatchSampler", "batch_size": 32, "shuffle": True,
                                   "drop_last": True}},
             "Eval": {"dataset": {"name": "SST2", "root": "./dataset/SST-2/", "split": "dev", "max_length": 128},
                      "sampler": {"name": "DistributedBatchSampler", "batch_size": 32, "shuffle": False,
                                  "drop_last": False}}},
}

# --- 2023 ppfleetx: resume switches -------------------------------------------------------------
RESUME_SWITCHES = {"Model": SHAPE, "Engine": {"save_load": {"load_meta_state": True, "load_rng_state": False}}}

# (id, {file name: document}, world size, {canonical key: expected value})
CASES = [
    ("pretraining_layout", {"main.yaml": PRETRAINING}, 2, {
        "Global.device": "gpu", "Global.seed": 7, "Global.global_batch_size": 16, "Global.local_batch_size": 8,
        "Global.micro_batch_size": 2, "Engine.accumulate_steps": 4, "Engine.max_steps": 50,
        "Engine.logging_freq": 3, "Engine.test_iters": 20, "Engine.mix_precision.enable": True,
        "Engine.mix_precision.scale_loss": 1024.0, "Engine.save_load.save_steps": 25,
        "Data.Train.dataset.split": [949, 50, 1], "Data.Eval.dataset.max_seq_len": 64,
        "Model.use_recompute": True, "Model.recompute_granularity": "full_attn", "Model.hidden_size": 64,
        "Model.ffn_hidden_size": 256, "Distributed.dp_degree": 2, "Optimizer.beta2": 0.95,
        "Optimizer.epsilon": 1e-6, "Optimizer.lr.warmup_rate": 0.1, "Optimizer.lr.max_lr": 3e-4,
        "Optimizer.grad_clip.clip_norm": 0.5, "Compress.Quantization.enable": False,
        "Compress.Quantization.activation_bits": 6}),
    ("pretraining_constant_lr", {"main.yaml": {"PreTraining": {**PRETRAINING["PreTraining"],
                                                               "Optimizer": {"lr": 1e-5}}}}, 2, {
        "Optimizer.lr.name": "Constant", "Optimizer.lr.max_lr": 1e-5}),
    ("examples_2022_engine_layout", {"main.yaml": EXAMPLES_2022}, 1, {
        "Global.seed": 99, "Global.global_batch_size": 8, "Engine.accumulate_steps": 2,
        "Engine.save_load.save_steps": 10, "Engine.save_load.save_epoch": 2, "Engine.mix_precision.enable": False,
        "Data.Train.dataset.split": [969, 30, 1], "Model.fused_linear": True, "Model.virtual_pp_degree": 1,
        "Optimizer.name": "AdamW", "Optimizer.grad_clip.name": "ClipGradByGlobalNorm",
        "Optimizer.grad_clip.clip_norm": 0.7, "Offline_Eval.eval_path": None, "Offline_Eval.cloze_eval": True,
        "Offline_Eval.overlapping_eval": 16, "Offline_Eval.batch_size": 4, "Engine.save_load.ckpt_dir": None}),
    ("gpt_base_2022_09", {"main.yaml": GPT_BASE_2022_09}, 1, {
        "Data.Train.dataset.num_samples": 32000, "Data.Train.sampler.name": "DistributedBatchSampler",
        "Optimizer.grad_clip.clip_norm": 1.0, "Global.local_batch_size": 2}),
    ("qat_top_level", {"main.yaml": QAT_TOP_LEVEL}, 8, {
        "Compress.Quantization.enable": True, "Compress.Quantization.weight_quantize_type": "abs_max",
        "Compress.Quantization.quantizable_layer_type": ["Linear", "ColumnParallelLinear", "RowParallelLinear"],
        "Compress.Quantization.onnx_format": False, "Compress.pretrained": "./ckpt/base",
        "Distributed.mp_degree": 8, "Model.vocab_size": 51200}),
    ("prune_top_level", {"main.yaml": PRUNE_TOP_LEVEL}, 1, {
        "Compress.Prune.enable": True, "Compress.Prune.criterion": "l2_norm", "Compress.Prune.head_ratio": 0.25}),
    ("recompute_layers", {"main.yaml": RECOMPUTE_LAYERS}, 1, {"Model.no_recompute_layers": [0, 2],
                                                             "Model.recompute_layers": None}),
    ("recompute_layers_blank_is_all", {"main.yaml": RECOMPUTE_ALL}, 1, {"Model.no_recompute_layers": []}),
    ("recompute_start_layer", {"main.yaml": RECOMPUTE_START}, 1, {"Model.no_recompute_layers": [0]}),
    ("examples_global_layout", {"main.yaml": EXAMPLES_GLOBAL}, 1, {
        "Global.seed": 3, "Engine.max_steps": 12, "Engine.logging_freq": 2, "Engine.mix_precision.level": "O1",
        "Engine.save_load.save_steps": 6, "Optimizer.grad_clip.multi_precision": True}),
    ("offline_eval_examples_layout", {"main.yaml": OFFLINE_EVAL_EXAMPLES}, 1, {
        "Offline_Eval.overlapping_eval": 16, "Offline_Eval.max_seq_len": 64,
        "Data.Eval.dataset.name": "LM_Eval_Dataset", "Engine.mix_precision.enable": True}),
    ("offline_eval_ckpt_dir", {"main.yaml": OFFLINE_EVAL_CKPT}, 1, {"Engine.save_load.ckpt_dir": "./ckpt/step_5"}),
    ("auto_sharding", {"auto_base.yaml": AUTO_BASE, "main.yaml": AUTO_SHARDING}, 4, {
        "Distributed.dp_degree": 1, "Distributed.sharding.sharding_degree": 4, "Global.global_batch_size": 4,
        "Engine.mix_precision.level": "O2", "Engine.mix_precision.use_fp16_guard": False,
        "Data.Train.sample_split": 2, "Model.module": "GPTModuleAuto", "Distributed.sharding_in_dp": False}),
    ("auto_tuning", {"auto_base.yaml": AUTO_BASE, "main.yaml": AUTO_TUNING}, 8, {
        "Tuning.enable": True, "Tuning.profile_end_step": 5, "Distributed.dp_degree": 8,
        "Model.recompute_granularity": "full_attn"}),
    ("auto_qat_generation", {"auto_base.yaml": AUTO_BASE, "main.yaml": AUTO_QAT_GENERATION}, 2, {
        "Compress.Quantization.enable": True, "Compress.Quantization.weight_quantize_type": "abs_max",
        "Generation.top_k": 50, "Distributed.mp_degree": 2}),
    ("auto_export", {"main.yaml": AUTO_EXPORT}, 1, {"Engine.max_steps": -1, "Engine.eval_iters": -1,
                                                     "Optimizer.lr.decay_steps": 360000}),
    ("auto_2022_09", {"main.yaml": AUTO_2022_09}, 1, {
        "Engine.mix_precision.scale_loss": 1024.0, "Engine.mix_precision.enable": True, "Engine.auto_mode": "semi",
        "Data.Train.collate_fn": "gpt_collate_fn", "Data.Eval.sample_split": 2}),
    ("auto_examples_2022_08", {"main.yaml": AUTO_EXAMPLES_2022_08}, 16, {
        "Model.use_recompute": True, "Distributed.dp_degree": 1, "Distributed.sharding.sharding_degree": 16,
        "Global.local_batch_size": 4}),
    ("finetune_glue", {"finetune_base.yaml": FINETUNE_BASE, "main.yaml": FINETUNE_GLUE}, 1, {
        "Engine.run_mode": "epoch", "Engine.max_steps": -1, "Engine.num_train_epochs": 3,
        "Engine.save_load.save_epoch": 2, "Engine.save_load.save_steps": None, "Model.num_classes": 2,
        "Model.pretrained": "./ckpt/PaddleFleetX_GPT_345M_220826/model", "Model.module": "GPTFinetuneModule",
        "Model.loss": {"train": {"name": "CrossEntropyLoss"}, "eval": {"name": "CrossEntropyLoss"}},
        "Optimizer.lr.name": "LinearDecayWithWarmup", "Optimizer.lr.warmup": 0.1,
        "Optimizer.lr.warmup_rate": 0.1, "Optimizer.lr.max_lr": 2e-5, "Optimizer.multi_precision": True,
        "Data.Train.dataset.name": "SST2", "Data.Train.dataset.split": "train", "Data.Eval.dataset.split": "dev",
        "Data.Eval.dataset.max_length": 128, "Data.Train.dataset.root": "./dataset/SST-2/",
        "Data.Train.sampler.batch_size": 32, "Global.seed": 42}),
    ("resume_switches", {"main.yaml": RESUME_SWITCHES}, 1, {"Engine.save_load.load_rng_state": False}),
]


def write_case(root: Path, files: dict) -> Path:
    for name, doc in files.items():
        (root / name).write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return root / "main.yaml"


def get(cfg, path: str):
    node = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("name,files,world,expect", CASES, ids=[c[0] for c in CASES])
def test_layout_loads_with_reference_meaning(tmp_path, name, files, world, expect):
    cfg = load_config(write_case(tmp_path, files), world_size=world)
    got = {k: get(cfg, k) for k in expect}
    assert got == expect
    # the resolved config is canonical: shown and loaded again, it resolves to the same values
    again = tmp_path / "shown.yaml"
    again.write_text(config_to_yaml(cfg), encoding="utf-8")
    # (compared as saved: a saved config records path keys absolute, docs/tokenizer.md)
    assert config_to_yaml(load_config(again, world_size=world)) == config_to_yaml(cfg)


OVERRIDES = [  # -o accepts every layout's spelling
    ("PreTraining.Model.hidden_size=96", "Model.hidden_size", 96),
    ("PreTraining.batch_size.micro_batch_size=1", "Global.micro_batch_size", 1),
    ("Gradclip.grad_clip=0.3", "Optimizer.grad_clip.clip_norm", 0.3),
    ("Eval.overlapping_eval=8", "Offline_Eval.overlapping_eval", 8),
    ("Quantization.use_qat=True", "Compress.Quantization.enable", True),
    ("Prune.ratio=0.5", "Compress.Prune.ratio", 0.5),
    ("Distributed.seed=5", "Global.seed", 5),
    ("Engine.save_load.save_by_step=7", "Engine.save_load.save_steps", 7),
    ("Engine.mix_precision.init_loss_scaling=64", "Engine.mix_precision.scale_loss", 64.0),
    ("Optimizer.lr.learning_rate=0.01", "Optimizer.lr.max_lr", 0.01),
    ("Global.max_steps=9", "Engine.max_steps", 9),
    ("Offline_Eval.ckpt_dir=some/dir", "Engine.save_load.ckpt_dir", "some/dir"),
    ("Model.recompute_granularity=only_attn", "Model.recompute_granularity", "full_attn"),
    ("Fused.fused_linear=True", "Model.fused_linear", True),
    ("Engine.use_recompute=True", "Model.use_recompute", True),
]


@pytest.mark.parametrize("override,key,value", OVERRIDES, ids=[o[0].split("=")[0] for o in OVERRIDES])
def test_overrides_in_every_layout(override, key, value):
    cfg = load_config(overrides=["Model.preset=tiny", override])
    assert get(cfg, key) == value


REFUSED = [  # (document, the one-line error's start)
    ({"Model": {**SHAPE, "num_experts": 2, "enable_expert_tensor_parallelism": True}}, "Model.enable_expert_tensor_parallelism: splitting experts over mp is not supported"),
    ({"Model": {**SHAPE, "moe_configs": {"expert_mode": False}}}, "Model.moe_configs: this MoE layout is not supported"),
    ({"Distillation": {"teacher": "x"}}, "Distillation: knowledge distillation is not supported"),
    ({"Compress": {"Distillation": {"alpha": 1}}}, "Compress.Distillation: knowledge distillation is not supported"),
    ({"Engine": {"distil_weight": 0.5}}, "Engine.distil_weight: knowledge distillation is not supported"),
    ({"PreTraining": {"Model": {"hidden_sise": 8}}}, "PreTraining.Model.hidden_sise: unknown key in the PreTraining layout"),
    ({"Gradclip": {"grad_clip": 1.0}, "Model": {"hidden_sise": 8}}, "Model.hidden_sise: unknown key (did you mean Model.hidden_size?)"),
    ({"Distributed": {"dp_degreei": 1}}, "Distributed.dp_degreei: unknown key (did you mean Distributed.dp_degree?)"),
    ({"Engine": {"mix_precision": {"use_fp16_guards": False}}}, "Engine.mix_precision.use_fp16_guards: unknown key"),
    ({"Tuning": {"enabled": True}}, "Tuning.enabled: unknown key"),
    ({"Engine": {"max_steps": -2}}, "Engine.max_steps: must be >= 0 (or -1"),
    ({"Engine": {"run_mode": "epochs"}}, "Engine.run_mode: must be step or epoch"),
    ({"Engine": {"save_load": {"load_meta_state": False}}}, "Engine.save_load.load_meta_state: False"),
    ({"Model": {**SHAPE, "recompute_layers": [4]}}, "Model.recompute_layers: [4] outside [0, 4)"),
    ({"Data": {"Train": {"dataset": {"split": [1, "x", 2]}}}}, "Data.Train.dataset.split: expected three weights"),
    ({"Optimizer": {"lr": {"warmup": -0.1}}}, "Optimizer.lr.warmup: must be >= 0"),
    ({"Distributed": {"dp_degree": 6, "sharding_in_dp": True, "sharding": {"sharding_degree": 4}}},
     "Distributed.dp_degree: 6 is not divisible by sharding_degree 4"),
]


@pytest.mark.parametrize("doc,message", REFUSED, ids=[r[1].split(":")[0] + f"-{i}" for i, r in enumerate(REFUSED)])
def test_refusals_are_one_line(tmp_path, doc, message):
    path = write_case(tmp_path, {"main.yaml": doc})
    with pytest.raises(ConfigError) as e:
        load_config(path, world_size=24)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,message", [
    (("Engine.max_steps=-1",), "Engine.max_steps: -1 needs Engine.run_mode=epoch"),
    (("Data.Train.dataset.split=train",), "Data.Train.dataset.split: 'train' names a fine-tuning split"),
    (("Data.Train.sampler.batch_size=8", "Global.local_batch_size=1"),
     "Data.Train.sampler.batch_size: 8 disagrees with Global.local_batch_size 1"),
])
def test_training_needs_a_step_count_and_weights(overrides, message):
    cfg = load_config(overrides=["Model.preset=tiny", *overrides])  # loads (config show, export, ...)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_train_shapes(cfg)


def test_auto_degrees_map_once(tmp_path):
    """Auto-parallel dp counts the sharding ranks; mapped onto our world = dp x sharding x mp x pp
    (the same file without the auto engine's keys means 256 data ranks, as in the eager engine)."""
    cfg = load_config(write_case(tmp_path, {"main.yaml": AUTO_EXAMPLES_2022_08}), world_size=16)
    assert (cfg.Distributed.dp_degree, cfg.Distributed.sharding.sharding_degree) == (1, 16)
    eager = {**AUTO_EXAMPLES_2022_08, "Engine": {"max_steps": 10}}
    with pytest.raises(ConfigError, match="data-parallel world 256"):
        load_config(write_case(tmp_path, {"main.yaml": eager}), world_size=16)


def test_cli_config_show_old_layout_and_refusal(tmp_path, run_cli):
    src = write_case(tmp_path, {"main.yaml": PRETRAINING})
    code, out, err = run_cli("config", "show", "--resolved", "-c", src)
    assert code == 0, err
    shown = yaml.safe_load(out)
    assert shown["Model"]["recompute_granularity"] == "full_attn" and shown["Optimizer"]["beta2"] == 0.95
    # the plain show writes the old layout in today's names, and loads back to the same config
    code, out, err = run_cli("config", "show", "-c", src)
    assert code == 0, err
    (tmp_path / "shown.yaml").write_text(out)
    assert load_config(str(tmp_path / "shown.yaml")).to_dict() == load_config(src).to_dict()
    moe = {"Model": {**SHAPE, "moe_configs": {"expert_mode": True}}}
    code, _, err = run_cli("config", "show", "-c", write_case(tmp_path, {"main.yaml": moe}))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "this MoE layout is not supported" in err
