"""Process-wide settings a training run makes once: seeds. (The CPU allocator's tuning, which the
decode backend shares, is `device.tune_cpu_allocator`.)"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
