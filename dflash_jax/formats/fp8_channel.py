"""compressed-tensors "float-quantized" FP8 weights with one scale per output row or per tensor (llm-compressor's
FP8 schemes, `quantization_config.quant_method` "compressed-tensors" with 8-bit float weights of strategy
"channel" or "tensor": zai-org's GLM-4.5 / GLM-4.5-Air FP8 releases), dequantised on load.

A quantised Linear weight `NAME.weight` is stored as float8_e4m3fn [R, C] beside `NAME.weight_scale`: [R, 1]
(or [R]) for a scale per row, [1, 1], [1] or [] for one scale for the whole tensor, in float32, bfloat16 or
float16.
Dequantised, value (r, c) is weight[r, c] times its row's scale, computed in the scale's dtype, as
compressed-tensors' `dequantize` gives it (the fp8 value cast to the scale's dtype, then the product; torch
multiplies bfloat16 and float16 in float32 and rounds once). The product of an e4m3 value and such a scale is
exact in float64, so the result is that product rounded once to the scale's dtype, which these equal bit for
bit.

`dequantized(tensors)` wraps a checkpoint's mapping so that each pair reads as `NAME.weight`, a lazy
`Fp8ChannelTensor` that dequantises when read (whole, or some rows).
"""
from __future__ import annotations

from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

from dflash_jax._errors import CheckpointError

SCALE_SUFFIX = "_scale"  # NAME.weight_scale scales NAME.weight
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def dequantize_channel_fp8(weight, scale) -> np.ndarray:
    """weight float8_e4m3fn [R, C], scale [R, 1] / [R] / [1, 1] / [1] / [] (float32, bfloat16, float16) -> [R, C] in
    the scale's dtype: each value times its row's (or the tensor's) scale, rounded once."""
    weight, scale = np.asarray(weight), np.asarray(scale)
    column = scale.astype(np.float32).reshape(-1, 1)  # [R, 1] or [1, 1]
    return (weight.astype(np.float32) * column).astype(scale.dtype)


class Fp8ChannelTensor:
    """One dequantised weight [R, C] of a float8_e4m3fn weight and its row (or tensor) scale, read lazily:
    `np.asarray(t)` (all of it) or `t.first_axis(rows)` (some rows, with their scales)."""

    def __init__(self, weight, scale, name: str = "tensor"):
        self.weight, self.scale, self.name = weight, scale, name
        w, s = tuple(weight.shape), tuple(scale.shape)
        if len(w) != 2 or np.dtype(weight.dtype) != FP8:
            raise CheckpointError(f"FP8 tensor {name}: expected a float8_e4m3fn matrix, got "
                                  f"{np.dtype(weight.dtype).name} {list(w)}")
        per_row = s in ((w[0], 1), (w[0],))
        if not (per_row or s in ((1, 1), (1,), ())) or np.dtype(scale.dtype) not in SCALE_DTYPES:
            raise CheckpointError(f"FP8 tensor {name}: its {name}{SCALE_SUFFIX} must be float32, bfloat16 or float16 "
                                  f"of "
                                  f"shape [{w[0]}, 1] (a scale per row) or [1] (one scale), got "
                                  f"{np.dtype(scale.dtype).name} {list(s)}")
        self.per_row, self.shape, self.dtype = per_row, w, np.dtype(scale.dtype)

    def first_axis(self, index: slice) -> np.ndarray:
        """The dequantised rows `index` picks (only they and their scales read)."""
        scale = np.asarray(self.scale)
        return dequantize_channel_fp8(self.weight[index], scale.reshape(-1, 1)[index] if self.per_row else scale)

    def __array__(self, dtype=None, copy=None):
        out = dequantize_channel_fp8(self.weight, self.scale)
        return out if dtype is None else out.astype(dtype)


class Dequantized(Mapping):
    """A checkpoint's tensors with every float8_e4m3fn `NAME.weight` + `NAME.weight_scale` pair read as
    `NAME.weight` (`Fp8ChannelTensor`); the others (other `weight_scale`s among them: an INT4 group's, read by
    `loading.int4_pack`) as they are."""

    def __init__(self, tensors: Mapping, source: str = "checkpoint"):
        self.tensors = tensors
        names = set(tensors)
        self._pairs = {n[:-len(SCALE_SUFFIX)] for n in names if n.endswith(".weight" + SCALE_SUFFIX)
                       and n[:-len(SCALE_SUFFIX)] in names and np.dtype(tensors[n[:-len(SCALE_SUFFIX)]].dtype) == FP8}
        self._names = sorted(names - {n + SCALE_SUFFIX for n in self._pairs})

    def __getitem__(self, name: str):
        if name in self._pairs:
            return Fp8ChannelTensor(self.tensors[name], self.tensors[name + SCALE_SUFFIX], name)
        if name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in self._pairs:
            raise KeyError(name)
        return self.tensors[name]

    def __contains__(self, name) -> bool:
        return name in self.tensors and not (str(name).endswith(SCALE_SUFFIX)
                                             and str(name)[:-len(SCALE_SUFFIX)] in self._pairs)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def dequantized(tensors: Mapping, source: str = "checkpoint") -> Mapping:
    """`tensors` itself when it holds no `weight_scale`, else a `Dequantized` view of it."""
    if not any(n.endswith(".weight" + SCALE_SUFFIX) for n in tensors):
        return tensors
    return Dequantized(tensors, source)
