"""What the engine saves per served token keeps its results: the step's logits rows are read
in place (no copy), greedy rows of any requests share one group (no per-row copies), and a
request that keeps no scores (a server's) skips the vocabulary-wide log-softmax, while tokens,
asked-for log-probs and offline scores stay those of each request alone; greedy picks its
token with a vectorized exact argmax."""

from __future__ import annotations

import pytest
import torch

from gf_testutil import skip_unless_runs, tiny_model
from gptforge.generate.backend import TorchBackend
from gptforge.generate.engine import EngineCore, Request, SamplingParams, SchedulerConfig, TokenEvent
from gptforge.generate.engine.runner import stack_rows
from gptforge.generate.engine.sampler import Scored, row_argmax
from gptforge.generate.slots import slots_for
from test_generate import _spread

pytestmark = pytest.mark.usefixtures("one_thread")


def test_stack_rows_views_consecutive_rows_and_copies_otherwise():
    logits = torch.randn(5, 11)
    rows = [logits[i] for i in range(1, 4)]
    view = stack_rows(rows)
    assert torch.equal(view, torch.stack(rows)) and view.data_ptr() == logits[1].data_ptr()
    for other in ([logits[3], logits[1]], [logits[0], logits[2]], [logits[0], torch.randn(11)],
                  [logits[:, 0], logits[:, 1]], [logits[0, :5], logits[0, 6:11]]):
        out = stack_rows(other)
        assert torch.equal(out, torch.stack(other)) and out.data_ptr() != other[0].data_ptr()


def test_log_probs_of_some_rows_are_bitwise_those_of_all_rows():
    scores = torch.randn(9, 50257) * 4
    full = Scored(scores, None).logprobs()
    part = Scored(scores, None).logprobs([6, 0, 3])
    assert torch.equal(part, full[[6, 0, 3]])


@pytest.mark.parametrize("route", ["native avx2", "native scalar", "amax blocks"])
def test_row_argmax_is_torch_argmax(route, monkeypatch):
    from gptforge.transforms import native_kernels

    if route == "amax blocks":  # where gptforge's kernels do not run
        monkeypatch.setenv(native_kernels.ISA_ENV, "off")
    else:
        if native_kernels.unavailable() is not None:
            pytest.skip(f"gptforge's CPU kernels are unavailable: {native_kernels.unavailable()}")
        path = route.split()[1]
        skip_unless_runs(path, native_kernels.cpu_isa())
        monkeypatch.setenv(native_kernels.ISA_ENV, path)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 50257, generator=g)
    x[1, 50250] = 9.0  # the maximum only in the partial last block
    x[2, [10, 700, 50256]] = 9.0  # ties: the first wins
    x[3, 5000] = float("nan")  # NaN wins (argmax's rule)
    x[4] = float("-inf")
    x[5, :] = 0.0
    x[5, 3], x[5, 900] = -0.0, 0.0
    x[6, [64, 63]] = 7.0  # ties across a block edge
    x[7, 128] = float("inf")
    x[8, [9, 50256]] = float("nan")  # the first NaN wins
    x[9, 50256] = float("nan")  # NaN only in the tail of the vector steps
    for t in (x, x[:, :130], x[:, :100], x[:, :15], x[:, :1], x[2:10], torch.cat([x, x], 0)[::2], x[:, 1:]):
        assert torch.equal(row_argmax(t), t.argmax(dim=-1))
    assert torch.equal(row_argmax(x.double()), x.double().argmax(dim=-1))


@pytest.fixture(scope="module")
def model():
    return _spread(tiny_model("Model.num_layers=2")[0], 0)


PROMPTS = [[5, 17, 300, 41, 9], [7, 1000, 12, 66] * 9, [250, 251, 252], [99, 3]]


def _run(model, specs):
    """Each (prompt, params, keep_scores) as a request, all in one batch: [(tokens, logprob_sum,
    event log-probs)] per request."""
    with TorchBackend(model) as be:
        core = EngineCore(slots_for(be), eos_token_ids=[], vocab_limit=None, max_positions=be.max_positions,
                          scheduler=SchedulerConfig(max_batch_size=16))
        core.isolate = False
        events = [[] for _ in specs]
        reqs = [Request([p], params, sink=events[i].append, keep_scores=keep)
                for i, (p, params, keep) in enumerate(specs)]
        seqs = [core.add(r, bounded=False)[0] for r in reqs]
        core.run()
    return [(s.generated, s.logprob_sum, [e.logprob for e in ev if isinstance(e, TokenEvent)])
            for s, ev in zip(seqs, events, strict=True)]


def test_a_mixed_batch_gives_each_request_its_solo_tokens_scores_and_log_probs(model):
    greedy = SamplingParams(max_tokens=9, temperature=0)
    specs = [(PROMPTS[0], greedy, False),
             (PROMPTS[1], SamplingParams(max_tokens=9, temperature=0, logprobs=2), False),
             (PROMPTS[2], SamplingParams(max_tokens=9, temperature=0, repetition_penalty=1.3), True),
             (PROMPTS[3], SamplingParams(max_tokens=9, temperature=0.9, top_k=30, seed=3), True),
             (PROMPTS[0], greedy, True)]
    together = _run(model, specs)
    for spec, got in zip(specs, together, strict=True):
        alone = _run(model, [(spec[0], spec[1], True)])[0]
        assert got[0] == alone[0]  # the same tokens whoever shares the batch
        kept = spec[2] or spec[1].logprobs is not None  # log-probs asked for: computed anyway
        assert got[1] == (alone[1] if kept else 0.0)  # bitwise where kept, skipped elsewhere
        assert got[2] == alone[2]  # asked-for log-probs whatever keep_scores says
    assert together[1][2] and all(lp is not None for lp in together[1][2])
    assert together[0][0] == together[4][0] and together[4][1] < 0


def test_built_in_processors_get_the_history_length_and_the_callers_own_get_its_ids(model):
    """The built-in processors read only the history's length, so the sampler skips building the
    token tensor for them; a caller's own processor still sees every token."""
    from gptforge.generate.engine.sampler import Sampler
    from gptforge.generate.processors import MinNewTokens, ProcessorList, VocabLimit

    assert not ProcessorList([MinNewTokens(3, 2, [1]), VocabLimit(5)]).reads_ids
    seen = []

    def own(ids, scores):
        seen.append(ids.clone())
        return scores

    assert ProcessorList([VocabLimit(5), own]).reads_ids
    for extra in ((), (own,)):
        with TorchBackend(model) as be:
            core = EngineCore(slots_for(be), eos_token_ids=[0], vocab_limit=50, max_positions=be.max_positions,
                              scheduler=SchedulerConfig(max_batch_size=4))
            core.sampler = Sampler([0], 50, torch.device("cpu"), extra)
            seq = core.add(Request([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, min_tokens=2)),
                           bounded=False)[0]
            core.run()
        assert len(seq.generated) == 4 and all(t < 50 and t != 0 for t in seq.generated[:2])
    assert [h.tolist() for h in seen] == [[PROMPTS[0] + seq.generated[:i]] for i in range(4)]
