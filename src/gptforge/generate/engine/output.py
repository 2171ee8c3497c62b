"""The output processor: what happens to a chosen token. It is recorded (with its log-prob),
detokenized incrementally, checked against EOS, stop strings and `max_tokens`, and sent to the
request as a `TokenEvent`; a finished sequence gets its `FinishEvent` (reason stop | length |
abort | error). Metrics hooks see every token and every finish.

A `metrics` object may define `on_token(first: bool, seconds: float)` (time to first token from
the request's arrival, or time since the sequence's previous token); missing hooks are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch

from gptforge.generate.engine.sequence import FinishEvent, TokenEvent

# Byte-level BPE splits many characters (accents, CJK, emoji) over several tokens; decoding a
# prefix that ends inside a character yields U+FFFD. `IncrementalDecoder` decodes a short window
# of recent tokens and holds a delta back while it ends in U+FFFD, so every emitted piece is
# valid text and the pieces concatenate to the full decode (the approach of HF's
# text-generation-inference).
REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Feed token ids one at a time with `push(id)`; each call returns the new complete text
    ("" while a character is still incomplete). `flush()` returns whatever is left."""

    def __init__(self, tokenizer, skip_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.skip = set(skip_ids)
        self.ids: list[int] = []
        self.prefix = 0  # window start: the text before it was complete
        self.read = 0  # end of what has been emitted

    def push(self, token_id: int) -> str:
        if token_id in self.skip:
            return ""
        self.ids.append(int(token_id))
        before = self.tokenizer.decode(self.ids[self.prefix: self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """The rest of the text (an incomplete final character decodes as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.prefix: self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


class _Text:
    def __init__(self, tokenizer):
        self.decoder = IncrementalDecoder(tokenizer)
        self.text = ""  # decoded text so far
        self.sent = 0  # characters of `text` already sent


class OutputProcessor:
    """Records tokens and sends events (see the module docstring). Without a `tokenizer`, no
    text is made (token-id clients) and stop strings cannot apply."""

    def __init__(self, tokenizer, eos_token_ids: Seq[int], metrics=None):
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.metrics = metrics

    def record(self, seq, tok: int, logp: torch.Tensor | None, now: float) -> bool:
        """Record token `tok` of `seq` (`logp` [V]: log-probs of the processed distribution it was
        chosen from; None when the request neither keeps scores nor asked for log-probs) and send
        it; True when `seq` has finished."""
        p = seq.params
        first = not seq.generated
        seq.generated.append(tok)
        if logp is not None:  # None: nobody reads this request's log-probs (`Request.keep_scores`)
            seq.logprob_sum += float(logp[tok])
        self._observe(seq, first, now)
        lp = top = None
        if p.logprobs is not None:
            lp = float(logp[tok])
            if p.logprobs > 0:
                v, i = torch.topk(logp, p.logprobs)
                top = list(zip(i.tolist(), v.tolist(), strict=True))
        sink = seq.req.sink
        if tok in self.eos:
            sink(TokenEvent(seq.index, tok, "", lp, top, eos=True))
            self.finish(seq, "stop", self._flush(seq))
            return True
        t = seq.text_state
        if t is None:  # token ids only
            if len(seq.generated) >= p.max_tokens:
                sink(TokenEvent(seq.index, tok, "", lp, top))
                self.finish(seq, "length", "")
                return True
            sink(TokenEvent(seq.index, tok, "", lp, top))
            return False
        t.text += t.decoder.push(tok)
        stop_at = self._find_stop(seq)
        if stop_at is not None:
            t.text = t.text[:stop_at]
            sink(TokenEvent(seq.index, tok, "", lp, top))
            self.finish(seq, "stop", self._take(seq, len(t.text)))
            return True
        if len(seq.generated) >= p.max_tokens:
            sink(TokenEvent(seq.index, tok, "", lp, top))
            self.finish(seq, "length", self._flush(seq))
            return True
        hold = max((len(x) for x in p.stop), default=1) - 1
        sink(TokenEvent(seq.index, tok, self._take(seq, len(t.text) - hold), lp, top))
        return False

    def start(self, seq) -> None:
        """Prepare `seq`'s text state (when it is admitted)."""
        seq.text_state = _Text(self.tokenizer) if self.tokenizer is not None else None

    def finish(self, seq, reason: str, text: str, error: str | None = None) -> None:
        """Send `seq`'s `FinishEvent` (once)."""
        if seq.done:
            return
        seq.done = True
        seq.finish_reason = reason
        seq.req.open -= 1
        seq.req.sink(FinishEvent(seq.index, reason, text, len(seq.generated), error))

    def _observe(self, seq, first: bool, now: float) -> None:
        hook = getattr(self.metrics, "on_token", None)
        if hook is not None:
            hook(first, now - (seq.req.arrived if first else seq.last_time))
        if first:
            seq.first_time = now
        seq.last_time = now

    def _find_stop(self, seq) -> int | None:
        stops, t = seq.params.stop, seq.text_state
        if not stops:
            return None
        lo = max(0, t.sent - max(len(x) for x in stops))
        hits = [i for i in (t.text.find(x, lo) for x in stops) if i >= 0]
        return min(hits) if hits else None

    def _take(self, seq, upto: int) -> str:
        """Text from what was sent up to `upto` (never backwards), marked as sent."""
        t = seq.text_state
        upto = max(upto, t.sent)
        piece, t.sent = t.text[t.sent:upto], upto
        return piece

    def _flush(self, seq) -> str:
        t = seq.text_state
        if t is None:
            return ""
        t.text += t.decoder.flush()
        stop_at = self._find_stop(seq)
        if stop_at is not None:
            t.text = t.text[:stop_at]
        return self._take(seq, len(t.text))
