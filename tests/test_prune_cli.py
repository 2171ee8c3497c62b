"""`gptforge prune` end to end: load → prune → fine-tune → checkpoint, HF export parity, resume, errors."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from gptforge.model_io import load_model
from test_train_support import small_tokenizer, state_equal, train_config

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=1)
def _dense_dir(root: str) -> Path:
    """A tiny model with 8 heads trained for a few steps (shared by the tests of this module)."""
    from gptforge.train import pretrain

    cfg = train_config(Path(root), "Model.num_attention_heads=8", "Engine.save_load.save_steps=-1",
                       "Engine.eval_freq=0", steps=6)
    return pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False).checkpoint_dir


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _dense_dir(str(tmp_path_factory.mktemp("dense")))


def _data_overrides(dense: Path) -> list[str]:
    root = dense.parent.parent
    return ["-o", f"Data.Train.dataset.input_dir={root / 'data' / 'corpus'}",
            "-o", f"Data.Eval.dataset.input_dir={root / 'data' / 'corpus'}"]


def test_prune_finetune_checkpoint_and_hf_export(run_cli, dense, tmp_path):
    code, out, err = run_cli("prune", "--ckpt", dense, "--out", tmp_path / "run", "--hf-out", tmp_path / "hf",
                             "-o", "Engine.max_steps=4", "-o", "Compress.Prune.ratio=0.25",
                             "-o", "Compress.Prune.criterion=activation", "-o", "Compress.Prune.calib_batches=2",
                             "-o", "Model.use_recompute=True",  # the reference cannot combine the two
                             "--save-pruned", tmp_path / "pruned", "--no-progress", *_data_overrides(dense))
    assert code == 0, err
    assert "6 of 8 per layer" in out and "192 of 256 per layer" in out
    run = tmp_path / "run"
    report = json.loads((run / "prune_report.json").read_text())
    assert report["layer_heads"] == [6, 6] and len(report["removed_heads"][0]) == 2
    # the checkpoint records the pruned shape: it loads without re-pruning
    tuned, cfg = load_model(run / "step_4")
    assert (cfg.Model.num_attention_heads, cfg.Model.head_dim, cfg.Model.ffn_hidden_size) == (6, 8, 192)
    pruned, _ = load_model(tmp_path / "pruned")
    assert pruned.num_parameters() == tuned.num_parameters() < load_model(dense)[0].num_parameters()
    assert not state_equal(pruned.state_dict(), tuned.state_dict())  # fine-tuning changed the weights
    # the recipe of the reference: no warmup, no weight decay, no dropout
    run_cfg = (run / "config.yaml").read_text()
    assert "warmup_rate: 0.0" in run_cfg and "weight_decay: 0.0" in run_cfg and "hidden_dropout_prob: 0.0" in run_cfg
    # HF export: transformers loads it and gives the same logits
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["n_inner"] == 192 and hf_cfg["gptforge_pruned_shape"]["layer_num_heads"] == [6, 6]
    x = torch.randint(0, 300, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, tuned(x).logits, rtol=1e-5, atol=1e-5)


def test_global_pruned_model_exports_to_hf_with_equal_logits(tmp_path):
    from transformers import GPT2LMHeadModel

    from gf_testutil import tiny_model
    from gptforge.config.schema import PruneConfig
    from gptforge.export.hf import save_pruned_hf_dir
    from gptforge.transforms.prune import prune_model

    model, cfg = tiny_model("Model.num_layers=3")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0, 0.1)
    prune_model(model, PruneConfig(enable=True, ratio=0.4, head_ratio=0.4, ffn_ratio=0.4, scope="global"))
    assert len(set(model.config.layer_ffn_sizes or [0])) > 1  # per-layer widths: padded in the export
    save_pruned_hf_dir(model, model.config, tmp_path / "hf", small_tokenizer())
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 4096, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_resume_of_a_pruned_sparse_finetune_is_exact(run_cli, dense, tmp_path):
    common = ["--ckpt", dense, "-o", "Compress.Prune.ratio=0.25", "-o", "Compress.Prune.semi_structured=magnitude",
              "-o", "Engine.save_load.save_steps=2", "-o", "Optimizer.weight_decay=0.1", "--no-progress",
              *_data_overrides(dense)]
    code, _, err = run_cli("prune", *common, "--out", tmp_path / "a", "-o", "Engine.max_steps=4")
    assert code == 0, err
    # an interrupted run: stop after step 2, then resume with the full step count
    code, _, err = run_cli("prune", *common, "--out", tmp_path / "b", "-o", "Engine.max_steps=2",
                           "-o", "Optimizer.lr.decay_steps=4")
    assert code == 0, err
    code, out, err = run_cli("prune", *common, "--out", tmp_path / "b", "-o", "Engine.max_steps=4", "--resume", "auto")
    assert code == 0, err
    a, _ = load_model(tmp_path / "a" / "step_4")
    b, _ = load_model(tmp_path / "b" / "step_4")
    assert state_equal(a.state_dict(), b.state_dict())
    from gptforge.transforms.sparsity import is_2_4, target_layers

    assert all(is_2_4(m.weight) for m in target_layers(a).values())
    # a second fresh run into a directory with checkpoints is refused (one line, exit 2)
    code, _, err = run_cli("prune", *common, "--out", tmp_path / "a", "-o", "Engine.max_steps=4")
    assert code == 2 and "already holds checkpoints of another run" in err and "Traceback" not in err


def test_max_steps_zero_writes_the_pruned_model(run_cli, dense, tmp_path):
    code, out, err = run_cli("prune", "--ckpt", dense, "--out", tmp_path / "run", "-o", "Engine.max_steps=0",
                             "-o", "Compress.Prune.head_ratio=0.5", "-o", "Compress.Prune.ffn_ratio=0",
                             "-o", "Compress.Prune.ratio=0.9")
    assert code == 0, err
    model, cfg = load_model(tmp_path / "run" / "pruned")
    assert (cfg.Model.num_attention_heads, cfg.Model.ffn_hidden_size) == (4, 256)


@pytest.mark.parametrize("overrides,message", [
    (["-o", "Compress.Prune.criterion=fisher"], "Compress.Prune.criterion"),
    (["-o", "Compress.Prune.enable=False"], "Compress.Prune.enable"),
    (["-o", "Compress.Prune.scope=layer"], "Compress.Prune.scope"),
    (["-o", "Compress.Prune.semi_structured=4:8"], "Compress.Prune.semi_structured"),
    (["-o", "Compress.Prune.head_ratio=1.5"], "Compress.Prune.head_ratio"),
])
def test_config_errors_are_one_line(run_cli, dense, tmp_path, overrides, message):
    code, _, err = run_cli("prune", "--ckpt", dense, "--out", tmp_path / "x", *overrides)
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_pretrained_is_required(run_cli, tmp_path):
    code, _, err = run_cli("prune", "-c", ROOT / "configs" / "prune_gpt_345M_single_card.yaml",
                           "-o", f"Engine.save_load.output_dir={tmp_path}")
    assert code == 2 and "Compress.pretrained" in err


def test_reference_config_matches_the_spec():
    from gptforge.config import load_config

    cfg = load_config(ROOT / "configs" / "prune_gpt_345M_single_card.yaml")
    p, lr = cfg.Compress.Prune, cfg.Optimizer.lr
    assert (p.enable, p.criterion, p.ratio, p.head_ratio, p.ffn_ratio) == (True, "l1_norm", 0.125, 0.125, 0.125)
    assert (cfg.Model.hidden_size, cfg.Model.num_layers, cfg.Model.num_attention_heads) == (1024, 24, 16)
    assert (cfg.Model.hidden_dropout_prob, cfg.Model.attention_probs_dropout_prob) == (0.0, 0.0)
    assert (cfg.Optimizer.weight_decay, lr.warmup_rate, lr.decay_steps, lr.max_lr, lr.min_lr) == \
        (0.0, 0.0, 90000, 2.5e-5, 5e-6)
    mini = load_config(ROOT / "configs" / "prune_gpt_mini_cpu.yaml")
    assert mini.Compress.Prune.enable and mini.Data.Train.dataset.input_dir == "builtin"


def test_prune_then_qat_in_one_run_and_qat_from_a_pruned_directory(run_cli, dense, tmp_path):
    from gptforge.transforms.quant import QuantLinear
    from gptforge.transforms.sparsity import is_2_4, target_layers

    data = _data_overrides(dense)
    code, out, err = run_cli("prune", "--ckpt", dense, "--out", tmp_path / "pq", "-o", "Engine.max_steps=2",
                             "-o", "Compress.Prune.ratio=0.25", "-o", "Compress.Prune.semi_structured=magnitude",
                             "-o", "Compress.Quantization.enable=True", "--save-pruned", tmp_path / "float",
                             "--no-progress", *data)
    assert code == 0, err
    model, cfg = load_model(tmp_path / "pq" / "step_2")
    assert cfg.Model.num_attention_heads == 6 and cfg.Compress.Quantization.enable
    layers = target_layers(model)
    assert all(type(m) is QuantLinear for m in layers.values())
    assert all(is_2_4(m.weight) for m in layers.values())  # the 2:4 pattern survives QAT fine-tuning
    float_model, float_cfg = load_model(tmp_path / "float")
    assert not float_cfg.Compress.Quantization.enable
    assert float_model.num_parameters() < load_model(dense)[0].num_parameters()
    # a pruned directory is an ordinary Compress.pretrained for `gptforge qat`
    code, out, err = run_cli("qat", "--ckpt", tmp_path / "float", "-o", f"Engine.save_load.output_dir={tmp_path / 'q'}",
                             "-o", "Engine.max_steps=2", "-o", "Engine.save_load.save_steps=-1", "--no-progress", *data)
    assert code == 0, err
    qmodel, qcfg = load_model(tmp_path / "q" / "step_2")
    assert (qcfg.Model.num_attention_heads, qcfg.Model.ffn_hidden_size) == (6, 192)
    assert any(type(m) is QuantLinear for m in qmodel.modules())


def test_reference_345M_config_runs_on_any_pretrained_shape(run_cli, dense, tmp_path):
    """`-c configs/prune_gpt_345M_single_card.yaml -o Compress.pretrained=DIR`: the shape comes from DIR."""
    data = _data_overrides(dense)
    code, out, err = run_cli("prune", "-c", ROOT / "configs" / "prune_gpt_345M_single_card.yaml",
                             "-o", f"Compress.pretrained={dense}", "-o", f"Engine.save_load.output_dir={tmp_path}",
                             "-o", "Engine.max_steps=1", "-o", "Engine.mix_precision.enable=False",
                             "-o", "Global.local_batch_size=2", "-o", "Global.micro_batch_size=2",
                             "-o", "Data.Train.dataset.max_seq_len=32", "-o", "Data.Eval.dataset.max_seq_len=32",
                             "-o", "Global.device=cpu", "--no-progress", *data)
    assert code == 0, err
    assert "7 of 8 per layer" in out and "224 of 256 per layer" in out  # ratio 0.125 of the tiny model
    _, cfg = load_model(tmp_path / "step_1")
    assert (cfg.Model.hidden_size, cfg.Model.num_attention_heads, cfg.Optimizer.lr.max_lr) == (64, 7, 2.5e-5)
