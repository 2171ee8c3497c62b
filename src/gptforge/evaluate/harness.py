"""Our model as an lm-evaluation-harness `LM`, so any lm-eval task runs on local data files.

lm-eval is an optional extra (`pip install 'gptforge[eval]'`) and is imported only when this
module's functions are called. The adapter follows lm-eval's HF backend (`HFLM`) wherever the
numbers depend on it: context/continuation tokenization (`TemplateLM._encode_pair`), left
truncation to `max_length + 1` tokens, rolling windows for `loglikelihood_rolling`, stop
sequences for `generate_until`; it scores through `gptforge.evaluate.common`, which projects
only the scored positions onto the vocabulary.

Tasks come from YAML files in `--include-path DIR` (e.g. `dataset_path: json`,
`dataset_kwargs: {data_files: {test: /path.jsonl}}`); the Hub is never contacted: the HF
offline switches are set before lm-eval and `datasets` are imported.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from gptforge.errors import UsageError
from gptforge.fsguard import check_path_kind
from gptforge.progress import mode as progress_mode

MODEL_NAME = "gptforge"  # name registered with lm-eval's model registry
_CLASS: type | None = None


def _import_lm_eval():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UsageError("the lm-eval adapter needs lm-eval: pip install 'gptforge[eval]' "
                         "(or pip install lm-eval)") from None


def lm_class() -> type:
    """The `GPTForgeLM` class (a `lm_eval.api.model.TemplateLM`), built and registered on first use."""
    global _CLASS
    if _CLASS is None:
        _import_lm_eval()
        from gptforge.evaluate.harness_lm import build_lm_class

        _CLASS = build_lm_class(MODEL_NAME)
    return _CLASS


def __getattr__(name: str):  # `from gptforge.evaluate.harness import GPTForgeLM`, lazily
    if name == "GPTForgeLM":
        return lm_class()
    raise AttributeError(name)


def task_manager(include_path: str | os.PathLike | None = None, builtin_tasks: bool = False):
    """An lm-eval TaskManager over `include_path` (and lm-eval's own tasks if asked: +~14 s)."""
    _import_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        check_path_kind(include_path, "dir", "--include-path", UsageError, "give a directory of task YAML files")
    if include_path is None and not builtin_tasks:
        builtin_tasks = True
    return TaskManager(include_path=str(include_path) if include_path else None, include_defaults=builtin_tasks)


def run_harness(model, tokenizer, tasks: list[str] | str, *, include_path: str | os.PathLike | None = None,
                batch_size: int = 8, limit: int | float | None = None, num_fewshot: int | None = None,
                builtin_tasks: bool = False, output: str | os.PathLike | None = None, tm=None,
                max_length: int | None = None, vocab_size: int | None = None, amp_dtype=None,
                echo: bool = True, bootstrap_iters: int = 0, progress: bool = True) -> dict:
    """Run lm-eval `tasks` on our model; returns lm-eval's results dict (plus per-sample
    metrics under "samples") and writes it as JSON to `output` when given. `progress=False`
    silences every progress bar: ours, lm-eval's and `datasets`'."""
    _import_lm_eval()
    from lm_eval import evaluator
    from lm_eval.utils import make_table

    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    if not names:
        raise UsageError("--harness: give one or more task names, comma-separated")
    tm = tm or task_manager(include_path, builtin_tasks)
    unknown = [t for t in names if t not in tm.all_tasks]
    if unknown:
        where = f"under {include_path}" if include_path else "in lm-eval"
        shown = ", ".join(sorted(tm.all_tasks)[:12]) or "none"
        raise UsageError(f"--harness: unknown task(s) {', '.join(unknown)}; tasks found {where}: {shown}"
                         + ("" if builtin_tasks else " (add --builtin-tasks for lm-eval's own tasks)"))
    lm = lm_class()(model=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
                    vocab_size=vocab_size, amp_dtype=amp_dtype, progress=progress)
    # lm-eval's and datasets' own bars redraw with \r: shown on a terminal only; a redirected log
    # gets our plain lines (gptforge.progress) and none of theirs
    with contextlib.nullcontext() if progress and progress_mode() == "bar" else _no_progress_bars():
        res = evaluator.simple_evaluate(model=lm, tasks=names, task_manager=tm, limit=limit,
                                        num_fewshot=num_fewshot, log_samples=True,
                                        bootstrap_iters=bootstrap_iters)
    res["samples"] = {task: [_sample_summary(s) for s in samples]
                      for task, samples in (res.get("samples") or {}).items()}
    if echo:
        print(make_table(res))
    if output is not None:
        from lm_eval.utils import handle_non_serializable

        from gptforge.evaluate.common import write_json_atomic

        write_json_atomic(output, res, default=handle_non_serializable)
        res["output"] = str(output)
        if echo:
            print(f"results written to {output}")
    return res


@contextlib.contextmanager
def _no_progress_bars():
    """Silence lm-eval's and `datasets`' progress bars for one run. `datasets` has a switch;
    lm-eval has none for the bar of `Task.build_all_requests` (and calls `loglikelihood`
    without `disable_tqdm`), so the `tqdm` its two API modules imported is swapped, for the
    duration only, for a subclass that is always disabled."""
    import datasets
    from lm_eval.api import model as lm_model
    from lm_eval.api import task as lm_task

    class _Disabled(lm_task.tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    bars_were_on = datasets.is_progress_bar_enabled()
    saved = lm_task.tqdm, lm_model.tqdm
    datasets.disable_progress_bars()
    lm_task.tqdm = lm_model.tqdm = _Disabled
    try:
        yield
    finally:
        lm_task.tqdm, lm_model.tqdm = saved
        if bars_were_on:
            datasets.enable_progress_bars()


def _sample_summary(s: dict[str, Any]) -> dict[str, Any]:
    """One logged sample without its document: id, target, model response and metrics."""
    out = {"doc_id": s.get("doc_id"), "target": s.get("target"), "filtered_resps": s.get("filtered_resps")}
    for m in s.get("metrics") or []:
        if m in s:
            out[m] = s[m]
    return out
