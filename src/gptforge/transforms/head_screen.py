"""Greedy decoding's next token without reading the whole LM head: an int8 screen with a proven
error bound, then exact logits for the few columns that can still hold the maximum.

At batch 1 the tied head is the largest read of a decode step (GPT-2 124M: 154 MB of fp32
weights of ~490, 77 of ~245 in bf16), yet a greedy request that reads no scores (no log-probs,
no kept scores) only needs the argmax. The screen is the head rounded to int8 with one scale
per row (39 MB), run on the weight-only int8 kernel. For a hidden row h, the logit the head's
own kernel computes, exact(n), and the screen's, approx(n), satisfy

    |exact(n) - approx(n)| <= B = ||h||_2 * slack,
    slack = max_n ||w_n - s_n q_n||_2 + gamma * (max_n ||w_n||_2 + max_n ||s_n q_n||_2)

(Cauchy-Schwarz on the weights' rounding; gamma = (K + 16) u bounds any fp32 dot product's own
rounding error, whatever its summation order, relative to sum |h_k w_nk|). So every column whose
exact logit is the row's maximum has approx >= max approx - 2B: those candidates (a few dozen
even on a random model's flat logits) get their logits from the head's own kernel, bit for bit,
and every other column -inf. The argmax, and the first maximum among ties, are the full
logits'. Columns a greedy row may not produce (a vocabulary limit, EOS before `min_tokens`) are
dropped before the maximum is taken. Any non-finite value, or magnitudes near fp32's range,
return None: the caller computes the full head.
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gptforge.transforms import huge_pages, native_kernels
from gptforge.transforms.cpu_kernels import requested_choice
from gptforge.transforms.head import embedding_logits
from gptforge.transforms.weight_only import WeightOnlyEmbedding

ENV = "GPTFORGE_HEAD_SCREEN"  # auto (default) | off: always the full head
# Rows a screened call takes: the weight-only kernel's per call. Against the 124M head on 2 AVX2
# cores the screen took 0.43x the fp32 head's time at 1 row, 0.73x at 8; a bf16 head reads half
# of fp32's bytes, so there it pays only up to 2 rows (0.71x at 1, 0.86x at 2, ~1x at 4-8).
MAX_ROWS = 8
BF16_MAX_ROWS = 2
_U = 2.0 ** -24  # fp32 unit roundoff
_SAFE = 1e36  # |h| * |w| beyond this could overflow a partial sum: no screen
_CHUNK = 4096  # rows of the head per float64 pass when building (bounded memory)

# A column mask per row: (limit: columns >= it are never chosen, or None; forbidden ids).
Mask = tuple[int | None, Sequence[int]]


@dataclass
class Screen:
    q: torch.Tensor  # int8 [V, K]
    scale: torch.Tensor  # fp32 [V, 1]
    slack: float  # B / ||h||_2
    w_norm: float  # max_n ||w_n||_2


def enabled() -> bool:
    """`GPTFORGE_HEAD_SCREEN`: auto (screen where it applies) or off; another value is a UsageError."""
    return requested_choice(None, ENV, ("auto", "off"), ENV) == "auto"


def available() -> bool:
    """Whether the screen runs here: the native kernels are built and not switched off."""
    return enabled() and native_kernels.unavailable() is None and native_kernels.isa() != "scalar"


@torch.no_grad()
def build(weight: torch.Tensor) -> Screen | None:
    """The int8 screen of a head weight [V, K] (fp32, or bf16 values), or None where it has a
    non-finite value."""
    w = weight.detach()
    V, K = w.shape
    q = huge_pages.empty((V, K), torch.int8)  # streamed whole at every screened step
    scale = torch.empty(V, 1)
    dw = wn = whn = 0.0
    for a in range(0, V, _CHUNK):
        part = w[a:a + _CHUNK].float()
        if not torch.isfinite(part).all():
            return None
        s = (part.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        qa = torch.round(part / s).clamp_(-127, 127)
        q[a:a + _CHUNK] = qa.to(torch.int8)
        scale[a:a + _CHUNK] = s
        exact, hat = part.double(), qa.double() * s.double()
        dw = max(dw, float((exact - hat).norm(dim=1).max()))
        wn = max(wn, float(exact.norm(dim=1).max()))
        whn = max(whn, float(hat.norm(dim=1).max()))
    gamma = (K + 16) * _U / (1 - (K + 16) * _U)
    # float64 norms are within ~K * 1e-16 of the real ones: the margin covers them.
    return Screen(q, scale, (dw + gamma * (wn + whn)) * (1 + 1e-6), wn)


_SCREENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def screen_of(module: torch.nn.Module, weight: torch.Tensor) -> Screen | None:
    """`build(weight)`, cached on `module` while that weight is unchanged: the same storage, version
    counter and content sum (a write through `.data` bumps no version; one read, ~16 ms at 124M)."""
    try:
        version = weight._version
    except RuntimeError:  # an inference-mode tensor has no version counter
        version = -1
    stamp = (weight.data_ptr(), version, tuple(weight.shape), weight.dtype, float(weight.sum(dtype=torch.float64)))
    hit = _SCREENS.get(module)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    screen = build(weight)
    _SCREENS[module] = (stamp, screen)
    return screen


class HeadScreener:
    """A decode backend's screen while it is open: the head's int8 copy is looked up (its weights
    checked) once per opening, as the backend's packed weight copies are."""

    def __init__(self):
        self._screen: Screen | bool | None = None  # None: not looked up in this opening; False: none

    def reset(self) -> None:
        self._screen = None

    def logits(self, model: torch.nn.Module, head_gemv: tuple | None, h: torch.Tensor,
               masks: Sequence[Mask] | None) -> torch.Tensor | None:
        """`screened_logits` of `model`'s head for rows `h` with `masks`, or None: no masks, too many
        rows, the screen off or unavailable, or a head it does not apply to (see `exact_columns`)."""
        if masks is None or h.shape[0] > MAX_ROWS or not available():
            return None
        exact = exact_columns(model, head_gemv, h)
        if exact is None:
            return None
        if self._screen is None:
            self._screen = screen_of(model.wte, model.wte.weight) or False
        return screened_logits(h, self._screen, exact, masks) if self._screen else None


def _f32_at_most(x: float) -> float:
    """The largest float32 <= x (finite x within float32's range)."""
    f = struct.unpack("<f", struct.pack("<f", x))[0]
    if f <= x:
        return f
    b = struct.unpack("<I", struct.pack("<f", f))[0]
    b = b - 1 if f > 0 else 0x80000001 if f == 0 else b + 1  # one float32 step toward -inf
    return struct.unpack("<f", struct.pack("<I", b))[0]


def approx_logits(h: torch.Tensor, screen: Screen) -> torch.Tensor:
    """h [R <= MAX_ROWS, K] times the screen's weights: [R, V] (the weight-only int8 kernel)."""
    return native_kernels.weight_only_linear(h, screen.q, screen.scale, None, None, 8)


@torch.no_grad()
def screened_logits(h: torch.Tensor, screen: Screen, exact: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    masks: Sequence[Mask]) -> torch.Tensor | None:
    """[R, V] logits of hidden rows `h` [R, K] (fp32) that are -inf except at the columns that can
    hold each row's greedy choice, where they are `exact(h, cols)` (the head's own values for
    those columns, [R, C]); `masks[r]`: the columns row r may not choose. None: use the full
    head (see the module docstring)."""
    if h.shape[0] > MAX_ROWS:
        return None
    norms = torch.linalg.vector_norm(h, dim=1, dtype=torch.float64).tolist()  # NaN / inf where h has them
    if not all(n * screen.w_norm <= _SAFE for n in norms):
        return None
    approx = _mask(approx_logits(h, screen), masks)
    floors = [t - 2.0 * n * screen.slack for t, n in zip(approx.amax(dim=1).tolist(), norms, strict=True)]
    if not all(-_SAFE < f < _SAFE for f in floors):  # everything forbidden, or a NaN: the full head decides
        return None
    floor = torch.tensor([_f32_at_most(f) for f in floors])
    cols = native_kernels.screen_candidates(approx, floor)
    vals = exact(h, cols)
    if not torch.isfinite(vals).all():
        return None
    out = approx.fill_(float("-inf"))
    out[:, cols] = vals
    return _mask(out, masks)  # a column another row needed stays forbidden to this one


def _mask(x: torch.Tensor, masks: Sequence[Mask]) -> torch.Tensor:
    for r, (limit, banned) in enumerate(masks):
        if limit is not None:
            x[r, limit:] = float("-inf")
        if banned:
            x[r, list(banned)] = float("-inf")
    return x


def exact_columns(model: torch.nn.Module, head_gemv: tuple | None,
                  h: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """`exact(h, cols)`: the logits of columns `cols` as the head computes them for rows `h` (the
    same kernel over those columns' weights: each output's sum never depends on the others), or
    None where the head's kernel is not one whose columns can be taken apart: the fp32 head on
    the native GEMV (`head_gemv`: its 64-output blocks and ISA path) or a bf16 weight-only head on
    the native kernel (up to `BF16_MAX_ROWS` rows)."""
    if head_gemv is not None:
        w, path = model.wte.weight, head_gemv[1]  # the weight the head's blocks were made of
        return lambda x, cols: native_kernels.fp32_columns(x, w, cols, path)
    wte = getattr(model, "wte", None)
    if (isinstance(wte, WeightOnlyEmbedding) and wte.bits == 16 and not wte._awq
            and getattr(model.__dict__.get("logits"), "__func__", None) is embedding_logits
            and h.shape[0] <= BF16_MAX_ROWS and wte.kernel_for(h) == "native"):
        return lambda x, cols: native_kernels.weight_only_linear(x, wte.weight[cols], None, None, None, 16)
    return None
