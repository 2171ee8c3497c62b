"""The terminal loop of `gptforge chat`: read a line, answer it streamed, repeat.

On a TTY the prompt is "> " (with readline's line editing where Python has it); piped stdin is
read line by line with no prompt, so `echo hi | gptforge chat ...` answers one turn. `/reset`
clears the history, `/exit` (or end of input, Ctrl-D) leaves. Ctrl-C while an answer is being
written stops that answer and returns to the prompt (a SIGINT handler raises a flag the session
checks after every piece, so decoding is never torn mid-step); Ctrl-C at the prompt leaves.
Answers go to stdout; notices (trimming, a stopped answer, `--verbose` figures) to stderr.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from gptforge.chat.session import ChatSession, Reply
from gptforge.errors import DataError

COMMANDS = ("/reset", "/exit")
NAME = "gptforge chat"


class _Interrupt:
    """While active, SIGINT only raises `flag` (in the main thread; elsewhere nothing changes)."""

    def __init__(self):
        self.flag = False
        self._old = None

    def __enter__(self) -> _Interrupt:
        self.flag = False
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._raise_flag)
        return self

    def _raise_flag(self, signum, frame) -> None:  # noqa: ARG002
        self.flag = True

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


def _read(stdin, out, tty: bool) -> str | None:
    """The next line without its newline; None at end of input. Ctrl-C propagates."""
    if tty:
        try:
            return input("> ") if stdin is sys.stdin and out is sys.stdout else _prompted(stdin, out)
        except EOFError:
            return None
    line = stdin.readline()
    return None if line == "" else line.rstrip("\r\n")


def _prompted(stdin, out) -> str | None:
    out.write("> ")
    out.flush()
    line = stdin.readline()
    if line == "":
        raise EOFError
    return line.rstrip("\r\n")


def _note(err, text: str) -> None:
    err.write(f"{NAME}: {text}\n")
    err.flush()


def _figures(r: Reply) -> str:
    rate = r.new_tokens / r.seconds if r.seconds > 0 else 0.0
    return (f"[prompt {r.prompt_tokens} tokens, answer {r.new_tokens} tokens in {r.seconds:.2f} s "
            f"({rate:.1f} tokens/s), {r.finish}]")


def _answer(session: ChatSession, line: str, out, err, verbose: bool, said_trim: bool) -> bool:
    """Answer one line; returns whether the trimming notice has been given."""
    def write(piece: str) -> None:
        out.write(piece)
        out.flush()

    with _Interrupt() as stop:
        try:
            r = session.reply(line, write, lambda: stop.flag)
        except DataError as e:  # a message too long for the context: say so, keep chatting
            _note(err, f"error: {e}")
            return said_trim
    out.write("\n")
    out.flush()
    if session.trimmed and not said_trim:
        _note(err, f"the conversation outgrew the model's {session.backend.max_positions} positions; dropping "
                   "its oldest turns to make room (the system message stays)")
        said_trim = True
    if r.finish == "interrupted":
        _note(err, "answer stopped (Ctrl-C)")
    elif r.finish == "length":
        _note(err, f"the answer reached --max-new-tokens ({session.generation.max_dec_len})")
    if verbose:
        _note(err, _figures(r))
    return said_trim


def _command(session: ChatSession, line: str, err) -> bool | None:
    """Run a /command: True to leave, False to go on; None when `line` is a message."""
    word = line.strip()
    if not word.startswith("/") or " " in word:
        return None
    if word in ("/exit", "/quit"):
        return True
    if word == "/reset":
        session.reset()
        _note(err, "history cleared")
    else:
        _note(err, f"unknown command {word}; the commands are {' and '.join(COMMANDS)}")
    return False


def run_repl(session: ChatSession, stdin=None, out=None, err=None, verbose: bool = False) -> int:
    """Chat until /exit, end of input or Ctrl-C at the prompt; returns the exit code (0)."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    tty = stdin.isatty()
    if tty:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing and history for input()
    said_trim = False
    while True:
        try:
            line = _read(stdin, out, tty)
        except KeyboardInterrupt:
            out.write("\n")
            _note(err, "interrupted at the prompt; bye")
            return 0
        if line is None:
            if tty:
                out.write("\n")
            _note(err, "stdin closed (end of input); bye")
            return 0
        leave = _command(session, line, err)
        if leave:
            return 0
        if leave is None and line.strip():
            said_trim = _answer(session, line, out, err, verbose, said_trim)
