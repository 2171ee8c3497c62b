"""Chat templates: our rendering and token ids equal transformers' `apply_chat_template`, and the
learned-token mask equals its `return_assistant_tokens_mask` (assistant tokens + EOS)."""

from __future__ import annotations

import json

import pytest

from gptforge.data.chat_template import DEFAULT_TEMPLATE, ChatTemplate, template_for
from gptforge.data.tokenizer import gpt2_tokenizer, load_tokenizer
from gptforge.errors import ConfigError, DataError

transformers = pytest.importorskip("transformers")

# ChatML with the end-of-turn marker and EOS learned; the tagged twin marks the same text with
# {% generation %} so transformers reports which tokens are the assistant's.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{{ m['content'] + '<|im_end|>' + eos_token }}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_TAGGED = CHATML.replace("{{ m['content'] + '<|im_end|>' + eos_token }}",
                               "{% generation %}{{ m['content'] + '<|im_end|>' + eos_token }}{% endgeneration %}")

SINGLE = [{"role": "user", "content": "Reverse the word 'stone'."},
          {"role": "assistant", "content": "enots"}]
MULTI = [{"role": "system", "content": "You answer in one word."},
         {"role": "user", "content": "Sort the digits 4 1 3."},
         {"role": "assistant", "content": "1 3 4"},
         {"role": "user", "content": "What is 12 + 30?"},
         {"role": "assistant", "content": "42"}]


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    gpt2_tokenizer().save(d)
    return transformers.AutoTokenizer.from_pretrained(str(d))


def _hf(hf_tok, template, messages, **kw):
    return hf_tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True, **kw)


@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "multi_system"])
@pytest.mark.parametrize("template,reference", [(DEFAULT_TEMPLATE, DEFAULT_TEMPLATE), (CHATML, CHATML_TAGGED)],
                         ids=["default", "chatml"])
def test_ids_and_mask_equal_transformers(hf_tok, messages, template, reference):
    tok = gpt2_tokenizer()
    ours = ChatTemplate(template).encode(tok, messages)
    ref = _hf(hf_tok, reference, messages, return_assistant_tokens_mask=True)
    assert ours.ids == list(ref["input_ids"])
    assert tok.eos_token_id in ours.ids
    assert ours.mask == list(ref["assistant_masks"])
    # exactly the assistant text + EOS: decoding the masked tokens gives the answers back
    learned = tok.decode([i for i, m in zip(ours.ids, ours.mask, strict=True) if m])
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert all(a in learned for a in answers)
    unmasked = tok.decode([i for i, m in zip(ours.ids, ours.mask, strict=True) if not m])
    assert not any(a in unmasked for a in answers if len(a) > 2) and "<|endoftext|>" not in unmasked
    assert learned.count("<|endoftext|>") == len(answers)


@pytest.mark.parametrize("template", [DEFAULT_TEMPLATE, CHATML])
def test_generation_prompt_equals_transformers(hf_tok, template):
    tok = gpt2_tokenizer()
    prompt = MULTI[:4]
    assert ChatTemplate(template).prompt_ids(tok, prompt) == \
        list(_hf(hf_tok, template, prompt, add_generation_prompt=True)["input_ids"])


def test_train_on_inputs_learns_everything():
    enc = ChatTemplate().encode(gpt2_tokenizer(), MULTI, train_on_inputs=True)
    assert all(enc.mask) and len(enc.mask) == len(enc.ids)


def test_eos_appended_when_the_template_has_none():
    plain = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")
    tok = gpt2_tokenizer()
    enc = ChatTemplate(plain).encode(tok, SINGLE)
    assert enc.ids[-1] == tok.eos_token_id and enc.mask[-1] == 1
    assert tok.decode([i for i, m in zip(enc.ids, enc.mask, strict=True) if m]) == " enots<|endoftext|>"


def test_template_from_tokenizer_config_and_saved_with_the_tokenizer(tmp_path):
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": CHATML}))
    assert ChatTemplate.from_file(cfg).source == CHATML
    (tmp_path / "t.jinja").write_text(CHATML)
    assert ChatTemplate.from_file(tmp_path / "t.jinja").source == CHATML
    # a tokenizer carrying a template writes it into tokenizer_config.json and reads it back
    tok = load_tokenizer("gpt2")
    d = tmp_path / "model"
    tok.with_chat_template(CHATML).save(d)
    assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    back = load_tokenizer(None, d)
    assert back.chat_template == CHATML and template_for(back).source == CHATML
    assert transformers.AutoTokenizer.from_pretrained(str(d)).chat_template == CHATML
    assert gpt2_tokenizer().chat_template is None  # the shared cached tokenizer is untouched


def test_template_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="bad.jinja: not a valid Jinja"):
        ChatTemplate.from_file(bad)
    with pytest.raises(ConfigError, match="not found"):
        ChatTemplate.from_file(tmp_path / "missing.jinja")
    with pytest.raises(DataError, match="unknown role"):
        ChatTemplate().render([{"role": "tool", "content": "x"}])
    raising = "{{ raise_exception('system messages are not supported') }}"
    with pytest.raises(DataError, match="not supported"):
        ChatTemplate(raising).render(SINGLE)
