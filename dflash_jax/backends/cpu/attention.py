"""Attention over one layer of a KV cache plus the step's new keys, on a CPU, as one custom call
(`cpu_cache_attention.cc`, built by `backends.cpu.ffi`): what `attention.cache_attention` runs for
float32 queries over float32 or float16 keys and values on a CPU where the kernels are built. XLA
runs the jnp reference (`reference.chunked_cache_attention_with_lse`) as a few dozen small
operations per cache chunk, which cost more than their arithmetic at decode sizes. Other backends
and dtypes keep the reference (`attention.cache_attention` asks `applies` first)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.backends.cpu.ffi import available
from dflash_jax.kernels.masks import KeyRanges

TARGET_NAMES = {jnp.dtype(jnp.float32): "dflash_cache_attention",  # by the dtype of the K/V
                jnp.dtype(jnp.float16): "dflash_cache_attention_f16"}


def applies(q, cache_k, k) -> bool:
    """Whether `cache_attention` can take these inputs: float32 queries, the cache and the new
    keys in one dtype, float32 or float16; a CPU default backend (a GPU host never builds the
    library for it), the kernels built."""
    return (q.dtype == jnp.float32 and cache_k.dtype == k.dtype and cache_k.dtype in TARGET_NAMES
            and jax.default_backend() == "cpu" and available())


def cache_attention(q, cache_k, cache_v, layer, cache_ranges: KeyRanges, k, v, ranges: KeyRanges, *,
                    scale: float):
    """q [B, Tq, Hq, D] over layer `layer` of cache_k/v [L, B, S, Hkv, D] (slots visible through
    cache_ranges) and the new k, v [B, T, Hkv, D] (through ranges) -> [B, Tq, Hq, D] float32.
    Keys and values are read in their dtype (float32 or float16) and computed on in float32.
    Only where `applies`: with a CPU default backend the program is lowered for the CPU alone, so
    the custom call goes in without a fallback (`lax.platform_dependent` would also trace and
    compile the jnp reference of every layer, a large share of a CLI run's compile time even with
    the persistent cache warm)."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call(TARGET_NAMES[cache_k.dtype], out)
    return call(q, cache_k, cache_v, jnp.asarray(layer, jnp.int32), cache_ranges.start, cache_ranges.end, k, v,
                ranges.start, ranges.end, scale=np.float32(scale))
