"""The CPU cache-attention kernel (`dflash_jax.backends.cpu.attention`, what `cache_attention`
runs on the CPU backend for float32 queries over a float32 or float16 cache): equal to the jnp reference
over ragged rows, sliding windows, GQA, queries that see nothing and ranges that overlap; a
query's result does not depend on the other queries of the call; the compiled program calls it in
place of the reference's loop."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.backends.cpu.attention import applies, TARGET_NAMES
from dflash_jax.kernels import masks
from dflash_jax.kernels.masks import KeyRanges
from dflash_jax.layers import attention

cache_attention = functools.partial(attention.cache_attention, backend="cpu")  # what the CPU backend's models call
needs_kernel = pytest.mark.skipif(not applies(jnp.zeros(1), jnp.zeros(1), jnp.zeros(1)),
                                  reason="the CPU kernels are not built here")


KV_DTYPES = [np.float32, np.float16]


def _case(b, tq, hq, hkv, d, layers=3, slots=40, seed=0, kv_dtype=np.float32):
    """q float32, cache and new K/V in kv_dtype; d 64 or 128: the vectorised path, others: the
    generic one."""
    rng = np.random.default_rng(seed)
    f = lambda dtype, *shape: jnp.asarray(rng.standard_normal(shape).astype(dtype))
    kv = functools.partial(f, kv_dtype)
    return (f(np.float32, b, tq, hq, d), kv(layers, b, slots, hkv, d), kv(layers, b, slots, hkv, d),
            kv(b, tq, hkv, d), kv(b, tq, hkv, d))


def _both(q, ck, cv, layer, cache_ranges, k, v, ranges):
    run = lambda impl: jax.jit(lambda *a: cache_attention(*a, impl=impl))(q, ck, cv, layer, cache_ranges, k, v, ranges)
    return np.asarray(run("auto")), np.asarray(run("reference"))


@needs_kernel
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("tq,hq,hkv,d,window", [(1, 4, 2, 16, 0), (3, 9, 3, 64, 0), (16, 4, 4, 12, 5),
                                                (2, 4, 1, 128, 0), (5, 6, 2, 64, 3),
                                                # 5, 7 and 8 query heads per kv head: the kernel's
                                                # head groups 3 + 2, 3 + 2 + 2, 3 + 3 + 2
                                                (3, 10, 2, 64, 0), (2, 7, 1, 64, 4), (4, 8, 1, 128, 0)])
def test_kernel_equals_the_reference(tq, hq, hkv, d, window, kv_dtype):
    """Decode-step ranges as the target builds them: row b has `offsets[b]` cached slots, the
    tq new tokens follow them (causal, optional sliding window). Float16 K/V: both read them as
    the same float32 numbers, so the tolerance stays float32's."""
    q, ck, cv, k, v = _case(2, tq, hq, hkv, d, seed=tq, kv_dtype=kv_dtype)
    got, want = map(np.asarray, _decode_step_both(q, ck, cv, 1, k, v, np.asarray([7, 30]), window=window))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@functools.partial(jax.jit, static_argnames="window")
def _decode_step_both(q, ck, cv, layer, k, v, offsets, *, window):
    """cache_attention's "auto" (the kernel) and "reference" over decode-step ranges, built in the
    same program (not op by op per shape)."""
    tq = q.shape[1]
    ranges = masks.causal(offsets[:, None] + jnp.arange(tq)[None], window)
    args = (q, ck, cv, layer, ranges.segment(0, offsets), k, v, ranges.segment(offsets, offsets + tq))
    return cache_attention(*args, impl="auto"), cache_attention(*args, impl="reference")


@needs_kernel
def test_empty_and_overlapping_ranges():
    """A query that sees no key yields zeros; a key inside both of a query's ranges counts once."""
    q, ck, cv, k, v = _case(1, 3, 4, 2, 64)
    cache_ranges = KeyRanges(start=jnp.asarray([[[0, 0], [2, 5], [0, 10]]], jnp.int32),
                             end=jnp.asarray([[[0, 0], [9, 12], [20, 15]]], jnp.int32))
    ranges = KeyRanges(start=jnp.asarray([[[0, 0], [0, 0], [1, 0]]], jnp.int32),
                       end=jnp.asarray([[[0, 0], [0, 0], [3, 2]]], jnp.int32))
    got, want = _both(q, ck, cv, 2, cache_ranges, k, v, ranges)
    np.testing.assert_array_equal(got[0, 0], 0.0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@needs_kernel
def test_a_querys_result_does_not_depend_on_the_other_queries():
    q, ck, cv, k, v = _case(1, 6, 4, 2, 64)
    offsets = jnp.asarray([20])
    positions = offsets[:, None] + jnp.arange(6)[None]
    ranges = masks.causal(positions)
    cache_ranges, new_ranges = ranges.segment(0, offsets), ranges.segment(offsets, offsets + 6)
    together = np.asarray(cache_attention(q, ck, cv, 0, cache_ranges, k, v, new_ranges))
    for t in range(6):
        pick = lambda r: KeyRanges(r.start[:, t:t + 1], r.end[:, t:t + 1])
        alone = np.asarray(cache_attention(q[:, t:t + 1], ck, cv, 0, pick(cache_ranges), k, v, pick(new_ranges)))
        np.testing.assert_array_equal(alone[:, 0], together[:, t])


@needs_kernel
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128)])
def test_over_a_long_cache_a_querys_result_is_the_same_alone_in_twos_and_in_sixteens(hq, hkv, d, kv_dtype):
    """One row over ~900 cached slots: alone or in twos the kernel shares one task's key blocks and
    value vectors out over the threads, its heads one at a time; sixteen go as tasks of four queries
    with their heads grouped. Every way gives the same bits, and the reference's values."""
    q, ck, cv, k, v = _case(1, 16, hq, hkv, d, layers=1, slots=960, kv_dtype=kv_dtype)
    offsets = jnp.asarray([900])
    positions = offsets[:, None] + jnp.arange(16)[None]
    ranges = masks.causal(positions)
    cache_ranges, new_ranges = ranges.segment(0, offsets), ranges.segment(offsets, offsets + 16)
    together, want = _both(q, ck, cv, 0, cache_ranges, k, v, new_ranges)
    np.testing.assert_allclose(together, want, rtol=2e-5, atol=2e-5)
    for t0, size in [(0, 1), (9, 1), (2, 2), (14, 2), (4, 4)]:
        pick = lambda r: KeyRanges(r.start[:, t0:t0 + size], r.end[:, t0:t0 + size])
        part = np.asarray(cache_attention(q[:, t0:t0 + size], ck, cv, 0, pick(cache_ranges), k, v, pick(new_ranges)))
        np.testing.assert_array_equal(part, together[:, t0:t0 + size])


@needs_kernel
def test_the_compiled_step_calls_the_kernel_of_its_kv_dtype_and_bf16_keeps_the_reference():
    ranges = masks.causal(jnp.asarray([[5, 6]]))
    cache_ranges, new_ranges = ranges.segment(0, jnp.asarray([5])), ranges.segment(jnp.asarray([5]), jnp.asarray([7]))
    calls = lambda q, ck, cv, k, v: {
        name for name in TARGET_NAMES.values()
        if f'custom_call_target="{name}"' in jax.jit(lambda q, ck, cv, k, v: cache_attention(
            q, ck, cv, 0, cache_ranges, k, v, new_ranges)).lower(q, ck, cv, k, v).compile().as_text()}
    for kv_dtype in KV_DTYPES:
        assert calls(*_case(1, 2, 4, 2, 16, kv_dtype=kv_dtype)) == {TARGET_NAMES[jnp.dtype(kv_dtype)]}
    q, *kv = _case(1, 2, 4, 2, 16)
    assert calls(q.astype(jnp.bfloat16), *(x.astype(jnp.bfloat16) for x in kv)) == set()
    assert calls(q, *(x.astype(jnp.bfloat16) for x in kv)) == set()  # float32 queries over a bfloat16 cache
