"""Offline evaluation: LAMBADA and WikiText against independent computations on HF transformers.

Data is generated here; the model is a random-init tiny GPT with GPT-2's tokenizer. A random
model with a tied head tends to predict the token it just saw, so passages whose last word
repeats the previous (single-token) word are scored correct: the data mixes right and wrong
examples and every comparison can fail.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from gf_testutil import tiny_model
from gptforge.data.tokenizer import gpt2_tokenizer
from gptforge.errors import ConfigError, DataError
from gptforge.evaluate import evaluate_lambada, evaluate_wikitext, split_passage, wikitext_detokenize
from gptforge.evaluate.common import reference_aggregate
from gptforge.evaluate.wikitext import window_plan
from gptforge.model_io import save_hf_dir, save_model_dir

SOURCE = (
    "The lighthouse keeper climbed the spiral stairs every evening before sunset. He carried a small "
    "brass lantern, a notebook full of weather observations, and a thermos of strong black coffee. "
    "From the gallery he could see the fishing boats returning to the harbour, their sails folded "
    "like tired wings. On clear nights the beam swept across the water for twenty miles, and sailors "
    "who had never met him trusted their lives to his patience. In winter the storms arrived without "
    "warning, hammering the windows with salt and sleet, yet the old mechanism kept turning. His "
    "daughter Margarethe wrote letters from the university in the capital, describing lectures on "
    "astronomy, chemistry and ancient navigation. She promised to visit when the examinations were "
    "finished, bringing books, oranges and a new telescope for the observatory."
)

WIKI = (
    " \n = Valkyria Chronicles III = \n \n"
    " Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese : 戦場のヴァルキュリア3 , lit . Valkyria "
    "of the Battlefield 3 ) , commonly referred to as Valkyria Chronicles III outside Japan , is a "
    "tactical role @-@ playing video game developed by Sega and Media.Vision for the PlayStation "
    "Portable . Released in January 2011 in Japan , it is the third game in the Valkyria series . \n \n"
    " = = Gameplay = = \n \n"
    " As with previous games , the game 's battles cost 1 @,@ 000 points and 3 @.@ 5 hours at 20 ° C ; "
    "the players ' units \" move \" [ quickly ] { or not } ! Is it N years ? Yes ' indeed ' . \n \n"
    " = = = Reception = = = \n \n"
    " The game was praised by critics , who noted its story , its characters and its music . "
    "Sales reached 102 @,@ 779 copies in the first week , placing it second on the charts . \n"
)


def make_lambada(path, n: int = 40, seed: int = 0) -> None:
    """LAMBADA-format jsonl: passages of SOURCE's words; every other one repeats its last word."""
    words = SOURCE.split()
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            start = rng.randrange(len(words) - 35)
            ws = words[start:start + rng.randint(6, 34)]
            if i % 2 == 0:
                ws.append(ws[-1])
            f.write(json.dumps({"text": " ".join(ws)}) + "\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model, tokenizer, our dir, HF dir, lambada jsonl, wikitext file)."""
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("eval")
    model, cfg = tiny_model("Model.vocab_size=50304", "Model.hidden_size=128")
    tok = gpt2_tokenizer()
    save_model_dir(model, cfg, d / "ours", tokenizer=tok)
    save_hf_dir(model, cfg, d / "hf", tokenizer=tok)
    make_lambada(d / "lambada.jsonl")
    (d / "wiki.txt").write_text(WIKI, encoding="utf-8")
    return model, tok, d / "ours", d / "hf", d / "lambada.jsonl", d / "wiki.txt"


@pytest.fixture(scope="module")
def hf_model(setup):
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel.from_pretrained(setup[3]).eval()


# ----------------------------------------------------------------------------- LAMBADA


def test_split_rule():
    assert split_passage("the cat saw the cat") == ("the cat saw the", " cat")
    assert split_passage("  a  b \n c. ") == ("a  b", " c.")
    assert split_passage("alone") == ("", " alone")


# Passages with a newline before the last word (as 7 of the OpenAI test file's), with and
# without a space before the newline, and one with trailing whitespace.
NEWLINE_PASSAGES = [
    "He carried a small brass lantern and a notebook.\nnotebook",
    "The beam swept across the water for twenty \nmiles",
    "She promised to visit when the examinations were finished ",
]


def test_split_rules_differ_only_on_whitespace_before_the_last_word():
    text = NEWLINE_PASSAGES[0]
    assert split_passage(text) == ("He carried a small brass lantern and a notebook.", " notebook")
    assert split_passage(text, "lm_eval") == ("He carried a small brass lantern and a", " notebook.\nnotebook")
    assert split_passage(NEWLINE_PASSAGES[1], "lm_eval") == ("The beam swept across the water for twenty", " \nmiles")
    assert split_passage(NEWLINE_PASSAGES[2], "lm_eval") == (NEWLINE_PASSAGES[2][:-1], " ")
    plain = "the cat saw the cat"
    assert split_passage(plain, "lm_eval") == split_passage(plain)
    with pytest.raises(ValueError, match="lm_evaluation"):
        split_passage(plain, "lm_evaluation")


def test_lambada_split_rules_score_their_own_targets(setup, hf_model, tmp_path):
    """Both rules on passages with a newline before the last word, against straightforward HF
    scoring of each rule's (context, target) ids; on plain passages the rules agree."""
    model, tok, _, _, path, _ = setup
    f = tmp_path / "nl.jsonl"
    f.write_text(path.read_text() + "".join(json.dumps({"text": t}) + "\n" for t in NEWLINE_PASSAGES))
    from gptforge.evaluate.lambada import encode_examples, read_lambada

    res = {r: evaluate_lambada(model, tok, f, batch_size=8, split_rule=r) for r in ("reference", "lm_eval")}
    ref, lme = res["reference"]["examples"], res["lm_eval"]["examples"]
    n_plain = len(ref) - len(NEWLINE_PASSAGES)
    assert [e["target"] for e in ref[n_plain:]] == [" notebook", " miles", " finished"]
    assert [e["target"] for e in lme[n_plain:]] == [" notebook.\nnotebook", " \nmiles", " "]
    for a, b in zip(ref[:n_plain], lme[:n_plain], strict=True):
        assert a["correct"] == b["correct"] and a["target_logprob"] == pytest.approx(b["target_logprob"], abs=1e-5)
    assert res["lm_eval"]["metrics"]["split_rule"] == "lm_eval"
    for rule, r in res.items():
        examples = r["examples"]
        ctxs, tgts = encode_examples(tok, read_lambada(f, rule), rule)
        # the plain passages agree between the rules and test_lambada_matches_hf checks them
        for c, t, e in list(zip(ctxs, tgts, examples, strict=True))[n_plain - 2:]:
            ids = torch.tensor([c + t])
            with torch.no_grad():
                logp = F.log_softmax(hf_model(ids).logits[0, len(c) - 1:-1].double(), -1)
            assert e["correct"] == (logp.argmax(-1).tolist() == t), rule
            assert e["target_logprob"] == pytest.approx(float(sum(logp[k, x] for k, x in enumerate(t))), abs=1e-3)
    # lm-eval's tokenization of the pair: the context's trailing whitespace joins the target
    ctxs, tgts = encode_examples(tok, read_lambada(f, "lm_eval"), "lm_eval")
    assert tok.decode(tgts[-1]) == " " and tok.decode(ctxs[-1]) == NEWLINE_PASSAGES[2][:-1]


def _hf_lambada(hf, tok, path):
    """Straightforward per-example scoring with HF transformers, full logits, batch 1."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        ctx, tgt = split_passage(json.loads(line)["text"])
        c, t = tok.encode(ctx), tok.encode(tgt)
        ids = torch.tensor([c + t])
        with torch.no_grad():
            logp = F.log_softmax(hf(ids).logits[0, len(c) - 1:-1].double(), -1)
        pred = logp.argmax(-1).tolist()
        out.append((pred == t, float(sum(logp[k, x] for k, x in enumerate(t))), pred[-1] == t[-1]))
    return out


def test_lambada_matches_hf(setup, hf_model):
    model, tok, _, _, path, _ = setup
    res = evaluate_lambada(model, tok, path, batch_size=8)
    ref = _hf_lambada(hf_model, tok, path)
    got = [(e["correct"], e["target_logprob"], e["last_token_correct"]) for e in res["examples"]]
    assert [g[0] for g in got] == [r[0] for r in ref]
    assert [g[2] for g in got] == [r[2] for r in ref]
    assert max(abs(g[1] - r[1]) for g, r in zip(got, ref, strict=True)) < 1e-3
    m = res["metrics"]
    n_ok = sum(r[0] for r in ref)
    assert 0 < n_ok < len(ref), "test data must mix right and wrong examples"
    assert m["number_correct"] == n_ok and m["total_examples"] == len(ref)
    assert m["accuracy"] == n_ok / len(ref)
    assert m["target_perplexity"] == pytest.approx(math.exp(-sum(r[1] for r in ref) / len(ref)), rel=1e-4)
    assert m["last_token_accuracy"] == sum(r[2] for r in ref) / len(ref)
    assert res["final_line"] == (f"validation results on {path} | number correct: {n_ok:.4E} | "
                                 f"total examples: {len(ref):.4E} | avg accuracy: {n_ok / len(ref):.4E}")


def test_lambada_batching_is_exact(setup):
    model, tok, _, _, path, _ = setup
    runs = [evaluate_lambada(model, tok, path, batch_size=b)["examples"] for b in (1, 3, 64)]
    for r in runs[1:]:
        assert [e["correct"] for e in r] == [e["correct"] for e in runs[0]]
        assert max(abs(a["target_logprob"] - b["target_logprob"]) for a, b in zip(r, runs[0], strict=True)) < 1e-4


def test_lambada_long_context_keeps_rightmost(setup, hf_model, tmp_path):
    model, tok, *_ = setup
    text = SOURCE + " coffee coffee"
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": text}) + "\n")
    res = evaluate_lambada(model, tok, tmp_path / "long.jsonl", seq_len=32)
    ctx, tgt = split_passage(text)
    ids = (tok.encode(ctx) + tok.encode(tgt))[-33:-1]
    with torch.no_grad():
        lp = F.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].double(), -1)[tok.encode(tgt)[0]]
    assert res["metrics"]["truncated_contexts"] == 1 and res["metrics"]["window"] == 32
    assert res["examples"][0]["target_logprob"] == pytest.approx(float(lp), abs=1e-3)


def test_lambada_wrapped_model_without_hidden_states(setup):
    """Models from other areas may only offer model(ids): the full-logits path gives the same."""
    model, tok, _, _, path, _ = setup

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, ids):
            return self.inner(ids).logits

    a = evaluate_lambada(model, tok, path, batch_size=4)["examples"]
    b = evaluate_lambada(Wrapped(model), tok, path, batch_size=4)["examples"]
    assert [e["correct"] for e in a] == [e["correct"] for e in b]


def test_emulated_reference_aggregation(setup):
    # Spec §7.3: batch 0 counts logging_freq times, then whole groups of logging_freq batches; the tail drops.
    assert reference_aggregate([float(i) for i in range(1, 26)], 10) == 10 * 1 + sum(range(2, 22))
    assert reference_aggregate([3.0], 10) == 30.0
    model, tok, _, _, path, _ = setup
    res = evaluate_lambada(model, tok, path, batch_size=2, emulate_reference_aggregation=True, logging_freq=10)
    per = [e["correct"] for e in res["examples"]]
    batches = [sum(per[i:i + 2]) for i in range(0, len(per), 2)]  # 20 batches: 0, 1..10, 11..19 dropped
    assert res["reference_aggregation"]["number_correct"] == 10 * batches[0] + sum(batches[1:11])
    assert res["metrics"]["number_correct"] == sum(per)


# ---------------------------------------------------------------------------- WikiText


def test_detokenizer_matches_lm_eval():
    pre = pytest.importorskip("lm_eval.tasks.wikitext.preprocess_wikitext")
    assert wikitext_detokenize(WIKI) == pre.wikitext_detokenizer({"page": WIKI})
    assert "role-playing" in wikitext_detokenize(WIKI) and "== Gameplay ==" in wikitext_detokenize(WIKI)


def _straightforward_nll(hf, tokens, L, s):
    """Each target j is predicted from tokens[w*s : j], w = the window that scores j by definition
    (the first window scores targets 1..L, window w>0 the targets L+(w-1)s+1 .. L+ws). Targets
    with the same context start share one causal forward pass."""
    by_start: dict[int, list[int]] = {}
    for j in range(1, len(tokens)):
        w = 0 if j <= L else math.ceil((j - L) / s)
        assert 0 < j - w * s <= L
        by_start.setdefault(w * s, []).append(j)
    total = 0.0
    for start, js in by_start.items():
        with torch.no_grad():
            logp = F.log_softmax(hf(torch.tensor([tokens[start:js[-1]]])).logits[0].double(), -1)
        total -= sum(float(logp[j - 1 - start, tokens[j]]) for j in js)
    return total


@pytest.mark.parametrize("L,s", [(48, 48), (48, 16), (40, 7)])
def test_wikitext_matches_straightforward(setup, hf_model, L, s):
    model, tok, _, _, _, wiki = setup
    res = evaluate_wikitext(model, tok, wiki, seq_len=L, stride=s, batch_size=3)
    tokens = tok.encode(wikitext_detokenize(WIKI))
    N, n_orig = len(tokens), len(WIKI.strip().split(" "))
    avg = _straightforward_nll(hf_model, tokens, L, s) / (N - 1)
    m = res["metrics"]
    assert m["num_tokens"] == N and m["num_original_tokens"] == n_orig
    assert m["avg_loss"] == pytest.approx(avg, rel=1e-5)
    assert m["ppl"] == pytest.approx(math.exp(avg), rel=1e-5)
    assert m["token_ratio"] == (N - 1) / (n_orig - 1)
    assert m["adjusted_ppl"] == pytest.approx(math.exp(avg * (N - 1) / (n_orig - 1)), rel=1e-4)
    assert res["final_line"].startswith(f"validation results on {wiki} | avg loss: {m['avg_loss']:.4E} | ")
    assert res["final_line"].endswith(f"| token ratio: {m['token_ratio']} |")


@pytest.mark.parametrize("L,s", [(48, 48), (48, 16)])
def test_wikitext_matches_hf_sliding_window_recipe(setup, hf_model, L, s):
    """The transformers docs' perplexity recipe (windows of max_length tokens every `stride`,
    labels[:, :-trg_len] = -100). With max_length = L + 1 it scores exactly the tokens Megatron's
    windows score; the recipe's own average weights each window by (valid labels - 1), so the
    compared quantity is the plain sum of token NLLs (window mean × tokens it scored) / (N - 1)."""
    model, tok, _, _, _, wiki = setup
    ids = torch.tensor([tok.encode(wikitext_detokenize(WIKI))])
    max_length, seq_len = L + 1, ids.size(1)
    nll_sum, prev_end = 0.0, 0
    for begin in range(0, seq_len, s):
        end = min(begin + max_length, seq_len)
        trg_len = end - prev_end
        inp = ids[:, begin:end]
        target = inp.clone()
        target[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf_model(inp, labels=target).loss
        nll_sum += float(loss) * int((target[:, 1:] != -100).sum())
        prev_end = end
        if end == seq_len:
            break
    res = evaluate_wikitext(model, tok, wiki, seq_len=L, stride=s)
    assert res["metrics"]["avg_loss"] == pytest.approx(nll_sum / (seq_len - 1), rel=1e-5)
    # bits per byte: the same NLL over the UTF-8 bytes after the first (unscored) token
    text = wikitext_detokenize(WIKI)
    scored = len(text.encode("utf-8")) - len(tok.decode(ids[0, :1].tolist()).encode("utf-8"))
    assert res["metrics"]["scored_bytes"] == scored
    assert res["metrics"]["bits_per_byte"] == pytest.approx(nll_sum / math.log(2) / scored, rel=1e-5)


def test_wikitext_bits_per_byte_of_a_uniform_model(setup, tmp_path):
    """A model whose logits are all zero spends log2(V) bits on every token."""
    _, tok, _, _, _, wiki = setup
    model, _ = tiny_model("Model.vocab_size=50304", "Model.hidden_size=32")
    with torch.no_grad():
        model.wte.weight.zero_()  # tied head: every logit 0
    res = evaluate_wikitext(model, tok, wiki, seq_len=32, stride=16)["metrics"]
    n = len(tok.encode(wikitext_detokenize(WIKI)))
    assert res["bits_per_byte"] == pytest.approx((n - 1) * math.log2(50304) / res["scored_bytes"], rel=1e-6)


def test_wikitext_detokenize_false_scores_the_text_unchanged(setup, tmp_path):
    """Code keeps its indentation: with detokenize=False the scored bytes are the file's own."""
    _, tok, _, _, _, _ = setup
    model, _ = tiny_model("Model.vocab_size=50304", "Model.hidden_size=32")
    with torch.no_grad():
        model.wte.weight.zero_()
    code = "def f(x):\n    if x , y :\n        return ( x )\n" * 4
    path = tmp_path / "code.txt"
    path.write_text(code)
    raw = evaluate_wikitext(model, tok, path, seq_len=32, stride=16, detokenize=False)["metrics"]
    det = evaluate_wikitext(model, tok, path, seq_len=32, stride=16)["metrics"]
    first = tok.decode(tok.encode(code)[:1])
    assert raw["scored_bytes"] == len(code.encode()) - len(first.encode())
    assert det["scored_bytes"] < raw["scored_bytes"]  # the WikiText rules rewrote the code
    n = len(tok.encode(code))
    assert raw["bits_per_byte"] == pytest.approx((n - 1) * math.log2(50304) / raw["scored_bytes"], rel=1e-6)


def test_window_plan_counts_reference_windows():
    # max(ceil(max(N-1-stride, 0)/stride) + 1, 1) windows at multiples of stride.
    assert window_plan(101, 50, 50) == [(0, 0), (50, 0)]
    assert len(window_plan(101, 50, 10)) == math.ceil(90 / 10) + 1
    assert window_plan(2, 50, 10) == [(0, 0)]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("content,msg", [
    (b'{"text": "a b c"}\n{"txt": "x y"}\n', ':2: no "text" field'),
    (b'{"text": "a b c"}\n\n{"text": "   "}\n', ":3: \"text\" has no whitespace-separated word"),
    (b'{"text": "a b"}\nnot json\n', ":2: not valid JSON"),
    (b'{"text": "a b"}\n{"text": "caf\xe9 ok"}\n', ":2: not valid UTF-8"),
    (b"", ": file is empty"),
    (b"\n\n", ": file is empty"),
])
def test_lambada_bad_input(setup, tmp_path, content, msg):
    model, tok, *_ = setup
    p = tmp_path / "bad.jsonl"
    p.write_bytes(content)
    with pytest.raises(DataError, match=str(p).replace("\\", "\\\\") + msg.replace("(", r"\(")):
        evaluate_lambada(model, tok, p)


def test_bad_windows(setup, tmp_path):
    model, tok, _, _, _, wiki = setup
    with pytest.raises(DataError, match="not found"):
        evaluate_wikitext(model, tok, tmp_path / "missing.txt", seq_len=32)
    with pytest.raises(ConfigError, match="longer than the model's context"):
        evaluate_wikitext(model, tok, wiki, seq_len=1024)
    with pytest.raises(ConfigError, match="overlapping_eval=64"):
        evaluate_wikitext(model, tok, wiki, seq_len=32, stride=64)
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "a " + "x" * 400}) + "\n")
    with pytest.raises(DataError, match=r"t.jsonl:1: the target word is \d+ tokens, longer than the window"):
        evaluate_lambada(model, tok, tmp_path / "t.jsonl", seq_len=8)


def test_tokenizer_model_mismatch(setup):
    _, tok, _, _, path, _ = setup
    small, _ = tiny_model()  # vocabulary of 4096: GPT-2 ids do not fit
    with pytest.raises(ConfigError, match="the tokenizer does not belong to this model"):
        evaluate_lambada(small, tok, path)


# --------------------------------------------------------------------------------- CLI


def test_cli_lambada_reference_config(setup, run_cli, tmp_path):
    _, _, ours, _, path, _ = setup
    out = tmp_path / "res.json"
    code, stdout, err = run_cli("eval", "-c", "configs/eval_gpt_345M_single_card.yaml",
                                "-o", f"Offline_Eval.eval_path={path}", "-o", "Offline_Eval.cloze_eval=True",
                                "--ckpt", ours, "--output", out, "--no-progress")
    assert code == 0, err
    res = json.loads(out.read_text())
    assert stdout.splitlines()[0] == res["final_line"]
    assert "last-token accuracy (GPT-2 paper's looser rule)" in stdout
    assert {"index", "correct", "target_logprob", "last_token_correct"} <= set(res["examples"][0])
    assert res["model"]["checkpoint"] == str(ours) and res["tokenizer"]["vocab_size"] == 50257
    assert res["config"]["batch_size"] == 8 and res["metrics"]["window"] == 256  # 1024 capped to the model


def test_cli_wikitext_hf_dir_default_output(setup, run_cli, tmp_path, monkeypatch):
    model, tok, _, hf, _, wiki = setup
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPTFORGE_PROGRESS_EVERY", "0")  # a plain progress line at every batch
    code, stdout, err = run_cli("eval", "--ckpt", hf, "-o", f"Offline_Eval.eval_path={wiki}",
                                "-o", "Offline_Eval.max_seq_len=48", "-o", "Offline_Eval.overlapping_eval=16",
                                "--emulate-reference-aggregation")
    assert code == 0, err
    res = json.loads((tmp_path / "eval_results_wikitext.json").read_text())
    assert not (hf / "eval_results_wikitext.json").exists()  # a model directory is never written by eval
    direct = evaluate_wikitext(model, tok, wiki, seq_len=48, stride=16)
    assert res["metrics"]["avg_loss"] == pytest.approx(direct["metrics"]["avg_loss"], rel=1e-5)
    assert "EMULATED reference aggregation" in stdout  # the labelled line
    assert "[WikiText]" in err and "\r" not in err  # captured (not a terminal): plain progress lines


def test_cli_lambada_split_option(setup, run_cli, tmp_path):
    _, _, ours, _, path, _ = setup
    f = tmp_path / "nl.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in NEWLINE_PASSAGES))
    got = {}
    for extra in ([], ["--lambada-split", "lm_eval"], ["-o", "Offline_Eval.lambada_split=lm_eval"]):
        out = tmp_path / f"r{len(got)}.json"
        code, _, err = run_cli("eval", "--ckpt", ours, "-o", f"Offline_Eval.eval_path={f}", "-o",
                               "Offline_Eval.cloze_eval=True", "--output", out, "--no-progress", *extra)
        assert code == 0, err
        res = json.loads(out.read_text())
        got[" ".join(extra)] = ([e["target"] for e in res["examples"]], res["config"]["lambada_split"])
    assert got[""] == ([" notebook", " miles", " finished"], "reference")
    assert got["--lambada-split lm_eval"] == ([" notebook.\nnotebook", " \nmiles", " "], "lm_eval")
    assert got["-o Offline_Eval.lambada_split=lm_eval"] == got["--lambada-split lm_eval"]
    code, _, err = run_cli("eval", "--ckpt", ours, "-o", "Offline_Eval.lambada_split=lm-eval")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "Offline_Eval.lambada_split: must be reference or lm_eval, got 'lm-eval' (did you mean lm_eval?)" in err


@pytest.mark.parametrize("args,msg", [
    (["-o", "Offline_Eval.eval_path=MISSING.txt"], "MISSING.txt: file not found"),
    (["-o", "Offline_Eval.eval_path=WIKI", "-o", "Offline_Eval.max_seq_len=1024"],
     "Offline_Eval.max_seq_len=1024: longer than the model's context"),
    ([], "Offline_Eval.eval_path: not set"),
])
def test_cli_errors_are_one_line(setup, run_cli, args, msg):
    _, _, ours, _, _, wiki = setup
    args = [a.replace("WIKI", str(wiki)) for a in args]
    code, _, err = run_cli("eval", "--ckpt", ours, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and msg in err
