"""Key/value storage for decoding, in one of three dtypes (`Generation.kv_cache_dtype`).

Keys and values are written in the compute dtype of the attention (the dtype of the new
keys) and read back in it; only the stored copy changes:

- float32 / the model's dtype: stored as is; reads are views of the buffer (no copy);
- bfloat16: stored rounded to bfloat16 (half the bytes); the attended window is upcast on read;
- int8: symmetric per-(row, head, position) scales, `scale = max|x| / 127` over head_dim,
  quantized on write and the attended window dequantized on read; the float32 scales live
  beside the int8 buffer (`head_dim + 4` bytes per head and position instead of `4 · head_dim`).

Each position is quantized on its own, so what a sequence stores never depends on what else
is in the batch or when it was written (batch-invariant decoding stays bit-identical, and a
speculative rollback that rewrites a position stores exactly what a plain decode would).
Pure PyTorch, like the model file that uses it.
"""

from __future__ import annotations

import torch

# `Generation.kv_cache_dtype` -> the storage dtype ("auto": the model's own, see `GPT.new_cache`).
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
INT8_MAX = 127
_SCALE_DTYPE = torch.float32


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scales [..., 1]) of `x` [..., head_dim]: symmetric, one scale per
    vector, `scale = max|x| / 127` (an all-zero vector gets scale 0 and zeros). Round-to-nearest,
    so `|x - dequantize_int8(q, scale)| <= scale / 2` per element."""
    xf = x.to(_SCALE_DTYPE)
    scale = xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q · scale` in `dtype` (the product is formed in float32, then cast)."""
    # One new buffer, scaled in place: `q * scale` (mixed dtypes) measured ~6x slower on CPU, and
    # `q.float() * scale` allocates a second window-sized buffer.
    return q.to(_SCALE_DTYPE).mul_(scale).to(dtype)


def kv_bytes_per_position(total_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one sequence's keys + values take per position with `total_heads` heads (summed
    over the layers) stored in `dtype` (int8: the values plus one float32 scale per head)."""
    if dtype == torch.int8:
        return 2 * total_heads * (head_dim + _SCALE_DTYPE.itemsize)
    return 2 * total_heads * head_dim * dtype.itemsize


class KVCache:
    """Preallocated key/value buffers, one pair per layer, shaped [B, heads, max_len, head_dim]
    and stored in `dtype` (a float dtype, or torch.int8 with per-(row, head, position) scales).

    A forward pass writes its new keys/values at `length` and advances `length` once at the
    end, so decoding never concatenates tensors. `zero=False` leaves the buffers uninitialized
    (callers that only ever read positions they wrote).
    """

    def __init__(self, layer_heads: list[int], batch_size: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", zero: bool = True):
        alloc = torch.zeros if zero else torch.empty
        self.dtype = dtype
        self.k = [alloc(batch_size, h, max_len, head_dim, dtype=dtype, device=device) for h in layer_heads]
        self.v = [alloc(batch_size, h, max_len, head_dim, dtype=dtype, device=device) for h in layer_heads]
        self.k_scale: list[torch.Tensor] | None = None
        self.v_scale: list[torch.Tensor] | None = None
        if dtype == torch.int8:
            self.k_scale = [alloc(batch_size, h, max_len, 1, dtype=_SCALE_DTYPE, device=device) for h in layer_heads]
            self.v_scale = [torch.zeros_like(s) if zero else torch.empty_like(s) for s in self.k_scale]
        self.max_len = max_len
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store [B, h, T, d] keys/values of `layer` at positions start..start+T-1."""
        end = start + k.shape[2]
        if self.k_scale is None:
            self.k[layer][:, :, start:end] = k
            self.v[layer][:, :, start:end] = v
            return
        for q_buf, s_buf, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = quantize_int8(x)
            q_buf[layer][:, :, start:end] = q
            s_buf[layer][:, :, start:end] = scale

    def read(self, layer: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions 0..end-1 of `layer` in `dtype` (views when stored in it)."""
        k, v = self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        if self.k_scale is not None:
            return (dequantize_int8(k, self.k_scale[layer][:, :, :end], dtype),
                    dequantize_int8(v, self.v_scale[layer][:, :, :end], dtype))
        if k.dtype != dtype:
            return k.to(dtype), v.to(dtype)
        return k, v

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new [B, h, T, d] keys/values for `layer`; return all keys/values so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions needed, {self.max_len} allocated")
        self.write(layer, start, k, v)
        return self.read(layer, end, k.dtype)

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (beam search keeps the cache of the surviving beams)."""
        self.k = [k.index_select(0, index) for k in self.k]
        self.v = [v.index_select(0, index) for v in self.v]
        if self.k_scale is not None:
            self.k_scale = [s.index_select(0, index) for s in self.k_scale]
            self.v_scale = [s.index_select(0, index) for s in self.v_scale]

    def position_bytes(self) -> int:
        """Bytes one row's keys + values take per position in this cache."""
        return kv_bytes_per_position(sum(k.shape[1] for k in self.k), self.k[0].shape[-1], self.dtype)
