"""Chat prompts for base models: messages → one plain-text prompt through a Jinja template.

The default template (`chat_template.jinja`, next to this file) writes

    <system text>

    User: <message>
    Assistant: <message>
    User: <message>
    Assistant:

and adds the stop string "\\nUser:". `--chat-template FILE` replaces it with any Jinja template
over `messages` (each with `role` and `content`), the form Hugging Face chat templates use;
a replaced template adds no stop strings.
"""

from __future__ import annotations

from pathlib import Path

from gptforge.errors import ConfigError

DEFAULT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
DEFAULT_STOP = ["\nUser:"]


class ChatTemplate:
    """`render(messages) -> str`; `stop` lists the template's own stop strings."""

    def __init__(self, path: str | Path | None = None):
        import jinja2

        p = Path(path) if path else DEFAULT_TEMPLATE
        if not p.is_file():
            raise ConfigError(f"--chat-template {p}: file not found")
        try:
            source = p.read_text(encoding="utf-8")
            env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False)
            self.template = env.from_string(source)
        except (UnicodeDecodeError, jinja2.TemplateError) as e:
            raise ConfigError(f"--chat-template {p}: not a valid Jinja template ({e})") from None
        self.path = p
        self.stop = list(DEFAULT_STOP) if path is None else []

    def render(self, messages: list[dict]) -> str:
        import jinja2

        try:
            return self.template.render(messages=messages)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template {self.path.name} failed on these messages: {e}") from None
