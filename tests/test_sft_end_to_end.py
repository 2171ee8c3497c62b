"""End to end on the built-in corpus: pretrain a small model, instruction-tune it on the synthetic
set (data/synthetic_instructions.py), answer held-out instances greedily; DPO the pretrained
model on synthetic preference pairs. Also a quick default-suite version of the sft verb."""

from __future__ import annotations

import json

import pytest
import torch

from gptforge.data.synthetic_instructions import write_set

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sft_verb_trains_saves_the_template_and_resumes(tmp_path, run_cli):
    from gf_testutil import spread_gpt2_vocab_dir

    base = spread_gpt2_vocab_dir(tmp_path / "base")
    files = write_set(tmp_path / "data", n_train=48, n_test=8)
    template = tmp_path / "chatml.jinja"
    template.write_text("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
                        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    args = ["sft", "--ckpt", base, "--data", files["train"], "--eval-data", files["test"], "--out", tmp_path / "run",
            "--chat-template", template, "-o", "Global.global_batch_size=4", "-o", "Data.Train.dataset.max_seq_len=48",
            "-o", "Engine.save_load.save_steps=2", "-o", "Optimizer.lr.max_lr=1e-3", "--no-progress"]
    code, out, err = run_cli(*args, "-o", "Instruct.max_steps=4")
    assert code == 0, err
    assert "validation loss" in out
    cfg = json.loads((tmp_path / "run" / "step_4" / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == template.read_text()
    # the exported HF directory carries the template for transformers
    code, _, err = run_cli("export", "--ckpt", tmp_path / "run" / "step_4", "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).chat_template == template.read_text()
    # a run stopped after step 2 and resumed ends bit-identical to the uninterrupted one
    import shutil

    from safetensors.torch import load_file

    want = load_file(str(tmp_path / "run" / "step_4" / "model.safetensors"))
    shutil.rmtree(tmp_path / "run" / "step_4")
    code, out, err = run_cli(*args, "-o", "Instruct.max_steps=4", "--resume", "auto")
    assert code == 0 and "step 4" in out, err
    got = load_file(str(tmp_path / "run" / "step_4" / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_sft_and_dpo_with_lora_write_peft_adapters(tmp_path, run_cli):
    from safetensors.torch import load_file

    from gf_testutil import spread_gpt2_vocab_dir

    base = spread_gpt2_vocab_dir(tmp_path / "base")
    files = write_set(tmp_path / "data", n_train=24, n_test=8)
    common = ["-o", "Global.global_batch_size=4", "-o", "Data.Train.dataset.max_seq_len=48", "-o",
              "Instruct.max_steps=2", "-o", "Instruct.lora.targets=all", "-o", "Instruct.lora.r=4", "--method", "lora",
              "-o", "Optimizer.lr.max_lr=1e-2", "--no-progress"]
    for verb, data in (("sft", files["train"]), ("dpo", files["pref_train"])):
        code, out, err = run_cli(verb, "--ckpt", base, "--data", data, "--out", tmp_path / verb, *common)
        assert code == 0, err
        adapter = tmp_path / verb / "adapter"
        assert f"adapter {adapter}" in out and "trainable" in out
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        assert cfg["r"] == 4 and {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"} <= set(cfg["target_modules"])
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in tensors.items())
        assert "chat_template" in json.loads((adapter / "tokenizer_config.json").read_text())
        # the base stays frozen: its weights in the step checkpoint are the starting ones
        step = load_file(str(tmp_path / verb / "step_2" / "model.safetensors"))
        start = load_file(str(base / "model.safetensors"))
        assert torch.equal(step["blocks.0.linear1.base.weight"], start["blocks.0.linear1.weight"])


def test_lora_sft_over_an_int8_base_and_full_is_refused(tmp_path, run_cli):
    """`sft --method lora` trains float adapters over a converted INT8 model (the INT8 layers stay
    INT8 and frozen); full fine-tuning of it is a one-line error."""
    from safetensors.torch import load_file

    from gf_testutil import tiny_model
    from gptforge.config.schema import QuantizationConfig
    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.model_io import save_model_dir
    from gptforge.transforms.int8 import convert_model, converted_config
    from gptforge.transforms.quant import quantize_model

    torch.manual_seed(0)
    m, cfg = tiny_model("Model.vocab_size=50257")
    quantize_model(m, QuantizationConfig(enable=True))
    with torch.no_grad():
        m.train()(torch.randint(0, 50257, (2, 16)))  # the activation scales
    convert_model(m.eval())
    cfg.Compress.Quantization = converted_config(QuantizationConfig(enable=True), False, [])
    save_model_dir(m, cfg, tmp_path / "int8", gpt2_tokenizer())
    files = write_set(tmp_path / "data", n_train=24, n_test=8)
    args = ["sft", "--ckpt", tmp_path / "int8", "--data", files["train"], "-o", "Global.global_batch_size=4", "-o",
            "Data.Train.dataset.max_seq_len=48", "-o", "Instruct.max_steps=2", "--no-progress"]
    code, _, err = run_cli(*args, "--out", tmp_path / "full")
    assert code == 2 and "cannot be fully fine-tuned" in err and "--method lora" in err, err
    code, out, err = run_cli(*args, "--out", tmp_path / "lora", "--method", "lora", "-o", "Instruct.lora.targets=all",
                             "-o", "Optimizer.lr.max_lr=1e-2")
    assert code == 0, err
    tensors = load_file(str(tmp_path / "lora" / "adapter" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in tensors.items())
    step = load_file(str(tmp_path / "lora" / "step_2" / "model.safetensors"))
    assert step["blocks.0.linear1.base.weight"].dtype == torch.int8
    assert torch.equal(step["blocks.0.linear1.base.weight"], m.blocks[0].linear1.weight)


def test_sft_errors_are_one_line(tmp_path, run_cli):
    from gf_testutil import spread_gpt2_vocab_dir

    base = spread_gpt2_vocab_dir(tmp_path / "base")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x", "output": "y"}\n{"instruction": "x", "output": 3}\n')
    code, _, err = run_cli("sft", "--ckpt", base, "--data", bad, "--out", tmp_path / "run", "--no-progress")
    assert code == 2 and f"{bad}:2: field 'output' must be a string" in err and "Traceback" not in err
    code, _, err = run_cli("sft", "--ckpt", base, "--out", tmp_path / "run", "--no-progress")
    assert code == 2 and "Instruct.train_data" in err


@pytest.mark.slow
@pytest.mark.timeout(5400)  # ~45 min on 2 busy cores: past the suite's 900 s default
def test_pretrain_sft_dpo_on_the_builtin_corpus(tmp_path, monkeypatch):
    """Issue 31's end-to-end acceptance, by benchmarks/sft_end_to_end.py's pipeline (its one
    implementation) at the measured run's sizes (benchmarks/results/2026-11-26-sft-end-to-end.md:
    about 45 minutes on 2 busy cores): pretrain on the corpus + 70% skill text, 500 steps on
    skill documents, SFT full / LoRA / LoRA over INT8, DPO from the fully tuned model."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sft_end_to_end.py"
    spec = importlib.util.spec_from_file_location("sft_end_to_end", path)
    e2e = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, e2e)  # dataclasses resolve Plan's annotations through it
    spec.loader.exec_module(e2e)
    res = e2e.run_pipeline(tmp_path, e2e.Plan())
    print(json.dumps(res), e2e.table(res), sep="\n", flush=True)
    full, lora, int8 = (res["sft"][m] for m in ("full", "lora", "lora_int8"))
    pref = res["dpo"]
    # The measured run (benchmarks/results/2026-11-26-sft-end-to-end.md): EOS 1.000 everywhere;
    # exact match full 0.995, LoRA (860 steps) 0.995, LoRA over INT8 0.995; DPO on the style pairs
    # 0.500 -> 1.000. Over the previous corpus-only base LoRA reached 0.005, so each check can fail.
    for r in (full, lora, int8):
        assert r["ended_with_eos"] >= 0.99, r
    assert full["exact_match"] >= 0.90, full
    assert lora["exact_match"] >= full["exact_match"] - 0.02, (lora, full)
    assert int8["exact_match"] >= lora["exact_match"] - 0.02, (int8, lora)
    assert 0.3 <= pref["before"]["accuracy"] <= 0.7 and pref["after"]["accuracy"] >= 0.90, pref
