"""The training loop of `gptforge pretrain` (spec §4): setup order, step, eval, log, save, resume.

Setup follows the reference (spec §8.2): join the process group (under torchrun) → build the
model (or take the caller's) → load `Compress.pretrained` weights → the caller's transform
(fake-quant, pruning) → device → resume weights → recompute → parallel wrapping → compile →
precision → AdamW over the trainable parameters → resume optimizer/scheduler/scaler/RNG state.

One step consumes one global batch: the local batch is split into `accumulate_steps`
micro-batches whose `loss/acc` are backpropagated; then unscale (fp16) → clip → AdamW; the LR
schedule advances by the global batch only if the update happened. Steps are counted from 1:
`step_N` is the state after N updates and a run with `Engine.max_steps=N` does exactly N
(the reference does N+1 and re-runs the saved step on resume; see docs/pretrain.md).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gptforge.config.schema import Config
from gptforge.errors import ConfigError, GPTForgeError
from gptforge.model import moe
from gptforge.train import checkpoint as ckpt
from gptforge.train import dist_checkpoint as dist_ckpt
from gptforge.train.distill import Distiller
from gptforge.train.interrupt import StopSignals, stop_run
from gptforge.train.metrics import (
    MoEWindow,
    RunLogger,
    device_name,
    eval_line,
    fmt_mfu,
    peak_flops,
    peak_memory_bytes,
    train_flops_per_token,
    train_line,
)
from gptforge.train.optim import LRSchedule, Scheduler, build_optimizer
from gptforge.train.parallel import init_parallel
from gptforge.train.precision import Precision
from gptforge.train.process import seed_everything
from gptforge.train.profile_window import ProfileWindow
from gptforge.train.recompute import apply_recompute
from gptforge.train.run_start import RunStart, plan_start
from gptforge.train.time_fit import TimeFit
from gptforge.train.trainer_data import TrainerData
from gptforge.train.trainer_eval import TrainerEval
from gptforge.train.trainer_report import TrainerReport
from gptforge.train.trainer_save import TrainerSaving
from gptforge.train.trainer_sync import TrainerSync
from gptforge.train.weights import check_same_shape, load_pretrained


class NonFiniteLossError(GPTForgeError):
    """Training produced a non-finite loss or gradient and `Engine.on_nonfinite` is `stop`."""

    def __init__(self, message: str, step: int, last_checkpoint: Path | None):
        super().__init__(message)
        self.step, self.last_checkpoint = step, last_checkpoint


@dataclass
class TrainResult:
    """What a run did: the last step, per-step losses of this process's steps, checkpoints."""

    step: int
    losses: list[float]
    checkpoint_dir: Path | None
    output_dir: Path
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


def _notice(msg: str) -> None:
    import sys

    print(f"gptforge: {msg}", file=sys.stderr)


class Trainer(TrainerData, TrainerEval, TrainerSaving, TrainerReport, TrainerSync):
    """Owns the model, optimizer, data iterators and run directory of one training run.

    `model`: an already-built (possibly transformed) model to train; default: built from
    `cfg.Model`. `transform(model) -> model` runs after `Compress.pretrained` weights are
    loaded (QAT inserts fake-quant modules here, pruning shrinks the model). `datasets`:
    {"Train": ..., "Eval": ...} to use instead of `build_datasets(cfg)`. `resume`: a step
    checkpoint, a run directory, or "auto" (the newest complete checkpoint in the output dir);
    default `Engine.save_load.ckpt_dir`. `start`: where the run starts, already decided by the
    caller (`run_start.plan_start`); it replaces `resume` and `overwrite`.

    The output directory has one owner: the main process holds its lock (`run_lock`, under
    the name `verb`) from here until `train()` returns. Checkpoints of another run there are
    refused unless `overwrite`, which deletes them (with the old metrics and logs) when
    training starts. SIGINT / SIGTERM during `train()` save the current step and raise
    `interrupt.TrainingInterrupted` (docs/pretrain.md).
    """

    distiller: Distiller | None = None  # Engine.distill: the teacher term of the loss

    def __init__(self, cfg: Config, model: nn.Module | None = None, tokenizer=None, *,
                 transform: Callable[[nn.Module], nn.Module] | None = None,
                 datasets: dict | None = None, resume: str | Path | None = None,
                 progress: bool | None = None, echo: bool = True, overwrite: bool = False,
                 verb: str = "pretrain", start: RunStart | None = None):
        from gptforge.config import check_train_shapes
        from gptforge.device import select_device, tune_cpu_allocator
        from gptforge.run_lock import lock_dir
        from gptforge.train.trackers import check_trackers

        check_train_shapes(cfg)
        check_trackers(cfg.Engine.trackers)  # a missing tracker package fails before any work
        self.cfg = cfg
        self.verb = verb  # names the verb in the run's header line (prune, qat, pretrain)
        e = cfg.Engine
        if e.run_mode != "step":
            raise ConfigError(f"Engine.run_mode: {e.run_mode!r} is not supported by pretrain; use step "
                              "(training length is Engine.max_steps)")
        # Validates Distributed against WORLD_SIZE; under torchrun joins the process group and
        # picks this rank's GPU.
        self.par = init_parallel(cfg, select_device(cfg.Global.device))
        self.device = self.par.device
        self.malloc_tuned = self.device.type == "cpu" and tune_cpu_allocator()
        self.output_dir = Path(e.save_load.output_dir).expanduser()
        made_dir = not self.output_dir.exists()
        # One writer per run directory: a second one fails here, before any work, naming the holder.
        self._lock = lock_dir(self.output_dir, verb) if self.par.is_main else None
        try:
            self._setup(cfg, model, tokenizer, transform, datasets, progress, echo,
                        self._start(cfg, start, resume, overwrite))
        except BaseException:
            self._release()
            if made_dir and self.par.is_main:
                with contextlib.suppress(OSError):
                    self.output_dir.rmdir()  # only if this run put nothing there
            raise

    def _start(self, cfg, start: RunStart | None, resume, overwrite: bool) -> RunStart:
        """Where the run starts; a decision taken before the lock is checked again under it."""
        if start is None:
            return plan_start(cfg, resume=resume, force=overwrite)
        start.check_lineage()
        return start

    def _setup(self, cfg, model, tokenizer, transform, datasets, progress, echo, start: RunStart) -> None:
        from gptforge.config import check_train_shapes

        e = cfg.Engine
        self.max_steps = e.max_steps
        self.gbs, self.local_bs = cfg.Global.global_batch_size, cfg.Global.local_batch_size
        self.acc = e.accumulate_steps
        self.start = start
        self.resume_dir = start.resume
        self.run_id = start.run_id  # keep_last prunes only this lineage
        seed_everything(cfg.Global.seed)

        # 1. model → pretrained weights → caller's transform → device → resumed weights
        resumed_whole = False
        if model is None and transform is None and self.resume_dir is not None:
            # The checkpoint knows its shape and structure (pruned widths, fake-quant modules).
            from gptforge.model_io import load_model

            model, shaped = load_model(self.resume_dir, cfg, with_structure=True)
            check_same_shape(cfg.Model, shaped.Model, self.resume_dir)
            cfg.Model = shaped.Model  # the saved config must describe the saved model
            check_train_shapes(cfg)
            resumed_whole = True
        elif model is None:
            from gptforge.model import build_model

            model = build_model(cfg.Model)
        if cfg.Compress.pretrained and self.resume_dir is None:
            load_pretrained(model, cfg.Compress.pretrained, cfg)
        if transform is not None:
            model = transform(model)
        model = model.to(self.device)
        if self.resume_dir is not None and not resumed_whole:
            ckpt.load_model_weights(self.resume_dir, model)
        self.model = model  # the plain model: saved, evaluated, handed back
        self.distiller = Distiller.from_config(cfg, self.device, int(model.wte.weight.shape[0]))
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        vocab = getattr(getattr(model, "config", None), "vocab_size", cfg.Model.vocab_size)
        if self.tokenizer.vocab_size > vocab:
            raise ConfigError(
                f"Data.tokenizer: {self.tokenizer.name!r} has {self.tokenizer.vocab_size} tokens but the model's "
                f"vocabulary is {vocab}; add -o Model.vocab_size={self.tokenizer.vocab_size} (presets tiny and mini "
                "are sized for a trained tokenizer, -o Data.tokenizer=DIR), or use the tokenizer the data was made with")
        self.datasets = datasets
        self._build_datasets()  # data errors surface before the optimizer and run directory exist

        # 2. recompute → compile → parallel → precision → optimizer
        m = cfg.Model
        granularity = m.recompute_granularity if (m.use_recompute or m.recompute_granularity) else None
        if self.par.pp_recompute_interval:
            granularity = None  # the pipeline stages recompute segments of blocks themselves
        self.recomputed = apply_recompute(model, granularity, m.no_recompute_layers or []) or (
            ["pipeline segments"] if self.par.pp_recompute_interval else [])
        self.flops_per_token = train_flops_per_token(model, cfg.Data.Train.dataset.max_seq_len)
        train_model = self.par.wrap(model)  # TP/FSDP2 change `model` in place; DDP wraps it
        if self.par.pipelined:
            # This rank's stages: the modules it trains, saves and evaluates.
            self.model = model = train_model
        if self.par.distributed:
            # Every rank built the same weights from Global.seed; dropout now draws per rank
            # (same across a tensor-parallel group, different across data ranks).
            self.par.seed_rngs()
        if e.compile:
            if self.device.type == "cpu":
                _notice("Engine.compile on CPU: expect no speed-up at model scale and 10-50 s of compile time")
            train_model = torch.compile(train_model)
        self.train_model = train_model
        self.precision = Precision(e.mix_precision, self.device)
        self.optimizer = self.par.prepare_optimizer(build_optimizer(model, cfg.Optimizer))
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.scheduler = Scheduler(self.optimizer, LRSchedule.from_config(cfg))

        # 3. training state
        self.step, self.eval_consumed, self.eval_batches_done = 0, 0, 0
        self.last_checkpoint: Path | None = None
        if self.resume_dir is not None:
            meta = dist_ckpt.load_training_state(self.resume_dir, model, self.optimizer, self.scheduler,
                                                 self.precision, self.par)
            self.step = int(meta["step"])
            self.eval_consumed = int(meta.get("eval_consumed_samples", 0))
            self.eval_batches_done = int(meta.get("eval_batches", 0))
            self.last_checkpoint = self.resume_dir
            if int(meta.get("global_batch_size", self.gbs)) != self.gbs:
                raise ConfigError(f"Global.global_batch_size: {self.gbs} differs from the checkpoint's "
                                  f"{meta['global_batch_size']} ({self.resume_dir}); resume with the same batch size")
        self.progress, self.echo = progress, echo
        self.moe_window = MoEWindow() if moe.moe_layers(model) else None
        self.peak = peak_flops(self.device, self.precision.name)

    # -------------------------------------------------------------------------- step

    def _forward_loss(self, batch: dict, model: nn.Module) -> torch.Tensor:
        with self.precision.autocast():
            out = model(batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"],
                        loss_mask=batch["loss_mask"])
            if self.distiller is not None and model.training:  # evaluation reports the plain loss
                return self.distiller.loss(out.loss, out.logits, batch)
        return out.loss

    def train_step(self, batch: dict) -> dict:
        """One optimizer step on one local batch; returns loss, lr, grad_norm, found_inf."""
        model = self.train_model
        model.train()
        lr = self.scheduler.lr
        micro = [{k: v[i * self.cfg.Global.micro_batch_size:(i + 1) * self.cfg.Global.micro_batch_size]
                  for k, v in batch.items()} for i in range(self.acc)]
        total = torch.zeros((), device=self.device)
        if self.par.pipelined:
            with self.precision.autocast():
                total += self.par.pipeline_step(batch) * self.acc  # mean → sum, as the loop's
            micro = []
        for i, mb in enumerate(micro):
            with self.par.no_sync(model, i == self.acc - 1):
                loss = self._forward_loss(mb, model)
                if self.moe_window is not None:
                    # The reference adds weight x the mean per-layer balancing loss to the loss.
                    aux = moe.aux_loss(model)
                    if aux is not None and self.cfg.Model.balance_loss_weight:
                        loss = loss + self.cfg.Model.balance_loss_weight * aux
                    self.moe_window.add(moe.load_stats(model))
                self.precision.backward(loss / self.acc)
            total += loss.detach().float()
        self.par.finish_backward(self.params)
        loss_val = float(self.par.mean(total / self.acc))
        self.precision.unscale_(self.optimizer)
        norm = self.par.clip_grad_norm_(self.params, self.cfg.Optimizer.grad_clip.clip_norm)
        norm_val = float(norm)
        bad = not (math.isfinite(loss_val) and math.isfinite(norm_val))
        if bad and not self.precision.fp16:
            if self.cfg.Engine.on_nonfinite == "stop":
                self.optimizer.zero_grad(set_to_none=True)
                where = self.last_checkpoint or "none saved yet"
                raise NonFiniteLossError(
                    f"step {self.step + 1}: {'loss' if not math.isfinite(loss_val) else 'gradient norm'} is "
                    f"{loss_val if not math.isfinite(loss_val) else norm_val} ({self.precision.name}); training "
                    f"stopped, last good checkpoint: {where}. Lower Optimizer.lr.max_lr, or set "
                    "Engine.on_nonfinite=skip to skip such steps", self.step + 1, self.last_checkpoint)
            stepped = False  # skip: no update, no LR advance
        else:
            stepped = self.precision.step(self.optimizer)
        if stepped:
            self.scheduler.advance(self.gbs)
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_val, "lr": lr, "grad_norm": norm_val, "found_inf": int(not stepped),
                "loss_scale": self.precision.loss_scale}

    # -------------------------------------------------------------------------- loop

    def train(self) -> TrainResult:
        """Run until `Engine.max_steps` steps are done; returns a `TrainResult`. Gives the output
        directory's lock back when it returns or fails."""
        try:
            return self._train()
        finally:
            self._release()

    def _train(self) -> TrainResult:
        e, cfg = self.cfg.Engine, self.cfg
        train_len = len(self.datasets["Train"])
        if self.par.is_main:
            ckpt.clean_stale_tmp(self.output_dir)
            self.start.start_over()
            self._write_run_config()
        self.par.barrier()  # no rank writes a checkpoint before the stale temp dirs are gone
        # Records past the resumed step were logged by a run that died before saving them: drop
        # them so each step has one record however many times the run is resumed.
        log = RunLogger(self.output_dir, enabled=self.par.is_main, total_steps=self.max_steps,
                        start_step=self.step, progress=self.progress, echo=self.echo, truncate_after=self.step,
                        tensorboard="tensorboard" in e.trackers, trackers=self._trackers)
        seq = cfg.Data.Train.dataset.max_seq_len
        tokens_per_step = self.gbs * seq
        save_steps = e.save_load.save_steps
        losses: list[float] = []
        eval_losses: list[tuple[int, float]] = []
        start_step = self.step
        self._header(log, start_step)
        window_loss, window_inf, window_steps = 0.0, 0, 0
        t_window = t_start = time.perf_counter()
        train_iter = self._batches("Train", self.step * self.gbs)
        eval_total = e.eval_iters * (self.max_steps // e.eval_freq) if self._eval_enabled() else 0
        prof = ProfileWindow(cfg, self.output_dir, self.device, log) if cfg.Profiler.enable else None
        fit = TimeFit(self.scheduler.schedule, self.max_steps, e.max_time, self.gbs, self.step, e.fit_max_steps) \
            if e.fit_to_max_time and e.max_time else None
        stop = StopSignals()
        try:
            stop.__enter__()
            while self.step < self.max_steps:
                if prof is not None:
                    prof.before(self.step + 1)
                stats = self.train_step(next(train_iter))
                self.step += 1
                if prof is not None:
                    prof.after(self.step)
                log.progress(self.step)
                losses.append(stats["loss"])
                window_loss += stats["loss"]
                window_inf += stats["found_inf"]
                window_steps += 1
                if self.step % e.logging_freq == 0 or self.step == self.max_steps:
                    now = time.perf_counter()
                    if fit is not None:
                        self._refit(fit, now - t_start, log)
                    cost = (now - t_window) / window_steps
                    mean_loss = window_loss / window_steps
                    epoch = (self.step * self.gbs - 1) // train_len
                    log.info(train_line(epoch, e.num_train_epochs, self.step, self.max_steps, mean_loss, cost,
                                        tokens_per_step, self.par.data_world_size, stats["lr"], window_inf,
                                        stats["loss_scale"]))
                    tps = tokens_per_step / cost
                    mfu = self.flops_per_token * tps / self.par.world_size / self.peak if self.peak else None
                    log.record("train", self.step, {
                        "loss": mean_loss, "lr": stats["lr"], "grad_norm": stats["grad_norm"],
                        "found_inf": window_inf, "loss_scale": stats["loss_scale"], "step_time": cost,
                        "tokens_per_s": tps, "mfu": mfu, "consumed_samples": self.step * self.gbs,
                        **(self.moe_window.values() if self.moe_window is not None else {}),
                        **self._extra_line(log, "train")})
                    if self.moe_window is not None:
                        log.info(self.moe_window.line())
                        self.moe_window.reset()
                    log.progress(self.step, mean_loss)
                    window_loss, window_inf, window_steps, t_window = 0.0, 0, 0, now
                if self._eval_enabled() and self.step % e.eval_freq == 0:
                    t0 = time.perf_counter()
                    eval_loss = self.evaluate()
                    cost = (time.perf_counter() - t0) / e.eval_iters
                    eval_losses.append((self.step, eval_loss))
                    log.info(eval_line(0, self.eval_batches_done, eval_total, eval_loss, cost))
                    log.record("eval", self.step, {"loss": eval_loss, "ppl": math.exp(min(eval_loss, 50.0)),
                                                   "eval_time": cost * e.eval_iters, **self._extra_line(log, "eval")})
                    t_window += time.perf_counter() - t0  # eval time is not train time
                out_of_time = self._out_of_time(t_start)
                saved = (save_steps and self.step % save_steps == 0) or self.step == self.max_steps or out_of_time
                if saved:
                    t0 = time.perf_counter()
                    self._save(stats["loss"], log)
                    t_window += time.perf_counter() - t0
                if self.step < self.max_steps and self._any_rank(stop.requested):  # Ctrl-C / SIGTERM
                    stop_run(stop.signum, self.step, self.last_checkpoint if saved else self._save(stats["loss"], log),
                             log)
                if out_of_time and self.step < self.max_steps:
                    log.record("stop", self.step, {"reason": "max_time", "max_time": e.max_time,
                                                   "last_checkpoint": str(self.last_checkpoint)})
                    log.info(f"[stop] Engine.max_time: {e.max_time:g} s of training reached at step {self.step} of "
                             f"{self.max_steps}; checkpoint {self.last_checkpoint}"
                             f"{'; its lr decay is complete (Engine.fit_to_max_time)' if fit else ' (--resume auto continues)'}")
                    break
        except NonFiniteLossError as err:
            log.record("stop", err.step, {"reason": "nonfinite", "last_checkpoint": str(err.last_checkpoint)})
            log.info(f"[stop] {err}")
            log.close(ok=False)
            raise
        except BaseException:  # an error or an interrupt: tracker runs are marked failed and closed
            log.close(ok=False)
            raise
        finally:
            stop.__exit__()
        elapsed = time.perf_counter() - t_start
        done = self.step - start_step
        tps = done * tokens_per_step / elapsed if done and elapsed > 0 else 0.0
        mfu = self.flops_per_token * tps / self.par.world_size / self.peak if self.peak and tps else None
        summary = {"steps": done, "train_time_s": elapsed, "tokens_per_s": tps, "mfu": mfu,
                   "peak_memory_bytes": peak_memory_bytes(self.device), "device": device_name(self.device),
                   "precision": self.precision.name, "final_loss": losses[-1] if losses else None}
        log.info(f"[Training] epoch: 0, total time: {elapsed:.5f} sec, steps: {done}, tokens/s: {tps:.0f}, "
                 f"MFU: {fmt_mfu(mfu)}, peak memory: {summary['peak_memory_bytes'] / 2**30:.2f} GiB")
        log.record("summary", self.step, summary)
        log.close()
        return TrainResult(step=self.step, losses=losses, checkpoint_dir=self.last_checkpoint,
                           output_dir=self.output_dir, eval_losses=eval_losses, metrics=summary)


def pretrain(cfg: Config, model: nn.Module | None = None, tokenizer=None, **kwargs) -> TrainResult:
    """Train `cfg` (a resolved Config) and return a `TrainResult`. Keyword arguments go to `Trainer`.
    Under torchrun every process calls this (the process group stays for later runs until exit)."""
    return Trainer(cfg, model, tokenizer, **kwargs).train()


__all__ = ["NonFiniteLossError", "TrainResult", "Trainer", "pretrain"]
