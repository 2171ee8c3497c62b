"""`gptforge chat`: the conversation's prompt equals transformers' `apply_chat_template` and serve's
/v1/chat/completions prompt, history is trimmed from the oldest turns, answers stop at the
template's stop strings; the REPL on piped stdin and in a pseudo-terminal (streaming, /reset,
Ctrl-C during an answer, EOF)."""

from __future__ import annotations

import io
import json
import re

import pytest

from gptforge.chat import ChatSession, run_repl
from gptforge.config.schema import GenerationConfig
from gptforge.data.chat_template import ChatTemplate, template_for
from gptforge.data.tokenizer import gpt2_tokenizer
from gptforge.errors import DataError
from gptforge.generate.backend import as_backend
from gptforge.model_io import load_model
from test_sft_template import CHATML, MULTI, _hf, hf_tok  # noqa: F401 - hf_tok is a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

# A template with no stop string of its own (its turns end in a newline only), so a random model's
# answer runs to the token limit: the terminal tests need answers of a known length.
PLAIN = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
GREEDY = ["-o", "Generation.decode_strategy=greedy_search"]
PROMPT = r"(?:^|\n)> "  # the REPL's prompt on a terminal


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from gf_testutil import spread_gpt2_vocab_dir

    return spread_gpt2_vocab_dir(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt)[0]


def session(model, template: ChatTemplate, max_new: int, system: str | None = None):
    """A greedy ChatSession over `model` (the caller closes nothing: TorchBackend without prepacking)."""
    be = as_backend(model, prepack=False).__enter__()
    gen = GenerationConfig(decode_strategy="greedy_search", max_dec_len=max_new)
    return ChatSession(be, gpt2_tokenizer(), template, gen, system=system)


@pytest.mark.parametrize("source", [None, CHATML], ids=["default", "chatml"])
def test_prompt_ids_equal_transformers(model, hf_tok, source):  # noqa: F811
    s = session(model, ChatTemplate(source), 8, system=MULTI[0]["content"])
    s.history = MULTI[1:3]
    text, n = s.fit(MULTI[3]["content"])
    ref = list(_hf(hf_tok, source or s.template.source, MULTI[:4], add_generation_prompt=True)["input_ids"])
    assert gpt2_tokenizer().encode(text) == ref and n == len(ref)


def test_template_stop_strings():
    assert ChatTemplate().stop == ["\nUser:"]
    assert ChatTemplate(CHATML).stop == ["<|im_end|>"]  # the text that closes its assistant turn before EOS
    assert ChatTemplate(PLAIN).stop == []


def test_stream_stops_at_a_stop_string(model):
    from gptforge.generate import stream

    tok, cfg = gpt2_tokenizer(), GenerationConfig(decode_strategy="greedy_search", max_dec_len=24)
    full = "".join(stream(model, tok, "Hello there", cfg))
    stop = full[len(full) // 2: len(full) // 2 + 3]
    s = stream(model, tok, "Hello there", cfg, stop=[stop])
    assert "".join(s) == full.split(stop)[0] == s.result.texts[0][0]
    assert s.result.finish_reasons == [["stop"]]


def test_history_is_trimmed_from_the_oldest_turn_keeping_the_system(model):
    s = session(model, ChatTemplate(), 64, system="Be brief.")  # 256 positions: 192 for the prompt
    turns = []
    for i in range(8):
        turns += [{"role": "user", "content": f"question {i} " + "word " * 12},
                  {"role": "assistant", "content": f"answer {i} " + "word " * 12}]
    s.history = list(turns)
    text, n = s.fit("last question")
    assert s.trimmed and n <= s.room and n == len(gpt2_tokenizer().encode(text))
    assert text.startswith("Be brief.\n\nUser: question") and "question 0 " not in text
    assert s.history == turns[len(turns) - len(s.history):] and len(s.history) % 2 == 0
    # one more turn would have fitted? no: the kept turns are as many as fit
    longer = s.template.prompt(s.messages(turns[len(turns) - len(s.history) - 2:]
                                          + [{"role": "user", "content": "last question"}]))
    assert len(gpt2_tokenizer().encode(longer)) > s.room
    # a message that cannot fit alone: one line, and the history is untouched
    kept = list(s.history)
    with pytest.raises(DataError, match=r"your message take \d+ tokens.*leave room for 192; shorten it"):
        s.fit("word " * 300)
    assert s.history == kept


def test_template_saved_with_an_adapter_wins_over_the_models(tmp_path):
    tok = gpt2_tokenizer().with_chat_template(PLAIN)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    assert template_for(tok, adapter=tmp_path).source == CHATML
    assert template_for(tok, adapter=tmp_path / "none").source == PLAIN
    (tmp_path / "t.jinja").write_text(MULTI[0]["content"])
    assert template_for(tok, str(tmp_path / "t.jinja"), adapter=tmp_path).source == MULTI[0]["content"]


def test_repl_on_piped_lines_in_process(model):
    s = session(model, ChatTemplate(PLAIN), 6)
    out, err = io.StringIO(), io.StringIO()
    code = run_repl(s, io.StringIO("Hi\n/rest\n\nHi again\n/reset\n/exit\nnever read\n"), out, err, verbose=True)
    assert code == 0
    assert "unknown command /rest; the commands are /reset and /exit" in err.getvalue()
    assert "history cleared" in err.getvalue() and "stdin closed" not in err.getvalue()
    assert len(out.getvalue().splitlines()) == 2 and s.history == []  # two answers, then /reset
    counts = [int(x) for x in re.findall(r"\[prompt (\d+) tokens", err.getvalue())]
    assert len(counts) == 2 and counts[1] > counts[0]  # the second prompt holds the first turn


def test_serve_and_chat_build_the_same_prompt(ckpt, model, tmp_path):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from serve_support import serving

    (tmp_path / "chatml.jinja").write_text(CHATML)
    s = session(model, template_for(gpt2_tokenizer(), str(tmp_path / "chatml.jinja")), 12, system="Be brief.")
    s.history = MULTI[1:3]
    pieces: list[str] = []
    reply = s.reply("What is 12 + 30?", pieces.append)
    with serving(model, gpt2_tokenizer(), GenerationConfig(), chat_template=str(tmp_path / "chatml.jinja")) as srv:
        assert srv.state.chat.source == CHATML
        msgs = [{"role": "system", "content": "Be brief."}, *MULTI[1:4]]
        assert srv.state.chat.prompt(msgs) == s.template.prompt(s.messages()[:-1])
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": msgs, "max_tokens": 12, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens"] == reply.prompt_tokens
    assert r["choices"][0]["message"]["content"].strip() == reply.text == "".join(pieces).rstrip()


# ------------------------------------------------------------------ the verb, in a terminal and a pipe

def _cli(*args) -> list[str]:
    import sys

    return [sys.executable, "-m", "gptforge", "chat", *map(str, args)]


def _env() -> dict:
    import os

    # one thread (a tiny model, a busy machine); TERM=dumb: readline writes no escape sequences
    return dict(os.environ, OMP_NUM_THREADS="1", TERM="dumb")


class Terminal:
    """A process whose stdin, stdout and stderr are a pseudo-terminal it controls (so ^C and ^D
    typed there are SIGINT and end of input, as in a real terminal)."""

    def __init__(self, argv):
        import fcntl
        import os
        import pty
        import signal
        import subprocess
        import termios

        from gptforge.transforms import native_kernels

        # The session's one-time kernel build happens here, not inside the terminal whose text the
        # test reads (run alone, or first on its worker, the chat would print the build's progress).
        native_kernels.unavailable()
        self.fd, follower = pty.openpty()

        def take_terminal():  # runs in the child after setsid: the pty becomes its controlling tty
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            # as a shell starts a foreground program: SIGINT at its default, whatever this test
            # process inherited (an ignored SIGINT survives exec, and Ctrl-C at the prompt did nothing)
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        self.proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=_env(),
                                     start_new_session=True, preexec_fn=take_terminal, close_fds=True)
        os.close(follower)
        self.seen = ""  # everything read so far
        self.mark = 0  # where the last match ended
        self.code: int | None = None

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Wait for the process to end by itself, unless the test failed: then stop it."""
        import os

        try:
            if exc_type is None:
                self.code = self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            os.close(self.fd)

    def expect(self, pattern: str, timeout: float = 300) -> re.Match:
        """Read until `pattern` matches what came after the last match; that match."""
        import os
        import select
        import time

        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern, re.S).search(self.seen, self.mark)
            if m:
                self.mark = m.end()
                return m
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"no {pattern!r} within {timeout} s; the terminal shows:\n{self.seen[-3000:]}")
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                data = b""
            if not data:
                raise AssertionError(f"the process ended before {pattern!r}:\n{self.seen[-3000:]}")
            # (the whole text: a "\r\n" may arrive split over two reads)
            self.seen = (self.seen + data.decode(errors="replace")).replace("\r\n", "\n")

    def type(self, text: str) -> None:
        import os

        os.write(self.fd, text.encode())



def test_terminal_reset_and_end_of_input(ckpt, tmp_path):
    (tmp_path / "plain.jinja").write_text(PLAIN)
    with Terminal(_cli("--ckpt", ckpt, "--chat-template", tmp_path / "plain.jinja", "--max-new-tokens", 6,
                       "--verbose", *GREEDY)) as t:
        counts, answers = [], []
        for line in ("Hello", "Hello", "/reset", "Hello"):
            t.expect(PROMPT)
            t.type(line + "\n")
            if line == "/reset":
                t.expect(r"history cleared")
                continue
            m = t.expect(re.escape(line) + r"\n(.*?)\n.*?\[prompt (\d+) tokens")
            answers.append(m[1])
            counts.append(int(m[2]))
        # the second prompt holds the first turn; after /reset the prompt (and the greedy answer) is the first's
        assert counts[1] > counts[0] and counts[2] == counts[0] and answers[2] == answers[0]
        t.expect(PROMPT)
        t.type("\x04")  # Ctrl-D at the prompt
        t.expect(r"stdin closed \(end of input\); bye")
    assert t.code == 0


def test_terminal_ctrl_c_stops_the_answer_not_the_program(tmp_path):
    import torch

    from gf_testutil import tiny_model
    from gptforge.model_io import save_model_dir

    # a longer context: answers of 200 tokens take long enough to be interrupted mid-way
    torch.manual_seed(0)
    m, cfg = tiny_model("Model.vocab_size=50257", "Model.max_position_embeddings=1024")
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    save_model_dir(m, cfg, tmp_path / "m", gpt2_tokenizer())
    (tmp_path / "plain.jinja").write_text(PLAIN)
    with Terminal(_cli("--ckpt", tmp_path / "m", "--chat-template", tmp_path / "plain.jinja", "--max-new-tokens",
                       200, "--verbose", *GREEDY)) as t:
        t.expect(PROMPT)
        t.type("Tell me a story\n")
        begun = t.expect(r"Tell me a story\n\S")  # the answer has begun: it streams
        t.type("\x03")  # Ctrl-C
        stopped = t.expect(r"\ngptforge chat: answer stopped \(Ctrl-C\)")
        # what was shown (the terminal echoes the keystroke as ^C somewhere in it)
        partial = t.seen[begun.end() - 1: stopped.start()].replace("^C", "").rstrip()
        t.expect(PROMPT)  # back at the prompt
        t.type("Go on\n")
        done = t.expect(r"Go on\n.*?\[prompt (\d+) tokens, answer 200 tokens.*?length\]")
        t.expect(PROMPT)
        # Ctrl-C at the prompt leaves. A keystroke that lands while readline switches the
        # terminal into its mode can be discarded by that switch (seen once under load: no ^C
        # echoed, nothing received), as in any readline program; a user presses again.
        for attempt in range(3):
            t.type("\x03")
            try:
                t.expect(r"interrupted at the prompt; bye", timeout=20 if attempt < 2 else 300)
                break
            except AssertionError:
                if attempt == 2:
                    raise
    assert t.code == 0
    s = session(load_model(tmp_path / "m")[0], ChatTemplate(PLAIN), 200)
    full = s.reply("Tell me a story", lambda _: None).text
    # what was shown is a strict beginning of the whole answer, and it stayed in the history
    assert partial and full.startswith(partial) and len(partial) < len(full)
    assert int(done[1]) == len(gpt2_tokenizer().encode(ChatTemplate(PLAIN).prompt([
        {"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": partial},
        {"role": "user", "content": "Go on"}])))


def test_piped_stdin_answers_then_says_stdin_closed(ckpt, model):
    import subprocess

    r = subprocess.run(_cli("--ckpt", ckpt, "--max-new-tokens", 8, *GREEDY), input="Hello there\n", text=True,
                       capture_output=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr
    assert "gptforge chat: stdin closed (end of input); bye" in r.stderr and "Traceback" not in r.stderr
    want = session(model, ChatTemplate(), 8).reply("Hello there", lambda _: None).text
    assert r.stdout == want + "\n"  # no prompt, no labels: the answer alone


def test_verb_errors_are_one_line_before_loading(run_cli, ckpt, tmp_path):
    code, _, err = run_cli("chat", "--ckpt", ckpt, "-o", "Generation.decode_strategy=beam_search")
    assert code == 2 and "Generation.decode_strategy: chat streams one answer" in err
    code, _, err = run_cli("chat", "--ckpt", ckpt, "--chat-template", tmp_path / "none.jinja")
    assert code == 2 and "none.jinja: file not found" in err and "Traceback" not in err
    code, _, err = run_cli("chat")
    assert code == 2 and "--ckpt" in err
