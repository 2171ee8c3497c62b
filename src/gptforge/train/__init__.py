"""Training: the loop (`Trainer`, `pretrain`), optimizer + LR schedule, precision, recompute,
checkpoints, metrics and the parallelism seam."""

from gptforge.train.trainer import NonFiniteLossError, Trainer, TrainResult, pretrain
from gptforge.train.weights import load_pretrained

__all__ = ["NonFiniteLossError", "TrainResult", "Trainer", "load_pretrained", "pretrain"]
