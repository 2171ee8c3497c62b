"""Fine-tuning a pretrained model beats training the same classifier from scratch.

The task needs what pretraining teaches: the language model learns, from running text, which
adjectives make "a ... treat" and which "a ... mess". The classifier is then fine-tuned on
sentences with half of the adjectives and evaluated on sentences with the *other* half, which
it never saw with a label. A model that read the text first transfers; one starting from random
weights can only guess.
"""

from __future__ import annotations

import random

import pytest

from gptforge.config import load_config
from gptforge.finetune.run import finetune
from test_finetune_support import NEG, NOUNS, POS, finetune_yaml, small_tokenizer, tiny_model_dir, write_split

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = ["Model.hidden_size=32", "Model.num_layers=2", "Model.num_attention_heads=4", "Model.ffn_hidden_size=64",
         "Model.vocab_size=384", "Model.max_position_embeddings=64", "Model.hidden_dropout_prob=0",
         "Model.attention_probs_dropout_prob=0"]


def _sentence(r: random.Random, adj: str, whole: bool) -> str:
    """"the film was a great treat." / "the film was an awful mess."; cut after the adjective."""
    ending = (" treat." if adj in POS else " mess.") if whole else ""
    return f"the {r.choice(NOUNS)} was a {adj}{ending}"


def _pretrain(tmp_path, steps: int):
    from gptforge.data.preprocess import preprocess_documents
    from gptforge.train import pretrain

    r = random.Random(0)
    docs = [" ".join(_sentence(r, r.choice(POS + NEG), True) for _ in range(6)) for _ in range(400)]
    tok = small_tokenizer()
    preprocess_documents(docs, tmp_path / "corpus" / "text", tok, workers=1, progress=False)
    tok.save(tmp_path / "tok")
    cfg = load_config(overrides=[
        *SHAPE, "Global.device=cpu", "Global.seed=3", "Global.global_batch_size=16", "Global.micro_batch_size=16",
        f"Engine.max_steps={steps}", "Engine.eval_freq=0", "Engine.logging_freq=50", "Engine.save_load.save_steps=-1",
        f"Engine.save_load.output_dir={tmp_path / 'pre'}", "Optimizer.lr.max_lr=1e-2", "Optimizer.lr.min_lr=1e-3",
        "Optimizer.lr.warmup_rate=0.05", f"Optimizer.lr.decay_steps={steps}",
        f"Data.tokenizer={tmp_path / 'tok'}",
        *(f"Data.{s}.dataset.{k}" for s in ("Train", "Eval")
          for k in (f"input_dir={tmp_path / 'corpus' / 'text'}", "max_seq_len=32")),
        "Data.Train.loader.num_workers=0"])
    return pretrain(cfg, tokenizer=tok, progress=False, echo=False)


def _task(root):
    r = random.Random(1)
    seen, unseen = (POS[:6], NEG[:6]), (POS[6:], NEG[6:])

    def rows(n, words):
        out = []
        for _ in range(n):
            y = r.randint(0, 1)
            out.append((_sentence(r, r.choice(words[0] if y else words[1]), False), None, y))
        return out

    write_split(root, "SST2", "train", rows(64, seen))
    write_split(root, "SST2", "dev", rows(48, unseen))  # adjectives the classifier never saw labelled


def _accuracy(tmp_path, start, name):
    y = finetune_yaml(tmp_path / f"{name}.yaml", "SST2", tmp_path / "task", start, tmp_path / name)
    cfg = load_config(y, ["Engine.num_train_epochs=4", "Optimizer.lr.max_lr=3e-3", "Global.seed=5"])
    return finetune(cfg, echo=False, progress=False).evals[-1]["dev"]["acc"]


@pytest.mark.parametrize("steps", [pytest.param(100, id="fast"), pytest.param(400, id="long", marks=pytest.mark.slow)])
def test_pretrained_beats_scratch_on_unseen_words(tmp_path, steps):
    pre = _pretrain(tmp_path, steps)
    assert pre.losses[-1] < 0.6 * pre.losses[0]
    _task(tmp_path / "task")
    scratch = tiny_model_dir(tmp_path / "scratch", seed=3)  # the same shape, random weights
    acc_pre = _accuracy(tmp_path, pre.checkpoint_dir, "from_pretrained")
    acc_scratch = _accuracy(tmp_path, scratch, "from_scratch")
    assert acc_pre >= 0.9 and acc_pre >= acc_scratch + 0.2, (acc_pre, acc_scratch)
