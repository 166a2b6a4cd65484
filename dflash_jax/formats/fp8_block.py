"""Block-scaled FP8 weights (DeepSeek-V3's released checkpoints, `quantization_config.quant_method` "fp8"
with `weight_block_size` [128, 128]), dequantised on load.

A quantised Linear weight `NAME.weight` is stored as float8_e4m3fn [R, C] beside `NAME.weight_scale_inv`
float32 [ceil(R / 128), ceil(C / 128)]: block (i, j) of the weight (rows 128 i .., columns 128 j ..;
the last row and column blocks partial where 128 does not divide) is multiplied by scale (i, j).
Dequantised, each value is float32(weight) * scale in float32, one rounding: DeepSeek-V3's reference
`weight_dequant` (inference/kernel.py: the fp8 value cast to float32 times its block's float32 scale),
whose float32 results these equal bit for bit (the product of an e4m3 value and a float32 is exact in
float64, so it is the float64 product rounded once to float32).

`dequantized(tensors)` wraps a checkpoint's mapping so that each pair reads as `NAME.weight`, a lazy
`Fp8BlockTensor` that dequantises when read (whole, or some rows: a sharded load's block).
"""
from __future__ import annotations

from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

from dflash_jax._errors import CheckpointError

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"  # NAME.weight_scale_inv scales NAME.weight
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def dequantize_block_fp8(weight, scale_inv, block: int = BLOCK) -> np.ndarray:
    """weight float8_e4m3fn [R, C], scale_inv float32 [ceil(R / block), ceil(C / block)] -> float32 [R, C]:
    each value times its block's scale, in float32."""
    weight = np.asarray(weight)
    rows, cols = weight.shape
    scale = np.asarray(scale_inv, np.float32)
    per_value = np.repeat(np.repeat(scale, block, axis=0)[:rows], block, axis=1)[:, :cols]
    return weight.astype(np.float32) * per_value


class Fp8BlockTensor:
    """One dequantised weight [R, C] of a float8_e4m3fn weight and its block scales, read lazily:
    `np.asarray(t)` (all of it) or `t.first_axis(rows)` (some rows, with their blocks' scales)."""

    dtype = np.dtype(np.float32)

    def __init__(self, weight, scale_inv, name: str = "tensor", block: int = BLOCK):
        self.weight, self.scale_inv, self.name, self.block = weight, scale_inv, name, block
        w, s = tuple(weight.shape), tuple(scale_inv.shape)
        if len(w) != 2 or np.dtype(weight.dtype) != FP8:
            raise CheckpointError(f"FP8 tensor {name}: expected a float8_e4m3fn matrix, got "
                                  f"{np.dtype(weight.dtype).name} {list(w)}")
        grid = tuple(-(-n // block) for n in w)
        if s != grid or np.dtype(scale_inv.dtype) != np.float32:
            raise CheckpointError(f"FP8 tensor {name}: its {name}{SCALE_SUFFIX} must be float32 of shape {list(grid)} "
                                  f"(one scale per {block}x{block} block of {list(w)}), got "
                                  f"{np.dtype(scale_inv.dtype).name} {list(s)}")
        self.shape = w

    def first_axis(self, index: slice) -> np.ndarray:
        """The dequantised rows `index` picks (only their blocks read)."""
        start, stop, step = index.indices(self.shape[0])
        if step != 1:
            return np.asarray(self)[index]
        lo, hi = start // self.block, -(-stop // self.block)
        rows = dequantize_block_fp8(self.weight[lo * self.block:min(hi * self.block, self.shape[0])],
                                    self.scale_inv[lo:hi], self.block)
        return rows[start - lo * self.block:stop - lo * self.block]

    def __array__(self, dtype=None, copy=None):
        out = dequantize_block_fp8(self.weight, self.scale_inv, self.block)
        return out if dtype is None else out.astype(dtype)


class Dequantized(Mapping):
    """A checkpoint's tensors with every `NAME.weight` + `NAME.weight_scale_inv` pair read as `NAME.weight`
    (`Fp8BlockTensor`); the others as they are. A scale without its weight, or an FP8 weight without its
    scale, is a CheckpointError naming `source` and the tensor."""

    def __init__(self, tensors: Mapping, source: str = "checkpoint", block: int = BLOCK):
        self.tensors, self.block = tensors, block
        names = set(tensors)
        self._pairs = {n[:-len(SCALE_SUFFIX)] for n in names if n.endswith(SCALE_SUFFIX)}
        lone = sorted(n + SCALE_SUFFIX for n in self._pairs if n not in names)
        if lone:
            raise CheckpointError(f"{source}: FP8 block scale(s) without their weight: {lone[:8]}")
        unscaled = sorted(n for n in names - self._pairs
                          if not n.endswith(SCALE_SUFFIX) and np.dtype(tensors[n].dtype) == FP8)
        if unscaled:
            raise CheckpointError(f"{source}: float8_e4m3fn tensor(s) without a {SCALE_SUFFIX[1:]} block scale: "
                                  f"{unscaled[:8]}")
        self._names = sorted(n for n in names if not n.endswith(SCALE_SUFFIX))

    def __getitem__(self, name: str):
        if name in self._pairs:
            return Fp8BlockTensor(self.tensors[name], self.tensors[name + SCALE_SUFFIX], name, self.block)
        if name.endswith(SCALE_SUFFIX):
            raise KeyError(name)
        return self.tensors[name]

    def __contains__(self, name) -> bool:
        return name in self.tensors and not str(name).endswith(SCALE_SUFFIX)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def dequantized(tensors: Mapping, source: str = "checkpoint", block: int = BLOCK) -> Mapping:
    """`tensors` itself when it holds no FP8 block scale, else a `Dequantized` view of it."""
    if not any(n.endswith(SCALE_SUFFIX) for n in tensors):
        return tensors
    return Dequantized(tensors, source, block)
