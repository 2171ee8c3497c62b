"""OpenAI request bodies (pydantic) and OpenAI-shaped errors for `gptforge serve`.

Unknown fields are rejected (400 naming the field), as OpenAI does; `top_k` and
`repetition_penalty` are extensions (vLLM's names). Only what the server implements is
accepted: penalties other than 0, `logit_bias`, `suffix` and `best_of` != n are 400s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gptforge.config.sampling import sampling_error

MAX_N = 16
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # OpenAI's API range; the config's (config.sampling) reaches 100


class APIError(Exception):
    """An error answered as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _surrogate(body) -> str | None:
    """The path of the first string (or key) of a decoded JSON body that holds a lone surrogate
    (JSON's "\\ud800" escapes decode to them, and no tokenizer or response can encode one), else
    None. Iterative: a body may nest as deep as the JSON parser allows."""
    todo = [(body, "")]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            todo.extend((k, path) for k in value if isinstance(k, str))
            todo.extend((v, f"{path}.{k}" if path else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            todo.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value))
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    # Non-finite numbers (Python's json reads NaN and Infinity) are 400s before any range check.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    # None: the server's default (`gptforge serve --temperature ...`), else OpenAI's (1, 1, off).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension; 0 or -1 = off
    repetition_penalty: float = 1.0  # extension; 1 = off
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        # An APIError, not a ValueError: pydantic passes it through, so the 400 names the field.
        where = _surrogate(data)
        if where is not None:
            raise APIError(400, f"{where}: contains an unpaired UTF-16 surrogate (\\ud800-\\udfff "
                           "without its pair); send valid Unicode text", param=where)
        return data

    @field_validator("temperature", "top_p", "top_k", "repetition_penalty", "seed")
    @classmethod
    def _sampling_range(cls, v, info: ValidationInfo):
        if v is None:  # null: the server's default
            return None
        if info.field_name == "top_k" and v == -1:
            return 0  # vLLM's spelling of "off"
        msg = sampling_error(info.field_name, v, max_temperature=MAX_TEMPERATURE)
        if msg:
            raise ValueError(msg)
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _zero_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("is not supported (use the repetition_penalty extension)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("is not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("must be up to 4 non-empty strings")
        return stops

    def stops(self) -> list[str]:
        return list(self.stop or [])


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)  # None: the server's --max-new-tokens, else 16 (OpenAI's)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported (prompt log-probabilities are not computed)")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool fields of other clients
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self
