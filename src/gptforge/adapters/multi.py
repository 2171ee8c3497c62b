"""Several LoRA/DoRA adapters over one base model at once, chosen per token row: what `serve`
needs to decode requests for different adapters in one continuous batch (vLLM's multi-LoRA,
punica's idea at our size).

`serve_adapters(model, [(name, dir), ...])` wraps every Linear some adapter targets in a
`MultiLoraLinear` (base + each adapter's pairs, kept apart by adapter index) and returns the
model's `AdapterRouter`. Before a forward pass the caller says which rows (token positions of
the flattened input, e.g. the packed row of a ragged step) belong to which adapter:

    with router.route({"sql": [0, 1, 2], "chat": [3]}):   # other rows: the base alone
        model.hidden_states(...)

Each wrapped Linear runs its base once over all rows, then, for each adapter present in the
step, gathers that adapter's rows (index_select), adds its update with the same arithmetic as a
`LoraLinear` holding that adapter alone (`layers.apply_pairs`) and writes them back
(index_copy): no loop over rows and no weight copies. DoRA fits too: its factor m/‖W + s·B·A‖
is per output feature, so each row's DoRA output follows from that row's base output.

Head (lm_head) adapters are refused: the vocabulary projection is tied to the embedding and
runs over the logits rows, not the token rows (use `generate --adapter`, or merge the rest).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from gptforge.adapters.inject import WRAPPABLE
from gptforge.adapters.layers import (
    FULL,
    LoraPair,
    WrappedLinear,
    apply_pairs,
    base_forward,
    effective_weight,
)
from gptforge.adapters.peft_format import HEAD, read_pairs
from gptforge.errors import UsageError


class AdapterRouter:
    """The served adapters' names (index = position) and, during one forward pass, the rows each
    adapter present owns (`route`). Shared by every `MultiLoraLinear` of a model."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.groups: list[tuple[int, torch.Tensor]] = []  # (adapter index, row indices) of the current pass

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"unknown adapter {name!r}; this model serves {self.names}") from None

    @contextlib.contextmanager
    def route(self, rows: Mapping[str, Sequence[int]], device=None) -> Iterator[None]:
        """Within the block, the rows `rows[name]` of every forward pass get adapter `name`."""
        self.groups = [(self.index(n), torch.tensor(list(r), dtype=torch.long, device=device))
                       for n, r in rows.items() if len(r)]
        try:
            yield
        finally:
            self.groups = []


class MultiLoraLinear(WrappedLinear):
    """A block Linear (`base`) with the pairs of several adapters (`variants[str(index)]`:
    `full`, or q/k/v slices of a fused QKV), applied to the rows the router gives each."""

    def __init__(self, base: nn.Module, router: AdapterRouter, head_dim: int | None = None):
        super().__init__()
        self.base = base
        self.head_dim = head_dim
        self.variants = nn.ModuleDict()
        self.__dict__["router"] = router  # shared, not a submodule

    def add(self, index: int, name: str, pair: LoraPair) -> None:
        """Put `pair` (over slice `name`) into adapter `index`'s pairs."""
        if name != FULL and self.head_dim is None:
            raise ValueError(f"slice {name!r} needs the fused QKV projection")
        pairs = self.variants[str(index)] if str(index) in self.variants else nn.ModuleDict()
        if name in pairs or (len(pairs) and (name == FULL or FULL in pairs)):
            raise ValueError(f"adapter {index} already has a pair over the rows of {name!r}")
        pairs[name] = pair
        self.variants[str(index)] = pairs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = base_forward(self.base, x)
        todo = [(str(i), rows) for i, rows in self.router.groups if str(i) in self.variants]
        if not todo:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        bias, weight = getattr(self.base, "bias", None), None
        for key, rows in todo:
            pairs = self.variants[key]
            if weight is None and any(p.dora for p in pairs.values()):
                weight = effective_weight(self.base)
            new = apply_pairs(pairs, self.head_dim, flat_x.index_select(0, rows), flat_y.index_select(0, rows),
                              weight, bias)
            flat_y = flat_y.index_copy(0, rows, new)
        return flat_y.reshape(y.shape)

    def extra_repr(self) -> str:
        return f"adapters={[self.router.names[int(k)] for k in self.variants]}"


def router_of(model: nn.Module) -> AdapterRouter | None:
    """The router of a model prepared by `serve_adapters` (None: no served adapters)."""
    return next((m.router for m in model.modules() if isinstance(m, MultiLoraLinear)), None)


def _wrapper(model: nn.Module, path: str, router: AdapterRouter) -> MultiLoraLinear:
    mod = model.get_submodule(path)
    if isinstance(mod, MultiLoraLinear):
        return mod
    if not isinstance(mod, WRAPPABLE):
        raise UsageError(f"{path} is a {type(mod).__name__}; served adapters go on plain, fake-quant or INT8 Linears "
                         "(a model with adapters merged in or attached cannot take more)")
    head_dim = model.get_submodule(path.rpartition(".")[0]).head_dim if path.endswith("qkv_proj") else None
    wrapped = MultiLoraLinear(mod, router, head_dim)
    model.set_submodule(path, wrapped)
    return wrapped


def serve_adapters(model: nn.Module, adapters: Sequence[tuple[str, str | os.PathLike]]) -> AdapterRouter:
    """Load each (name, PEFT adapter directory) over `model` (in place, frozen, eval mode) to be
    routed by name; returns the router. All directories are read and checked before the model
    changes; errors are one line naming the adapter."""
    names = [n for n, _ in adapters]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise UsageError(f"--adapter {dup}: the name is given twice; give each adapter its own name")
    loaded = []
    for name, path in adapters:
        pairs, _ = read_pairs(model, path)
        if any(target == HEAD for target, _, _ in pairs):
            raise UsageError(f"--adapter {name}={path}: the adapter has a head (lm_head) pair, which is not served "
                             "beside other adapters (the head is tied to the embedding); use generate --adapter")
        loaded.append(pairs)
    router = AdapterRouter()
    device = model.wte.weight.device
    for index, ((name, _), pairs) in enumerate(zip(adapters, loaded, strict=True)):
        for target, slice_name, pair in pairs:
            _wrapper(model, target, router).add(index, slice_name, pair.to(device).eval())
        router.names.append(name)
    for p in model.parameters():
        p.requires_grad_(False)
    return router
