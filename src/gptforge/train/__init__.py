"""Training: the loop (`Trainer`, `pretrain`), optimizer + LR schedule, precision, recompute,
checkpoints, metrics and the parallelism seam."""

from gptforge.train.trainer import NonFiniteLossError, Trainer, TrainResult, load_pretrained, pretrain

__all__ = ["NonFiniteLossError", "TrainResult", "Trainer", "load_pretrained", "pretrain"]
