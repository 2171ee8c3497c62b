"""DPO: our loss equals TRL's `DPOTrainer.dpo_loss` on the same log-probabilities (1e-6), is ln 2
at step 0, and a short run logs rewards and keeps its reference fixed."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from gptforge.finetune.dpo import dpo_loss, sequence_logps

pytestmark = pytest.mark.usefixtures("one_thread")


def _trl_dpo_loss():
    """TRL's own loss function. trl 0.28 probes optional packages through transformers 5's
    `_is_package_available`, which returns a (bool, version) tuple that is always truthy: make
    the probes answer with the bool before trl's trainer modules import."""
    import trl.import_utils as iu

    for name in [n for n in dir(iu) if n.startswith("is_") and n.endswith("_available")]:
        probe = getattr(iu, name)
        setattr(iu, name, lambda *a, _p=probe, **k: (lambda v: v[0] if isinstance(v, tuple) else v)(_p(*a, **k)))
    from trl.trainer.dpo_config import FDivergenceType
    from trl.trainer.dpo_trainer import DPOTrainer

    def loss(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):
        fake = types.SimpleNamespace(beta=beta, label_smoothing=label_smoothing, reference_free=False,
                                     f_divergence_type=FDivergenceType.REVERSE_KL, f_divergence_params=None,
                                     use_weighting=False, accelerator=types.SimpleNamespace(device="cpu"))
        return DPOTrainer.dpo_loss(fake, chosen, rejected, ref_chosen, ref_rejected, loss_type="sigmoid")

    return loss


@pytest.fixture(scope="module")
def trl_loss():
    pytest.importorskip("trl")
    return _trl_dpo_loss()


@pytest.mark.parametrize("beta,smoothing", [(0.1, 0.0), (0.5, 0.2), (2.0, 0.05)])
def test_loss_equals_trl(trl_loss, beta, smoothing):
    g = torch.Generator().manual_seed(1)
    chosen, rejected, ref_c, ref_r = (-20 * torch.rand(16, generator=g, dtype=torch.float64) for _ in range(4))
    ours = dpo_loss(chosen, rejected, ref_c, ref_r, beta, smoothing)
    theirs = trl_loss(chosen, rejected, ref_c, ref_r, beta, smoothing)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert ours[0].std() > 0.01  # the pairs differ, so agreement is not a constant's


def test_step0_loss_is_ln2(trl_loss):
    logps = -10 * torch.rand(8, dtype=torch.float64)
    other = -10 * torch.rand(8, dtype=torch.float64)
    for smoothing in (0.0, 0.3):
        loss = dpo_loss(logps, other, logps, other, 0.1, smoothing)[0].mean()
        assert abs(float(loss) - math.log(2)) < 1e-12
        assert abs(float(trl_loss(logps, other, logps, other, 0.1, smoothing)[0].mean()) - math.log(2)) < 1e-12


def test_sequence_logps_scores_only_the_masked_tokens():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 0], [1, 1, 1, 1, 1]])
    ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(sequence_logps(logits, labels, mask), (ref * mask).sum(-1))


def test_dpo_run_starts_at_ln2_and_logs_rewards(tmp_path, run_cli):
    from gf_testutil import spread_gpt2_vocab_dir
    from gptforge.data.synthetic_instructions import write_set

    base = spread_gpt2_vocab_dir(tmp_path / "base")
    files = write_set(tmp_path / "data", n_train=24, n_test=8)
    code, out, err = run_cli("dpo", "--ckpt", base, "--data", files["pref_train"], "--eval-data", files["pref_test"],
                             "--out", tmp_path / "run", "-o", "Global.global_batch_size=8", "-o",
                             "Data.Train.dataset.max_seq_len=32", "-o", "Instruct.max_steps=2", "-o",
                             "Optimizer.lr.max_lr=1e-3", "-o", "Model.hidden_dropout_prob=0", "-o",
                             "Model.attention_probs_dropout_prob=0", "--no-progress")
    assert code == 0, err
    rec = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rec if r["kind"] == "train"]
    assert len(train) == 2 and all({"rewards_chosen", "rewards_rejected", "reward_accuracy"} <= set(r) for r in train)
    assert abs(train[0]["loss"] - math.log(2)) < 1e-5  # step 1: the policy is the reference
    assert train[0]["rewards_chosen"] == train[0]["rewards_rejected"] == 0.0
    assert any(r["kind"] == "eval" and "reward_accuracy" in r for r in rec)
    report = json.loads((tmp_path / "run" / "dpo_results.json").read_text())
    assert report["before"]["reward_accuracy"] == 0.0 and report["before"]["margin"] == 0.0
    assert "held-out preference accuracy" in out
