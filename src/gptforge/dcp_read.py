"""Reading torch.distributed.checkpoint (DCP) directories in one process.

Model loading (`model_io`) and training (`train/`) both read DCP step directories; this module is
their common floor, so that `model_io` needs nothing from `train/` and `train/checkpoint.py` and
`train/dist_checkpoint.py` do not import each other.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from gptforge.errors import CheckpointError

METADATA_FILE = ".metadata"


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """A directory written by DCP (it has `.metadata`)."""
    return (Path(path) / METADATA_FILE).is_file()


def dcp_load(state: dict, path: Path, no_dist: bool) -> None:
    """`dcp.load` into `state` in place; `no_dist` reads without a process group."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # Reading in one process is the point here, not a fallback worth a warning.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=no_dist)


def read_model_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a DCP checkpoint, in this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    p = Path(path)
    try:
        reader = dcp.FileSystemReader(str(p))
        md = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - DCP raises several types
        raise CheckpointError(f"{p / METADATA_FILE}: unreadable ({type(e).__name__}: {e})") from None
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    if not sd:
        raise CheckpointError(f"{p}: the distributed checkpoint holds no model.* tensors")
    try:
        dcp_load(sd, p, no_dist=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{p}: cannot read the distributed checkpoint ({type(e).__name__}: {e})") from None
    return {k[len("model."):]: v for k, v in sd.items()}
