"""Chat templates: conversations → text → token ids + the mask of the tokens a model learns.

One implementation for training (`gptforge sft` / `dpo`) and inference. A template is Jinja
in the dialect of transformers' `apply_chat_template`: it sees `messages` (each with `role` and
`content`), `add_generation_prompt` and the tokenizer's special tokens (`eos_token`,
`bos_token`, `unk_token`), and may call `raise_exception(msg)`, `strftime_now(fmt)`,
`namespace(...)`, `dict(...)`, the `tojson` filter and `{% generation %}` blocks. It renders in
the same environment transformers builds (an immutable sandbox, `trim_blocks`,
`lstrip_blocks`, loop controls), so the token ids equal theirs (tests/test_sft_template.py).

The default template (`DEFAULT_TEMPLATE`, for base models) writes

    <system text>

    User: <message>
    Assistant: <answer><|endoftext|>User: <message>
    Assistant:

EOS closes every assistant turn, so a model trained on it learns to stop; "\\nUser:" stays a
stop string for base models that were never tuned on it. Another template's stop string is the
text it closes an assistant turn with before EOS, if any (ChatML's `<|im_end|>`).

`prompt(messages)` is what a model continues in `gptforge chat` and serve's
/v1/chat/completions: both render through this class, with the model's saved template.

Which tokens are learned: the assistant turns. With `{% generation %}` blocks in the template
(transformers' `return_assistant_tokens_mask`), exactly the text inside them. Without, each
assistant turn's text is what `messages[:i+1]` renders beyond the prompt of `messages[:i]` with
`add_generation_prompt=True`, trailing whitespace excluded (so ChatML's `<|im_end|>` is learned,
its newline is not). A token counts as an assistant token when any of its characters does (as in
transformers, whose mask runs from the token holding a span's first character to the one
holding its last).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from gptforge.errors import ConfigError, DataError

EOS = "<|endoftext|>"
DEFAULT_TEMPLATE = (
    "{%- for m in messages -%}\n"
    "{%- if m.role == 'system' -%}{{ m.content + '\\n\\n' }}\n"
    "{%- elif m.role == 'user' -%}{{ 'User: ' + m.content + '\\n' }}\n"
    "{%- elif m.role == 'assistant' -%}"
    "{{ 'Assistant:' }}{% generation %}{{ ' ' + m.content + eos_token }}{% endgeneration %}\n"
    "{%- else -%}{{ raise_exception('unknown role: ' + m.role) }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)
DEFAULT_STOP = ["\nUser:"]
ROLES = ("system", "user", "assistant")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """The template in transformers' environment (utils/chat_template_utils.py)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}…{% endgeneration %}`: records the character span it renders."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span", [jinja2.nodes.ContextReference()]), [], [],
                                          body).set_lineno(lineno)

        def _span(self, context, caller):
            text = caller()
            spans = context.get("_gf_spans")
            if spans is not None:
                spans.append(text)
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=lambda *a, **k: dict(*a, **k), namespace=jinja2.utils.Namespace)
    return env.from_string(source)


@dataclass
class Encoded:
    """One tokenized example: ids and, per id, 1 where the model learns to predict it."""

    ids: list[int]
    mask: list[int]


class ChatTemplate:
    """A Jinja chat template bound to special tokens; `render`, `encode`, `assistant_spans`."""

    def __init__(self, source: str | None = None, origin: str = "the default chat template",
                 eos_token: str = EOS, bos_token: str = EOS, unk_token: str = EOS):
        import jinja2

        self.source = DEFAULT_TEMPLATE if source is None else source
        self.is_default = source is None or source == DEFAULT_TEMPLATE
        self.origin = origin
        self.special = {"eos_token": eos_token, "bos_token": bos_token, "unk_token": unk_token}
        try:
            self.template = _compile(self.source)
        except jinja2.TemplateError as e:
            raise ConfigError(f"{origin}: not a valid Jinja chat template ({e})") from None
        self.has_generation_tags = bool(_GENERATION_TAG.search(self.source))
        self.stop = list(DEFAULT_STOP) if self.is_default else self._turn_end()

    def _turn_end(self) -> list[str]:
        """The text the template closes an assistant turn with before EOS (ChatML's
        `<|im_end|>`), as a stop string: a model tuned on the template writes it and then EOS,
        and a tokenizer without it as a special token would show it as text."""
        marker = "\u2063answer\u2063"  # invisible separators: text no template writes itself
        try:
            text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}])
        except Exception:  # noqa: BLE001 - a template that refuses this conversation names no end marker
            return []
        at = text.rfind(marker)
        tail = text[at + len(marker):].split(self.special["eos_token"])[0].strip() if at >= 0 else ""
        return [tail] if tail else []

    @classmethod
    def from_file(cls, path: str | Path, **special) -> ChatTemplate:
        """A `.jinja` file, or a tokenizer_config.json whose `chat_template` is a string."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"chat template {p}: file not found")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"chat template {p}: unreadable ({e})") from None
        if p.suffix == ".json":
            try:
                text = json.loads(text).get("chat_template")
            except (ValueError, AttributeError):
                raise ConfigError(f"chat template {p}: not a JSON object") from None
            if not isinstance(text, str):
                raise ConfigError(f"chat template {p}: no 'chat_template' string in it (a list of named templates "
                                  "is not supported: save the one you want as a .jinja file)")
        return cls(text, origin=str(p), **special)

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               spans: list[str] | None = None) -> str:
        """The template's text for `messages` (as transformers renders it)."""
        import jinja2

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, _gf_spans=spans, **self.special)
        except jinja2.TemplateError as e:
            raise DataError(f"{self.origin} failed on a conversation: {e}") from None

    def assistant_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """Character spans of `text` (the rendering of `messages`) the model learns."""
        if self.has_generation_tags:
            pieces: list[str] = []
            self.render(messages, spans=pieces)
            out, at = [], 0
            for piece in pieces:  # each block's text appears in order in the rendering
                start = text.find(piece, at)
                if start < 0:
                    raise DataError(f"{self.origin}: a {{% generation %}} block's text is not in the rendering")
                out.append((start, start + len(piece)))
                at = start + len(piece)
            return out
        out = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[:i + 1]).rstrip()
            if not (text.startswith(prompt) and text.startswith(upto) and len(upto) >= len(prompt)):
                raise DataError(f"{self.origin}: the rendering of the first turns is not a prefix of the whole "
                                "conversation's, so the assistant turns cannot be found; mark them with "
                                "{% generation %}...{% endgeneration %}")
            out.append((len(prompt), len(upto)))
        return out

    def encode(self, tokenizer, messages: list[dict], train_on_inputs: bool = False) -> Encoded:
        """Token ids of the rendered conversation (equal to transformers' `apply_chat_template`)
        and the learned-token mask. EOS is appended (and learned) when the template does not
        close the last assistant turn with it."""
        text = self.render(messages)
        enc = tokenizer.backend.encode(text, add_special_tokens=False)
        ids = list(enc.ids)
        spans = self.assistant_spans(messages, text)
        mask = [int(any(a < e and b > s for s, e in spans)) for a, b in enc.offsets]
        learned = [i for i, m in zip(ids, mask, strict=True) if m]
        if train_on_inputs:
            mask = [1] * len(ids)
        if not learned or learned[-1] != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)
            mask.append(1)
        return Encoded(ids, mask)

    def prompt(self, messages: list[dict]) -> str:
        """The text of `messages` followed by the generation prompt: what a model continues
        (`gptforge chat`, serve's /v1/chat/completions)."""
        return self.render(messages, add_generation_prompt=True)

    def prompt_ids(self, tokenizer, messages: list[dict]) -> list[int]:
        """Ids of `messages` followed by the generation prompt (what a model continues)."""
        return tokenizer.encode(self.prompt(messages))


def _saved_template(directory: str | Path) -> str | None:
    """The `chat_template` string of a directory's tokenizer_config.json (what `sft` saves
    with a model or an adapter), if it has one."""
    try:
        value = json.loads((Path(directory) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = value.get("chat_template") if isinstance(value, dict) else None
    return value if isinstance(value, str) else None


def template_for(tokenizer, spec: str | None = None, adapter: str | Path | None = None) -> ChatTemplate:
    """`spec` (a .jinja file or a tokenizer_config.json), else the template saved with the
    `adapter` directory (an adapter tuned by `sft` saves the one it learned), else the
    tokenizer's own `chat_template` (a model directory's), else the default."""
    special = {"eos_token": EOS}
    if spec:
        return ChatTemplate.from_file(spec, **special)
    saved = _saved_template(adapter) if adapter else None
    if saved:
        return ChatTemplate(saved, origin=f"the chat template of the adapter {adapter}", **special)
    own = getattr(tokenizer, "chat_template", None)
    if own:
        return ChatTemplate(own, origin=f"the chat template of {tokenizer.name}", **special)
    return ChatTemplate(**special)


def check_messages(messages, where: str) -> list[dict]:
    """`messages` as a list of {role, content} dicts, or a DataError naming `where` and the field."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: messages[{i}] is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: messages[{i}].role is {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out
