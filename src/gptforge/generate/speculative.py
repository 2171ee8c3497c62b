"""Speculative decoding: a small draft model proposes K tokens, the target checks them in one pass.

A decode step of a large model is bound by reading its weights; checking K+1 positions costs
about as much as one. Each round the draft (any `StepBackend` with the same tokenizer: a pruned
model, the INT8 model of the same float model, a model with layers dropped) proposes K tokens
one by one; the target scores `[last, d1..dK]` with `step_all` and every row keeps the longest
prefix it accepts, plus one token of its own:

- greedy: a draft token is accepted while it equals the target's argmax, and the target's
  argmax follows, so the output is plain greedy's, token for token (up to floating-point
  rounding between a K+1-token pass and K+1 one-token passes, which can flip exact near-ties);
- sampling: speculative sampling with rejection (Leviathan et al. 2023, Chen et al. 2023):
  d_i ~ q_i is kept with probability min(1, p_i(d_i)/q_i(d_i)); at the first rejection a token
  is drawn from norm(max(p_i - q_i, 0)), after K acceptances from p_{K+1}. The output follows
  the target's distribution p exactly. p and q are the *processed* distributions: the same
  processors (repetition penalty, min length, vocabulary mask, user processors) and warpers
  (temperature, top-k, top-p) run on draft and target scores, each with its own row's history.

The rules live here (configuration, tokenizer check, acceptance, adaptive K, cache rollback);
the engine runs them inside its step (`generate/engine/spec.py`): each sequence keeps its own
K (`num_draft_tokens: auto` starts at 4 and adapts with HF's rule: +2 after a round in which
every draft was accepted, -1 otherwise), and its KV slots roll back to what it accepted.
"""

from __future__ import annotations

import torch

from gptforge.errors import CheckpointError, ConfigError

AUTO_START, AUTO_MIN, AUTO_MAX = 4, 1, 16
MAX_DRAFT_TOKENS = 64


def parse_num_draft_tokens(value) -> tuple[int, bool]:
    """(K to start with, adaptive?) from `Generation.num_draft_tokens` (an integer or `auto`)."""
    text = str(value).strip().lower()
    if text == "auto":
        return AUTO_START, True
    try:
        k = int(text)
    except ValueError:
        k = None
    if k is None or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"Generation.num_draft_tokens: {value!r} is not an integer in 1..{MAX_DRAFT_TOKENS} "
                          "or auto; give e.g. 4, or auto")
    return k, False


def check_speculative(cfg) -> None:
    """`ConfigError` for Generation settings speculative decoding cannot run with."""
    parse_num_draft_tokens(cfg.num_draft_tokens)
    if cfg.decode_strategy == "beam_search":
        raise ConfigError(f"Generation.draft={cfg.draft}: speculative decoding works with greedy_search or "
                          "sampling, not beam_search; unset Generation.draft or change decode_strategy")
    if not cfg.use_cache:
        raise ConfigError(f"Generation.draft={cfg.draft}: speculative decoding needs Generation.use_cache=True")


def check_same_tokenizer(draft_tok, target_tok, draft_name, target_name) -> None:
    """`CheckpointError` naming both models when the draft's tokenizer is not the target's."""
    if draft_tok.fingerprint() != target_tok.fingerprint():
        raise CheckpointError(
            f"Generation.draft={draft_name}: its tokenizer ({draft_tok.vocab_size} tokens, fingerprint "
            f"{draft_tok.fingerprint()}) differs from the target {target_name}'s ({target_tok.vocab_size} tokens, "
            f"{target_tok.fingerprint()}); a draft must share the target's tokenizer")


# ------------------------------------------------------------------------------ acceptance
# The per-row acceptance rules of the one decoding engine's speculative rounds
# (`generate.engine.spec`), whichever client (generate, infer, serve) runs it.

def align_draft_logits(logits: torch.Tensor, vocab_size: int, device) -> torch.Tensor:
    """Draft logits [..., Vd] as float32 on the target's `device` and vocabulary width (ids the
    draft lacks: -inf; ids past the target's: dropped)."""
    logits = logits.to(device).float()
    Vd = logits.shape[-1]
    if Vd > vocab_size:
        return logits[..., :vocab_size]
    if Vd < vocab_size:
        return torch.nn.functional.pad(logits, (0, vocab_size - Vd), value=float("-inf"))
    return logits


def accept_greedy(drafts: torch.Tensor, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of `drafts` [N, k] against the target's argmax `choice` [N, k+1]:
    (accepted counts [N], tokens [N, k+1]); row r emits `tokens[r, :acc[r] + 1]`. Up to the first
    mismatch the draft's tokens are the target's argmax, so the tokens are `choice` itself."""
    k = drafts.shape[1]
    acc = (drafts == choice[:, :k]).long().cumprod(1).sum(1)
    return acc, choice


def accept_sampling(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling with rejection (Leviathan et al. 2023, Chen et al. 2023) of `drafts`
    [N, k] drawn from `q` [N, k, V], against the target's `p` [N, k+1, V] (both the processed,
    warped distributions): (accepted counts [N], tokens [N, k+1]); row r emits
    `tokens[r, :acc[r] + 1]`. Random numbers: k uniforms per row, then one multinomial draw."""
    N, k = drafts.shape
    dev = drafts.device
    pd = p[:, :k].gather(2, drafts[..., None]).squeeze(-1)
    qd = q.gather(2, drafts[..., None]).squeeze(-1)
    u = torch.rand(N, k, generator=generator, device=dev)
    acc = (u * qd < pd).long().cumprod(1).sum(1)
    rows = torch.arange(N, device=dev)
    p_at = p[rows, acc]
    q_at = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, acc]
    resid = (p_at - q_at).clamp_min(0)
    empty = resid.sum(-1, keepdim=True) <= 0  # p == q up to rounding: the residual is p itself
    resid = torch.where(empty, p_at, resid)
    c = torch.multinomial(resid / resid.sum(-1, keepdim=True), 1, generator=generator).squeeze(1)
    E = torch.cat([drafts, c[:, None]], 1)
    E[rows, acc] = c
    return acc, E


def next_k(k: int, all_accepted: bool) -> int:
    """`num_draft_tokens: auto`'s next K (HF's rule): +2 after a round in which every draft
    token was accepted, -1 otherwise, within AUTO_MIN..AUTO_MAX."""
    return min(k + 2, AUTO_MAX) if all_accepted else max(k - 1, AUTO_MIN)


# ------------------------------------------------------------------------------ caches

def truncate_cache(cache, length: int) -> None:
    """Roll a KV cache (ours or onnxruntime's past arrays) back to its first `length` positions."""
    if hasattr(cache, "k"):  # our KVCache: slots past `length` are overwritten by the next write
        cache.length = length
    elif hasattr(cache, "arrays"):  # onnxruntime's concatenated past arrays
        cache.arrays = [a[:, :, :length] for a in cache.arrays]
    else:
        raise TypeError(f"speculative decoding cannot roll back a {type(cache).__name__}")
