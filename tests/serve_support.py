"""Helpers for the serve tests: a tiny served model and a real uvicorn server on a free port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import pytest

from gf_testutil import spread_gpt2_vocab_dir


def make_ckpt(path):
    """A tiny model with GPT-2's vocabulary and varied text (gf_testutil)."""
    return spread_gpt2_vocab_dir(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    url: str
    state: object
    server: object
    thread: threading.Thread


@contextlib.contextmanager
def serving(model, tok, generation, **opts):
    """Run `gptforge serve`'s server for `model` (with `draft=`: speculative decoding) in a thread;
    always stopped on exit."""
    from gptforge.serve.server import DrainingServer, ServeOptions, build_state

    draft = opts.pop("draft", None)
    o = ServeOptions(model_name=opts.pop("model_name", "tiny"), port=free_port(), **opts)
    state = build_state(model, tok, generation, o, draft=draft)
    srv = DrainingServer(state, o, log_level="warning")
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            if not t.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield Served(f"http://127.0.0.1:{o.port}", state, srv, t)
    finally:
        srv.server.should_exit = True
        t.join(20)
        state.engine.stop()
        assert not t.is_alive()


@contextlib.contextmanager
def throttled(state, seconds: float):
    """Make every engine step take at least `seconds` (so a request outlives a test's actions)."""
    slots = state.engine.slots
    inner = slots.step

    def slow(segments):
        time.sleep(seconds)
        return inner(segments)

    slots.step = slow
    try:
        yield
    finally:
        slots.step = inner


def model_fixtures(name: str):
    """The module-scoped `ckpt` (a tiny model directory), `model` (loaded) and `tok` fixtures the
    serve test modules share: `ckpt, model, tok = model_fixtures("serve")`."""
    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.model_io import load_model

    @pytest.fixture(scope="module")
    def ckpt(tmp_path_factory):
        return make_ckpt(tmp_path_factory.mktemp(name) / "model")

    @pytest.fixture(scope="module")
    def model(ckpt):
        return load_model(ckpt)

    @pytest.fixture(scope="module")
    def tok():
        return gpt2_tokenizer()

    return ckpt, model, tok
