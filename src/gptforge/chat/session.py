"""One conversation with a model: its messages, the prompt the chat template makes of them
(trimmed from the oldest turns to fit the context), and each answer streamed from the engine.

The prompt is `template.prompt(messages)` tokenized, the same text serve's
/v1/chat/completions builds for the same messages (data/chat_template.py). An answer stops at
EOS, at the template's stop strings, at `Generation.max_dec_len` tokens, or when the caller's
`interrupted()` turns true (Ctrl-C in the REPL); what was shown is what enters the history.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from gptforge.config.schema import GenerationConfig
from gptforge.data.chat_template import ChatTemplate
from gptforge.errors import ConfigError, DataError


@dataclass
class Reply:
    """One answer: the text shown, the token counts, how long it took and why it ended
    (eos | stop | length | interrupted)."""

    text: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    finish: str


class ChatSession:
    """The conversation over an open `StepBackend` (our GPT in a `TorchBackend`, or ONNX).

    `generation` must be greedy_search or sampling with one sequence; its `max_dec_len` is the
    answer's token limit and is reserved in the context on every turn."""

    def __init__(self, backend, tokenizer, template: ChatTemplate, generation: GenerationConfig,
                 system: str | None = None, draft=None):
        check_chat_generation(generation)
        if generation.max_dec_len >= backend.max_positions:
            raise ConfigError(f"Generation.max_dec_len: {generation.max_dec_len} new tokens leave no room for a "
                              f"prompt in the model's {backend.max_positions} positions; lower --max-new-tokens")
        self.backend, self.tokenizer, self.template = backend, tokenizer, template
        self.generation, self.draft = generation, draft
        self.system = system
        self.history: list[dict] = []  # user and assistant messages, alternating
        self.trimmed = False  # whether the oldest turns were ever dropped to fit the context

    @property
    def room(self) -> int:
        """Prompt tokens that fit beside an answer of `max_dec_len` tokens."""
        return self.backend.max_positions - self.generation.max_dec_len

    def messages(self, turns: list[dict] | None = None) -> list[dict]:
        """The system message (if any) followed by `turns` (default: the history)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + list(self.history if turns is None else turns)

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self.history = []

    def fit(self, user: str) -> tuple[str, int]:
        """(prompt text, its token count) for the history plus `user`, dropping the oldest
        turns (a user message and its answer) until it fits `room`; the history keeps what
        fits. A message that cannot fit even alone is a `DataError` (the history is kept)."""
        turns = list(self.history)
        while True:
            text = self.template.prompt(self.messages([*turns, {"role": "user", "content": user}]))
            n = len(self.tokenizer.encode(text))
            if n <= self.room:
                break
            if not turns:
                what = "the system message and your message" if self.system else "your message"
                raise DataError(f"{what} take {n} tokens in the chat template, but the model's "
                                f"{self.backend.max_positions} positions less --max-new-tokens "
                                f"{self.generation.max_dec_len} leave room for {self.room}; shorten it or "
                                "lower --max-new-tokens")
            turns = turns[2:]
            self.trimmed = True
        self.history = turns
        return text, n

    def reply(self, user: str, write: Callable[[str], object],
              interrupted: Callable[[], bool] = lambda: False) -> Reply:
        """Answer `user`: each piece of text goes to `write` as it is decoded (leading
        whitespace dropped); `interrupted()`, asked after every piece, ends the answer early.
        The turn (with what was shown) joins the history."""
        from gptforge.generate.api import stream

        text, n_prompt = self.fit(user)
        t0 = time.perf_counter()
        s = stream(self.backend, self.tokenizer, text, self.generation, draft=self.draft, stop=self.template.stop)
        shown: list[str] = []
        pieces = iter(s)
        try:
            for piece in pieces:
                if not shown:
                    piece = piece.lstrip()
                if piece:
                    shown.append(piece)
                    write(piece)
                if interrupted():
                    break
        finally:
            pieces.close()  # an early end stops decoding here
        answer = "".join(shown).rstrip()
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        if s.result is None:
            return Reply(answer, n_prompt, len(self.tokenizer.encode(answer)), time.perf_counter() - t0,
                         "interrupted")
        return Reply(answer, n_prompt, s.result.new_tokens, s.result.seconds, s.result.finish_reasons[0][0])


def check_chat_generation(generation: GenerationConfig) -> None:
    """A chat streams one answer: greedy_search or sampling, one sequence (else a ConfigError)."""
    if generation.decode_strategy == "beam_search":
        raise ConfigError("Generation.decode_strategy: chat streams one answer from greedy_search or sampling; "
                          "beam search only knows its best answer at the end")
    if generation.num_return_sequences != 1:
        raise ConfigError(f"Generation.num_return_sequences: chat streams one answer, got "
                          f"{generation.num_return_sequences}; set it to 1")


def chat_generation(generation: GenerationConfig, max_new_tokens: int) -> GenerationConfig:
    """`generation` with `max_new_tokens` as its answer limit (`max_dec_len`)."""
    return dataclasses.replace(generation, max_dec_len=int(max_new_tokens))
