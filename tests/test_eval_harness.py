"""The lm-eval adapter: per-example parity with our LAMBADA scoring and with lm-eval's own HF
backend (`HFLM`) on the HF-exported model, for loglikelihood, loglikelihood_rolling and
generate_until, on local task YAMLs written here. Skipped only when lm-eval is not installed."""

from __future__ import annotations

import json
import sys

import pytest

from gptforge.errors import UsageError
from gptforge.evaluate import evaluate_lambada
from test_eval import WIKI, make_lambada

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

TASKS = {
    "lambada_local": """
task: lambada_local
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/lambada.jsonl}}}}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - {{metric: perplexity, aggregation: perplexity, higher_is_better: false}}
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
""",
    "wikitext_local": """
task: wikitext_local
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/wiki.jsonl}}}}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{page}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "gen_local": """
task: gen_local
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/gen.jsonl}}}}
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: [".", "\\n"], max_gen_toks: 6, do_sample: false}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
""",
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Model + tokenizer + HF export, data files, task YAMLs and one shared TaskManager."""
    import torch

    from gf_testutil import tiny_model
    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.evaluate.harness import task_manager
    from gptforge.model_io import save_hf_dir, save_model_dir

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("harness")
    model, cfg = tiny_model("Model.vocab_size=50304", "Model.hidden_size=128")
    tok = gpt2_tokenizer()
    save_model_dir(model, cfg, d / "ours", tokenizer=tok)
    save_hf_dir(model, cfg, d / "hf", tokenizer=tok)
    make_lambada(d / "lambada.jsonl")
    paras = [p for p in WIKI.split("\n \n") if p.strip()]
    with open(d / "wiki.jsonl", "w", encoding="utf-8") as f:
        for page in (WIKI, WIKI * 2, paras[1]):
            f.write(json.dumps({"page": page}) + "\n")
    with open(d / "gen.jsonl", "w", encoding="utf-8") as f:
        for p in paras[:4] + ["The lighthouse keeper climbed the", "One two three four"]:
            f.write(json.dumps({"prompt": p.strip()[:200], "answer": "x"}) + "\n")
    (d / "tasks").mkdir()
    for name, text in TASKS.items():
        (d / "tasks" / f"{name}.yaml").write_text(text.format(data=d))
    return dict(model=model, tok=tok, dir=d, tm=task_manager(d / "tasks"))


def _evaluate(env, lm, task):
    from lm_eval import evaluator

    res = evaluator.simple_evaluate(model=lm, tasks=[task], task_manager=env["tm"], log_samples=True,
                                    bootstrap_iters=0)
    samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    return res["results"][task], samples


@pytest.fixture(scope="module")
def ours_lm(env):
    from gptforge.evaluate.harness import lm_class

    return lm_class()(model=env["model"], tokenizer=env["tok"], batch_size=8, max_length=64)


@pytest.fixture(scope="module")
def hf_lm(env):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(env["dir"] / "hf"), batch_size=1, device="cpu", max_length=64)


def test_lambada_adapter_and_hflm_match_ours(env, ours_lm, hf_lm):
    direct = evaluate_lambada(env["model"], env["tok"], env["dir"] / "lambada.jsonl", batch_size=8, seq_len=64)
    want = [e["correct"] for e in direct["examples"]]
    assert 0 < sum(want) < len(want)
    for lm in (ours_lm, hf_lm):
        metrics, samples = _evaluate(env, lm, "lambada_local")
        assert [bool(s["acc"]) for s in samples] == want, type(lm).__name__
        lps = [s["filtered_resps"][0][0] for s in samples]
        assert max(abs(a - e["target_logprob"]) for a, e in zip(lps, direct["examples"], strict=True)) < 1e-3
        assert metrics["acc,none"] == pytest.approx(direct["metrics"]["accuracy"])
        assert metrics["perplexity,none"] == pytest.approx(direct["metrics"]["target_perplexity"], rel=1e-4)


def test_rolling_loglikelihood_matches_hflm(env, ours_lm, hf_lm):
    ours, s_ours = _evaluate(env, ours_lm, "wikitext_local")
    ref, s_ref = _evaluate(env, hf_lm, "wikitext_local")
    for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours[key] == pytest.approx(ref[key], rel=1e-5), key
    for a, b in zip(s_ours, s_ref, strict=True):
        assert a["filtered_resps"][0] == pytest.approx(b["filtered_resps"][0], abs=1e-3)


def test_generate_until_matches_hflm(env, ours_lm, hf_lm):
    _, s_ours = _evaluate(env, ours_lm, "gen_local")
    _, s_ref = _evaluate(env, hf_lm, "gen_local")
    got = [s["filtered_resps"][0] for s in s_ours]
    assert got == [s["filtered_resps"][0] for s in s_ref]
    assert any(got) and all("." not in g and "\n" not in g for g in got)


def test_cli_harness(env, run_cli, tmp_path):
    out = tmp_path / "h.json"
    code, stdout, err = run_cli("eval", "--ckpt", env["dir"] / "ours", "--harness", "lambada_local",
                                "--include-path", env["dir"] / "tasks", "--output", out)
    assert code == 0, err
    res = json.loads(out.read_text())
    direct = evaluate_lambada(env["model"], env["tok"], env["dir"] / "lambada.jsonl")
    assert res["results"]["lambada_local"]["acc,none"] == pytest.approx(direct["metrics"]["accuracy"])
    assert [bool(s["acc"]) for s in sorted(res["samples"]["lambada_local"], key=lambda s: s["doc_id"])] == \
        [e["correct"] for e in direct["examples"]]
    assert "lambada_local" in stdout  # lm-eval's results table

    code, _, err = run_cli("eval", "--ckpt", env["dir"] / "ours", "--harness", "nope",
                           "--include-path", env["dir"] / "tasks")
    assert code == 2 and "unknown task(s) nope" in err and "lambada_local" in err


def test_registered_model_name(env):
    from lm_eval.api.registry import get_model

    from gptforge.evaluate.harness import MODEL_NAME, lm_class

    cls = lm_class()
    assert get_model(MODEL_NAME) is cls
    lm = cls.create_from_arg_string(f"ckpt={env['dir'] / 'ours'},batch_size=4,device=cpu")
    assert lm.batch_size == 4 and lm.max_length == 256 and lm.eot_token_id == 50256


def test_missing_extra_is_a_clear_error(env, monkeypatch):
    from gptforge.evaluate import harness

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(UsageError, match=r"pip install 'gptforge\[eval\]'"):
        harness.run_harness(env["model"], env["tok"], "lambada_local")


@pytest.fixture(scope="module")
def openai_task(env):
    """lm-eval's own `lambada_openai.yaml` (its doc_to_text / doc_to_target untouched), pointed
    at a local file that mixes plain passages with passages that have a newline before the last
    word; returns (task name, TaskManager, jsonl path)."""
    from pathlib import Path

    import lm_eval
    import yaml

    from gptforge.evaluate.harness import task_manager
    from test_eval import NEWLINE_PASSAGES

    d = env["dir"] / "openai"
    (d / "tasks").mkdir(parents=True)
    data = d / "lambada_nl.jsonl"
    data.write_text((env["dir"] / "lambada.jsonl").read_text()
                    + "".join(json.dumps({"text": t}) + "\n" for t in NEWLINE_PASSAGES))
    cfg = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "lambada" / "lambada_openai.yaml").read_text())
    cfg.pop("tag", None)
    cfg.pop("dataset_name", None)
    cfg.update(task="lambada_openai_local", dataset_path="json", dataset_kwargs={"data_files": {"test": str(data)}})
    (d / "tasks" / "lambada_openai_local.yaml").write_text(yaml.safe_dump(cfg))
    return "lambada_openai_local", task_manager(d / "tasks"), data


def test_lm_eval_split_is_lambada_openai_example_by_example(env, openai_task, ours_lm, hf_lm):
    from lm_eval import evaluator
    from lm_eval.tasks import get_task_dict

    from gptforge.evaluate.lambada import read_lambada
    from test_eval import NEWLINE_PASSAGES

    name, tm, data = openai_task
    task = get_task_dict([name], tm)[name]
    task.build_all_requests(rank=0, world_size=1)
    lm_eval_pairs = [i.args for i in sorted(task.instances, key=lambda i: i.doc_id)]
    ours = [(e.context, e.target) for e in read_lambada(data, "lm_eval")]
    assert ours == lm_eval_pairs
    reference = [(e.context, e.target) for e in read_lambada(data)]
    n_plain = len(reference) - len(NEWLINE_PASSAGES)
    assert reference[:n_plain] == lm_eval_pairs[:n_plain]
    assert all(a != b for a, b in zip(reference[n_plain:], lm_eval_pairs[n_plain:], strict=True))

    direct = evaluate_lambada(env["model"], env["tok"], data, batch_size=8, seq_len=64, split_rule="lm_eval")
    for lm in (ours_lm, hf_lm):
        res = evaluator.simple_evaluate(model=lm, tasks=[name], task_manager=tm, log_samples=True, bootstrap_iters=0)
        samples = sorted(res["samples"][name], key=lambda s: s["doc_id"])
        assert [bool(s["acc"]) for s in samples] == [e["correct"] for e in direct["examples"]], type(lm).__name__
        lps = [s["filtered_resps"][0][0] for s in samples]
        assert max(abs(a - e["target_logprob"]) for a, e in zip(lps, direct["examples"], strict=True)) < 1e-3
        assert res["results"][name]["perplexity,none"] == pytest.approx(direct["metrics"]["target_perplexity"],
                                                                        rel=1e-4)


def test_no_progress_silences_every_bar_in_harness_mode(env, run_cli, tmp_path, monkeypatch):
    argv = ("eval", "--ckpt", env["dir"] / "ours", "--harness", "lambada_local", "--include-path", env["dir"] / "tasks")
    monkeypatch.setenv("GPTFORGE_PROGRESS", "bar")  # as on a terminal
    code, _, err = run_cli(*argv, "--output", tmp_path / "a.json")
    assert code == 0, err
    for bar in ("Tokenizing inputs", "loglikelihood:", "it/s"):  # lm-eval's, ours, and lm-eval's unnamed one
        assert bar in err, bar
    monkeypatch.setenv("GPTFORGE_PROGRESS", "plain")  # a redirected log: none of lm-eval's \r bars
    code, _, err = run_cli(*argv, "--output", tmp_path / "p.json")
    assert code == 0, err
    assert "\r" not in err and "it/s" not in err and "Tokenizing inputs" not in err, err
    monkeypatch.delenv("GPTFORGE_PROGRESS")
    code, _, err = run_cli(*argv, "--output", tmp_path / "b.json", "--no-progress")
    assert code == 0, err
    assert "it/s" not in err and "%|" not in err and "Generating test split" not in err, err
    assert json.loads((tmp_path / "a.json").read_text())["results"] == \
        json.loads((tmp_path / "b.json").read_text())["results"]
    from lm_eval.api import model as lm_model
    from lm_eval.api import task as lm_task
    from tqdm import tqdm

    assert lm_task.tqdm is tqdm and lm_model.tqdm is tqdm  # restored after the run
