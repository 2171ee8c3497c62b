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

Rows accept different counts. Both KV caches are rolled back to the longest kept prefix; a row
that kept fewer columns marks the rest as holes in its attention mask (positions count real
tokens only, as with left padding), and when holes fill the cache it is compacted. A row that
emits EOS stops as in plain decoding. `num_draft_tokens: auto` starts at 4 and adapts (HF's
rule): +2 after a round where every row accepted all drafts, -1 otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from gptforge.errors import CheckpointError, ConfigError
from gptforge.generate.processors import NO_TOKEN, ProcessorList
from gptforge.generate.search import PromptBatch, SearchOutput
from gptforge.generate.spec_stats import SpeculativeStats, record

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


def load_draft(path, *, device=None, tokenizer=None, target_name: str = "model"):
    """The draft model (eval mode) from a model directory of any format `model_io` reads; with
    `tokenizer` (the target's), a different draft tokenizer is a one-line `CheckpointError`."""
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.model_io import load_model, resolve_checkpoint_path

    p = resolve_checkpoint_path(path)
    model, cfg = load_model(p, device=device)
    if tokenizer is not None:
        own = p.is_dir() and ((p / "tokenizer.json").is_file() or (p / "vocab.json").is_file())
        dtok = load_tokenizer(None, p) if own else load_tokenizer(cfg.Data.tokenizer, p if p.is_dir() else None)
        check_same_tokenizer(dtok, tokenizer, Path(path), target_name)
    return model


# ------------------------------------------------------------------------------ acceptance
# The per-row acceptance rules, shared by `SpeculativeDecoder` (generate, infer) and the
# continuous-batching engine of `gptforge serve`.

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


def _gather(cache, index: torch.Tensor) -> None:
    """Keep, per row, the cache positions `index` [N, T] (in that order) as positions 0..T-1."""
    T = index.shape[1]
    if hasattr(cache, "k"):
        for bufs in (cache.k, cache.v):
            for t in bufs:
                idx = index.to(t.device)[:, None, :, None].expand(t.shape[0], t.shape[1], T, t.shape[3])
                t[:, :, :T] = t.gather(2, idx)
        cache.length = T
    elif hasattr(cache, "arrays"):
        idx = index.cpu().numpy()[:, None, :, None]
        cache.arrays = [np.ascontiguousarray(np.take_along_axis(a, idx, axis=2)) for a in cache.arrays]
    else:
        raise TypeError(f"speculative decoding cannot compact a {type(cache).__name__}")


class _Lane:
    """One model's side of the loop: its backend, KV cache, key mask and next position per row."""

    def __init__(self, be, prompts: PromptBatch, n: int, cap: int):
        self.be, self.cap = be, cap
        dev = be.device
        B, L = prompts.batch_size, prompts.length
        self.cache = be.new_cache(B, cap)
        logits = be.step(prompts.input_ids.to(dev), prompts.position_ids.to(dev),
                         None if prompts.attention_mask is None else prompts.attention_mask.to(dev), self.cache)
        rows = torch.arange(B, device=dev).repeat_interleave(n)
        if n > 1:  # prefill once per prompt, then copy its cache to the n samples
            self.cache = be.reorder(self.cache, rows)
            logits = logits.index_select(0, rows)
        self.first_logits = logits
        self.mask = torch.zeros(B * n, cap, dtype=torch.long, device=dev)
        if prompts.attention_mask is None:
            self.mask[:, :L] = 1
        else:
            self.mask[:, :L] = prompts.attention_mask.to(dev).index_select(0, rows)
        self.holes = prompts.attention_mask is not None
        self.pos = prompts.position_ids[:, -1].to(dev).index_select(0, rows) + 1
        self.max_pos = int(be.max_positions) - 1

    @property
    def length(self) -> int:
        return int(self.cache.length)

    def feed(self, tokens: torch.Tensor, valid: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """Append `tokens` [N, T] (`valid` False: a hole); logits of the last or of every position."""
        dev = self.be.device
        tokens, valid = tokens.to(dev), valid.to(dev)
        T = tokens.shape[1]
        if self.length + T > self.cap:  # pragma: no cover - `reserve` runs before every round
            raise RuntimeError("speculative decoding: a round outgrew its reserved cache columns")
        start = self.length
        self.mask[:, start:start + T] = valid
        if not bool(valid.all()):
            self.holes = True
        pos = (self.pos[:, None] + valid.long().cumsum(1) - 1).clamp(0, self.max_pos)
        self.pos = self.pos + valid.sum(1)
        mask = self.mask[:, :start + T] if self.holes else None
        fn = self.be.step_all if all_logits else self.be.step
        return fn(tokens, pos, mask, self.cache)

    def reserve(self, width: int) -> int:
        """Make room for `width` more columns (compacting holes away if needed); the start column."""
        if self.length + width > self.cap:
            self._compact()
        return self.length

    def keep(self, start: int, width: int, counts: torch.Tensor) -> None:
        """Of the `width` columns fed since `start`, keep the first `counts[r]` per row: roll the
        cache back to the longest kept prefix and mark the rest of each row as holes."""
        counts = counts.to(self.mask.device)
        top = int(counts.max())
        seg = self.mask[:, start:start + width]
        drop = torch.arange(width, device=seg.device)[None, :] >= counts[:, None]
        self.pos = self.pos - (seg.bool() & drop).sum(1)
        seg.masked_fill_(drop, 0)
        if bool(drop[:, :top].any()):
            self.holes = True
        truncate_cache(self.cache, start + top)

    def _compact(self) -> None:
        n = self.length
        valid = self.mask[:, :n].bool()
        T = int(valid.sum(1).max())
        if self.cap <= T:  # pragma: no cover - the capacity leaves room for a round by construction
            raise RuntimeError("speculative decoding: KV cache full after compaction")
        key = torch.where(valid, torch.arange(n, device=valid.device), -1)
        index = key.sort(dim=1, stable=True).indices[:, n - T:]  # each row's valid slots, right-aligned
        _gather(self.cache, index)
        kept = valid.gather(1, index)
        self.mask.zero_()
        self.mask[:, :T] = kept
        self.holes = not bool(kept.all())


# ------------------------------------------------------------------------------ the loop

class SpeculativeDecoder:
    """Greedy or sampling decoding of `target` checked against proposals of `draft` (both
    `StepBackend`s; the target needs `step_all`). Same interface as `search.TokenDecoder`:
    iterating yields chosen tokens column by column ([N], pad for rows that emitted fewer this
    round); `output()` gives the `SearchOutput`. `drafted` / `accepted` count draft tokens.
    """

    def __init__(self, target, draft, prompts: PromptBatch, *, num_draft_tokens: int = 5, adaptive: bool = False,
                 max_new_tokens: int, greedy: bool, processors: ProcessorList, warpers: ProcessorList | None = None,
                 generator: torch.Generator | None = None, eos_token_ids: Sequence[int] = (),
                 pad_token_id: int = 0, num_return_sequences: int = 1, early_finish: bool = True):
        if not hasattr(target, "step_all"):
            raise ConfigError(f"Generation.draft: the target backend ({type(target).__name__}) cannot score several "
                              "tokens per step; speculative decoding needs a gptforge model or an ONNX export")
        self.target, self.draft, self.prompts = target, draft, prompts
        self.k = int(num_draft_tokens)
        self.k_max = max(self.k, AUTO_MAX) if adaptive else self.k
        self.adaptive = adaptive
        self.max_new = int(max_new_tokens)
        self.greedy = greedy
        self.processors = processors
        self.warpers = warpers or ProcessorList()
        self.generator = generator
        self.eos = list(eos_token_ids)
        self.pad = int(pad_token_id)
        self.n = int(num_return_sequences)
        self.early_finish = early_finish
        N = prompts.batch_size * self.n
        dev = target.device
        with torch.inference_mode():
            self.tokens = torch.full((N, self.max_new), self.pad, dtype=torch.long, device=dev)
            self.lengths = torch.zeros(N, dtype=torch.long, device=dev)
            self.finished = torch.zeros(N, dtype=torch.bool, device=dev)
            self.score_sum = torch.zeros(N, dtype=torch.float32, device=dev)
        self.steps = 0
        self.rounds = 0
        self.drafted = 0
        self.accepted = 0
        self.k_history: list[int] = []

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def stats(self) -> SpeculativeStats:
        return SpeculativeStats(self.rounds, self.drafted, self.accepted)

    # -- scores --------------------------------------------------------------------------------

    def _scores(self, hist: torch.Tensor, lens: torch.Tensor, logits: torch.Tensor, warp: bool):
        """(processed scores, warped scores or None) of `logits` [N, V]; row r's processors see
        `hist[r, :lens[r]]`, exactly the history plain decoding would give them."""
        procs, warpers = self.processors, (self.warpers if warp else ProcessorList())
        if not procs and not warpers:
            return logits, (logits if warp else None)
        proc = torch.empty_like(logits)
        warped = torch.empty_like(logits) if warp else None
        for length in torch.unique(lens).tolist():
            rows = (lens == length).nonzero().squeeze(1)
            h = hist.index_select(0, rows)[:, :length]
            s = procs(h, logits.index_select(0, rows).clone())
            proc[rows] = s
            if warp:
                warped[rows] = warpers(h, s.clone())
        return proc, warped

    def _draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return align_draft_logits(logits, self.target.vocab_size, self.target.device)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _emit(self, E, e, logp, ngen, hist, L, alive):
        """Write up to `e[r]` tokens of `E` [N, W] per alive row (cut after EOS); update state.
        Returns the counts actually emitted."""
        N, W = E.shape
        cols = torch.arange(W, device=E.device)
        e = torch.where(alive, e, 0)
        within = cols[None] < e[:, None]
        eos = torch.tensor(self.eos, dtype=torch.long, device=E.device)
        is_eos = torch.isin(E, eos) & within
        has = is_eos.any(1)
        first = is_eos.float().argmax(1)
        e = torch.where(has, torch.minimum(e, first + 1), e)
        within = cols[None] < e[:, None]
        rows, cs = within.nonzero(as_tuple=True)
        self.tokens[rows, ngen[rows] + cs] = E[rows, cs]
        hist[rows, L + ngen[rows] + cs] = E[rows, cs]
        self.score_sum += torch.where(within, logp, 0.0).sum(1)
        self.lengths += e
        ngen += e
        self.finished |= has
        alive &= ~has & (ngen < self.max_new)
        self.steps = int(ngen.max())
        return e

    def _columns(self, E, e) -> Iterator[torch.Tensor]:
        for j in range(int(e.max()) if e.numel() else 0):
            yield torch.where(e > j, E[:, j], self.pad).clone()

    # -- the loop --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[torch.Tensor]:
        p, n = self.prompts, self.n
        B, L = p.batch_size, p.length
        N = B * n
        dev = self.target.device
        with torch.inference_mode():
            cap = L + self.max_new + 2 * (self.k_max + 2)
            tgt = _Lane(self.target, p, n, cap)
            dft = _Lane(self.draft, p, n, cap)
            hist = torch.full((N, L + self.max_new + self.k_max + 2), NO_TOKEN, dtype=torch.long, device=dev)
            hist[:, :L] = p.history.to(dev).repeat_interleave(n, 0)
            ngen = torch.zeros(N, dtype=torch.long, device=dev)
            alive = torch.ones(N, dtype=torch.bool, device=dev)
            ones = torch.ones(N, 1, dtype=torch.bool, device=dev)
            # The first token comes from the target's prefill, as in plain decoding.
            lens = torch.full((N,), L, dtype=torch.long, device=dev)
            proc, warped = self._scores(hist, lens, tgt.first_logits.float(), not self.greedy)
            first = proc.argmax(-1) if self.greedy else torch.multinomial(
                warped.softmax(-1), 1, generator=self.generator).squeeze(1)
            logp = torch.log_softmax(proc, -1).gather(1, first[:, None])
            e = self._emit(first[:, None], torch.ones(N, dtype=torch.long, device=dev), logp, ngen, hist, L, alive)
            x = first
            pend = torch.full((N,), self.pad, dtype=torch.long, device=dev)
            has2 = torch.zeros(N, dtype=torch.bool, device=dev)
        yield from self._columns(first[:, None], e)
        while bool(alive.any()):
            with torch.inference_mode():
                E, e = self._round(tgt, dft, hist, ngen, alive, x, pend, has2, L, ones)
                x = torch.where(e > 0, E.gather(1, (e - 1).clamp_min(0)[:, None]).squeeze(1), x)
            yield from self._columns(E, e)
        if not self.early_finish:
            self.steps = self.max_new

    def _round(self, tgt: _Lane, dft: _Lane, hist, ngen, alive, x, pend, has2, L, ones):
        """One draft/verify round; updates the state in place; returns (tokens [N, W], counts)."""
        N = x.shape[0]
        dev = x.device
        rem = self.max_new - ngen
        k = min(self.k, int(rem[alive].max()) - 1)
        if k < 1:  # at most one token left in every row: one plain target step
            tgt.reserve(1)
            logits = tgt.feed(x[:, None], ones, all_logits=False)
            proc, warped = self._scores(hist, L + ngen, logits.float(), not self.greedy)
            nxt = proc.argmax(-1) if self.greedy else torch.multinomial(
                warped.softmax(-1), 1, generator=self.generator).squeeze(1)
            logp = torch.log_softmax(proc, -1).gather(1, nxt[:, None])
            e = self._emit(nxt[:, None], torch.ones(N, dtype=torch.long, device=dev), logp, ngen, hist, L, alive)
            return nxt[:, None], e
        was_alive = alive.clone()
        # -- draft: k tokens, one at a time (the first call also feeds a pending accepted token)
        dstart = dft.reserve(k + 1)
        tstart = tgt.reserve(k + 1)
        if bool((has2 & alive).any()):
            cols, valid = torch.stack([pend, x], 1), torch.stack([has2, torch.ones_like(has2)], 1)
        else:
            cols, valid = x[:, None], ones
        c1 = cols.shape[1]
        dl = self._draft_logits(dft.feed(cols, valid, all_logits=False))
        drafts = torch.empty(N, k, dtype=torch.long, device=dev)
        qs = []
        hist_rows = torch.arange(N, device=dev)
        for i in range(k):
            if i:
                dl = self._draft_logits(dft.feed(drafts[:, i - 1:i], ones, all_logits=False))
            proc, warped = self._scores(hist, L + ngen + i, dl, not self.greedy)
            if self.greedy:
                d = proc.argmax(-1)
            else:
                q = warped.softmax(-1)
                d = torch.multinomial(q, 1, generator=self.generator).squeeze(1)
                qs.append(q)
            drafts[:, i] = d
            hist[hist_rows, L + ngen + i] = d
        # -- verify: the target scores [x, d1..dk] in one pass
        tl = tgt.feed(torch.cat([x[:, None], drafts], 1), ones.expand(N, k + 1), all_logits=True).float()
        procs, ps = [], []
        for i in range(k + 1):
            proc, warped = self._scores(hist, L + ngen + i, tl[:, i], not self.greedy)
            procs.append(proc)
            if not self.greedy:
                ps.append(warped.softmax(-1))
        P = torch.stack(procs, 1)  # [N, k+1, V]
        if self.greedy:
            acc, E = accept_greedy(drafts, P.argmax(-1))
        else:
            acc, E = accept_sampling(drafts, torch.stack(ps, 1), torch.stack(qs, 1), self.generator)
        logp = torch.log_softmax(P, -1).gather(2, E[..., None]).squeeze(-1)
        e = torch.minimum(acc + 1, rem)
        # The history beyond each row's emitted tokens held drafts: clear it.
        hist[hist_rows[:, None], (L + ngen)[:, None] + torch.arange(k, device=dev)[None]] = NO_TOKEN
        e = self._emit(E, e, logp, ngen, hist, L, alive)
        this = SpeculativeStats(1, k * int(was_alive.sum()), int(torch.where(was_alive, acc, 0).sum()))
        self.rounds += this.rounds
        self.drafted += this.drafted
        self.accepted += this.accepted
        record(this)  # for `collect_stats()` around generate() / stream()
        self.k_history.append(k)
        if self.adaptive:
            self.k = next_k(self.k, bool((acc[was_alive] == k).all()))
        # -- roll back both caches to what each row keeps (rows that are done keep the most)
        if bool(alive.any()):
            keep_t = e.clone()
            keep_d = c1 + torch.minimum(e - 1, torch.full_like(e, k - 1))
            keep_t = torch.where(alive, keep_t, keep_t[alive].max())
            keep_d = torch.where(alive, keep_d, keep_d[alive].max())
            tgt.keep(tstart, k + 1, keep_t)
            dft.keep(dstart, c1 + k - 1, keep_d)
            has2.copy_(alive & (e - 1 == k))
            pend.copy_(drafts[:, k - 1])
        return E, e

    def run(self) -> SearchOutput:
        for _ in self:
            pass
        return self.output()

    def output(self) -> SearchOutput:
        scores = self.score_sum / self.lengths.clamp_min(1)
        return SearchOutput(self.tokens[:, : self.steps].cpu(), self.lengths.cpu(), self.finished.cpu(), scores.cpu())
