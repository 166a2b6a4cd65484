"""compressed-tensors "pack-quantized" INT4 weights (Kimi-K2-Thinking / Kimi-K2.5's routed experts:
`quantization_config.quant_method` "compressed-tensors", symmetric 4-bit integers in groups), dequantised
on load.

A quantised Linear weight `NAME.weight` [R, C] is stored as three tensors: `NAME.weight_packed` int32
[R, ceil(C / 8)] (value c of a row in word c // 8, bits 4 (c % 8) .. 4 (c % 8) + 3, stored as q + 8 so
that -8 .. 7 fit 0 .. 15), `NAME.weight_scale` [R, C / G] (bfloat16 in the releases; one scale per group
of G consecutive columns) and `NAME.weight_shape` [2] (R, C). Dequantised, value (r, c) is
q * scale[r, c // G] computed in the scale's dtype, as compressed-tensors' `unpack_from_int32` and
`dequantize` give it (torch multiplies bfloat16 in float32 and rounds once; q * scale is exact in float32,
so the result is that product rounded once to the scale's dtype).

`dequantized(tensors)` wraps a checkpoint's mapping so that each triple reads as `NAME.weight`, a lazy
`Int4PackedTensor` that dequantises when read (whole, or some rows).
"""
from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from dflash_jax._errors import CheckpointError

PACKED, SCALE, SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"
BITS, PER_WORD = 4, 8


def unpack_int4(packed, columns: int) -> np.ndarray:
    """int32 [R, ceil(C / 8)] -> int8 [R, C] in -8 .. 7 (`columns` = C drops the last word's padding)."""
    words = np.asarray(packed).view(np.uint32)
    nibbles = np.stack([(words >> (BITS * i)) & 0xF for i in range(PER_WORD)], axis=-1)  # [R, W, 8]
    return (nibbles.reshape(words.shape[0], -1)[:, :columns].astype(np.int16) - 8).astype(np.int8)


def dequantize_int4(packed, scale, columns: int) -> np.ndarray:
    """The weight [R, C] of packed int32 [R, ceil(C / 8)] and group scales [R, C / G], in the scale's dtype."""
    scale = np.asarray(scale)
    values = unpack_int4(packed, columns).astype(np.float32)
    group = columns // scale.shape[1]
    return (values * np.repeat(scale.astype(np.float32), group, axis=1)).astype(scale.dtype)


class Int4PackedTensor:
    """One dequantised weight [R, C] of a pack-quantized triple, read lazily: `np.asarray(t)` or
    `t.first_axis(rows)`."""

    def __init__(self, packed, scale, shape, name: str = "tensor"):
        self.packed, self.scale, self.name = packed, scale, name
        rows, cols = (int(n) for n in np.asarray(shape).reshape(-1)) if np.size(shape) == 2 else (-1, -1)
        p, s = tuple(packed.shape), tuple(scale.shape)
        if (rows < 0 or np.dtype(packed.dtype) != np.int32 or p != (rows, -(-cols // PER_WORD)) or len(s) != 2
                or s[0] != rows or s[1] <= 0 or cols % s[1]):
            raise CheckpointError(f"pack-quantized tensor {name}: expected {name}{SHAPE} [R, C], int32 "
                                  f"{name}{PACKED} [R, ceil(C / 8)] and {name}{SCALE} [R, C / group]; got shape "
                                  f"{np.asarray(shape).tolist()}, {np.dtype(packed.dtype).name} {list(p)} and "
                                  f"{list(s)}")
        self.shape, self.dtype = (rows, cols), np.dtype(scale.dtype)

    def first_axis(self, index: slice) -> np.ndarray:
        return dequantize_int4(self.packed[index], self.scale[index], self.shape[1])

    def __array__(self, dtype=None, copy=None):
        out = dequantize_int4(self.packed, self.scale, self.shape[1])
        return out if dtype is None else out.astype(dtype)


class Dequantized(Mapping):
    """A checkpoint's tensors with every `NAME.weight_packed` / `_scale` / `_shape` triple read as
    `NAME.weight`; the others as they are. A triple with a part missing is a CheckpointError."""

    def __init__(self, tensors: Mapping, source: str = "checkpoint"):
        self.tensors = tensors
        names = set(tensors)
        self._triples = {n[:-len(PACKED)] for n in names if n.endswith(PACKED)}
        broken = sorted(p for p in self._triples if p + SCALE not in names or p + SHAPE not in names)
        if broken:
            raise CheckpointError(f"{source}: pack-quantized tensor(s) without their {SCALE[1:]} or {SHAPE[1:]}: "
                                  f"{[p + PACKED for p in broken[:8]]}")
        packed = {p + end for p in self._triples for end in (PACKED, SCALE, SHAPE)}
        self._names = sorted(names - packed) + sorted(p + ".weight" for p in self._triples)

    def _part(self, name: str) -> bool:
        """Whether `name` is one of a triple's stored tensors (shown only as the weight)."""
        return any(name.endswith(end) and name[:-len(end)] in self._triples for end in (PACKED, SCALE, SHAPE))

    def __getitem__(self, name: str):
        prefix = name[:-len(".weight")] if name.endswith(".weight") else None
        if prefix in self._triples:
            t = self.tensors
            return Int4PackedTensor(t[prefix + PACKED], t[prefix + SCALE], np.asarray(t[prefix + SHAPE]), prefix)
        if self._part(name):
            raise KeyError(name)
        return self.tensors[name]

    def __contains__(self, name) -> bool:
        name = str(name)
        if name.endswith(".weight") and name[:-len(".weight")] in self._triples:
            return True
        return not self._part(name) and name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def dequantized(tensors: Mapping, source: str = "checkpoint") -> Mapping:
    """`tensors` itself when it holds no pack-quantized weight, else a `Dequantized` view of it."""
    if not any(n.endswith(PACKED) for n in tensors):
        return tensors
    return Dequantized(tensors, source)
