"""Host arrays that JAX adopts without a copy.

On a CPU, `jax.device_put` of a C-contiguous numpy array whose data is 64-byte aligned aliases
it (jaxlib's CPU client), where `jnp.asarray` copies and numpy's own allocations are only 16-byte
aligned. Adopting an aligned array costs neither a second copy of the weight in memory nor
the time of copying it, which for a model's weights is a visible part of a load. Loading a target
builds each weight once into `empty` and hands it over with `adopt`; elsewhere, or unaligned,
`adopt` is an ordinary `jax.device_put` (a copy).
"""
from __future__ import annotations

import jax
import numpy as np

ALIGNMENT = 64  # bytes


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ALIGNMENT boundary."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size == 0:
        return np.empty(shape, dtype)
    raw = np.empty(size + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + size].view(dtype).reshape(shape)


def adopt(array: np.ndarray) -> jax.Array:
    """`array` as a JAX array, sharing its memory where the backend allows (see the module
    docstring). The caller hands the array over: it must not write to it afterwards."""
    return jax.device_put(array)
