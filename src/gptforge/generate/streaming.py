"""Token ids → text deltas, emitting only complete characters.

Byte-level BPE splits many characters (accents, CJK, emoji) over several tokens; decoding a
prefix that ends inside a character yields U+FFFD. `IncrementalDecoder` decodes a short window
of recent tokens and holds a delta back while it ends in U+FFFD, so every emitted piece is
valid text and the pieces concatenate to the full decode (the approach of HF's
text-generation-inference).
"""

from __future__ import annotations

from collections.abc import Iterable

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
