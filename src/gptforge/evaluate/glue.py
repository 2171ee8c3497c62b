"""`gptforge eval` of a fine-tuned classifier: the GLUE task metric on a local dev file.

The task comes from the classifier directory (recorded by `gptforge finetune`), else
`Data.Eval.dataset.name`. The data is `--glue-file FILE` (one TSV of the task's layout), else
`Data.Eval.dataset.root` + `split` (default `dev`; MNLI's `dev` is both matched and
mismatched). The metric is `Model.metric.eval.name`, else the task's own (MCC for CoLA,
accuracy + F1 for MRPC/QQP, Pearson/Spearman for STS-B, accuracy otherwise).
"""

from __future__ import annotations

import os
import time

from gptforge.errors import ConfigError
from gptforge.evaluate.common import write_json_atomic
from gptforge.evaluate.runner import model_identity, results_path, tokenizer_identity


def run_glue_eval(cfg, clf, tokenizer, task_name: str | None, *, file: str | os.PathLike | None = None,
                  output: str | os.PathLike | None = None, ckpt: str | os.PathLike | None = None,
                  echo: bool = True) -> dict:
    """Score `clf` on the GLUE data the arguments / `cfg.Data.Eval.dataset` name; print one
    line per split and write the results JSON (default `<ckpt>/eval_results_glue.json`)."""
    from gptforge.finetune import metrics as M
    from gptforge.finetune.glue import GlueDataset, get_task, is_glue, read_glue
    from gptforge.finetune.predict import score
    from gptforge.finetune.run import DEFAULT_MAX_LENGTH, eval_splits

    ev = cfg.Data.Eval.dataset
    name = task_name or (ev.name if is_glue(ev.name) else None) or (
        cfg.Data.Train.dataset.name if is_glue(cfg.Data.Train.dataset.name) else None)
    if name is None:
        raise ConfigError("Data.Eval.dataset.name: name the GLUE task of this classifier (e.g. -o "
                          "Data.Eval.dataset.name=SST2)")
    task = get_task(name, "Data.Eval.dataset.name")
    metric = ((cfg.Model.metric or {}).get("eval") or {}).get("name") or task.metric
    M.check_metric(metric)
    max_length = ev.max_length or cfg.Data.Train.dataset.max_length or DEFAULT_MAX_LENGTH
    max_length = min(max_length, int(clf.gpt.wpe.weight.shape[0]))
    batch = cfg.Data.Eval.sampler.batch_size or cfg.Offline_Eval.batch_size
    if file is not None:
        sources = {os.path.basename(str(file)): (file, "dev")}
    else:
        root = ev.root or cfg.Data.Train.dataset.root
        if root is None:
            raise ConfigError("Data.Eval.dataset.root: set the directory of the task's TSV files, or pass "
                              "--glue-file FILE")
        split = ev.split if isinstance(ev.split, str) else "dev"
        sources = {s: (root, s) for s in eval_splits(task, split)}
    results = {}
    t0 = time.perf_counter()
    for label, (where, split) in sources.items():
        ds = GlueDataset(task, read_glue(task, where, split), tokenizer, max_length)
        if not ds.has_labels:
            raise ConfigError(f"{where}: the {task.name} {split} data has no labels to score against")
        results[label] = score(clf, ds, metric, batch)
        if echo:
            print(f"[eval] {task.name} {label}: {M.describe(metric, results[label])}, loss: "
                  f"{results[label]['loss']:.6f}, examples: {results[label]['examples']}")
    doc = {"task": task.name, "metric": metric, "results": results, "max_length": max_length,
           "model": model_identity(clf, cfg, ckpt), "tokenizer": tokenizer_identity(tokenizer),
           "seconds": round(time.perf_counter() - t0, 3)}
    path = results_path(cfg, "glue", output)
    write_json_atomic(path, doc)
    if echo:
        print(f"results: {path}")
    return doc
