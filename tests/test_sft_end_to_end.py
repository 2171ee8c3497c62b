"""End to end on the built-in corpus: pretrain a small model, instruction-tune it on the synthetic
set (data/synthetic_instructions.py), answer held-out instances greedily; DPO the pretrained
model on synthetic preference pairs. Also a quick default-suite version of the sft verb."""

from __future__ import annotations

import json
import os

import pytest
import torch

from gptforge.data.synthetic_instructions import messages, score_answers, write_set

pytestmark = pytest.mark.usefixtures("one_thread")


def greedy_answers(ckpt, prompts: list[str], max_new: int = 24) -> dict:
    """Greedy answers of the model at `ckpt` (its own chat template) → answers and EOS flags."""
    from gptforge.config.schema import GenerationConfig
    from gptforge.data.chat_template import template_for
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.generate.api import generate_ids
    from gptforge.model_io import load_model

    model, _ = load_model(ckpt)
    tok = load_tokenizer(None, ckpt)
    template = template_for(tok)
    ids = [template.prompt_ids(tok, messages(p)) for p in prompts]
    out = generate_ids(model, ids, GenerationConfig(decode_strategy="greedy_search", max_dec_len=max_new),
                       eos_token_id=tok.eos_token_id)
    return {"answers": [tok.decode(s) for s in out.sequences()], "finished": out.finished.tolist()}


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
def test_pretrain_sft_dpo_on_the_builtin_corpus(tmp_path, run_cli):
    from gptforge.config import load_config
    from gptforge.train import pretrain

    # A 2048-token BPE learned from the same corpus keeps the vocabulary projection (with GPT-2's
    # 50k tokens, most of a small model's CPU time) cheap.
    code, _, err = run_cli("tokenizer", "train", "--builtin", "--vocab-size", "2048", "--out", tmp_path / "tok",
                           "--no-progress")
    assert code == 0, err
    steps = int(os.environ.get("GPTFORGE_E2E_PRETRAIN_STEPS", "400"))
    cfg = load_config("pretrain_gpt_tiny_cpu", [
        "Global.device=cpu", f"Engine.max_steps={steps}", "Engine.eval_freq=-1", "Engine.save_load.save_steps=-1",
        "Global.global_batch_size=16", "Global.local_batch_size=16", "Global.micro_batch_size=16",
        f"Data.tokenizer={tmp_path / 'tok'}", "Model.vocab_size=2048",
        "Data.Train.dataset.max_seq_len=64", "Data.Eval.dataset.max_seq_len=64", "Optimizer.lr.max_lr=2e-3",
        f"Engine.save_load.output_dir={tmp_path / 'pre'}", "Engine.logging_freq=50"])
    pre = pretrain(cfg, progress=False, echo=False).checkpoint_dir
    files = write_set(tmp_path / "data", n_train=4000, n_test=200)
    common = ["-o", "Global.global_batch_size=16", "-o", "Data.Train.dataset.max_seq_len=64", "-o",
              "Model.hidden_dropout_prob=0", "-o", "Model.attention_probs_dropout_prob=0", "-o",
              "Engine.save_load.save_steps=-1", "-o", "Engine.logging_freq=50", "--no-progress"]
    epochs = os.environ.get("GPTFORGE_E2E_SFT_EPOCHS", "8")
    code, out, err = run_cli("sft", "--ckpt", pre, "--data", files["train"], "--out", tmp_path / "sft", "-o",
                             f"Instruct.epochs={epochs}", "-o", "Optimizer.lr.max_lr=2e-3", "-o",
                             "Optimizer.lr.min_lr=1e-4", *common)
    assert code == 0, err
    tuned = sorted((tmp_path / "sft").glob("step_*"))[-1]
    test = [json.loads(line)["messages"] for line in files["test"].read_text().splitlines()]
    got = greedy_answers(tuned, [m[0]["content"] for m in test])
    score = score_answers(got["answers"], got["finished"], [m[1]["content"] for m in test])

    code, out, err = run_cli("dpo", "--ckpt", pre, "--data", files["pref_train"], "--eval-data", files["pref_test"],
                             "--out", tmp_path / "dpo", "-o", "Instruct.max_steps=250", "-o", "Instruct.beta=0.1",
                             "-o", "Optimizer.lr.max_lr=1e-3", *common)
    assert code == 0, err
    pref = json.loads((tmp_path / "dpo" / "dpo_results.json").read_text())
    print(json.dumps({"sft": score, "dpo": pref}), flush=True)
    # Achieved on 2026-11-25 (400 pretraining steps, 8 SFT epochs, 250 DPO steps; see
    # benchmarks/results/2026-11-25-sft-end-to-end.md): EOS 0.99, exact match 0.59 (reverse 0.84,
    # list 0.80, sort 0.58, add 0.14), preference accuracy 0.595 -> 0.89. These are guarded:
    assert score["ended_with_eos"] >= 0.99, score
    assert score["exact_match"] >= 0.5, score
    assert 0.3 <= pref["before"]["accuracy"] <= 0.7 and pref["after"]["accuracy"] >= 0.85, pref
    # The targets are not reached at this size and length yet: reported, not hidden.
    if score["exact_match"] < 0.90 or pref["after"]["accuracy"] < 0.90:
        pytest.xfail(f"issue 31 targets (exact match >= 0.90, DPO preference accuracy >= 0.90) not reached: "
                     f"{score}, {pref['after']}")
