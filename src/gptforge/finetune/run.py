"""`gptforge finetune`: GLUE sequence classification from a pretrained GPT (the reference's
GPTFinetuneModule), epoch- or step-driven.

Built from the training parts of `train/`: AdamW parameter groups (`optim.build_optimizer`),
the learning-rate schedules measured in samples (`optim.LRSchedule`, LinearDecayWithWarmup with a
fractional warmup), global-norm clipping, fp16/bf16 precision (`precision.Precision`), the run
logger (`metrics.RunLogger`: train.log, metrics.jsonl, TensorBoard) and atomic model
directories (`model_io`). What differs from pretraining is the data (a GLUE split, shuffled
every epoch), the loss (cross-entropy over classes, MSE for STS-B), the evaluation (the task
metric over the whole dev split) and the saving rhythm (`save_epoch`).

Run modes: `epoch` trains `Engine.num_train_epochs` passes (`Engine.max_steps > 0` caps the
total), evaluates every `eval_freq` epochs and saves `epoch_N` every `save_epoch` epochs;
`step` trains `Engine.max_steps` steps, evaluating every `eval_freq` steps and saving
`step_N` every `save_load.save_steps`. The last epoch/step is always evaluated and saved.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from gptforge.config.schema import Config
from gptforge.errors import CheckpointError, ConfigError, DataError
from gptforge.finetune import metrics as M
from gptforge.finetune import rundir
from gptforge.finetune.classifier import SequenceClassifier, is_classifier_dir, read_head
from gptforge.finetune.glue import GlueDataset, GlueTask, get_task, is_glue, load_glue
from gptforge.finetune.predict import batches, score
from gptforge.train.run_start import RunStart

LOSSES = ("CrossEntropyLoss", "MSELoss")
DEFAULT_MAX_LENGTH = 128  # the reference's GLUE datasets
RESULTS_FILE = rundir.RESULTS_FILE


@dataclass
class FinetuneResult:
    """What a run did: steps, per-step losses, each evaluation, the best one, the last save."""

    task: str
    epochs: int
    steps: int
    losses: list[float]
    evals: list[dict] = field(default_factory=list)
    best: dict | None = None
    checkpoint_dir: Path | None = None
    output_dir: Path | None = None


# ------------------------------------------------------------------------------ setup


def _device(spec: str | torch.device | None) -> torch.device:
    if isinstance(spec, torch.device):
        return spec
    s = (spec or "auto").lower().replace("gpu", "cuda")
    if s == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if s.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"Global.device: {spec!r} requested but no CUDA device is available; use -o Global.device=cpu")
    return torch.device(s)


def pretrained_path(cfg: Config, pretrained: str | os.PathLike | None = None) -> Path:
    """The model to start from: the argument, else Model.pretrained, else Compress.pretrained.
    A reference-style prefix (`.../model`) finds `.../model.pdparams`."""
    spec = pretrained or cfg.Model.pretrained or cfg.Compress.pretrained
    if not spec:
        raise ConfigError("Model.pretrained: set the model to fine-tune (our model directory, an HF GPT-2 "
                          "directory or a .pdparams), e.g. -o Model.pretrained=DIR or --ckpt DIR")
    p = Path(spec).expanduser()
    if not p.exists() and Path(f"{p}.pdparams").is_file():
        p = Path(f"{p}.pdparams")
    return p


def _task_settings(cfg: Config) -> tuple[GlueTask, str, str]:
    """(task, loss name, metric name) from Data.Train.dataset.name and Model.loss / Model.metric."""
    name = cfg.Data.Train.dataset.name
    if not is_glue(name):
        raise ConfigError(f"Data.Train.dataset.name: {name!r} is not a GLUE task; gptforge finetune trains one "
                          "of CoLA, SST2, MNLI, QNLI, RTE, WNLI, MRPC, QQP, STSB")
    task = get_task(name)
    loss = ((cfg.Model.loss or {}).get("train") or {}).get("name") or ("MSELoss" if task.regression else
                                                                        "CrossEntropyLoss")
    if loss not in LOSSES:
        raise ConfigError(f"Model.loss.train.name: {loss!r} is not one of {', '.join(LOSSES)}")
    if (loss == "MSELoss") != task.regression:
        raise ConfigError(f"Model.loss.train.name: {loss} does not fit {task.name} "
                          f"({'a regression' if task.regression else 'a classification'} task); use "
                          f"{'MSELoss' if task.regression else 'CrossEntropyLoss'}")
    metric = ((cfg.Model.metric or {}).get("eval") or {}).get("name") or task.metric
    M.check_metric(metric)
    if (metric == "PearsonAndSpearman") != task.regression:
        raise ConfigError(f"Model.metric.eval.name: {metric} does not fit {task.name}; its metric is {task.metric}")
    return task, loss, metric


def _num_classes(cfg: Config, task: GlueTask) -> int:
    n = cfg.Model.num_classes
    if n is None:
        return task.num_classes
    if task.regression and n != 1:
        raise ConfigError(f"Model.num_classes: {task.name} is a regression task, set it to 1 (got {n})")
    if not task.regression and n < task.num_classes:
        raise ConfigError(f"Model.num_classes: {task.name} has {task.num_classes} labels, got {n}")
    return n


def _split_name(ds_cfg, default: str) -> str:
    return ds_cfg.split if isinstance(ds_cfg.split, str) else default


def eval_splits(task: GlueTask, split: str) -> list[str]:
    """MNLI's `dev` means both dev_matched and dev_mismatched (reported separately)."""
    if task.name == "MNLI" and split == "dev":
        return ["dev_matched", "dev_mismatched"]
    return [split]


def build_classifier(cfg: Config, path: Path, device: torch.device, num_classes: int):
    """(classifier, config with the checkpoint's shape, tokenizer) from any model gptforge reads.
    QAT models keep their fake-quant modules; a classifier directory also keeps its head when the
    class count matches."""
    from gptforge.config.schema import QuantizationConfig
    from gptforge.config.typed import build_section
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.model_io import load_model, read_checkpoint_config, resolve_checkpoint_path

    p = resolve_checkpoint_path(path)
    gpt, cfg = load_model(p, cfg, device=device)
    quant = ((read_checkpoint_config(p).get("Compress") or {}).get("Quantization") or {})
    if quant.get("enable"):
        if quant.get("converted"):
            raise CheckpointError(f"{p}: a converted INT8 model cannot be trained; fine-tune the QAT model it "
                                  "was converted from")
        # The classifier directory must rebuild the fake-quant modules when it is loaded again.
        cfg.Compress.Quantization = build_section(QuantizationConfig, quant, "Compress.Quantization")
    tok = load_tokenizer(cfg.Data.tokenizer, p if p.is_dir() else None)
    vocab = gpt.wte.weight.shape[0]
    if tok.vocab_size > vocab:
        raise ConfigError(f"Data.tokenizer: {tok.name!r} has {tok.vocab_size} tokens but the model's vocabulary is "
                          f"{vocab}; use the tokenizer the model was trained with")
    clf = SequenceClassifier(gpt, num_classes, tok.eos_token_id)
    if is_classifier_dir(p):
        weight, meta = read_head(p)
        if weight.shape[0] == num_classes:
            with torch.no_grad():
                clf.score.weight.copy_(weight.to(clf.score.weight.dtype))
            clf.pad_token_id = int(meta.get("pad_token_id", clf.pad_token_id))
    cfg.Model.num_classes = num_classes
    cfg.Model.pretrained = str(p)
    return clf.to(device), cfg, tok


def _datasets(cfg: Config, task: GlueTask, tok, max_positions: int) -> tuple[GlueDataset, dict[str, GlueDataset]]:
    tr, ev = cfg.Data.Train.dataset, cfg.Data.Eval.dataset
    if not tr.root:
        raise ConfigError(f"Data.Train.dataset.root: not set; give the {task.name} directory (GLUE's train.tsv, "
                          "dev.tsv) with --data DIR or -o Data.Train.dataset.root=DIR")
    lengths = {}
    for key, ds in (("Train", tr), ("Eval", ev)):
        n = ds.max_length or DEFAULT_MAX_LENGTH
        if n > max_positions:
            raise ConfigError(f"Data.{key}.dataset.max_length: {n} exceeds the model's {max_positions} positions")
        lengths[key] = n
    train = load_glue(task.name, tr.root, _split_name(tr, "train"), tok, lengths["Train"])
    if not train.has_labels:
        raise DataError(f"Data.Train.dataset: the {task.name} {_split_name(tr, 'train')} split has no labels")
    evals = {}
    if cfg.Engine.eval_freq > 0:
        if is_glue(ev.name) and get_task(ev.name, "Data.Eval.dataset.name") is not task:
            raise ConfigError(f"Data.Eval.dataset.name: {ev.name} differs from Data.Train.dataset.name {tr.name}")
        root = ev.root or tr.root
        for split in eval_splits(task, _split_name(ev, "dev")):
            ds = load_glue(task.name, root, split, tok, lengths["Eval"], key="Data.Eval.dataset")
            if not ds.has_labels:
                raise DataError(f"Data.Eval.dataset: the {task.name} {split} split has no labels; evaluate on a "
                                "dev split, or set Engine.eval_freq=0")
            evals[split] = ds
    return train, evals


# ------------------------------------------------------------------------------- loop


class _Run:
    def __init__(self, cfg: Config, clf: SequenceClassifier, tok, task: GlueTask, loss: str, metric: str,
                 train: GlueDataset, evals: dict[str, GlueDataset], device: torch.device, progress, echo,
                 start: RunStart):
        from gptforge.train.optim import LRSchedule, Scheduler, build_optimizer
        from gptforge.train.precision import Precision

        self.cfg, self.clf, self.tok, self.task = cfg, clf, tok, task
        self.loss_name, self.metric, self.train_ds, self.evals = loss, metric, train, evals
        self.device, self.start, self.progress, self.echo = device, start, progress, echo
        e, tr_sampler = cfg.Engine, cfg.Data.Train.sampler
        self.bs = tr_sampler.batch_size or cfg.Global.local_batch_size
        micro = cfg.Global.micro_batch_size or self.bs
        self.micro = micro if micro < self.bs and self.bs % micro == 0 else self.bs
        self.eval_bs = cfg.Data.Eval.sampler.batch_size or self.bs
        self.shuffle, self.drop_last = tr_sampler.shuffle, tr_sampler.drop_last
        n = len(train)
        self.steps_per_epoch = n // self.bs if self.drop_last else math.ceil(n / self.bs)
        if self.steps_per_epoch == 0:
            raise DataError(f"Data.Train.dataset: {n} {task.name} examples make no batch of {self.bs} "
                            "(Data.Train.sampler.batch_size); lower it or set drop_last: False")
        if e.run_mode == "epoch":
            self.total = e.num_train_epochs * self.steps_per_epoch
            if e.max_steps > 0:
                self.total = min(self.total, e.max_steps)
        else:
            if e.max_steps <= 0:
                raise ConfigError(f"Engine.max_steps: {e.max_steps} needs Engine.run_mode=epoch; give a step count")
            self.total = e.max_steps
        self.epochs = math.ceil(self.total / self.steps_per_epoch)
        self.output_dir = start.output_dir
        self.precision = Precision(e.mix_precision, device)
        self.optimizer = build_optimizer(clf, cfg.Optimizer)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        lr = cfg.Optimizer.lr
        decay = self.total * self.bs
        warmup = lr.warmup_steps * self.bs if lr.warmup_steps is not None else lr.warmup_rate * decay
        if warmup > decay:
            raise ConfigError(f"Optimizer.lr.warmup: {lr.warmup_steps} steps exceed the run's {self.total} steps")
        self.scheduler = Scheduler(self.optimizer, LRSchedule(lr.name, lr.max_lr, lr.min_lr, decay, warmup,
                                                              lr.use_increments))
        from gptforge.train.trackers import check_trackers

        check_trackers(e.trackers)
        self.step, self.saved_step = 0, -1
        self.result = FinetuneResult(task.name, self.epochs, 0, [], output_dir=self.output_dir)
        if start.resume is not None:
            rundir.restore(self, start.resume)

    def _logger(self):
        """train.log / metrics.jsonl / TensorBoard; records past the resumed step (logged by a run that
        died before saving them) are dropped, so each step has one record across resumes."""
        from gptforge.train.metrics import RunLogger
        from gptforge.train.trackers import open_trackers

        e = self.cfg.Engine
        return RunLogger(self.output_dir, total_steps=self.total, start_step=self.step, progress=self.progress,
                         echo=self.echo, truncate_after=self.step, tensorboard="tensorboard" in e.trackers,
                         trackers=lambda: open_trackers(e.trackers, self.output_dir, e.tracker_project,
                                                        e.tracker_run_name, self.cfg.to_dict()))

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.loss_name == "MSELoss":
            return F.mse_loss(logits[:, 0], labels.float())
        return F.cross_entropy(logits, labels)

    def train_step(self, batch: dict) -> dict:
        clf = self.clf
        clf.train()
        lr = self.scheduler.lr
        ids, labels = batch["input_ids"].to(self.device), batch["labels"].to(self.device)
        total = 0.0
        chunks = max(1, math.ceil(len(ids) / self.micro))
        for i in range(chunks):
            sl = slice(i * self.micro, (i + 1) * self.micro)
            with self.precision.autocast():
                logits = clf(ids[sl])
            loss = self._loss(logits, labels[sl])
            self.precision.backward(loss / chunks)
            total += float(loss.detach()) / chunks
        from gptforge.train.optim import clip_grad_norm_

        self.precision.unscale_(self.optimizer)
        norm = float(clip_grad_norm_(self.params, self.cfg.Optimizer.grad_clip.clip_norm))
        if not (math.isfinite(total) and math.isfinite(norm)) and not self.precision.fp16:
            raise ConfigError(f"step {self.step + 1}: the loss or gradient is not finite ({total}, norm {norm}); "
                              "lower Optimizer.lr.max_lr")
        stepped = self.precision.step(self.optimizer)
        if stepped:
            self.scheduler.advance(len(ids))
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": total, "lr": lr, "grad_norm": norm, "found_inf": int(not stepped),
                "tokens": int((ids != clf.pad_token_id).sum())}

    def evaluate(self, epoch: int) -> dict:
        t0 = time.perf_counter()
        row: dict = {"epoch": epoch, "step": self.step}
        for split, ds in self.evals.items():
            res = score(self.clf, ds, self.metric, self.eval_bs, self.precision.autocast)
            row[split] = res
            self.log.info(f"[Eval] epoch: {epoch}, step: {self.step}, {self.task.name} {split}: "
                          f"{M.describe(self.metric, res)}, loss: {res['loss']:.6f}")
            self.log.record(f"eval/{split}", self.step, {k: v for k, v in res.items() if k != "examples"})
        row["main"] = sum(r["main"] for k, r in row.items() if k in self.evals) / len(self.evals)
        row["eval_time_s"] = round(time.perf_counter() - t0, 3)
        self.result.evals.append(row)
        if self.result.best is None or row["main"] > self.result.best["main"]:
            self.result.best = row
        self.log.info(f"[Eval] epoch: {epoch}, total time: {row['eval_time_s']:.5f} sec, best_metric: "
                      f"{self.result.best['main']:.5f} (epoch {self.result.best['epoch']})")
        return row

    def save(self, name: str, epoch: int) -> Path:
        """A classifier directory with this step's training state (a resumable checkpoint)."""
        path = rundir.save(self, name, epoch)
        self.result.checkpoint_dir, self.saved_step = path, self.step
        self.log.info(f"[save] {name}: {path}")
        return path

    def run(self) -> FinetuneResult:
        from gptforge.train.checkpoint import clean_stale_tmp
        from gptforge.train.interrupt import StopSignals

        clean_stale_tmp(self.output_dir)  # temps of a killed run's saves (their writer is dead)
        self.start.start_over(extra_files=(RESULTS_FILE,))
        self.log = self._logger()
        self._header()
        try:
            with StopSignals() as stop:
                self._epochs(stop)
        except BaseException:  # an error or an interrupt: tracker runs are marked failed and closed
            self.log.close(ok=False)
            raise
        self.result.steps = self.step
        rundir.write_results(self)
        self.log.close()
        return self.result

    def _header(self) -> None:
        n_params = sum(p.numel() for p in self.clf.parameters())
        self.log.info(f"gptforge finetune: {self.task.name}, {len(self.train_ds)} train examples, "
                      f"{', '.join(f'{k} {len(v)}' for k, v in self.evals.items()) or 'no eval'}; "
                      f"{n_params / 1e6:.2f}M parameters, {self.clf.num_classes} classes, batch {self.bs} "
                      f"(micro {self.micro}), {self.steps_per_epoch} steps/epoch, {self.total} steps, "
                      f"{self.precision.name}, device {self.device}, output {self.output_dir}")
        if self.start.resume is not None:
            self.log.info(f"resumed from {self.start.resume} at step {self.step}")

    def _epochs(self, stop) -> None:
        import itertools

        from gptforge.train.metrics import train_line

        e, cfg = self.cfg.Engine, self.cfg
        epoch_mode = e.run_mode == "epoch"
        window, window_n, t_window = 0.0, 0, time.perf_counter()
        first = self.step // self.steps_per_epoch + 1
        for epoch in range(first, self.epochs + 1):
            loader = batches(self.train_ds, self.bs, self.clf.pad_token_id, shuffle=self.shuffle,
                             drop_last=self.drop_last, seed=cfg.Global.seed + epoch)
            done = self.step - (epoch - 1) * self.steps_per_epoch if epoch == first else 0  # a resumed epoch
            t_epoch = time.perf_counter()
            for batch in itertools.islice(loader, done, None):
                if self.step >= self.total:
                    break
                if stop.requested:
                    rundir.interrupt(self, stop.signum, epoch)
                stats = self.train_step(batch)
                self.step += 1
                self.result.losses.append(stats["loss"])
                window += stats["loss"]
                window_n += 1
                self.log.progress(self.step, stats["loss"])
                if self.step % e.logging_freq == 0 or self.step == self.total:
                    cost = (time.perf_counter() - t_window) / window_n
                    self.log.info(train_line(epoch, self.epochs, self.step, self.total, window / window_n, cost,
                                             stats["tokens"], 1, stats["lr"], stats["found_inf"],
                                             self.precision.loss_scale))
                    self.log.record("train", self.step, {"loss": window / window_n, "lr": stats["lr"],
                                                         "grad_norm": stats["grad_norm"], "epoch": epoch})
                    window, window_n, t_window = 0.0, 0, time.perf_counter()
                last = self.step == self.total
                if not epoch_mode:
                    if self.evals and (self.step % e.eval_freq == 0 or last):
                        self.evaluate(epoch)
                    save_steps = e.save_load.save_steps
                    if (save_steps and self.step % save_steps == 0) or last:
                        self.save(f"step_{self.step}", epoch)
            self.log.info(f"[Training] epoch: {epoch}, total time: {time.perf_counter() - t_epoch:.5f} sec")
            if epoch_mode:
                last = self.step >= self.total
                if self.evals and (epoch % e.eval_freq == 0 or last):
                    self.evaluate(epoch)
                if epoch % e.save_load.save_epoch == 0 or last:
                    self.save(f"epoch_{epoch}", epoch)
            if self.step >= self.total:
                break


def finetune(cfg: Config, pretrained: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
             progress: bool | None = None, echo: bool = True, resume=None, force: bool = False) -> FinetuneResult:
    """Fine-tune the model at `pretrained` (default Model.pretrained) on the GLUE task of
    `cfg.Data.Train.dataset` and return a `FinetuneResult`; classifier directories are written
    under Engine.save_load.output_dir.

    The output directory is the run's, as for `pretrain`: locked while the run lasts, another
    run's checkpoints there refused unless `force` (which deletes them), `resume` ("auto", a
    saved `epoch_N` / `step_N`, or default `Engine.save_load.ckpt_dir`) continues a run exactly;
    SIGINT / SIGTERM save the current step and raise `TrainingInterrupted`."""
    from gptforge.config.resolve import world_size_from_env
    from gptforge.run_lock import lock_dir

    if world_size_from_env() > 1:
        raise ConfigError("WORLD_SIZE > 1: gptforge finetune runs in one process (as the reference's "
                          "GPTFinetuneModule); launch it without torchrun")
    out = Path(cfg.Engine.save_load.output_dir).expanduser()
    made_dir = not out.exists()
    lock = lock_dir(out, "finetune")  # a second writer fails here, naming this process
    try:
        return _finetune(cfg, pretrained, device, progress, echo, resume, force)
    except BaseException:
        if made_dir:
            lock.release()
            with contextlib.suppress(OSError):
                out.rmdir()  # only if this run put nothing there
        raise
    finally:
        lock.release()


def _finetune(cfg: Config, pretrained, device, progress, echo, resume, force) -> FinetuneResult:
    from gptforge.train.process import seed_everything
    from gptforge.train.run_start import plan_start

    start = plan_start(cfg, resume=resume, force=force, kinds=rundir.KINDS, echo=echo)
    task, loss, metric = _task_settings(cfg)
    num_classes = _num_classes(cfg, task)
    path = start.resume if start.resume is not None else pretrained_path(cfg, pretrained)
    dev = _device(device if device is not None else cfg.Global.device)
    seed_everything(cfg.Global.seed)
    clf, cfg, tok = build_classifier(cfg, path, dev, num_classes)
    if start.resume is not None:  # the run's own starting point, not the checkpoint it resumes
        from gptforge.model_io import read_checkpoint_config

        cfg.Model.pretrained = (read_checkpoint_config(start.resume).get("Model") or {}).get("pretrained") or path
    # The classifier directories record where their data is: absolute, so that `gptforge eval
    # --ckpt OUTPUT/epoch_N` finds the dev split from any directory.
    for ds in (cfg.Data.Train.dataset, cfg.Data.Eval.dataset):
        if ds.root:
            ds.root = str(Path(ds.root).expanduser().resolve())
    cfg.Model.pretrained = str(Path(cfg.Model.pretrained).resolve())
    train, evals = _datasets(cfg, task, tok, clf.gpt.wpe.weight.shape[0])
    return _Run(cfg, clf, tok, task, loss, metric, train, evals, dev, progress, echo, start).run()


def summary_line(res: FinetuneResult, run_mode: str = "epoch") -> str:
    """The run's last line: the best evaluation and the directory holding it, then the last save."""
    head = f"gptforge finetune: {res.task}, {res.steps} steps"
    if res.best is None:
        return f"{head} -> {res.checkpoint_dir}"
    unit = "epoch" if run_mode == "epoch" else "step"
    shown = ", ".join(f"{k} {v['main']:.4f}" for k, v in res.best.items() if isinstance(v, dict))
    where = res.best.get("checkpoint")
    best = (f"best ({unit} {res.best[unit]}): {shown} -> {where}" if where else
            f"best ({unit} {res.best[unit]}, not saved): {shown}")
    last = "" if where == str(res.checkpoint_dir) else f"; last: {res.checkpoint_dir}"
    return f"{head}; {best}{last}"
