"""`gptforge generate --chat` / `--messages FILE` and `generate.generate_chat`: the prompt is the
chat template's rendering (ids equal transformers' `apply_chat_template`), the greedy answer is
the one `gptforge chat` and serve's /v1/chat/completions give for the same conversation, answers
end at the template's stop strings, `--adapter` brings its weights and its saved template, and a
bad record is one line naming file:line and the field."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from gptforge.config.schema import GenerationConfig
from gptforge.data.chat_template import ChatTemplate, template_for
from gptforge.data.tokenizer import gpt2_tokenizer
from gptforge.errors import ConfigError
from gptforge.generate import generate, generate_chat, stream
from gptforge.model_io import load_model
from test_chat import PLAIN, session
from test_sft_template import CHATML, MULTI, _hf, hf_tok  # noqa: F401 - hf_tok is a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = ["-o", "Generation.decode_strategy=greedy_search"]
SYSTEM = {"role": "system", "content": "Be brief."}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from gf_testutil import spread_gpt2_vocab_dir

    return spread_gpt2_vocab_dir(tmp_path_factory.mktemp("gchat") / "model")


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt)[0]


def _jsonl(path, *convs):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return path


def _results(path) -> list[dict]:
    return json.loads(path.read_text())["results"]


@pytest.mark.parametrize("source", [None, CHATML], ids=["default", "chatml"])
def test_prompt_ids_equal_transformers(run_cli, ckpt, model, hf_tok, tmp_path, source):  # noqa: F811
    conv = MULTI[:4]  # a system message, a user turn, an answer, and the user turn to answer
    extra = []
    if source:
        (tmp_path / "t.jinja").write_text(source)
        extra = ["--chat-template", tmp_path / "t.jinja"]
    code, _, err = run_cli("generate", "--ckpt", ckpt, "--messages", _jsonl(tmp_path / "c.jsonl", conv, conv[:2]),
                           "--max-new-tokens", 4, *GREEDY, "--out", tmp_path / "o.json", *extra)
    assert code == 0, err
    items = _results(tmp_path / "o.json")
    tok = gpt2_tokenizer()
    for item, msgs in zip(items, (conv, conv[:2]), strict=True):
        ref = list(_hf(hf_tok, source or ChatTemplate().source, msgs, add_generation_prompt=True)["input_ids"])
        assert tok.encode(item["prompt"]) == ref and item["prompt_tokens"] == len(ref)
        assert item["messages"] == msgs
    res = generate_chat(model, tok, conv, GenerationConfig(decode_strategy="greedy_search", max_dec_len=4),
                        template=ChatTemplate(source))
    assert res.prompts == [items[0]["prompt"]] and res.token_ids[0][0] == items[0]["completions"][0]["token_ids"]


def test_greedy_answers_equal_chat_and_serve(run_cli, ckpt, model, tmp_path):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from serve_support import serving

    convs = [[SYSTEM, *MULTI[1:4]], [SYSTEM, {"role": "user", "content": "Hello there"}]]
    replies = []
    for conv in convs:  # gptforge chat's session, one conversation at a time
        s = session(model, ChatTemplate(), 12, system=SYSTEM["content"])
        s.history = conv[1:-1]
        replies.append(s.reply(conv[-1]["content"], lambda _: None))
    code, out, err = run_cli("generate", "--ckpt", ckpt, "--messages", _jsonl(tmp_path / "c.jsonl", *convs),
                             "--max-new-tokens", 12, *GREEDY, "--out", tmp_path / "o.json")
    assert code == 0, err
    items = _results(tmp_path / "o.json")  # two conversations decoded in one continuous batch
    assert [i["completions"][0]["text"].strip() for i in items] == [r.text for r in replies]
    assert [i["prompt_tokens"] for i in items] == [r.prompt_tokens for r in replies]
    assert out.splitlines()[1::2] == [r.text for r in replies]  # a header, then the answer alone
    # one user turn from --prompt and --system, streamed: the answer alone, as chat prints it
    code, out, err = run_cli("generate", "--ckpt", ckpt, "--chat", "--prompt", "Hello there", "--system",
                             SYSTEM["content"], "--max-new-tokens", 12, *GREEDY)
    assert code == 0, err
    assert out == replies[1].text + "\n"
    with serving(model, gpt2_tokenizer(), GenerationConfig()) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": convs[0], "max_tokens": 12, "temperature": 0}).json()
    assert r["choices"][0]["message"]["content"].strip() == replies[0].text
    assert r["usage"]["prompt_tokens"] == items[0]["prompt_tokens"]


def test_stop_strings_end_answers_in_a_batch(model):
    tok, cfg = gpt2_tokenizer(), GenerationConfig(decode_strategy="greedy_search", max_dec_len=24)
    prompts = ["Hello there", "The cat sat on"]
    full = generate(model, tok, prompts, cfg)
    text = full.texts[0][0]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and stop not in full.texts[1][0]
    res = generate(model, tok, prompts, cfg, stop=[stop])
    assert res.texts[0][0] == text.split(stop)[0] == "".join(stream(model, tok, prompts[0], cfg, stop=[stop]))
    assert res.finish_reasons == [["stop"], [full.finish_reasons[1][0]]]
    assert res.texts[1] == full.texts[1] and res.token_ids[1] == full.token_ids[1]
    assert res.token_ids[0][0] == full.token_ids[0][0][:len(res.token_ids[0][0])]  # the stop's tokens counted
    with pytest.raises(ConfigError, match="beam search ranks whole hypotheses"):
        generate(model, tok, prompts, GenerationConfig(decode_strategy="beam_search", num_beams=2), stop=[stop])


def test_adapter_brings_its_weights_and_its_template(run_cli, ckpt, model, tmp_path):
    from gptforge.adapters import apply_lora
    from gptforge.adapters.peft_format import save_adapter
    from gptforge.config.schema import LoraConfig
    from gptforge.generate.loader import load_runnable
    from lora_support import _randomize

    m = copy.deepcopy(model)
    apply_lora(m, LoraConfig(r=4, alpha=8, targets=["qkv", "linear1"]))
    torch.manual_seed(3)
    _randomize(m)
    adapter = save_adapter(m, tmp_path / "adapter")
    gpt2_tokenizer().with_chat_template(PLAIN).save(adapter)  # as `sft` saves the template it tuned on
    code, out, err = run_cli("generate", "--ckpt", ckpt, "--adapter", adapter, "--chat", "--prompt", "Hi",
                             "--max-new-tokens", 8, *GREEDY, "--out", tmp_path / "o.json")
    assert code == 0, err
    item = _results(tmp_path / "o.json")[0]
    assert item["prompt"] == "user: Hi\nassistant:"  # the adapter's template, not the model's default
    tuned, _, tok = load_runnable(ckpt, adapter=adapter)
    want = session(tuned, template_for(tok, adapter=adapter), 8).reply("Hi", lambda _: None).text
    base = session(model, ChatTemplate(PLAIN), 8).reply("Hi", lambda _: None).text
    assert out == want + "\n" and want != base


def test_bad_records_and_refusals_are_one_line(run_cli, ckpt, tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "Hi"}]})
    cases = {
        '{"messages": [{"role": "bot", "content": "x"}]}': r":2: field 'messages': messages\[0\]\.role is 'bot'",
        '{"messages": [{"role": "user", "content": 3}]}': r":2: field 'messages': messages\[0\]\.content must be",
        '{"messages": []}': r":2: field 'messages': 'messages' must be a non-empty list",
        '{"prompt": "Hi"}': r":2: field 'messages' is missing",
        '{"messages": [': r":2: not valid JSON",
        '["Hi"]': r":2: a record must be a JSON object",
    }
    f = tmp_path / "c.jsonl"
    for line, pattern in cases.items():
        f.write_text(good + "\n" + line + "\n")
        code, _, err = run_cli("generate", "--ckpt", ckpt, "--messages", f)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert str(f) in err and __import__("re").search(pattern, err), err
    refusals = [
        (["--prompt", "x", "--system", "s"], "--system needs --chat"),
        (["--prompt", "x", "--chat-template", tmp_path / "t.jinja"], "--chat-template needs --chat"),
        (["--chat"], "--chat: give a user message"),
        (["--chat", "--prompt", "x", "-o", "Generation.decode_strategy=beam_search"], "beam search cannot apply"),
        (["--chat", "--prompt", "x", "--truncate-prompt"], "--truncate-prompt would cut"),
        (["--chat", "--prompt", "x", "--chat-template", tmp_path / "none.jinja"], "none.jinja: file not found"),
        (["--messages", tmp_path / "none.jsonl"], "none.jsonl"),
    ]
    for args, msg in refusals:
        code, _, err = run_cli("generate", "--ckpt", ckpt, *args)
        assert code == 2 and msg in err and "Traceback" not in err, (args, err)
