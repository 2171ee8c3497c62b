"""Which rows of the tied embedding / LM head to keep at 8 bits when the rest are at 4, and what
keeping the top k of them buys (`gptforge analyze --weights int4`; `bit_plan` spends a budget on it).

A row's rounding error e_v changes only token v's logit and token v's input embedding, and how
much that costs depends on how often the model predicts or reads v. Rows are ranked by how often
token v occurs in a large sample of the calibration text (`token_counts`: up to COUNT_TOKENS
tokens, far more than the calibration windows), ties (rows the sample never shows) by a
second-order estimate of the KL increase its error causes on the calibration windows: the
Hessian of KL(float ‖ model) at the float model is the Fisher information, so the estimate is
0.5 · e_vᵀ F_v e_v with F_v the Fisher's
own block of row v (terms between rows dropped). Its head part is exact, 0.5 · Σ p_v (1 - p_v)
(h · e_v)² over positions; its embedding part is 0.5 · E[(g_v · e_v)²] with g_v the gradient of a
window's log-likelihood with respect to row v's input embeddings under next tokens *sampled from
the float model itself* (whose mean outer product is the Fisher), with the term between the two
uses sampled the same way. A row's gain from 8 bits is its score at the 4-bit error less its score
at the 8-bit error.

Why counts first: the Fisher estimate sees only the rows the few calibration windows read, so a
ranking by it alone fits those windows. Measured on a model of the built-in corpus
(benchmarks/results/2026-11-27-head-row-order.md): with 1024 of 4096 rows at 8 bits, the head's
KL on held-out text was 0.0120 ranked by the Fisher estimate on 64 windows, 0.0095 on 512 windows
and 0.0091 ranked by the counts of 4096 windows' tokens, which cost only the tokenizing.

The ranking only orders the rows; what a plan relies on is measured: the KL with the top k rows at
8 bits and the rest at 4 (the same metric and rounding as every other layer's row of the analysis)
for k on a ladder of fractions of the vocabulary (`FRACTIONS`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from gptforge.errors import UsageError

FRACTIONS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8)
SCORE = "counts+fisher"  # analyses ranked by the Fisher estimate alone say "fisher": their ladder is measured again
COUNT_TOKENS = 1 << 19  # tokens of the calibration text counted for the ranking


def token_counts(ids: list[int], vocab: int) -> torch.Tensor:
    """How often each of `vocab` token ids occurs in the first COUNT_TOKENS of `ids` (int64 [vocab])."""
    t = torch.tensor(ids[:COUNT_TOKENS], dtype=torch.long)
    return torch.bincount(t[(t >= 0) & (t < vocab)], minlength=vocab)


def counts_digest(counts: torch.Tensor) -> str:
    """A short digest of `token_counts` (an analysis's ladder is reused only for the same counts)."""
    return hashlib.sha256(counts.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def ladder_sizes(vocab: int, fractions=FRACTIONS) -> list[int]:
    """Distinct row counts 1 <= k < vocab of the ladder's fractions, ascending."""
    return sorted({min(vocab - 1, max(1, round(f * vocab))) for f in fractions} - {0}) if vocab > 1 else []


def fisher_row_scores(model: nn.Module, batches: list[dict], errors: list[torch.Tensor], *, draws: int = 1,
                      seed: int = 0) -> list[torch.Tensor]:
    """Per error matrix E (each [vocab, dim], a rounding error of the tied weight) the per-row
    second-order estimate of the KL increase per window that E_v causes (see the module docstring):
    - as the head's row v: 0.5 · Σ_positions p_v (1 - p_v) (h · E_v)², exactly (v's own logit moves
      by h · E_v; a sampled estimate would miss the many rare tokens);
    - as the input embedding of v, and the term between the two uses: 0.5 · E[a² + 2ab], a = the
      gradient of the window's log-likelihood of next tokens sampled from the model itself with
      respect to the embedding outputs at the positions reading v, times E_v; b = the same
      likelihood's gradient with respect to v's head row, times E_v (`draws` samples per window;
      E[b²] is the head term above, so the whole is the sampled Fisher block of row v).
    Means over the windows of `batches`. The model's parameters are left as they were."""
    w = model.wte.weight
    vocab = w.shape[0]
    errors = [e.detach().float().to(w.device) for e in errors]
    head = [torch.zeros(vocab, dtype=torch.float64) for _ in errors]
    emb = [torch.zeros(vocab, dtype=torch.float64) for _ in errors]
    gen = torch.Generator().manual_seed(seed)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    leaf: list[torch.Tensor] = []

    def as_leaf(mod, args, out):  # the embedding output becomes the tensor the gradients are taken for
        leaf[:] = [out.detach().requires_grad_()]
        return leaf[0]

    windows = 0
    hook = model.wte.register_forward_hook(as_leaf)
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        with torch.enable_grad():
            for b in batches:
                for tokens in b["tokens"]:
                    ids = tokens.to(w.device)
                    h = model.hidden_states(ids.unsqueeze(0))
                    logp = torch.log_softmax(model.logits(h).float()[0], -1)
                    prob = logp.detach().exp()
                    hd = h[0].detach().float()
                    moves = [hd @ e.T for e in errors]  # [positions, vocab]: each logit's change, h · E_v
                    for acc, d in zip(head, moves, strict=True):
                        acc += (prob * (1 - prob) * d.pow(2)).sum(0).double().cpu()
                    for _ in range(draws):
                        y = torch.multinomial(prob.cpu(), 1, generator=gen).to(w.device)
                        (g,) = torch.autograd.grad(logp.gather(1, y).sum(), leaf[0], retain_graph=True)
                        for acc, e, d in zip(emb, errors, moves, strict=True):
                            lookup = torch.zeros(vocab, dtype=torch.float64, device=w.device).index_add_(
                                0, ids, (g[0].float() * e[ids]).sum(1).double())
                            # the head use's sampled part, for the term between the two uses
                            out = torch.zeros(vocab, dtype=torch.float64, device=w.device).index_add_(
                                0, y[:, 0], d.gather(1, y)[:, 0].double()) - (prob * d).sum(0).double()
                            acc += (lookup.pow(2) + 2 * lookup * out).cpu()
                    windows += 1
    finally:
        hook.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
    n = max(windows, 1)
    return [0.5 * (hs / n + es / (n * max(draws, 1))) for hs, es in zip(head, emb, strict=True)]


def row_order(model: nn.Module, batches: list[dict], w: torch.Tensor, w4: torch.Tensor,
              w8: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids by decreasing `counts` (`token_counts`; None: all equal), ties by decreasing
    estimated gain from 8 bits on `batches`, then lower id first."""
    s4, s8 = fisher_row_scores(model, batches, [w4 - w, w8 - w])
    gain = (s4 - s8).numpy()
    freq = np.zeros(len(gain)) if counts is None else counts.double().numpy()[: len(gain)]
    return torch.from_numpy(np.lexsort((np.arange(len(gain)), -gain, -freq)).copy())


def measure_ladder(set_weight: Callable[[torch.Tensor], float], w4: torch.Tensor, w8: torch.Tensor,
                   order: torch.Tensor, sizes: list[int], progress=None) -> list[dict]:
    """[{rows8: k, increase}] for each k: `set_weight(W)` measures the metric's increase with the
    tied weight W in place of the float one; W holds the top k rows of `order` from `w8`, the
    rest from `w4`."""
    out = []
    for k in sizes:
        hot = torch.zeros(len(w4), dtype=torch.bool, device=w4.device)
        hot[order[:k]] = True
        out.append({"rows8": int(k), "increase": float(set_weight(torch.where(hot.unsqueeze(1), w8, w4)))})
        if progress is not None:
            progress(k)
    return out


def head_rows_result(order: torch.Tensor, ladder: list[dict], counts: torch.Tensor | None = None) -> dict:
    """What analysis.json keeps under `head_rows` (`counts`: the digest of the ranking's token counts)."""
    return {"score": SCORE if counts is not None else "fisher", "order": [int(v) for v in order], "ladder": ladder,
            **({"counts": counts_digest(counts)} if counts is not None else {})}


def parse_head_rows(hr, vocab: int) -> dict:
    """{order, ladder} of an analysis's `head_rows` for a `vocab`-row head; ValueError saying what
    is wrong with it."""
    if not isinstance(hr, dict) or not isinstance(hr.get("order"), list) or not isinstance(hr.get("ladder"), list):
        raise ValueError("no order / ladder lists")
    order = hr["order"]
    if len(order) != vocab or not all(isinstance(v, int) for v in order) or sorted(order) != list(range(vocab)):
        raise ValueError(f"order is not a permutation of the {vocab} rows")
    ladder = hr["ladder"]
    ok = all(isinstance(r, dict) and isinstance(r.get("rows8"), int) and 0 < r["rows8"] < vocab
             and isinstance(r.get("increase"), (int, float)) for r in ladder)
    if not ladder or not ok:
        raise ValueError("ladder rows need rows8 (0 < k < vocabulary) and increase")
    return {"order": order, "ladder": ladder}


def read_head_rows(state: dict, vocab: int, where: str = "the analysis") -> dict | None:
    """The `head_rows` of an analysis; None for an analysis made before it existed (plans then
    keep the head one table); UsageError naming `where` when the section is damaged."""
    if "head_rows" not in state or state["head_rows"] is None:
        return None
    try:
        return parse_head_rows(state["head_rows"], vocab)
    except ValueError as e:
        raise UsageError(f"{where}: head_rows is damaged ({e}); run `gptforge analyze --weights int4 --force` "
                         "on this model again") from None
