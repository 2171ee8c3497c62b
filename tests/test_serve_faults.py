"""`gptforge serve` under attack and misuse (issue #33): one request never hurts another.

Two servers, always stopped: an in-process one (to poison sampling for one sequence, which the
door now refuses to do with bad values) and a real `gptforge serve --port 0 --api-key ...`
process whose log is read for tracebacks. Clients are real HTTP clients (openai, httpx, raw
sockets)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from gptforge.config.schema import GenerationConfig  # noqa: E402
from gptforge.generate import generate  # noqa: E402
from serve_faults_support import KEY, POISON, Proc, poisoned_sampling, storm, upload, wait_idle  # noqa: E402
from serve_support import model_fixtures, serving, throttled  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


ckpt, model, tok = model_fixtures("faults")


def solo(model, tok, prompt, max_tokens):
    """What `gptforge generate` gives for one prompt alone (greedy)."""
    cfg = GenerationConfig(decode_strategy="greedy_search", max_dec_len=max_tokens)
    return generate(model[0], tok, [prompt], cfg).texts[0][0]


GREEDY = [("The cat sat on", 24), ("Once upon a time", 30), ("Hello", 20), ("In the morning we", 26)]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_a_poisoned_request_leaves_running_greedy_requests_equal_to_solo_generate(model, tok, speculative):
    refs = [solo(model, tok, p, n) for p, n in GREEDY]
    m, cfg = model
    with serving(m, tok, cfg.Generation, draft=m if speculative else None) as s:
        st = s.state

        async def main():
            c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)

            async def poison():
                await asyncio.sleep(0.1)  # the greedy requests are running by then
                with pytest.raises(openai.InternalServerError) as e:
                    await c.completions.create(model="tiny", prompt="Poison", max_tokens=50, temperature=0.9,
                                               seed=POISON, n=2)
                return e.value

            try:
                return await asyncio.gather(poison(), *[
                    c.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0) for p, n in GREEDY])
            finally:
                await c.close()

        with throttled(st, 0.01), poisoned_sampling(st.engine) as struck:
            err, *out = asyncio.run(main())
        assert struck and max(struck) >= 2  # it struck while other sequences shared the batch
        assert [r.choices[0].text for r in out] == refs
        assert err.status_code == 500 and "probability tensor" in err.message
        assert wait_idle(st.engine)
        metrics = httpx.get(s.url + "/metrics").text
        assert 'endpoint="/v1/completions",status="500"} 1.0' in metrics
        # The server goes on serving.
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        assert c.completions.create(model="tiny", prompt="Hello", max_tokens=20, temperature=0).choices[0].text \
            == refs[2]


def test_a_failing_choice_ends_its_siblings_and_a_stream_says_so(model, tok):
    m, cfg = model
    with serving(m, tok, cfg.Generation) as s:
        st = s.state
        with throttled(st, 0.01), poisoned_sampling(st.engine):
            before = st.engine.steps
            # Choice 1 samples with seed + 1 = POISON; choice 0 would run 200 steps for nobody.
            r = httpx.post(s.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Go", "max_tokens": 200, "temperature": 0.9, "seed": POISON - 1, "n": 2})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert wait_idle(st.engine) and st.engine.steps - before < 20
            lines = []
            with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60, json={
                    "model": "tiny", "messages": [{"role": "user", "content": "Go"}], "max_tokens": 200,
                    "seed": POISON, "n": 2, "stream": True}) as resp:
                assert resp.status_code == 200
                lines = [x[6:] for x in resp.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(x) for x in lines[:-1]]
        assert any("probability tensor" in c.get("error", {}).get("message", "") for c in chunks)
        reasons = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                   if c.get("choices") and c["choices"][0]["finish_reason"]}
        assert reasons == {0: "error", 1: "error"}
        assert wait_idle(st.engine) and st.engine.steps - before < 40


def test_a_failed_model_step_or_slot_ends_only_its_sequences_and_the_server_goes_on(model, tok):
    m, cfg = model
    ref = solo(model, tok, "Hello", 12)
    with serving(m, tok, cfg.Generation) as s:
        st, slots = s.state, s.state.engine.slots
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        step, new_slot = slots.step, slots.new_slot

        def failing_step(segments):
            slots.step = step  # once
            raise RuntimeError("device lost")

        def failing_slot(capacity):
            if capacity == 3 + 77:  # "The cat sat" (3 tokens) + max_tokens 77: out of memory
                raise MemoryError("no room for this sequence")
            return new_slot(capacity)

        slots.step = failing_step
        with pytest.raises(openai.InternalServerError, match="device lost"):
            c.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0)
        assert c.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0).choices[0].text == ref
        slots.new_slot = failing_slot
        try:
            with pytest.raises(openai.InternalServerError, match="no room"):
                c.completions.create(model="tiny", prompt=["Hello", "The cat sat"], max_tokens=77, temperature=0)
            assert c.completions.create(model="tiny", prompt="Hello", max_tokens=12,
                                        temperature=0).choices[0].text == ref
        finally:
            slots.new_slot = new_slot
        assert wait_idle(st.engine)


def test_request_timeout_cancels_and_answers_504(model, tok):
    m, cfg = model
    with serving(m, tok, cfg.Generation, request_timeout=0.5) as s:
        st = s.state
        with throttled(st, 0.02):
            t0 = time.monotonic()
            r = httpx.post(s.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "Go", "max_tokens": 200, "temperature": 0})
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
            assert time.monotonic() - t0 < 3
            with httpx.stream("POST", s.url + "/v1/completions", timeout=30, json={
                    "model": "tiny", "prompt": "Go", "max_tokens": 200, "temperature": 0, "stream": True}) as resp:
                lines = [x[6:] for x in resp.iter_lines() if x.startswith("data: ")]
            assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "timeout"
            assert wait_idle(st.engine)  # the slots are free
        ok = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4})
        assert ok.status_code == 200


def test_an_unexpected_error_is_an_openai_500_counted_and_logged_once(model, tok, caplog):
    m, cfg = model
    with serving(m, tok, cfg.Generation) as s:
        s.state.chat.prompt = lambda messages: 1 / 0  # a bug in a handler
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        with caplog.at_level("ERROR", logger="gptforge.serve"):
            r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert [rec.exc_info[0] for rec in caplog.records if rec.name == "gptforge.serve"] == [ZeroDivisionError]
        assert 'endpoint="/v1/chat/completions",status="500"} 1.0' in httpx.get(s.url + "/metrics").text
        assert httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                          timeout=30).status_code == 200


def test_tokenizing_runs_off_the_event_loop(model, tok):
    """A prompt that takes long to encode holds no one else up: /health and other requests go on."""
    m, cfg = model
    with serving(m, tok, cfg.Generation) as s:
        inner, started = tok.encode, threading.Event()

        def slow_encode(text):
            if text.startswith("SLOW"):
                started.set()
                time.sleep(3)
            return inner(text)

        tok.encode = slow_encode  # the instance only (gpt2_tokenizer() is shared)
        try:
            slow = threading.Thread(target=lambda: httpx.post(s.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "SLOW prompt", "max_tokens": 2}))
            slow.start()
            assert started.wait(10)
            t0 = time.monotonic()
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200
            r = httpx.post(s.url + "/v1/chat/completions", timeout=5, json={
                "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert r.status_code == 200 and time.monotonic() - t0 < 2.5 and slow.is_alive()
            slow.join(30)
        finally:
            del tok.encode


# -- a real `gptforge serve` process ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    """`gptforge serve --port 0 --api-key KEY` with its log in a file; stopped with SIGTERM."""
    log = tmp_path_factory.mktemp("serve_log") / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    env.pop("GPTFORGE_API_KEY", None)
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "gptforge", "serve", "--ckpt", str(ckpt), "--port", "0",
                                 "--model-name", "tiny", "--api-key", KEY, "--log-level", "warning"],
                                env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not (m := re.search(r"on http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield Proc(f"http://127.0.0.1:{m.group(1)}", proc, log)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_port_0_announces_the_bound_port_and_only_health_is_open(server):
    port = int(server.url.rsplit(":", 1)[1])
    assert port != 0
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    for path in ("/metrics", "/openapi.json", "/v1/models", "/docs", "/v1/nothing", "/nothing"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        r = httpx.get(server.url + path, headers={"Authorization": f"Bearer {KEY}x"})
        assert r.status_code == 401, path
    h = server.headers()
    assert httpx.get(server.url + "/metrics", headers=h).text.startswith("# HELP")
    assert httpx.get(server.url + "/openapi.json", headers=h).json()["info"]["title"] == "gptforge serve"
    r = httpx.post(server.url + "/v1/nothing", headers=h)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    server.assert_clean_log()


def _bad(server, path: str, body, param, status=400, raw: str | None = None):
    r = httpx.post(server.url + path, headers={**server.headers(), "Content-Type": "application/json"},
                   content=raw if raw is not None else json.dumps(body), timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


OUT_OF_RANGE = [
    ("temperature", 1e-300), ("temperature", -1), ("temperature", 2.5), ("temperature", "NaN"),
    ("temperature", "Infinity"), ("top_p", 0), ("top_p", 1.5), ("top_p", "NaN"), ("top_k", -2), ("top_k", 1.5),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 0), ("repetition_penalty", -1),
    ("repetition_penalty", 1e300), ("repetition_penalty", "Infinity"), ("seed", 2**64), ("seed", 2**63),
    ("seed", -1), ("seed", 1e30), ("n", 0), ("n", 17), ("max_tokens", 0), ("max_tokens", 10**30),
    ("logprobs", 21), ("logprobs", -1), ("presence_penalty", 0.5), ("presence_penalty", "NaN"),
    ("frequency_penalty", -2), ("best_of", 3),
]


@pytest.mark.parametrize("key,value", OUT_OF_RANGE, ids=[f"{k}={v}" for k, v in OUT_OF_RANGE])
def test_each_out_of_range_sampling_parameter_is_a_400_naming_it(server, key, value):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, key: value}
    raw = json.dumps(body).replace(f'"{value}"', str(value)) if isinstance(value, str) else None
    err = _bad(server, "/v1/completions", body, None if key == "best_of" else key, raw=raw)
    assert key in err["message"]
    if key not in ("n", "max_tokens", "logprobs", "best_of", "presence_penalty", "frequency_penalty"):
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, key: value}
        raw = json.dumps(chat).replace(f'"{value}"', str(value)) if isinstance(value, str) else None
        _bad(server, "/v1/chat/completions", chat, key, raw=raw)
    server.assert_clean_log()


def test_the_edges_of_the_ranges_are_served(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = c.completions.create(model="tiny", prompt="Hi", max_tokens=4, n=2, seed=2**63 - 1, temperature=0.01,
                             top_p=1e-9, extra_body={"repetition_penalty": 100, "top_k": -1})
    assert len(r.choices) == 2 and all(ch.finish_reason in ("stop", "length") for ch in r.choices)
    r = c.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=2, seed=0,
                             extra_body={"repetition_penalty": 0.01})
    assert r.choices[0].finish_reason in ("stop", "length")
    server.assert_clean_log()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "\\ud800abc"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "bad \\udfff"]}, "prompt.1"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["\\ud83d"]}, "stop.0"),
    ("/v1/completions", {"prompt": "Hi", "user": "\\udc00"}, "user"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]},
     "messages.0.content.0.text"),
])
def test_lone_surrogates_are_a_400(server, path, body, param):
    # json.dumps would escape the backslash: write the escape itself, as a client's JSON has it.
    raw = json.dumps({"model": "tiny", "max_tokens": 4, **body}).replace("\\\\u", "\\u")
    err = _bad(server, path, None, param, raw=raw)
    assert "surrogate" in err["message"]
    ok = json.dumps({"model": "tiny", "max_tokens": 2, "prompt": "\\ud83d\\ude00 paired is fine"}).replace("\\\\u", "\\u")
    r = httpx.post(server.url + "/v1/completions", headers={**server.headers(), "Content-Type": "application/json"},
                   content=ok, timeout=30)
    assert r.status_code == 200, r.text
    server.assert_clean_log()


@pytest.mark.parametrize("raw,needle", [
    ('{"model": "tiny", "prompt": "Hi",', "not valid JSON"),
    ('{"model": "tiny", "prompt": "Hi"} trailing', "not valid JSON"),
    ("[1, 2]", "valid dictionary"),
    ("", "Field required"),
])
def test_malformed_json_is_a_named_400(server, raw, needle):
    err = _bad(server, "/v1/completions", None, None, raw=raw)
    assert needle in err["message"] and err["param"] != "1"
    server.assert_clean_log()


def test_a_50_mb_body_gets_413_within_a_second_while_health_answers(server):
    body = b'{"model": "tiny", "prompt": "' + b"a" * (50 << 20) + b'"}'
    done = {}
    t = threading.Thread(target=lambda: done.update(zip(("data", "seconds", "sent"),
                                                        upload(server.url, server.headers(), body), strict=True)))
    t.start()
    health = []
    while t.is_alive() or not health:
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        health.append(time.monotonic() - t0)
    t.join(30)
    assert done["data"].startswith(b"HTTP/1.1 413 ") and done["seconds"] < 1.0, done
    assert done["sent"] < len(body)  # answered before the body was read
    assert max(health) < 1.0, health
    print(f"50 MB body: 413 after {done['seconds'] * 1000:.0f} ms, {done['sent'] >> 20} MiB sent; "
          f"{len(health)} /health calls meanwhile, slowest {max(health) * 1000:.0f} ms")
    # The same through httpx (which sends the whole body before it reads), and a chunked body
    # (no Content-Length), counted as it arrives.
    r = httpx.post(server.url + "/v1/completions", headers=server.headers(), content=body, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(50):
            yield b"a" * (1 << 20)
        yield b'"}'

    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", headers=server.headers(), content=chunks(), timeout=30)
    assert r.status_code == 413 and time.monotonic() - t0 < 5
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    server.assert_clean_log()


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(server):
    """5 MB fits the body limit but no 256-position context: 400 at once, not minutes of BPE."""
    for path, body in (("/v1/completions", {"prompt": "word " * (1 << 20)}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * (1 << 20)}]})):
        t0 = time.monotonic()
        err = _bad(server, path, {"model": "tiny", "max_tokens": 4, **body},
                   "prompt" if "prompt" in body else "messages")
        seconds = time.monotonic() - t0
        assert err["code"] == "context_length_exceeded" and seconds < 2
        print(f"5 MB {path} prompt: 400 after {seconds * 1000:.0f} ms")
    assert httpx.get(server.url + "/health").status_code == 200
    server.assert_clean_log()


def test_6000_distinct_paths_add_no_memory_and_no_metrics_series(server):
    h = server.headers()
    storm(server.url, [f"/warm/{i}" for i in range(300)], h)  # first-use allocations
    rss0, size0 = server.rss_mb(), len(httpx.get(server.url + "/metrics", headers=h).content)
    t0 = time.monotonic()
    assert set(storm(server.url, [f"/x{i}/{os.urandom(8).hex()}" for i in range(5000)], h)) == {404}
    assert set(storm(server.url, [f"/v1/y{i}" for i in range(1000)], {})) == {401}  # no key
    seconds = time.monotonic() - t0
    rss1, text = server.rss_mb(), httpx.get(server.url + "/metrics", headers=h).text
    assert rss1 - rss0 < 20, (rss0, rss1)
    assert len(text.encode()) - size0 < 10_000, (size0, len(text))
    assert 'endpoint="other",status="404"' in text and 'endpoint="other",status="401"' in text
    assert "/x1/" not in text and "/v1/y1" not in text
    print(f"6000 paths in {seconds:.1f} s; RSS {rss0:.1f} -> {rss1:.1f} MB; /metrics {size0} -> {len(text)} bytes")
    server.assert_clean_log()


def test_empty_api_keys_are_refused_at_start(run_cli, ckpt, monkeypatch):
    code, _, err = run_cli("serve", "--ckpt", ckpt, "--api-key", "")
    assert code == 2 and "--api-key is empty" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("GPTFORGE_API_KEY", "  ")
    code, _, err = run_cli("serve", "--ckpt", ckpt)
    assert code == 2 and "GPTFORGE_API_KEY is empty" in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


@pytest.mark.parametrize("override,key", [
    ("Generation.temperature=1e-300", "Generation.temperature"),
    ("Generation.temperature=nan", "Generation.temperature"),
    ("Generation.repetition_penalty=1e-300", "Generation.repetition_penalty"),
    ("Generation.repetition_penalty=inf", "Generation.repetition_penalty"),
    ("Generation.top_p=nan", "Generation.top_p"),
    ("Generation.seed=18446744073709551616", "Generation.seed"),
    ("Generation.length_penalty=nan", "Generation.length_penalty"),
])
@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_generation_overrides_out_of_range_are_one_line(run_cli, ckpt, override, key, verb):
    extra = ["--prompt", "Hi"] if verb == "generate" else []
    code, _, err = run_cli(verb, "--ckpt", ckpt, *extra, "-o", override)
    assert code == 2 and err.strip().startswith("gptforge") and key in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_generate_check_config_uses_the_same_ranges():
    from gptforge.config.sampling import sampling_error
    from gptforge.errors import ConfigError
    from gptforge.generate import check_config

    for key, value in (("temperature", 1e-300), ("repetition_penalty", 1e300), ("seed", 2**64), ("top_k", -1)):
        assert sampling_error(key, value)
        with pytest.raises(ConfigError, match=f"Generation.{key}"):
            check_config(GenerationConfig(**{key: value}))
    check_config(GenerationConfig(temperature=0.01, repetition_penalty=100, seed=2**63 - 1))
