"""Beam search over a `StepBackend`, with HF `transformers`' semantics (so outputs match it).

Per step and prompt: the `num_beams` running beams propose their continuations; the best
K = 2·num_beams (sum of log-probs) are kept, so that `num_beams` beams can continue even when
some candidates end. A candidate that emits EOS (or reaches `max_new_tokens`) and ranks among
the top `num_beams` becomes a finished hypothesis scored `sum_logprobs / generated_len **
length_penalty` (generated_len counts the EOS); the `num_beams` best hypotheses are kept.
A prompt stops improving when all `num_beams` hypothesis slots are full and the best running
beam, scored at its current length, cannot beat the worst of them (HF's `early_stopping=False`
heuristic); `early_stopping=True` also stops as soon as the slots are full. Logits processors
see log-probabilities here, as in HF's beam search.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gptforge.generate.processors import NO_TOKEN, ProcessorList
from gptforge.generate.search import PromptBatch, SearchOutput

# Score offset that takes a beam out of the running without creating infinities (HF's value).
_OUT = -1.0e9


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [B, k] of `t` [B, n, ...] along dim 1."""
    if t.dim() == 2:
        return t.gather(1, index)
    return t.gather(1, index[:, :, None].expand(-1, -1, t.shape[2]))


def _keep_best(nb: int, kept: tuple, new: tuple) -> tuple:
    """The `nb` best finished hypotheses (by score, the first tensor) of `kept` + `new`, each a
    tuple of [B, n, ...] tensors (scores, sequences, slot full, length, ended with EOS)."""
    best = torch.cat([kept[0], new[0]], 1).topk(nb, dim=1)
    return (best.values, *(_take(torch.cat([a, b], 1), best.indices) for a, b in zip(kept[1:], new[1:], strict=True)))


@torch.inference_mode()
def beam_search(backend, prompts: PromptBatch, *, num_beams: int, max_new_tokens: int,
                processors: ProcessorList, eos_token_ids: Sequence[int] = (), pad_token_id: int = 0,
                length_penalty: float = 1.0, early_stopping: bool = False,
                num_return_sequences: int = 1) -> SearchOutput:
    """Deterministic beam search; returns the `num_return_sequences` best hypotheses per prompt,
    best first, scored as HF's `sequences_scores`."""
    be, nb, T = backend, int(num_beams), int(max_new_tokens)
    B, L = prompts.batch_size, prompts.length
    dev = be.device
    K = max(2, 1 + len(eos_token_ids)) * nb
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=dev)

    # Prefill once per prompt, then give every beam a copy of the prompt's cache.
    cache = be.new_cache(B, L + T)
    logits = be.step(prompts.input_ids, prompts.position_ids, prompts.attention_mask, cache)
    rows = torch.arange(B, device=dev).repeat_interleave(nb)
    cache = be.reorder(cache, rows)
    logits = logits.index_select(0, rows)
    hist = torch.full((B * nb, L + T), NO_TOKEN, dtype=torch.long, device=dev)
    hist[:, :L] = prompts.history.repeat_interleave(nb, 0)
    mask = prompts.full_mask(B * nb, L + T, dev)
    pos = prompts.position_ids[:, -1:].repeat_interleave(nb, 0) + 1
    offset = torch.arange(B, device=dev)[:, None] * nb

    # Only beam 0 is live at first, so the first step does not pick the same token nb times.
    running = torch.zeros(B, nb, device=dev)
    running[:, 1:] = _OUT
    seqs = torch.full((B, nb, T), pad_token_id, dtype=torch.long, device=dev)
    fin_scores = torch.full((B, nb), float("-inf"), device=dev)
    fin_seqs = seqs.clone()
    fin_full = torch.zeros(B, nb, dtype=torch.bool, device=dev)  # slot holds a hypothesis
    fin_len = torch.zeros(B, nb, dtype=torch.long, device=dev)
    fin_eos = torch.zeros(B, nb, dtype=torch.bool, device=dev)
    improvable = torch.ones(B, dtype=torch.bool, device=dev)
    top_nb = torch.arange(K, device=dev) < nb

    for t in range(T):
        logp = processors(hist[:, : L + t], torch.log_softmax(logits.float(), dim=-1))
        V = logp.shape[-1]
        cand = (logp.view(B, nb, V) + running[:, :, None]).view(B, nb * V)
        vals, idx = cand.topk(K, dim=1)
        src, tok = idx // V, idx % V
        cand_seqs = _take(seqs, src)
        cand_seqs[:, :, t] = tok
        is_eos = torch.isin(tok, eos)
        stop = is_eos | (t + 1 >= T)

        # Finished hypotheses: candidates among the top nb that stop, while the prompt can improve.
        accept = stop & top_nb & improvable[:, None]
        if early_stopping:
            accept &= ~fin_full.all(1, keepdim=True)
        new_scores = torch.where(accept, vals / float(t + 1) ** length_penalty, float("-inf"))
        fin_scores, fin_seqs, fin_full, fin_len, fin_eos = _keep_best(
            nb, (fin_scores, fin_seqs, fin_full, fin_len, fin_eos),
            (new_scores, cand_seqs, accept, torch.full_like(tok, t + 1), is_eos))

        # Running beams for the next step: the best candidates that did not stop.
        keep = (vals + stop.float() * _OUT).topk(nb, dim=1)
        running = keep.values
        seqs = _take(cand_seqs, keep.indices)
        beam_rows = (offset + _take(src, keep.indices)).view(-1)

        # HF's early-stop heuristic: can the best running beam still beat the worst hypothesis?
        best_running = running[:, 0] / float(t + 1) ** length_penalty
        improvable &= ~fin_full.all(1) | (best_running > fin_scores.min(1).values)
        if (not bool(improvable.any()) or (early_stopping and bool(fin_full.all()))
                or bool(stop.all()) or t == T - 1):
            break
        cache = be.reorder(cache, beam_rows)
        hist = hist.index_select(0, beam_rows)
        nxt = seqs[:, :, t].reshape(-1)
        hist[:, L + t] = nxt
        logits = be.step(nxt[:, None], pos, mask[:, : L + t + 1] if mask is not None else None, cache)
        pos = pos + 1

    n = int(num_return_sequences)
    lengths = fin_len[:, :n].reshape(-1)
    width = max(int(lengths.max()), 1)
    return SearchOutput(fin_seqs[:, :n, :width].reshape(B * n, width).cpu(), lengths.cpu(),
                        fin_eos[:, :n].reshape(-1).cpu(), fin_scores[:, :n].reshape(-1).cpu())
