"""Attention over one layer of a KV cache plus the step's new keys, on a CPU, as one custom call
(`cpu_cache_attention.cc`, built by `kernels.cpu_ffi`): what `attention.cache_attention` runs for
float32 on a CPU where the kernels are built. XLA runs the jnp reference
(`reference.chunked_cache_attention_with_lse`) as a few dozen small operations per cache chunk,
which cost more than their arithmetic at decode sizes. Other backends and dtypes keep the
reference (`cpu_ffi.cpu_only`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kernels.cpu_ffi import available, cpu_only
from dflash_jax.masks import KeyRanges

TARGET_NAME = "dflash_cache_attention"


def applies(q, cache_k, k) -> bool:
    """Whether `cache_attention` can take these inputs: float32 throughout, a CPU default backend
    (a GPU host never builds the library for it), the kernels built."""
    return (q.dtype == cache_k.dtype == k.dtype == jnp.float32 and jax.default_backend() == "cpu"
            and available())


def cache_attention(q, cache_k, cache_v, layer, cache_ranges: KeyRanges, k, v, ranges: KeyRanges, *,
                    scale: float, reference):
    """q [B, Tq, Hq, D] over layer `layer` of cache_k/v [L, B, S, Hkv, D] (slots visible through
    cache_ranges) and the new k, v [B, T, Hkv, D] (through ranges) -> [B, Tq, Hq, D] float32.
    `reference` (same arguments, no scale keyword) is what other backends run."""

    def kernel(q, cache_k, cache_v, layer, cache_start, cache_end, k, v, start, end):
        out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
        return jax.ffi.ffi_call(TARGET_NAME, out)(q, cache_k, cache_v, layer, cache_start, cache_end, k, v,
                                                  start, end, scale=np.float32(scale))

    def default(q, cache_k, cache_v, layer, cache_start, cache_end, k, v, start, end):
        return reference(q, cache_k, cache_v, layer, KeyRanges(cache_start, cache_end), k, v, KeyRanges(start, end))

    layer = jnp.asarray(layer, jnp.int32)
    return cpu_only(kernel, default, q, cache_k, cache_v, layer, cache_ranges.start, cache_ranges.end, k, v,
                    ranges.start, ranges.end)
