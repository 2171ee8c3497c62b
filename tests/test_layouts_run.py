"""Each reference recipe family runs on its verb, from a YAML in the reference's own layout,
with `-o` overrides only for size (model shape, batch, steps, sequence length), the CPU
(device, fp32) and where data lives. Recipes are written here after the reference's files
(docs/recipes-reference.md); the layouts' meanings are checked in test_layouts.py, and here
two layouts that say the same thing must give the same numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from gptforge.model_io import load_model
from test_layouts import AUTO_BASE, SHAPE
from test_train_support import small_tokenizer, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")

BIG = {**SHAPE, "hidden_size": 1024, "num_layers": 24, "num_attention_heads": 16, "ffn_hidden_size": 4096,
       "max_position_embeddings": 1024}  # the 345M shape the recipes carry; -o shrinks it
TINY_MODEL = ("Model.vocab_size=512", "Model.hidden_size=32", "Model.num_layers=2", "Model.num_attention_heads=2",
              "Model.ffn_hidden_size=64", "Model.max_position_embeddings=64")
CPU = ("Global.device=cpu", "Engine.mix_precision.enable=False")


def write(root: Path, name: str, doc: dict) -> Path:
    path = root / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def train_args(w: dict, out: Path, steps: int = 3, *, model: bool = True) -> list[str]:
    """-o overrides for a CPU-size training run of any recipe."""
    o = [*CPU, *(TINY_MODEL if model else ()), f"Engine.max_steps={steps}", "Engine.eval_freq=2",
         "Engine.eval_iters=1", "Engine.logging_freq=1", "Engine.save_load.save_steps=-1",
         f"Engine.save_load.output_dir={out}", "Global.global_batch_size=4", "Global.local_batch_size=",
         "Global.micro_batch_size=2", "Optimizer.lr.decay_steps=", f"Data.tokenizer={w['tok']}",
         *(f"Data.{s}.{k}" for s in ("Train", "Eval") for k in (
             f"dataset.input_dir={w['corpus']}", "dataset.max_seq_len=32", "loader.num_workers=0"))]
    return [a for kv in o for a in ("-o", kv)]


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """A corpus, its tokenizer, eval files, and a model trained from the PreTraining-layout recipe."""
    root = tmp_path_factory.mktemp("layouts_run")
    write_corpus(root / "data")
    small_tokenizer().save(root / "tok")
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", ".", "pack", "my", "box", "with",
             "five", "dozen", "liquor", "jugs", "."]
    (root / "wiki.txt").write_text(" ".join(words * 12) + "\n", encoding="utf-8")
    (root / "lambada.jsonl").write_text("".join(
        json.dumps({"text": " ".join(words[i:i + 9])}) + "\n" for i in range(6)), encoding="utf-8")
    return {"root": root, "corpus": root / "data" / "corpus", "tok": root / "tok", "wiki": root / "wiki.txt",
            "lambada": root / "lambada.jsonl"}


@pytest.fixture(scope="module")
def base_model(w):
    """examples/gpt single-card recipe (2022-07, everything under PreTraining) → pretrain."""
    from gptforge.cli import main

    recipe = write(w["root"], "pretrain_pretraining_layout.yaml", {"PreTraining": {
        "device": "gpu", "max_steps": 500000, "seed": 1024, "use_recompute": False,
        "batch_size": {"global_batch_size": 8, "local_batch_size": 8, "micro_batch_size": 8},
        "mix_precision": {"use_pure_fp16": True, "scale_loss": 32768.0},
        "logging_freq": 1, "eval_freq": 500, "eval_iters": 10,
        "dataset": {"input_dir": "./data", "split": "949,50,1", "max_seq_len": 1024},
        "save_load": {"save_steps": 1000, "output_dir": "./output", "ckpt_dir": None},
        "Model": {**BIG, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        "Distributed": {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1},
        "Optimizer": {"weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
                      "lr": {"decay_steps": 360000, "warmup_rate": 0.01, "max_lr": 5e-3, "min_lr": 1e-3},
                      "grad_clip": 1.0},
    }})
    out = w["root"] / "runs" / "base"
    code = main(["pretrain", "-c", str(recipe), "--no-progress", *train_args(w, out, steps=6),
                 "-o", "Optimizer.lr.warmup_rate=0"])
    assert code == 0
    return out / "step_6"


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_pretrain_pretraining_layout(base_model):
    losses = [r["loss"] for r in metrics(base_model.parent) if r["kind"] == "train"]
    assert len(losses) == 6 and losses[-1] < losses[0]  # it trained, on the recipe's optimizer settings
    _, cfg = load_model(base_model)
    assert (cfg.Global.global_batch_size, cfg.Optimizer.grad_clip.clip_norm, cfg.Model.hidden_size) == (4, 1.0, 32)


# Single-card pretraining recipes of the other layouts: each trains 3 steps from its own file.
SINGLE_CARD = {
    "gradclip_2022_09": {  # fleetx/ppfleetx gpt_base with Gradclip and per-split old dataset keys
        "Global": {"device": "gpu", "seed": 1024}, "Engine": {"max_steps": 500000,
                                                              "mix_precision": {"use_pure_fp16": True}},
        "Data": {"dataset": {"input_dir": "./data", "split": "949,50,1", "max_seq_len": 1024}},
        "Model": {**BIG, "use_recompute": True, "recompute_granularity": None, "fused_linear": True},
        "Fused": {"tensor_fusion": False},
        "Optimizer": {"name": "Adam", "adam_beta1": 0.9, "lr": {"decay_steps": 360000, "warmup_rate": 0.01,
                                                                 "max_lr": 5e-5, "min_lr": 1e-5}},
        "Gradclip": {"name": "Glabal", "grad_clip": 1.0},
    },
    "recompute_layers_2022_09": {"Model": {**BIG, "use_recompute": True, "recompute_layers": [1]}},
    "examples_global_2022_12": {  # examples/transformer pretrain: Engine keys under Global
        "Global": {"device": "gpu", "seed": 1024, "local_batch_size": 8, "micro_batch_size": 8,
                   "max_steps": 500000, "logging_freq": 1, "eval_freq": 500, "eval_iters": 10,
                   "mix_precision": {"enable": True, "scale_loss": 32768.0},
                   "save_load": {"save_steps": 1000, "save_epoch": 1, "output_dir": "./output"}},
        "Model": {**BIG, "no_recompute_layers": None, "fuse_attn_qkv": True},
        "Optimizer": {"name": "FusedAdamW", "lr": {"name": "CosineAnnealingWithWarmupDecay",
                                                   "decay_steps": 360000, "max_lr": 5e-5, "min_lr": 1e-5},
                      "grad_clip": {"name": "ClipGradByGlobalNorm", "clip_norm": 1.0, "multi_precision": True}},
    },
    "auto_single_card": {  # ppfleetx auto/pretrain_gpt_345M_single_card on its auto base
        **AUTO_BASE, "Model": {**AUTO_BASE["Model"], **BIG, "use_recompute": False},
        "Distributed": {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
                        "sharding": {"sharding_degree": 1, "sharding_stage": 1}},
    },
}


@pytest.mark.parametrize("name", list(SINGLE_CARD))
def test_pretrain_single_card_layouts(w, run_cli, name):
    recipe = write(w["root"], f"{name}.yaml", SINGLE_CARD[name])
    out = w["root"] / "runs" / name
    code, _, err = run_cli("pretrain", "-c", recipe, "--no-progress", *train_args(w, out))
    assert code == 0, err
    rows = metrics(out)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    assert (out / "step_3" / "config.yaml").is_file()


def eval_recipes(w) -> dict:
    """The same WikiText settings in the three eval layouts."""
    shape = {"Model": BIG}
    return {
        "offline_eval": {**shape, "Offline_Eval": {  # ppfleetx eval_gpt_345M_single_card
            "eval_path": "./wikitext-103/wiki.valid.tokens", "cloze_eval": False, "overlapping_eval": 16,
            "batch_size": 2, "max_seq_len": 32, "logging_freq": 10}},
        "examples_offline_eval": {**shape,  # examples/transformer offline-eval: settings also in Data.Eval
            "Global": {"local_batch_size": 8, "micro_batch_size": 8, "mix_precision": {"enable": True}},
            "Data": {"Eval": {"dataset": {"name": "LM_Eval_Dataset", "input_dir": "./data/", "max_seq_len": 1024,
                                          "overlapping_eval": None},
                              "loader": {"num_workers": 1, "collate_fn": "gpt_collate_fn"}}},
            "Offline_Eval": {"eval_path": "./wiki.valid.tokens", "cloze_eval": False, "overlapping_eval": 16,
                             "batch_size": 2, "max_seq_len": 32, "logging_freq": 10}},
        "eval_section_2022_08": {**shape,  # examples/gpt/single: a top-level Eval with `None` strings
            "Eval": {"eval_path": "None", "cloze_eval": False, "overlapping_eval": 16, "ckpt_dir": "None",
                     "batch_size": 2, "max_seq_len": 32, "logging_freq": 10}},
    }


def test_eval_layouts_agree(w, base_model, run_cli):
    results = {}
    for name, doc in eval_recipes(w).items():
        recipe = write(w["root"], f"eval_{name}.yaml", doc)
        out = w["root"] / f"eval_{name}.json"
        code, _, err = run_cli("eval", "-c", recipe, "--ckpt", base_model, "--output", out, "--no-progress",
                               "-o", "Global.device=cpu", "-o", f"Offline_Eval.eval_path={w['wiki']}")
        assert code == 0, (name, err)
        results[name] = json.loads(out.read_text())["metrics"]
    first = results["offline_eval"]
    assert first["windows"] == 28  # 458 tokens, stride 16 (overlapping_eval) in windows of 32 (max_seq_len)
    assert all(r == first for r in results.values()), results  # one meaning, three spellings


def test_eval_lambada_offline_eval_layout(w, base_model, run_cli):
    recipe = write(w["root"], "eval_lambada.yaml", {"Model": BIG, "Offline_Eval": {
        "eval_path": "./lambada_test.jsonl", "cloze_eval": True, "batch_size": 8, "max_seq_len": 1024}})
    out = w["root"] / "lambada.json"
    code, _, err = run_cli("eval", "-c", recipe, "--ckpt", base_model, "--output", out, "--no-progress",
                           "-o", "Global.device=cpu", "-o", f"Offline_Eval.eval_path={w['lambada']}",
                           "-o", "Offline_Eval.max_seq_len=32")
    assert code == 0, err
    assert json.loads(out.read_text())["metrics"]["total_examples"] == 6


GENERATION = {
    "generation_single_card": {  # ppfleetx generation_gpt_345M_single_card
        "Model": {**BIG, "module": "GPTGenerationModule"},
        "Generation": {"top_k": 50, "top_p": 0.75, "temperature": 1.0, "min_dec_len": 1, "max_dec_len": 200,
                       "num_return_sequences": 1, "decode_strategy": "sampling"}},
    "auto_generation": {  # ppfleetx auto/generation_gpt_6.7B_mp1 on its auto base
        **AUTO_BASE, "Model": {**AUTO_BASE["Model"], **BIG, "module": "GPTGenerationModuleAuto"},
        "Engine": {"mix_precision": {"enable": True, "level": "o2", "use_fp16_guard": False}},
        "Generation": {"top_k": 0, "top_p": 0.9, "use_topp_sampling": True, "inference": True,
                       "min_dec_len": 8, "max_dec_len": 8, "decode_strategy": "sampling", "early_finish": True},
        "Distributed": {"dp_degree": 1, "mp_degree": 1}},
}


@pytest.mark.parametrize("name", list(GENERATION))
def test_generation_layouts(w, base_model, run_cli, name):
    recipe = write(w["root"], f"{name}.yaml", GENERATION[name])
    code, out, err = run_cli("generate", "-c", recipe, "--ckpt", base_model, "--prompt", "the quick brown",
                             "--json", w["root"] / f"{name}.json", "-o", "Global.device=cpu",
                             "-o", "Generation.max_dec_len=8", "-o", "Generation.seed=1")
    assert code == 0, err
    res = json.loads((w["root"] / f"{name}.json").read_text())
    ids = res["results"][0]["completions"][0]["token_ids"]
    assert out.startswith("the quick brown")
    want = GENERATION[name]["Generation"]
    assert {k: res["generation"][k] for k in ("top_k", "top_p", "min_dec_len")} == {
        k: want[k] for k in ("top_k", "top_p", "min_dec_len")}
    # min_dec_len 8 = max_dec_len: exactly 8 new tokens; otherwise up to max_dec_len
    assert len(ids) == 8 if want["min_dec_len"] == 8 else 1 <= len(ids) <= 8


QAT = {
    "qat_compress_2023": {  # ppfleetx qat_gpt_345M_single_card
        "Model": {**BIG, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        "Optimizer": {"weight_decay": 0.02, "lr": {"decay_steps": 72000, "max_lr": 5e-6, "min_lr": 1e-6}},
        "Compress": {"pretrained": None, "Quantization": {
            "enable": True, "weight_quantize_type": "abs_max", "activation_quantize_type": "moving_average_abs_max",
            "activation_preprocess_type": "PACT", "weight_bits": 8, "activation_bits": 8,
            "quantizable_layer_type": ["Linear", "ColumnParallelLinear", "RowParallelLinear"], "onnx_format": True,
            "freeze_embedding": True, "skip_tensor_map": {"block_3": ["linear2"], "block_5": ["linear1"]}}}},
    "qat_top_level_2022_09": {  # ppfleetx pretrain_gpt_345M_mp8_qat, before the Compress section
        "Model": BIG, "Distributed": {"dp_degree": 1, "mp_degree": 8},
        "Quantization": {"enable": True, "weight_quantize_type": "abs_max",
                         "activation_quantize_type": "moving_average_abs_max", "weight_bits": 8, "activation_bits": 8,
                         "quantizable_layer_type": ["Conv2D", "Linear", "Conv2DTranspose", "ColumnParallelLinear",
                                                    "RowParallelLinear"], "for_tensorrt": False,
                         "is_full_quantize": False, "onnx_format": False}},
}


@pytest.fixture(scope="module")
def qat_models(w, base_model):
    from gptforge.cli import main

    outs = {}
    for name, doc in QAT.items():
        recipe = write(w["root"], f"{name}.yaml", doc)
        out = w["root"] / "runs" / name
        size = ["-o", "Distributed.mp_degree=1", "-o", "Compress.Quantization.skip_tensor_map={block_1: [linear2]}"]
        assert main(["qat", "-c", str(recipe), "--ckpt", str(base_model), "--no-progress",
                     *train_args(w, out, steps=2, model=False), *size]) == 0
        outs[name] = out / "step_2"
    return outs


def test_qat_layouts(qat_models, base_model):
    import torch

    base, _ = load_model(base_model)
    for name, step in qat_models.items():
        model, cfg = load_model(step)
        q = cfg.Compress.Quantization
        assert q.enable and q.weight_quantize_type == "abs_max", name
        assert q.quantizable_layer_type == ["Linear", "ColumnParallelLinear", "RowParallelLinear"]
        assert q.activation_preprocess_type == ("PACT" if name == "qat_compress_2023" else None)
        assert sum("Quant" in type(m).__name__ for m in model.modules()) >= 7, name  # 8 Linears, 1 skipped
        # freeze_embedding (the Compress recipe) keeps the tied embedding; the 2022 recipe trains it
        frozen = torch.equal(model.wte.weight, base.wte.weight)
        assert frozen == (name == "qat_compress_2023"), name


def test_auto_qat_generation(w, qat_models, run_cli):
    """ppfleetx auto/qat_generation_gpt_345M_mp2: top-level Quantization, generation module, on the QAT
    model, as written (mp 2 is a training layout; generation runs in one process)."""
    doc = {**AUTO_BASE, "Model": {**AUTO_BASE["Model"], **BIG, "module": "GPTGenerationModuleAuto"},
           "Generation": {"top_k": 50, "top_p": 0.75, "max_dec_len": 200, "decode_strategy": "sampling"},
           "Distributed": {"dp_degree": 1, "mp_degree": 2},
           "Quantization": {"enable": True, "channel_wise_abs_max": False, "weight_bits": 8, "activation_bits": 8,
                            "onnx_format": True}}
    recipe = write(w["root"], "auto_qat_generation.yaml", doc)
    code, out, err = run_cli("generate", "-c", recipe, "--ckpt", qat_models["qat_compress_2023"],
                             "--prompt", "the lazy", "-o", "Global.device=cpu", "-o", "Generation.max_dec_len=4")
    assert code == 0, err
    assert out.startswith("the lazy")


PRUNE = {
    "prune_compress": {  # ppfleetx prune_gpt_345M_single_card
        "Model": {**BIG, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        "Optimizer": {"weight_decay": 0.0, "lr": {"decay_steps": 90000, "warmup_rate": 0.0, "max_lr": 2.5e-5,
                                                  "min_lr": 5e-6}},
        "Compress": {"pretrained": None, "Prune": {"enable": True, "criterion": "l1_norm", "ratio": 0.5}}},
    "prune_top_level_2022_10": {  # ppfleetx pretrain_gpt_345M_single_card_prune, before Compress
        "Model": BIG, "Prune": {"enable": True, "criterion": "l1_norm", "ratio": 0.5}},
}


def test_prune_layouts_agree(w, base_model, run_cli):
    shapes = {}
    for name, doc in PRUNE.items():
        recipe = write(w["root"], f"{name}.yaml", doc)
        out = w["root"] / "runs" / name
        code, _, err = run_cli("prune", "-c", recipe, "--ckpt", base_model, "--no-progress",
                               *train_args(w, out, steps=1, model=False))
        assert code == 0, (name, err)
        model, cfg = load_model(out / "step_1")
        shapes[name] = [tuple(p.shape) for p in model.parameters()]
        assert (cfg.Model.layer_num_heads or [cfg.Model.num_attention_heads])[0] == 1  # 2 heads → 1
    assert shapes["prune_compress"] == shapes["prune_top_level_2022_10"]


EXPORT = {
    "export_qat_examples": {  # examples/transformer pretrain/configs/export_qat_gpt_345M_single_card
        "Global": {"device": "gpu", "local_batch_size": 1, "micro_batch_size": 1},
        "Model": BIG,
        "Compress": {"pretrained": None, "Quantization": {"enable": True, "weight_quantize_type": "abs_max",
                                                          "activation_quantize_type": "moving_average_abs_max",
                                                          "weight_bits": 8, "activation_bits": 8, "onnx_format": True}}},
    "auto_export_fp16": {  # ppfleetx auto/export_gpt_fp16_single_card: every Engine count -1
        "Global": {"device": "gpu", "seed": 1024, "local_batch_size": 1, "micro_batch_size": 1},
        "Engine": {"max_steps": -1, "num_train_epochs": -1, "eval_freq": -1, "eval_iters": -1, "test_iters": -1,
                   "mix_precision": {"enable": True, "dtype": "float16", "level": "o2", "use_fp16_guard": False},
                   "save_load": {"output_dir": None, "ckpt_dir": None}},
        "Distributed": {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
                        "sharding": {"sharding_degree": 1, "sharding_stage": 1}}},
}


@pytest.fixture(scope="module")
def exports(w, base_model, qat_models):
    from gptforge.cli import main

    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    outs = {}
    for name, doc in EXPORT.items():
        recipe = write(w["root"], f"{name}.yaml", doc)
        ckpt = qat_models["qat_compress_2023"] if name == "export_qat_examples" else base_model
        out = w["root"] / "exports" / name
        assert main(["export", "-c", str(recipe), "--ckpt", str(ckpt), "--format", "onnx", "--out", str(out),
                     "--no-check", "-o", "Global.device=cpu"]) == 0
        outs[name] = out
    return outs


@pytest.mark.slow  # two ONNX exports: ~50 s on a busy 2-core machine; loading is in test_layouts.py
def test_export_layouts(exports):
    for name, out in exports.items():
        meta = json.loads((out / "gptforge_export.json").read_text())
        assert (out / "model.onnx").is_file(), name
        # the QAT recipe's model exports as INT8 QDQ; the auto fp16 recipe as fp32 (export is fp32 in the reference)
        assert meta["precision"] == ("int8" if name == "export_qat_examples" else "fp32"), (name, meta)


@pytest.mark.slow  # needs the exports above
def test_inference_layout(w, exports, run_cli):
    """ppfleetx inference_gpt_345M_single_card: an Inference section next to Generation."""
    recipe = write(w["root"], "inference.yaml", {
        "Inference": {"model_dir": "./output", "mp_degree": 1},
        "Generation": {"top_k": 1, "decode_strategy": "sampling", "max_dec_len": 200, "use_topp_sampling": True},
    })
    code, out, err = run_cli("infer", "-c", recipe, "--onnx", exports["auto_export_fp16"], "--prompt", "the quick",
                             "-o", "Generation.max_dec_len=5")
    assert code == 0, err
    assert out.startswith("the quick")


# ---- multi-process recipes: one torchrun launch of 2 gloo ranks runs them all ------------------

DISTRIBUTED = {
    "dp": ({"Model": {**BIG, "use_recompute": True}, "Distributed": {"dp_degree": None, "mp_degree": 1}},
           ()),  # pretrain_gpt_1.3B_dp8
    "sharding": ({"Model": {**BIG, "use_recompute": True, "fused_linear": True},
                  "Optimizer": {"tensor_fusion": True},
                  "Distributed": {"dp_degree": None, "sharding": {
                      "sharding_degree": 16, "sharding_stage": 2, "sharding_offload": False,
                      "reduce_overlap": True, "broadcast_overlap": True}}},
                 ("Distributed.sharding.sharding_degree=2",)),  # pretrain_gpt_6.7B_sharding16
    "mp": ({"Model": BIG, "Distributed": {"dp_degree": 1, "mp_degree": 8, "pp_degree": 1}},
           ("Distributed.mp_degree=2",)),  # pretrain_gpt_1.3B_mp8 (2022-09)
    "auto_sharding": ({**AUTO_BASE, "Model": {**AUTO_BASE["Model"], **BIG, "use_recompute": True},
                       "Distributed": {"dp_degree": None, "sharding": {"sharding_degree": 16, "sharding_stage": 2}}},
                      ("Distributed.sharding.sharding_degree=2",)),  # auto/pretrain_gpt_6.7B_sharding16
    "auto_dp_sharding": ({"Engine": {"use_recompute": True, "mix_precision": {"use_pure_fp16": True}},
                          "Data": {"batch_size": {"global_batch_size": 64}}, "Model": BIG,
                          "Distributed": {"dp_degree": 16, "sharding": {"sharding_degree": 16, "sharding_stage": 2}}},
                         ("Distributed.dp_degree=2", "Distributed.sharding.sharding_degree=2")),
    # examples/gpt/auto_parallel configs_345M_dp16sharding16: auto dp counts the sharding ranks
}


DEGREES = {"dp": (2, 1, 1), "sharding": (1, 2, 1), "mp": (1, 1, 2), "auto_sharding": (1, 2, 1),
           "auto_dp_sharding": (1, 2, 1)}  # (dp, sharding, mp) at 2 ranks


@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_distributed_recipes_resolve(tmp_path, name):
    """Fast: each multi-process recipe with its size overrides fits 2 ranks as (dp, sharding, mp)."""
    from gptforge.config import load_config
    from gptforge.config.resolve import check_distributed

    doc, size = DISTRIBUTED[name]
    cfg = load_config(write(tmp_path, f"{name}.yaml", doc), [*size, *TINY_MODEL, *CPU], world_size=2)
    check_distributed(cfg, world_size=2)
    d = cfg.Distributed
    assert (d.dp_degree, d.sharding.sharding_degree, d.mp_degree) == DEGREES[name]


@pytest.mark.slow
@pytest.mark.distributed
def test_distributed_recipes(w, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "distributed"))
    from dist_common import launch, result

    jobs = []
    for name, (doc, size) in DISTRIBUTED.items():
        recipe = write(tmp_path, f"{name}.yaml", doc)
        out = tmp_path / "runs" / name
        args = [*train_args(w, out, steps=2), *(a for kv in size for a in ("-o", kv))]
        jobs.append({"name": name, "cli": ["pretrain", "-c", str(recipe), "--no-progress", *map(str, args)]})
    launch(tmp_path, jobs, nproc=2)
    for name in DISTRIBUTED:
        assert len(result(tmp_path, name)["losses"]) == 2, name
    layouts = [line.split("), ", 1)[1].split(";")[0] for line in (tmp_path / "launch.log").read_text().splitlines()
               if line.startswith("distributed: 2 processes")]
    fsdp = "fsdp: dp 1 x sharding 2 (stage 2) x mp 1"
    # dp blank → 2 replicas; sharding16 → 2; mp8 → 2; the auto recipes' dp counts the sharding ranks
    assert layouts == ["ddp: dp 2 x sharding 1 x mp 1", fsdp, "tp: dp 1 x sharding 1 x mp 2", fsdp, fsdp]


# ---- pipeline-parallel recipes: 4 gloo ranks (mp 2 x pp 2) -------------------------------------

PIPELINE = {
    # pretrain_gpt_175B_mp8_pp16: sequence parallel, core_attn recompute, fused_linear, 1536 / 1536 / 1
    "pp_175B": ({"Global": {"global_batch_size": 1536, "local_batch_size": 1536, "micro_batch_size": 1},
                 "Model": {**SHAPE, "hidden_size": 12288, "num_layers": 96, "num_attention_heads": 96,
                           "ffn_hidden_size": 49152, "vocab_size": 51200, "max_position_embeddings": 1024,
                           "use_recompute": True, "recompute_granularity": "core_attn", "sequence_parallel": True,
                           "fused_linear": True, "virtual_pp_degree": 1},
                 "Distributed": {"dp_degree": 1, "mp_degree": 8, "pp_degree": 16,
                                 "sharding": {"sharding_degree": 1, "sharding_stage": 1}}},
                ("Distributed.mp_degree=2", "Distributed.pp_degree=2", "Global.global_batch_size=4",
                 "Global.local_batch_size=4", "Global.micro_batch_size=1")),
    # pretrain_gpt_13B_dp8: mp2 pp8, full recompute, seq 4096
    "pp_13B": ({"Global": {"global_batch_size": 480, "micro_batch_size": 4, "seed": 1234},
                "Model": {**SHAPE, "hidden_size": 5120, "num_layers": 40, "num_attention_heads": 40,
                          "ffn_hidden_size": 20480, "max_position_embeddings": 4096, "use_recompute": True},
                "Distributed": {"dp_degree": None, "mp_degree": 2, "pp_degree": 8}},
               ("Distributed.pp_degree=2",)),
}


@pytest.mark.parametrize("name", list(PIPELINE))
def test_pipeline_recipes_resolve(tmp_path, name):
    """Fast: the pipeline recipes with their size overrides fit 4 ranks as mp 2 x pp 2."""
    from gptforge.config import load_config
    from gptforge.config.resolve import check_distributed
    from gptforge.train.pipeline import check_pipeline_config

    doc, size = PIPELINE[name]
    cfg = load_config(write(tmp_path, f"{name}.yaml", doc), [*TINY_MODEL, *CPU, "Global.global_batch_size=4",
                                                            "Global.micro_batch_size=2",
                                                            "Global.local_batch_size=", *size], world_size=4)
    check_distributed(cfg, world_size=4)
    check_pipeline_config(cfg)
    d = cfg.Distributed
    assert (d.dp_degree, d.pp_degree, d.mp_degree) == (1, 2, 2)


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_recipes(w, tmp_path):
    """The reference's pipeline recipes' structure (pp, mp, sequence parallel, recompute) runs
    on 4 gloo ranks with -o overrides for size only."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "distributed"))
    from dist_common import launch, result

    jobs = []
    for name, (doc, size) in PIPELINE.items():
        recipe = write(tmp_path, f"{name}.yaml", doc)
        out = tmp_path / "runs" / name
        args = [*train_args(w, out, steps=2), *(a for kv in size for a in ("-o", kv))]
        jobs.append({"name": name, "cli": ["pretrain", "-c", str(recipe), "--no-progress", *map(str, args)]})
    launch(tmp_path, jobs, nproc=4, timeout=900)
    for name in PIPELINE:
        losses = result(tmp_path, name)["losses"]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), name
    layouts = [line.split("), ", 1)[1].split(";")[0] for line in (tmp_path / "launch.log").read_text().splitlines()
               if line.startswith("distributed: 4 processes")]
    assert layouts == ["pp+tp: dp 1 x pp 2 (1F1B, 4 micro-batches) x sharding 1 x mp 2 + sequence parallel",
                       "pp+tp: dp 1 x pp 2 (1F1B, 2 micro-batches) x sharding 1 x mp 2"]
