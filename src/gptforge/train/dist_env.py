"""Process-group setup for distributed training: topology, backend, device, mesh and seeds.

The rank layout follows the reference's hybrid topology: `dp` outermost, then `pp`, then
`sharding`, then `mp` innermost, so tensor-parallel peers are neighbouring ranks (one node, fast
links) and the data rank is `dp_rank·sharding + sharding_rank` (spec §2.5); the stages of one
pipeline read the same data slice. A launch that did not go through torchrun (no `WORLD_SIZE`) is one
process and never touches torch.distributed.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from gptforge.config.schema import Config
from gptforge.errors import ConfigError

BACKENDS = ("nccl", "gloo")
MESH_DIMS = ("dp", "pp", "sharding", "mp")


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the dp × pp × sharding × mp grid."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    dp: int = 1
    sharding: int = 1
    mp: int = 1
    pp: int = 1

    @property
    def mp_rank(self) -> int:
        return self.rank % self.mp

    @property
    def sharding_rank(self) -> int:
        return (self.rank // self.mp) % self.sharding

    @property
    def pp_rank(self) -> int:
        return (self.rank // (self.mp * self.sharding)) % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.mp * self.sharding * self.pp)

    @property
    def data_rank(self) -> int:
        """Which slice of every global batch this process reads (the sampler's rank)."""
        return self.dp_rank * self.sharding + self.sharding_rank

    @property
    def data_world_size(self) -> int:
        return self.dp * self.sharding

    def degrees(self) -> dict[str, int]:
        return {"dp_degree": self.dp, "sharding_degree": self.sharding, "mp_degree": self.mp, "pp_degree": self.pp}


def env_rank() -> tuple[int, int, int]:
    """(world size, rank, local rank) as torchrun sets them; (1, 0, 0) otherwise."""
    def read(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            raise ConfigError(f"{name}={os.environ[name]!r}: not an integer (set by torchrun)") from None

    return max(1, read("WORLD_SIZE", 1)), read("RANK", 0), read("LOCAL_RANK", 0)


def topology(cfg: Config, world_size: int, rank: int, local_rank: int = 0) -> Topology:
    """The Topology of `rank`; `cfg` must have passed `check_distributed`."""
    d = cfg.Distributed
    return Topology(world_size, rank, local_rank, d.dp_degree or 1, d.sharding.sharding_degree, d.mp_degree,
                    d.pp_degree)


def backend_for(cfg: Config, device: torch.device) -> str:
    """`Distributed.backend` if set, else NCCL for CUDA devices and gloo for CPU."""
    b = cfg.Distributed.backend
    if b:
        b = b.lower()
        if b not in BACKENDS:
            raise ConfigError(f"Distributed.backend: {cfg.Distributed.backend!r} is not one of {', '.join(BACKENDS)}")
        if b == "nccl" and device.type != "cuda":
            raise ConfigError("Distributed.backend: nccl needs CUDA devices; use gloo on CPU (or leave it blank)")
        return b
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """One GPU per process: `cuda` becomes `cuda:LOCAL_RANK` (an explicit `cuda:N` is kept for
    single-process runs only, where it cannot collide)."""
    if device.type != "cuda":
        return device
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise ConfigError(f"Global.device: local rank {local_rank} has no GPU ({n} visible); launch at most "
                          f"{n} processes per node (torchrun --nproc_per_node={n})")
    return torch.device("cuda", local_rank)


def init_process_group(cfg: Config, device: torch.device, topo: Topology) -> bool:
    """Join the default process group torchrun describes, once per process; True when this
    call created it.

    The group then lives until the process exits (an atexit hook tears it down) and later
    runs in the same process reuse it: torch caches device meshes and their sub-groups
    process-wide, so a destroyed and re-created group would leave stale groups behind them.
    """
    import atexit

    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != topo.world_size:
            raise ConfigError(f"WORLD_SIZE={topo.world_size} but the existing process group has "
                              f"{dist.get_world_size()} ranks")
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The default 10-minute timeout is short for a first step that builds index maps on rank 0.
    timeout = datetime.timedelta(minutes=int(os.environ.get("GPTFORGE_DIST_TIMEOUT_MIN", "30")))
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend_for(cfg, device), rank=topo.rank, world_size=topo.world_size,
                            timeout=timeout, **kwargs)
    atexit.register(_destroy)
    return True


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


_MESHES: dict = {}
_DATA_GROUPS: dict = {}


def build_mesh(topo: Topology, device: torch.device):
    """The 4-D ("dp", "pp", "sharding", "mp") DeviceMesh over all ranks (axes of size 1 included);
    one per layout and process, so repeated runs do not pile up process groups."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device.type, topo.world_size, topo.dp, topo.pp, topo.sharding, topo.mp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device.type, (topo.dp, topo.pp, topo.sharding, topo.mp),
                                         mesh_dim_names=MESH_DIMS)
    return _MESHES[key]


def data_group(topo: Topology):
    """The group of ranks holding the same model slice (same mp rank and pipeline stage): the
    data ranks gradients and a logged loss are averaged over. None (= every rank) without
    tensor or pipeline parallel."""
    import torch.distributed as dist

    if topo.mp == 1 and topo.pp == 1:
        return None
    key = (topo.world_size, topo.mp, topo.pp, topo.sharding)
    if key not in _DATA_GROUPS:
        def slice_of(r: int) -> tuple[int, int]:
            return r % topo.mp, (r // (topo.mp * topo.sharding)) % topo.pp

        # Every rank creates every group (a collective), then keeps its own.
        slices = sorted({slice_of(r) for r in range(topo.world_size)})
        _DATA_GROUPS[key], _ = dist.new_subgroups_by_enumeration(
            [[r for r in range(topo.world_size) if slice_of(r) == s] for s in slices])
    return _DATA_GROUPS[key]


_PAIR_GROUPS: dict = {}


def tied_pair_group(topo: Topology, first: int, last: int):
    """The group of this rank's pipeline ranks `first` and `last` (pp ranks of the stages that
    hold the tied word embedding); None when this rank is neither, or both are this rank."""
    import torch.distributed as dist

    if first == last:
        return None
    key = (topo.world_size, topo.mp, topo.pp, topo.sharding, first, last)
    if key not in _PAIR_GROUPS:
        stride = topo.mp * topo.sharding
        mine = None
        # new_group is collective over every rank: create all pairs everywhere, keep ours.
        for r in range(topo.world_size):
            if (r // stride) % topo.pp != first:
                continue
            pair = [r, r + (last - first) * stride]
            g = dist.new_group(pair)
            if topo.rank in pair:
                mine = g
        _PAIR_GROUPS[key] = mine
    return _PAIR_GROUPS[key]


def dropout_seed(seed: int, topo: Topology) -> int:
    """The reference's `global_seed` (spec §1.7): equal across a tensor-parallel group (its
    ranks hold the same replicated activations), different for every data-parallel rank."""
    mp, pp, dp = topo.mp, topo.pp, topo.dp
    return (seed + 1024 + topo.world_size + topo.dp_rank * mp * pp + topo.sharding_rank * mp * pp * dp
            + topo.pp_rank * mp)


__all__ = ["BACKENDS", "MESH_DIMS", "Topology", "backend_for", "build_mesh", "data_group", "dropout_seed", "env_rank",
           "init_process_group", "rank_device", "tied_pair_group", "topology"]
