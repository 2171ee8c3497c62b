"""Several LoRA/DoRA adapters served by name over one base in one continuous batch
(adapters.multi, `gptforge serve --adapter NAME=DIR`): each served request equals
`gptforge generate --adapter DIR` run alone, bit for bit, while the batch mixes adapters; the
routed layers equal peft's (mixed-batch `adapter_names` for LoRA, one adapter at a time for
DoRA) within 1e-5; /v1/models, unknown models and startup errors."""

from __future__ import annotations

import asyncio
import copy
import warnings

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from gptforge.adapters import apply_lora  # noqa: E402
from gptforge.adapters.multi import MultiLoraLinear, serve_adapters  # noqa: E402
from gptforge.adapters.peft_format import save_adapter  # noqa: E402
from gptforge.config.schema import LoraConfig  # noqa: E402
from gptforge.data.tokenizer import gpt2_tokenizer  # noqa: E402
from gptforge.model_io import load_model  # noqa: E402
from lora_support import _hf, _model, _randomize  # noqa: E402
from serve_support import make_ckpt, serving, throttled  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# A: LoRA on q/v slices and the FFN; B: DoRA over the fused QKV and out_proj.
SPECS = {"A": (["q", "v", "linear1", "linear2"], False, 1), "B": (["qkv", "out_proj"], True, 2)}
PROMPTS = {None: ["The cat sat on", "Once upon a time there was"], "A": ["The cat sat on", "Hello"],
           "B": ["The cat sat on", "import os"]}
MAX_TOKENS = 10


def _make_adapter(base, out, targets, dora, seed):
    m = copy.deepcopy(base)
    apply_lora(m, LoraConfig(r=4, alpha=8, dora=dora, targets=targets))
    torch.manual_seed(seed)
    _randomize(m)  # non-zero B (and DoRA magnitudes off the row norms): the adapter changes the output
    save_adapter(m, out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    ckpt = make_ckpt(root / "model")
    base, _ = load_model(ckpt)
    return ckpt, {name: _make_adapter(base, root / name, *spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def refs(dirs):
    """(token ids, text) of each prompt decoded alone, greedy, as `gptforge generate [--adapter DIR]`
    does it (the verb's loader and `generate`; one CLI run below checks they are the verb's)."""
    from gptforge.config.schema import GenerationConfig
    from gptforge.generate import generate
    from gptforge.generate.loader import load_runnable

    ckpt, adapters = dirs
    g = GenerationConfig(max_dec_len=MAX_TOKENS, decode_strategy="greedy_search")
    out = {}
    for name, prompts in PROMPTS.items():
        model, _, tok = load_runnable(ckpt, adapter=adapters[name] if name else None)
        for prompt in prompts:
            r = generate(model, tok, [prompt], g)
            out[name, prompt] = (r.token_ids[0][0], r.texts[0][0])
        # the packed low-rank products (batch invariance) are undone with the backend
        assert not any("low_rank" in m.__dict__ or "forward" in m.__dict__ for m in model.modules())
    return out


def test_the_references_are_what_generate_with_the_adapter_prints(dirs, refs, run_cli):
    ckpt, adapters = dirs
    code, out, err = run_cli("generate", "--ckpt", ckpt, "--adapter", adapters["A"], "--prompt", "Hello",
                             "-o", f"Generation.max_dec_len={MAX_TOKENS}", "-o", "Generation.decode_strategy=greedy_search",
                             "--no-stream")
    assert code == 0, err
    assert out == "Hello" + refs["A", "Hello"][1] + "\n"


@pytest.fixture(scope="module")
def server(dirs):
    ckpt, adapters = dirs
    model, cfg = load_model(ckpt)
    serve_adapters(model, list(adapters.items()))
    with serving(model, gpt2_tokenizer(), cfg.Generation, model_name="base", max_batch_size=16) as s:
        yield s


def test_a_mixed_batch_of_adapters_and_the_base_equals_each_generate_alone(server, refs):
    tok = gpt2_tokenizer()
    assert refs["A", "The cat sat on"] != refs[None, "The cat sat on"] != refs["B", "The cat sat on"]
    mixes: list[list] = []
    slots = server.state.engine.slots
    inner = slots.step

    def spy(segments):
        mixes.append([s.adapter for s in segments])
        return inner(segments)

    jobs = [(name, p) for name, prompts in PROMPTS.items() for p in prompts]

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*[c.completions.create(model=name or "base", prompt=p, max_tokens=MAX_TOKENS,
                                                               temperature=0, logprobs=0) for name, p in jobs])
        finally:
            await c.close()

    slots.step = spy
    try:
        with throttled(server.state, 0.01):  # all six arrive while the first ones still run
            out = asyncio.run(main())
    finally:
        slots.step = inner
    for (name, prompt), r in zip(jobs, out, strict=True):
        ids, text = refs[name, prompt]
        assert r.model == (name or "base")
        assert r.choices[0].text == text, (name, prompt)
        assert [tok.encode(t) for t in r.choices[0].logprobs.tokens] == [[i] for i in ids]  # the same ids
    # The engine really mixed them: one step held the base and both adapters, two rows of A among them.
    full = [m for m in mixes if {None, "A", "B"} <= set(m) and m.count("A") >= 2]
    assert full, mixes[:5]


def test_models_lists_the_adapters_unknown_models_are_404_and_metrics_count_each(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    listed = {m.id: m.model_extra.get("parent") for m in c.models.list().data}
    assert listed == {"base": None, "A": "base", "B": "base"}
    r = c.chat.completions.create(model="B", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                  temperature=0)
    assert r.model == "B"
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="C", prompt="Hi", max_tokens=2)
    body = e.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert all(f"`{m}`" in body["message"] for m in ("C", "base", "A", "B"))
    text = httpx.get(server.url + "/metrics").text
    assert 'gptforge_model_requests_total{model="B"}' in text


# ----------------------------------------------------------------------- against peft


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("kinds", [(False, False), (False, True)], ids=["lora+lora", "lora+dora"])
def test_routed_rows_equal_peft_for_each_row_group(tmp_path, kinds, quiet):
    """Three sequences in one forward pass: rows of A, rows of B, rows of the base. LoRA+LoRA
    against peft's own mixed batch (`adapter_names`); with DoRA (which peft does not mix) each
    row group against peft with that adapter active."""
    peft = pytest.importorskip("peft")
    base, _ = _model()
    hf = _hf(base, tmp_path / "hf")
    targets = {"A": ["q", "v", "linear1"], "B": ["qkv", "out_proj", "linear2"]}
    dirs = {n: _make_adapter(base, tmp_path / n, targets[n], dora, seed)
            for (n, dora), seed in zip(zip(("A", "B"), kinds, strict=True), (3, 4), strict=True)}
    theirs = peft.PeftModel.from_pretrained(hf, str(dirs["A"]), adapter_name="A")
    theirs.load_adapter(str(dirs["B"]), adapter_name="B")
    theirs.eval()
    ours = copy.deepcopy(base)
    router = serve_adapters(ours, list(dirs.items()))
    assert isinstance(ours.blocks[0].attn.qkv_proj, MultiLoraLinear)
    ids = torch.randint(0, 512, (3, 9), generator=torch.Generator().manual_seed(7))
    T = ids.shape[1]
    with torch.no_grad(), router.route({"A": range(0, T), "B": range(T, 2 * T)}):
        got = ours(ids).logits
        plain = base(ids).logits
    with torch.no_grad():
        if not any(kinds):
            want = theirs(input_ids=ids, adapter_names=["A", "B", "__base__"]).logits
        else:
            want = torch.empty_like(got)
            for row, name in enumerate(("A", "B")):
                theirs.set_adapter(name)
                want[row] = theirs(input_ids=ids[row:row + 1]).logits[0]
            with theirs.disable_adapter():
                want[2] = theirs(input_ids=ids[2:]).logits[0]
    for row in (0, 1):
        assert (got[row] - plain[row]).abs().max() > 1e-2  # each adapter changes its rows
    assert torch.equal(got[2], plain[2])  # the base's rows are the base's, exactly
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- the CLI


def _tamper(src, dst, edit):
    """A copy of adapter directory `src` whose tensors `edit(dict)` changed."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(str(dst / "adapter_model.safetensors"))
    edit(t)
    save_file(t, str(dst / "adapter_model.safetensors"))
    return dst


def _rename_block(t):
    for k in [k for k in t if ".h.0." in k]:  # every tensor of block 0 now targets a block 9
        t[k.replace(".h.0.", ".h.9.")] = t.pop(k)


def _widen_a(t):
    k = next(k for k in t if k.endswith("lora_A.weight"))
    t[k] = torch.zeros(t[k].shape[0], t[k].shape[1] + 1)


@pytest.mark.parametrize("case,needle", [
    ("missing", "adapter directory not found"),
    ("shape", "do not fit a layer"),
    ("nothing", "beyond the model's"),
    ("head", "head (lm_head)"),
    ("twice", "given twice"),
    ("base-name", "base model's name"),
    ("onnx", "--backend torch"),
])
def test_startup_errors_are_one_line(run_cli, dirs, tmp_path, case, needle):
    ckpt, adapters = dirs
    a = adapters["A"]
    extra = []
    if case == "missing":
        spec = [f"x={tmp_path / 'nope'}"]
    elif case == "shape":
        spec = [f"x={_tamper(a, tmp_path / 'w', _widen_a)}"]
    elif case == "nothing":
        spec = [f"x={_tamper(a, tmp_path / 'n', _rename_block)}"]
    elif case == "head":
        base, _ = load_model(ckpt)
        spec = [f"h={_make_adapter(base, tmp_path / 'h', ['head'], False, 5)}"]
    elif case == "twice":
        spec = [f"x={a}", f"x={adapters['B']}"]
    elif case == "base-name":
        spec = [f"model={a}"]
    else:
        spec, extra = [f"x={a}"], ["--backend", "onnx"]
    argv = ["serve", "--ckpt", ckpt, "--port", "0", *extra]
    for s in spec:
        argv += ["--adapter", s]
    code, _, err = run_cli(*argv)
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_bare_adapter_dir_is_named_after_it(dirs):
    from gptforge.commands.serve import parse_adapters

    _, adapters = dirs
    assert parse_adapters([str(adapters["A"]), f"sql={adapters['B']}"], "base") == [
        ("A", str(adapters["A"])), ("sql", str(adapters["B"]))]
