"""Kernels chosen per platform from one registry (`dflash_jax.kernels.registry`): the GPU's is the
Pallas Triton kernel; a platform without one runs the reference; a kernel registered for another
platform is what impl="auto" runs there, and cache capacities round to its key tile; no other code
changes for it."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from dflash_jax import backends
from dflash_jax.decode import loop as decode_loop
from dflash_jax.kernels import KEY_TILE
from dflash_jax.kernels import block_attention
from dflash_jax.kernels import masks
from dflash_jax.kernels import reference_attention
from dflash_jax.kernels import reference_attention_with_lse
from dflash_jax.kernels import registry
from dflash_jax.layers.attention import attention, cache_attention


def test_the_gpu_runs_the_triton_kernel_and_a_cpu_none():
    assert registry.for_platform("gpu").attention is block_attention
    assert registry.key_tile("gpu") == KEY_TILE == registry.DEFAULT_KEY_TILE
    assert registry.for_platform("cpu") is None and registry.key_tile("cpu") == registry.DEFAULT_KEY_TILE
    assert registry.forced("cpu") is registry.INTERPRETABLE  # impl="pallas" where the platform has none


def test_a_kernel_registered_for_a_platform_runs_there_and_sets_the_capacity_tile(monkeypatch):
    calls = []

    def kernel(q, k, v, ranges, *, scale=None, interpret=False, sinks=None):
        calls.append(("attention", k.shape[1]))
        return reference_attention(q, k, v, ranges, scale=scale, sinks=sinks)

    def kernel_lse(q, k, v, ranges, *, scale=None, interpret=False):
        calls.append(("with_lse", k.shape[1]))
        return reference_attention_with_lse(q, k, v, ranges, scale=scale)

    tpu = dataclasses.replace(registry.TRITON, name="test-tpu", key_tile=128, attention=kernel,
                              attention_with_lse=kernel_lse, unsupported_reason=lambda *args: None)
    monkeypatch.setitem(registry.KERNELS, "tpu", tpu)
    monkeypatch.setattr(backends, "platform", lambda: "tpu")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 4, 1, 8)), jnp.float32)
    ranges = masks.causal(jnp.arange(4)[None])
    np.testing.assert_allclose(np.asarray(attention(q, k, k, ranges)),
                               np.asarray(reference_attention(q, k, k, ranges)), rtol=1e-6)
    cache_k = jnp.asarray(rng.standard_normal((1, 1, 16, 1, 8)), jnp.float32)
    whole = masks.causal(jnp.arange(4)[None] + 16)
    cache_attention(q, cache_k, cache_k, 0, whole.segment(0, 16), k, k, whole.segment(16, 20))
    assert calls == [("attention", 4), ("with_lse", 16), ("with_lse", 4)], calls
    assert decode_loop.cache_tile() == 128
    monkeypatch.setattr(backends, "platform", lambda: "cpu")
    assert decode_loop.cache_tile() == registry.DEFAULT_KEY_TILE
