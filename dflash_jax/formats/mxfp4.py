"""MXFP4 expert weights (the released gpt-oss checkpoints), dequantised on load.

A quantised tensor `NAME` is stored as two: `NAME_blocks` uint8 [..., R, G, 16], two FP4 (e2m1)
values per byte, the low nibble first, 32 values per block; and `NAME_scales` uint8 [..., R, G], one
E8M0 exponent per block (2 ** (scale - 127)). Dequantised, the R rows of G * 32 values are
transposed: [E, R, G * 32] -> `NAME` [E, G * 32, R], the layout of the unquantised tensor
(transformers' `integrations/mxfp4.py`, `convert_moe_packed_tensors`, whose float32 results these
equal bit for bit).

`dequantized(tensors)` wraps a checkpoint's mapping so that each such pair reads as `NAME`, a
lazy `Mxfp4Tensor` that dequantises when read (one expert at a time into the float32 result), or
only some of its columns (`columns`: the gate or up half of gpt-oss's interleaved gate_up_proj).
"""
from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from dflash_jax._errors import CheckpointError

# FP4 e2m1 code -> value (sign bit 3, exponent bits 2-1, mantissa bit 0)
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_BIAS = 127
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, B], scales uint8 [...] (one per block) -> float32 [..., G * 2B]: value j
    of a block is byte j // 2's low nibble (j even) or high nibble (j odd), scaled by 2 ** (scale - 127)
    with `ldexp` (exact, rounded only where the result leaves float32's range, as torch.ldexp does)."""
    blocks = np.asarray(blocks, np.uint8)
    pairs = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # [..., G, B, 2]
    exponents = np.asarray(scales, np.int32)[..., None] - SCALE_BIAS
    with np.errstate(over="ignore"):
        values = np.ldexp(pairs.reshape(*blocks.shape[:-1], -1), exponents)
    return values.reshape(*blocks.shape[:-2], -1)


class Mxfp4Tensor:
    """One dequantised tensor [E, G * 32, R] of `NAME_blocks` [E, R, G, 16] and `NAME_scales` [E, R, G],
    read lazily: `np.asarray(t)` (all of it), `t.columns(start, step)` (its last-axis columns
    start::step, dequantising only those rows of the blocks), `t.first_axis(slice)` (some experts: a
    sharded load reads each device's experts only)."""

    dtype = np.dtype(np.float32)

    def __init__(self, blocks, scales, name: str = "tensor"):
        self.blocks, self.scales, self.name = blocks, scales, name
        b, s = tuple(blocks.shape), tuple(scales.shape)
        if len(b) != 4 or b[:-1] != s or np.dtype(blocks.dtype) != np.uint8 or np.dtype(scales.dtype) != np.uint8:
            raise CheckpointError(f"MXFP4 tensor {name}: expected uint8 blocks [E, R, G, B] and uint8 scales "
                                  f"[E, R, G], got {np.dtype(blocks.dtype).name} {list(b)} and "
                                  f"{np.dtype(scales.dtype).name} {list(s)}")
        self.shape = (b[0], b[2] * b[3] * 2, b[1])

    def first_axis(self, index: slice) -> "Mxfp4Tensor":
        """The tensor of the experts `index` picks (views of the blocks and scales: nothing is read)."""
        return Mxfp4Tensor(self.blocks[index], self.scales[index], self.name)

    def columns(self, start: int = 0, step: int = 1) -> np.ndarray:
        rows = range(self.shape[2])[start::step]
        out = np.empty((self.shape[0], self.shape[1], len(rows)), np.float32)
        for e in range(self.shape[0]):  # one expert's temporaries at a time
            picked = slice(start, None, step)
            out[e] = dequantize_rows(self.blocks[e, picked], self.scales[e, picked]).T
        return out

    def __array__(self, dtype=None, copy=None):
        out = self.columns()
        return out if dtype is None else out.astype(dtype)


class Dequantized(Mapping):
    """A checkpoint's tensors with every `NAME_blocks` / `NAME_scales` pair read as `NAME`
    (`Mxfp4Tensor`); the other tensors as they are. A pair with a half missing is a CheckpointError
    naming `source`."""

    def __init__(self, tensors: Mapping, source: str = "checkpoint"):
        self.tensors = tensors
        names = set(tensors)
        self._pairs = {n[: -len(BLOCKS)] for n in names if n.endswith(BLOCKS)}
        halves = {n[: -len(SCALES)] for n in names if n.endswith(SCALES)}
        lone = sorted(self._pairs ^ halves)
        if lone:
            raise CheckpointError(f"{source}: MXFP4 tensor(s) without both _blocks and _scales: {lone[:8]}")
        packed = {p + BLOCKS for p in self._pairs} | {p + SCALES for p in self._pairs}
        self._names = sorted(names - packed) + sorted(self._pairs)

    def __getitem__(self, name: str):
        if name in self._pairs:
            return Mxfp4Tensor(self.tensors[name + BLOCKS], self.tensors[name + SCALES], name)
        if name.endswith((BLOCKS, SCALES)) and name.rsplit("_", 1)[0] in self._pairs:
            raise KeyError(name)
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def dequantized(tensors: Mapping, source: str = "checkpoint") -> Mapping:
    """`tensors` itself when it holds no MXFP4 pair, else a `Dequantized` view of it."""
    if not any(n.endswith(BLOCKS) or n.endswith(SCALES) for n in tensors):
        return tensors
    return Dequantized(tensors, source)
