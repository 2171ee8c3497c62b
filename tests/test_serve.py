"""`gptforge serve` end to end: a real uvicorn server on a free port, the official `openai`
client and raw SSE with httpx. Greedy results are compared with `generate` run alone."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from gptforge.config.schema import GenerationConfig  # noqa: E402
from gptforge.generate import generate  # noqa: E402
from gptforge.model_io import load_model  # noqa: E402
from serve_support import model_fixtures, serving, throttled  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


ckpt, model, tok = model_fixtures("serve")


@pytest.fixture(scope="module")
def server(model, tok):
    m, cfg = model
    with serving(m, tok, cfg.Generation, max_batch_size=16, max_queue=64) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def solo(model, tok, prompt, max_tokens, **kw):
    """What `gptforge generate` prints for one prompt (one sequence, batch of one)."""
    kw.setdefault("decode_strategy", "greedy_search")
    return generate(model[0], tok, [prompt], GenerationConfig(max_dec_len=max_tokens, **kw))


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("gptforge_requests_total", "gptforge_generation_tokens_total", "gptforge_queue_depth",
                 "gptforge_batch_size", "gptforge_time_to_first_token_seconds_bucket",
                 "gptforge_inter_token_latency_seconds_bucket"):
        assert name in text
    assert 'endpoint="/v1/completions",status="200"' in text


def test_server_sampling_defaults_fill_only_what_a_request_omits(model, tok):
    """`gptforge serve --max-new-tokens 3 --temperature 0`: a request without max_tokens /
    temperature gets those (greedy, 3 tokens); its own fields win (5 tokens)."""
    m, cfg = model
    with serving(m, tok, cfg.Generation, sampling_defaults={"max_tokens": 3, "temperature": 0.0}) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.completions.create(model="tiny", prompt="The cat sat on")
        assert r.usage.completion_tokens <= 3 and r.choices[0].text == solo(model, tok, "The cat sat on", 3).texts[0][0]
        r5 = c.completions.create(model="tiny", prompt="The cat sat on", max_tokens=5, temperature=0)
        assert r5.choices[0].text == solo(model, tok, "The cat sat on", 5).texts[0][0]


def test_greedy_completion_equals_generate_and_usage_is_exact(model, tok, client):
    ref = solo(model, tok, "The cat sat on", 12)
    r = client.completions.create(model="tiny", prompt="The cat sat on", max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.texts[0][0]
    assert r.choices[0].finish_reason == ("stop" if ref.finish_reasons[0][0] == "eos" else "length")
    assert r.usage.prompt_tokens == len(tok.encode("The cat sat on"))
    assert r.usage.completion_tokens == ref.new_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # A list of prompts, token-id prompts and echo.
    r = client.completions.create(model="tiny", prompt=["The cat sat on", "Hello"], max_tokens=12, temperature=0,
                                  echo=True)
    assert [c.text for c in r.choices] == ["The cat sat on" + ref.texts[0][0],
                                           "Hello" + solo(model, tok, "Hello", 12).texts[0][0]]
    r = client.completions.create(model="tiny", prompt=tok.encode("The cat sat on"), max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.texts[0][0]


def test_chat_uses_the_plain_text_template(model, tok, client, server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = server.state.chat.prompt(msgs)
    assert prompt == "Be brief.\n\nUser: Hi\nAssistant:"
    ref = solo(model, tok, prompt, 10).texts[0][0].split("\nUser:")[0]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref
    assert r.usage.prompt_tokens == len(tok.encode(prompt))


def _sse(url, path, body):
    """(data chunks, saw [DONE]) of a streamed request read as raw server-sent events."""
    chunks, done = [], False
    with httpx.stream("POST", url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
            else:
                chunks.append(json.loads(line[6:]))
    return chunks, done


def test_streaming_matches_the_whole_response(server, client):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    whole = client.completions.create(**body)
    chunks, done = _sse(server.url, "/v1/completions", {**body, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    assert done and len(chunks) > 3
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole.choices[0].text
    assert chunks[-1]["usage"] == whole.usage.model_dump(exclude_none=True)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == whole.choices[0].finish_reason
    # The openai client's own stream reader, chat flavour.
    msgs = [{"role": "user", "content": "Tell me"}]
    ref = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True)]
    assert "".join(parts) == ref.choices[0].message.content


def test_n_choices_and_seeded_sampling(model, tok, client):
    kw = dict(model="tiny", prompt="In the morning", max_tokens=10, temperature=0.9, top_k=40, seed=7, n=3)
    a = client.completions.create(**{k: v for k, v in kw.items() if k != "top_k"}, extra_body={"top_k": 40})
    b = client.completions.create(**{k: v for k, v in kw.items() if k != "top_k"}, extra_body={"top_k": 40})
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # reproducible per request
    assert len({c.text for c in a.choices}) > 1  # choice i samples with seed + i
    # Choice 0 is exactly what `generate` samples alone with that seed.
    ref = solo(model, tok, "In the morning", 10, decode_strategy="sampling", temperature=0.9, top_k=40, seed=7)
    assert a.choices[0].text == ref.texts[0][0]
    assert a.usage.prompt_tokens == len(tok.encode("In the morning"))  # once per prompt, not per choice
    lengths = [10 if c.finish_reason == "length" else None for c in a.choices]
    if None not in lengths:
        assert a.usage.completion_tokens == 30


def test_stop_strings(model, tok, client, server):
    full = solo(model, tok, "The cat sat on", 16).texts[0][0]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    expected = full[: full.index(stop)]
    r = client.completions.create(model="tiny", prompt="The cat sat on", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks, _ = _sse(server.url, "/v1/completions", {"model": "tiny", "prompt": "The cat sat on", "max_tokens": 16,
                                                     "temperature": 0, "stop": stop, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected


def test_logprobs(model, tok, client):
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 6
    for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and max(top.values()) == pytest.approx(v) and top[t] == pytest.approx(v)
    ref = solo(model, tok, "Hello there", 6)
    assert sum(lp.token_logprobs) / 6 == pytest.approx(ref.scores[0][0], abs=1e-5)  # generate's mean log-prob
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)


@pytest.mark.parametrize("body,status,param", [
    ({"temperature": 5}, 400, "temperature"),
    ({"n": 0}, 400, "n"),
    ({"max_tokens": 300}, 400, "max_tokens"),  # the tiny model has 256 positions
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"unknown_field": 1}, 400, "unknown_field"),
    ({"model": "gpt-4"}, 404, "model"),
])
def test_error_statuses_have_openai_shape(server, body, status, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    if body.get("max_tokens"):
        assert err["code"] == "context_length_exceeded"


def test_queue_full_draining_and_api_key_statuses(server, client):
    st = server.state
    st.engine.max_queue, old = 0, st.engine.max_queue
    try:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    finally:
        st.engine.max_queue = old
    st.api_key = "sekrit"
    try:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        ok = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
    finally:
        st.api_key = None
    st.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503
    finally:
        st.draining = False


def test_disconnect_cancels_and_frees_the_slot(server):
    st = server.state
    before = st.engine.steps
    with throttled(st, 0.02):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "Go", "max_tokens": 200, "temperature": 0, "stream": True}) as resp:
            lines = resp.iter_lines()
            got = [line for _, line in zip(range(6), lines, strict=False)]
            assert any(x.startswith("data: ") for x in got)
            assert st.engine.batch_size == 1
        deadline = time.monotonic() + 5
        while st.engine.batch_size and time.monotonic() < deadline:
            time.sleep(0.02)
    assert st.engine.batch_size == 0 and st.engine.steps - before < 150  # left long before 200 tokens


def test_disconnect_cancels_a_non_streaming_request(server):
    st = server.state
    before = st.engine.steps
    with throttled(st, 0.02):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(30, read=0.5), json={
                "model": "tiny", "prompt": "Go", "max_tokens": 200, "temperature": 0})
        deadline = time.monotonic() + 5
        while st.engine.batch_size and time.monotonic() < deadline:
            time.sleep(0.02)
    assert st.engine.batch_size == 0 and st.engine.steps - before < 150


def test_sixteen_concurrent_mixed_greedy_requests_equal_solo_generate(model, tok, server):
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "small", "birds", "sing"]
    prompts = [" ".join(words[: 1 + (i * 5) % len(words)]) * (1 + i % 4) for i in range(16)]
    lengths = [4 + (i * 7) % 21 for i in range(16)]
    refs = [solo(model, tok, p, n).texts[0][0] for p, n in zip(prompts, lengths, strict=True)]
    server.state.engine.peak_batch = 0

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*[c.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)
                                          for p, n in zip(prompts, lengths, strict=True)])
        finally:
            await c.close()

    with throttled(server.state, 0.005):  # let all 16 arrive while the first ones still run
        out = asyncio.run(main())
    assert [r.choices[0].text for r in out] == refs
    assert server.state.engine.peak_batch >= 8  # they really shared batches


def test_graceful_drain_finishes_running_requests_then_stops(model, tok):
    m, cfg = model
    with serving(m, tok, cfg.Generation, drain_timeout=20) as s:
        with throttled(s.state, 0.01), httpx.stream("POST", s.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "Go", "max_tokens": 60, "temperature": 0, "stream": True}) as resp:
            lines = resp.iter_lines()
            next(lines)
            s.server.begin_drain()  # what SIGTERM does
            r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            assert httpx.get(s.url + "/health").status_code == 503
            rest = [x for x in lines if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        final = [json.loads(x[6:]) for x in rest[:-1]][-1]
        assert final["choices"][0]["finish_reason"] in ("length", "stop")
        s.thread.join(15)
        assert not s.thread.is_alive()  # the server stopped by itself


def test_sigterm_drains_then_exits_cleanly(ckpt, tmp_path):
    """A real `gptforge serve` process: SIGTERM lets the running stream finish, then exit 0."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from serve_support import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gptforge", "serve", "--ckpt", str(ckpt), "--port", str(port),
                             "--log-level", "warning", "--model-name", "tiny"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() >= deadline:  # kill first: read() waits for EOF
                proc.kill()
                pytest.fail("the server did not come up: " + proc.communicate(timeout=10)[0].decode()[-2000:])
            time.sleep(0.2)
        lines, first = [], threading.Event()

        def reader():
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": "Go", "max_tokens": 200, "temperature": 0, "stream": True}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()

        t = threading.Thread(target=reader)
        t.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0
        data = [x for x in lines if x.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_models_of_every_format_load_through_the_verb(ckpt, tmp_path, tok):
    """HF directories (and the other formats `load_model` reads) serve through the same loader."""
    import argparse

    from gptforge.commands.serve import add_arguments, load_served_model
    from gptforge.model_io import save_hf_dir

    m, cfg = load_model(ckpt)
    save_hf_dir(m, cfg, tmp_path / "hf", tok)
    p = argparse.ArgumentParser()
    add_arguments(p)
    model, cfg2, tok2 = load_served_model(p.parse_args(["--ckpt", str(tmp_path / "hf")]))
    with serving(model, tok2, cfg2.Generation, model_name="hf") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model="hf", prompt="The cat sat on", max_tokens=8, temperature=0)
    assert r.choices[0].text == generate(m, tok, ["The cat sat on"], GenerationConfig(
        decode_strategy="greedy_search", max_dec_len=8)).texts[0][0]


@pytest.mark.parametrize("which", ["fp32", "int8", "converted"])
def test_pruned_qat_and_int8_directories_serve_like_generate(which, request, tmp_path):
    """The pruned model (fp32 fixture), the QAT model (int8 fixture) and its real INT8 conversion
    (`quantize --convert`) through `gptforge serve`'s loader."""
    import argparse

    from gptforge.commands.serve import add_arguments, load_served_model
    from gptforge.compress.int8_convert import convert_checkpoint

    model_dir, _ = request.getfixturevalue("fp32" if which == "fp32" else "int8")
    if which == "converted":
        convert_checkpoint(model_dir, tmp_path / "int8", int8_embedding=True, echo=False)
        model_dir = tmp_path / "int8"
    p = argparse.ArgumentParser()
    add_arguments(p)
    model, cfg, tok = load_served_model(p.parse_args(["--ckpt", str(model_dir)]))
    prompts = ["Hello world", "The"]
    ref = generate(model, tok, prompts, GenerationConfig(decode_strategy="greedy_search", max_dec_len=6), batch_size=1)
    with serving(model, tok, cfg.Generation, model_name="m") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=0)
    assert [x.text for x in r.choices] == [t[0] for t in ref.texts]


def test_onnx_backend_serves_an_export(fp32):
    """`--backend onnx`: onnxruntime, one batch-1 cache per sequence; greedy equals `gptforge infer`."""
    import argparse

    from gptforge.commands.serve import add_arguments, load_served_model

    pytest.importorskip("onnxruntime")
    _, onnx_dir = fp32
    p = argparse.ArgumentParser()
    add_arguments(p)
    backend, cfg, tok = load_served_model(p.parse_args(["--ckpt", str(onnx_dir), "--backend", "onnx"]))
    ref = generate(backend, tok, ["Hello world", "A"], GenerationConfig(decode_strategy="greedy_search", max_dec_len=6))
    with serving(backend, tok, cfg.Generation, model_name="onnx") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model="onnx", prompt=["Hello world", "A"], max_tokens=6, temperature=0)
    assert [x.text for x in r.choices] == [t[0] for t in ref.texts]


def test_cli_errors_are_one_line(run_cli, tmp_path):
    code, _, err = run_cli("serve")
    assert code == 2 and "--ckpt" in err
    code, _, err = run_cli("serve", "--ckpt", tmp_path, "--prefill-tokens", "48")
    assert code == 2 and "multiple of 32" in err and len(err.strip().splitlines()) == 1


del torch
