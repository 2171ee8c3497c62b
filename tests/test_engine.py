"""The engine's offline use (`generate` of many prompts = continuous batching run to
completion): whatever the batch size, a prompt's tokens and scores are the ones it gets alone
(greedy and seeded sampling); a failure propagates to the caller (servers isolate it instead:
tests/test_serve_faults.py)."""

from __future__ import annotations

import pytest
import torch

from gf_testutil import assert_equal_if_invariant, packed_rows_invariant, tiny_model
from gptforge.config.schema import GenerationConfig
from gptforge.generate import generate_ids
from test_generate import _spread

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 300, 41, 9], [7, 1000, 12, 66, 2, 3, 4, 8, 90] * 5, [250, 251, 252], [99], list(range(1, 70))]


@pytest.fixture(scope="module")
def model():
    return _spread(tiny_model("Model.num_layers=2")[0], 0)


@pytest.mark.parametrize("cfg", [
    GenerationConfig(decode_strategy="greedy_search", max_dec_len=12),
    GenerationConfig(decode_strategy="sampling", max_dec_len=12, top_k=20, temperature=0.8, seed=4,
                     num_return_sequences=2),
], ids=["greedy", "sampling"])
def test_continuous_batching_equals_each_prompt_alone(model, cfg):
    invariant = packed_rows_invariant(model)  # bit for bit with the native kernels, or where this CPU's oneDNN is invariant
    full = generate_ids(model, PROMPTS, cfg)
    n = cfg.num_return_sequences
    for bs in (1, 2):
        part = generate_ids(model, PROMPTS, cfg, batch_size=bs)
        assert torch.equal(part.tokens, full.tokens)
        assert_equal_if_invariant(part.scores, full.scores, invariant)
    for i, p in enumerate(PROMPTS):
        alone = generate_ids(model, [p], cfg)
        w = alone.tokens.shape[1]
        assert torch.equal(alone.tokens, full.tokens[i * n:(i + 1) * n, :w])
        assert_equal_if_invariant(alone.scores, full.scores[i * n:(i + 1) * n], invariant)


def test_a_failure_reaches_the_offline_caller(model):
    def broken(input_ids, scores):
        if input_ids.shape[1] > 12:
            raise ValueError("processor broke")
        return scores

    with pytest.raises(ValueError, match="processor broke"):
        generate_ids(model, PROMPTS, GenerationConfig(decode_strategy="greedy_search", max_dec_len=8),
                     processors=[broken])


def test_speculative_statistics_reach_collect_stats(model):
    """The engine's speculator feeds both the result's `SpecStats` and `spec_stats.collect_stats()`
    (what `gptforge generate` / `infer` report)."""
    from gptforge.generate.spec_stats import collect_stats

    cfg = GenerationConfig(decode_strategy="greedy_search", max_dec_len=10, num_draft_tokens="3")
    with collect_stats() as total:
        out = generate_ids(model, PROMPTS, cfg, draft=model)
    s = out.speculative
    assert s.rounds > 0 and s.drafted > 0 and s.accepted == s.drafted  # the model drafts for itself
    assert (total.stats.rounds, total.stats.drafted, total.stats.accepted) == (s.rounds, s.drafted, s.accepted)
