"""`gptforge chat`: an interactive, multi-turn conversation with a model.

- `session.ChatSession`: the conversation (system message + turns), rendered through the model's
  chat template (data/chat_template.py, the one `sft` trains with and `serve`'s
  /v1/chat/completions renders through), trimmed from its oldest turns to fit the context, and
  each answer streamed from the decoding engine (`generate.stream`);
- `repl.run_repl`: the terminal loop around it (a TTY or piped lines; `/reset`, `/exit`; Ctrl-C
  stops the answer being written).
"""

from gptforge.chat.repl import run_repl
from gptforge.chat.session import ChatSession, Reply

__all__ = ["ChatSession", "Reply", "run_repl"]
