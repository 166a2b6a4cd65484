"""Attention sinks (gpt-oss): one learned logit per query head that joins every softmax and carries
no value. The reference, the attention seam (one part and a cache + new keys merged) and the
Pallas kernel (interpret mode: the sink inside its online softmax, forward, lse and the custom VJP
with d(sinks)) are checked against a float64 numpy softmax over [scores ; sink], with GQA, sliding
windows, ragged rows and a query that sees no key; the kernel's gradients against jax.grad of the
float32 reference."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.kernels import block_attention, block_attention_with_lse, BlockSizes, masks, reference_attention
from dflash_jax.layers.attention import attention, cache_attention

TOL = 2e-5
# Gradients (kernel vs jax.grad of the float32 reference), as a fraction of max(1, max |reference|):
# both sides are float32 and differ only in summation order (over <= 64 keys, 64 dims, and for
# d(sinks) over B * Tq <= 40 rows), an error of a few 1e-7 per term, so a few 1e-6 at most; 2e-5
# leaves headroom, while a sink missing from one softmax moves the result by its weight (> 1e-2 here).
GRAD_TOL = 2e-5
# bfloat16 inputs: the kernel and the float32 reference on the same (bf16) inputs differ by the
# rounding of the probabilities and products to bf16 (2**-8 = 4e-3 relative): 2e-2 of the scale.
BF16_TOL = 2e-2
TILES_16 = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)


def float64_sink_attention(q, k, v, visible, sinks, scale, return_lse=False):
    """softmax([q.k * scale (masked) ; sink]) @ [v ; 0] in float64 (and with return_lse its
    log-sum-exp [B, Tq, Hq]). visible [B, Tq, Tk]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, tq, hq, d = q.shape
    group = hq // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = np.where(visible[:, None], scores, -np.inf)
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (b, hq, tq, 1))
    logits = np.concatenate([scores, sink], axis=-1)
    top = logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits - top)
    denom = probs.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probs[..., :-1] / denom, v)
    return (out, np.moveaxis((top + np.log(denom))[..., 0], 1, 2)) if return_lse else out


def _case(seed, b=2, tq=5, tk=11, hq=4, hkv=2, d=8):
    """q, k, v and sinks (2 x N(0, 1)) in float32; numpy draws (nothing to compile)."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32))
               for shape in [(b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d)])
    return q, k, v, jnp.asarray(2.0 * rng.standard_normal(hq, np.float32))


@functools.partial(jax.jit, static_argnames="impl")
def _seam(q, k, v, start, end, sinks, impl=None):
    """reference_attention (impl None) or the seam's attention(impl=), compiled as the models call
    them; the ranges as arrays, one program for every window."""
    ranges = masks.KeyRanges(start, end)
    if impl is None:
        return reference_attention(q, k, v, ranges, sinks=sinks)
    return attention(q, k, v, ranges, impl=impl, sinks=sinks)


@pytest.mark.parametrize("window", [0, 3])
def test_reference_and_seam_match_float64(window):
    q, k, v, sinks = _case(0)
    b, tq, _, d = q.shape
    tk = k.shape[1]
    positions = jnp.asarray([[6, 7, 8, 9, 10], [2, 3, 4, 5, 6]], jnp.int32)  # ragged rows
    ranges = masks.causal(positions, window)
    want = float64_sink_attention(q, k, v, np.asarray(ranges.dense(tk)), sinks, d**-0.5)
    got = _seam(q, k, v, ranges.start, ranges.end, sinks)
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL, rtol=TOL)
    for impl in ("reference", "pallas_interpret"):
        got = _seam(q, k, v, ranges.start, ranges.end, sinks, impl=impl)
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
    got = jax.jit(lambda *args: cache_attention(*args, impl=impl, sinks=sinks))(  # one program, not op by op
        q, cache_k, cache_v, 0, ranges.segment(0, lengths), new_k, new_v, ranges.segment(lengths, lengths + tq))
    # the same keys laid out as one buffer per row: [cache[:len] ; new], key j at position j, seen by the
    # queries at positions >= j (in numpy: no eager jax op to compile per row)
    k_all, v_all, new_k, new_v, positions = map(np.asarray, (k_all, v_all, new_k, new_v, positions))
    keys, values, visible = [], [], []
    for row in range(b):
        n = int(lengths[row])
        keys.append(np.concatenate([k_all[row, :n], new_k[row]]))
        values.append(np.concatenate([v_all[row, :n], new_v[row]]))
        visible.append(np.arange(n + tq)[None, :] <= positions[row][:, None])
    for row in range(b):
        want = float64_sink_attention(q[row:row + 1], keys[row][None], values[row][None], visible[row][None],
                                      sinks, d**-0.5)
        np.testing.assert_allclose(np.asarray(got[row:row + 1]), want, atol=TOL, rtol=TOL)


# ----------------------------------------------------------------------------------------------
# The sink inside the Pallas kernel (interpret mode)


def _kernel_case(seed, b, tq, tk, hq, hkv, d, dtype=jnp.float32):
    """q, k, v (dtype), sinks [Hq] and a cotangent w (float32); numpy draws (nothing to compile)."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=shape).astype(np.float32)).astype(dtype)
               for shape in [(b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d)])
    sinks = jnp.asarray(2.0 * rng.normal(size=(hq,)).astype(np.float32))
    return q, k, v, sinks, jnp.asarray(rng.normal(size=(b, tq, hq, d)).astype(np.float32))


def _ragged_causal(tq, tk, offsets, window=0, masked=None):
    """Causal (sliding) ranges of rows ending at key tk - 1 - offsets[b]; masked: a (row, query)
    that sees no key."""
    positions = jnp.asarray(offsets, jnp.int32)[:, None] + jnp.arange(tq, dtype=jnp.int32)[None]
    ranges = masks.causal(positions, window)
    if masked is not None:
        ranges = masks.KeyRanges(ranges.start, ranges.end.at[masked].set(ranges.start[masked]))
    return ranges


def _kernel_and_reference(q, k, v, sinks, w, ranges, kernel):
    """(out, (dq, dk, dv, dsinks)) of kernel(q, k, v, ranges, sinks) and of the float32 reference
    on the float32-cast inputs, for the loss sum(w * out); one jit."""

    @jax.jit
    def run(q, k, v, sinks, w, start, end):
        r = masks.KeyRanges(start, end)

        def both(fn, *args):
            out, vjp = jax.vjp(fn, *args)
            return out, vjp(w.astype(out.dtype))

        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return (both(lambda q, k, v, s: kernel(q, k, v, r, s), q, k, v, sinks),
                both(lambda q, k, v, s: reference_attention(q, k, v, r, sinks=s), *f32, sinks))

    return run(q, k, v, sinks, w, ranges.start, ranges.end)


def _assert_grads_close(got, want, tol, what):
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape and np.isfinite(a).all(), (what, name)
        err, scale = float(np.abs(a - b).max()), max(1.0, float(np.abs(b).max()))
        assert err <= tol * scale, f"{what}: {name} max abs error {err:.3g} > {tol * scale:.3g}"


KERNEL_CASES = {
    # name: (seed, B, Tq, Tk, Hq, Hkv, D, key offsets, window, fully masked query, block sizes, backward)
    "gqa2_d16_window_masked": (11, 2, 13, 40, 4, 2, 16, [27, 9], 5, (1, 4), TILES_16, "pallas"),
    "gqa4_d64_splits": (12, 2, 3, 37, 4, 1, 64, [34, 20], 0, (0, 0),
                        dataclasses.replace(TILES_16, num_splits=3), "pallas"),
    "gqa2_d24_q16k32": (13, 1, 20, 33, 4, 2, 24, [13], 9, (0, 7),
                        BlockSizes(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16), "pallas"),
    "mha_d8_reference_backward": (14, 2, 7, 21, 2, 2, 8, [14, 3], 0, (1, 0), TILES_16, "reference"),
}


SLOW_KERNEL_CASES = ("gqa2_d24_q16k32", "mha_d8_reference_backward")  # make test-all


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_KERNEL_CASES else n
                                  for n in KERNEL_CASES])
def test_kernel_sink_forward_and_grads(name):
    """block_attention(..., sinks=) against float64 (forward) and jax.grad of the reference (dq, dk,
    dv, dsinks); a query that sees no key gives zeros and zero dq."""
    seed, b, tq, tk, hq, hkv, d, offsets, window, masked, blocks, backward = KERNEL_CASES[name]
    q, k, v, sinks, w = _kernel_case(seed, b, tq, tk, hq, hkv, d)
    ranges = _ragged_causal(tq, tk, offsets, window, masked)

    def kernel(q, k, v, r, s):
        return block_attention(q, k, v, r, sinks=s, block_sizes=blocks, interpret=True, backward=backward)

    (out, grads), (_, ref_grads) = _kernel_and_reference(q, k, v, sinks, w, ranges, kernel)
    want = float64_sink_attention(q, k, v, np.asarray(ranges.dense(tk)), sinks, d**-0.5)
    np.testing.assert_allclose(np.asarray(out), want, atol=TOL, rtol=TOL, err_msg=name)
    _assert_grads_close(grads, ref_grads, GRAD_TOL, name)
    if masked is not None:
        assert (np.asarray(out)[masked] == 0).all() and (np.asarray(grads[0])[masked] == 0).all()


def test_seam_kernel_sink_forward_and_grads_default_tiles():
    """attention(impl="pallas_interpret", sinks=) runs the sink kernel (default tiles, shrunk),
    differentiable in q, k, v and the sinks; one query head per kv head, head_dim 40 (padded), a
    sliding window."""
    q, k, v, sinks, w = _kernel_case(15, 2, 9, 30, 2, 2, 40)
    ranges = _ragged_causal(9, 30, [21, 4], window=6, masked=(1, 2))

    def kernel(q, k, v, r, s):
        return attention(q, k, v, r, impl="pallas_interpret", sinks=s)

    (out, grads), (_, ref_grads) = _kernel_and_reference(q, k, v, sinks, w, ranges, kernel)
    want = float64_sink_attention(q, k, v, np.asarray(ranges.dense(30)), sinks, 40**-0.5)
    np.testing.assert_allclose(np.asarray(out), want, atol=TOL, rtol=TOL)
    _assert_grads_close(grads, ref_grads, GRAD_TOL, "seam")


def test_kernel_sink_bfloat16():
    """bfloat16 q, k, v (float32 sinks): output and gradients in bfloat16, close to the float32
    reference on the same inputs."""
    q, k, v, sinks, w = _kernel_case(16, 1, 16, 24, 4, 2, 32, jnp.bfloat16)
    ranges = _ragged_causal(16, 24, [8], window=10, masked=(0, 3))

    def kernel(q, k, v, r, s):
        return block_attention(q, k, v, r, sinks=s, block_sizes=TILES_16, interpret=True)

    (out, grads), (ref_out, ref_grads) = _kernel_and_reference(q, k, v, sinks, w, ranges, kernel)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads[:3])
    assert grads[3].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out), atol=BF16_TOL)
    _assert_grads_close(grads, ref_grads, BF16_TOL, "bf16")


def test_kernel_lse_includes_the_sink():
    """block_attention_with_lse(..., sinks=): the natural lse over [scores ; sink] (float64), and
    for a query that sees no key out 0, lse = its head's sink; with the key tiles split over
    programs the sink enters once."""
    q, k, v, sinks, _ = _kernel_case(17, 2, 6, 45, 4, 2, 16)
    ranges = _ragged_causal(6, 45, [39, 12], masked=(0, 2))
    blocks = dataclasses.replace(TILES_16, num_splits=2)
    out, lse = jax.jit(lambda q, k, v, s: block_attention_with_lse(
        q, k, v, ranges, sinks=s, block_sizes=blocks, interpret=True))(q, k, v, sinks)
    want, want_lse = float64_sink_attention(q, k, v, np.asarray(ranges.dense(45)), sinks, 16**-0.5,
                                            return_lse=True)
    np.testing.assert_allclose(np.asarray(out), want, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=TOL, rtol=TOL)
    assert (np.asarray(out)[0, 2] == 0).all()
    np.testing.assert_allclose(np.asarray(lse)[0, 2], np.asarray(sinks), rtol=1e-6)


def test_kernel_rejects_sinks_of_the_wrong_shape():
    q, k = jnp.zeros((1, 4, 4, 8)), jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match="sinks must have shape"):
        block_attention(q, k, k, _ragged_causal(4, 8, [4]), sinks=jnp.zeros((2,)), interpret=True)
