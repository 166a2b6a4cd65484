"""Attention sinks (gpt-oss): one learned logit per query head that joins every softmax and carries
no value. The reference, the attention seam (one part and a cache + new keys merged) and the
kernel's path through the seam are checked against a float64 numpy softmax over [scores ; sink],
with GQA, sliding windows, ragged rows and a query that sees no key."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import _masks as masks
from dflash_jax._attention import attention, cache_attention
from dflash_jax.kernels import reference_attention

TOL = 2e-5


def float64_sink_attention(q, k, v, visible, sinks, scale):
    """softmax([q.k * scale (masked) ; sink]) @ [v ; 0] in float64. visible [B, Tq, Tk]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, tq, hq, d = q.shape
    group = hq // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = np.where(visible[:, None], scores, -np.inf)
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (b, hq, tq, 1))
    logits = np.concatenate([scores, sink], axis=-1)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs[..., :-1], v)


def _case(seed, b=2, tq=5, tk=11, hq=4, hkv=2, d=8):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (b, tq, hq, d), jnp.float32)
    k = jax.random.normal(keys[1], (b, tk, hkv, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, tk, hkv, d), jnp.float32)
    sinks = 2.0 * jax.random.normal(keys[3], (hq,), jnp.float32)
    return q, k, v, sinks


@pytest.mark.parametrize("window", [0, 3])
def test_reference_and_seam_match_float64(window):
    q, k, v, sinks = _case(0)
    b, tq, _, d = q.shape
    tk = k.shape[1]
    positions = jnp.asarray([[6, 7, 8, 9, 10], [2, 3, 4, 5, 6]], jnp.int32)  # ragged rows
    ranges = masks.causal(positions, window)
    want = float64_sink_attention(q, k, v, np.asarray(ranges.dense(tk)), sinks, d**-0.5)
    got = reference_attention(q, k, v, ranges, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL, rtol=TOL)
    for impl in ("reference", "pallas_interpret"):
        got = attention(q, k, v, ranges, impl=impl, sinks=sinks)
        np.testing.assert_allclose(np.asarray(got), want, atol=TOL, rtol=TOL, err_msg=impl)
    without = float64_sink_attention(q, k, v, np.asarray(ranges.dense(tk)), np.full(4, -np.inf), d**-0.5)
    assert np.abs(want - without).max() > 1e-2  # the sinks change the answer


def test_no_visible_key_gives_zeros():
    q, k, v, sinks = _case(1)
    empty = masks.KeyRanges(start=jnp.zeros((2, 5, 2), jnp.int32), end=jnp.zeros((2, 5, 2), jnp.int32))
    out = attention(q, k, v, empty, impl="reference", sinks=sinks)
    assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
def test_cache_attention_adds_the_sink_once(impl):
    """Cache slots + new keys merged, the sink added once: equals one softmax over all keys."""
    q, k_all, v_all, sinks = _case(2, tk=12)
    b, tq, _, d = q.shape
    lengths = jnp.asarray([7, 4], jnp.int32)  # cached keys per row; the 5 new keys follow
    capacity = 7
    cache_k = jnp.zeros((1, b, capacity, 2, d), jnp.float32).at[0].set(k_all[:, :capacity])
    cache_v = jnp.zeros((1, b, capacity, 2, d), jnp.float32).at[0].set(v_all[:, :capacity])
    new_k, new_v = k_all[:, capacity:], v_all[:, capacity:]
    positions = lengths[:, None] + jnp.arange(tq, dtype=jnp.int32)[None]
    ranges = masks.causal(positions)
    got = cache_attention(q, cache_k, cache_v, 0, ranges.segment(0, lengths), new_k, new_v,
                          ranges.segment(lengths, lengths + tq), impl=impl, sinks=sinks)
    # the same keys laid out as one buffer per row: [cache[:len] ; new]
    keys, values, visible = [], [], []
    for row in range(b):
        n = int(lengths[row])
        keys.append(np.concatenate([k_all[row, :n], new_k[row]]))
        values.append(np.concatenate([v_all[row, :n], new_v[row]]))
        visible.append(np.asarray(masks.causal(positions[row:row + 1]).dense(n + tq))[0])
    for row in range(b):
        want = float64_sink_attention(q[row:row + 1], keys[row][None], values[row][None], visible[row][None],
                                      sinks, d**-0.5)
        np.testing.assert_allclose(np.asarray(got[row:row + 1]), want, atol=TOL, rtol=TOL)
