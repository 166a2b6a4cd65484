"""Pallas block-attention kernels (interpret mode on CPU; compiled on a GPU with
DFLASH_PALLAS_BACKEND=compiled) against the dense reference.

Every case checks the forward output and the gradients (dq, dk, dv) of a random scalar loss,
and that nothing is NaN. Shapes are small so that the whole file stays fast in interpret mode.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.kernels import masks
from dflash_jax.layers import attention as attention_mod
from dflash_jax.layers.attention import attention
from dflash_jax.kernels import (
    BlockSizes,
    block_attention,
    block_attention_with_lse,
    reference_attention,
    round_up,
    unsupported_reason,
)
from dflash_jax.kernels.tile_plan import key_tile_lists, row_bounds, row_tile_plan
from support.pallas import abstract_gpu

# interpret mode runs everywhere; "compiled" runs the Triton kernels (a GPU is needed).
INTERPRET = os.environ.get("DFLASH_PALLAS_BACKEND", "interpret") != "compiled"
KERNEL_IMPL = "pallas_interpret" if INTERPRET else "pallas"

F32_TOL = 2e-5
TILES_16 = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)


def _qkv(seed, b, tq, tk, hq, hkv, d, dtype=jnp.float32):
    """q, k, v (in `dtype`) and the output cotangent w, N(0, 1), drawn with numpy (no random-number program
    compiled per shape)."""
    rng = np.random.default_rng(seed)
    q, k, v, w = (rng.standard_normal(shape).astype(np.float32)
                  for shape in ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d), (b, tq, hq, d)))
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(w)


def _out_and_grads(fn, q, k, v, w):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(w.astype(out.dtype))


def _run_both(q, k, v, w, ranges, scale=None, block_sizes=None, backward="pallas"):
    """(kernel out, kernel grads), (reference out, reference grads) and the same for the float32
    reference on the upcast inputs; one jit for all, shared by the cases of the same settings and
    shapes."""
    return _compiled_both(scale, block_sizes, backward)(q, k, v, w, ranges.start, ranges.end)


@functools.cache
def _compiled_both(scale, block_sizes, backward):
    @jax.jit
    def run(q, k, v, w, start, end):
        r = masks.KeyRanges(start, end)

        def kern(q, k, v):
            return block_attention(q, k, v, r, scale=scale, block_sizes=block_sizes, interpret=INTERPRET,
                                   backward=backward)

        def ref(q, k, v):
            return reference_attention(q, k, v, r, scale=scale)

        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return (_out_and_grads(kern, q, k, v, w), _out_and_grads(ref, q, k, v, w),
                _out_and_grads(ref, *f32, w))

    return run


def _assert_close(kernel, reference, tol, what):
    (ko, kg), (ro, rg) = kernel, reference
    for name, a, b in [("out", ko, ro), ("dq", kg[0], rg[0]), ("dk", kg[1], rg[1]), ("dv", kg[2], rg[2])]:
        a = np.asarray(a, np.float32)
        b = np.asarray(b, np.float32)
        assert a.shape == b.shape, (what, name, a.shape, b.shape)
        assert np.isfinite(a).all(), f"{what}: NaN/inf in kernel {name}"
        scale = max(1.0, float(np.abs(b).max()))
        err = float(np.abs(a - b).max())
        assert err <= tol * scale, f"{what}: {name} max abs error {err:.3g} > {tol * scale:.3g}"


def _check_f32(q, k, v, w, ranges, what, **kw):
    kernel, reference, _ = _run_both(q, k, v, w, ranges, **kw)
    _assert_close(kernel, reference, F32_TOL, what)
    return kernel


def _assert_masked_rows_zero(kernel, ranges):
    """Queries that see no key: zero output and zero dq."""
    (out, (dq, _, _)) = kernel
    empty = ~np.asarray(ranges.any_visible())  # [B, Tq]
    assert empty.any(), "test case should contain fully masked rows"
    assert (np.asarray(out)[empty] == 0).all()
    assert (np.asarray(dq)[empty] == 0).all()


# ----------------------------------------------------------------------------------------------
# Kernel vs reference, one mask kind per case


def test_causal_with_cache_offsets_gqa_ragged():
    # Ragged rows: row 0 decodes positions 3..26, row 1 positions 16..39 of a 40-slot cache.
    # Tq = 24 and Tk = 40 are not multiples of the 16-tiles; GQA 4 query heads over 2 kv heads.
    q, k, v, w = _qkv(0, 2, 24, 40, 4, 2, 16)
    pos = jnp.arange(24)[None] + jnp.array([[3], [16]])
    _check_f32(q, k, v, w, masks.causal(pos), "causal", block_sizes=TILES_16)


def test_sliding_window_bf16():
    q, k, v, w = _qkv(1, 1, 48, 48, 2, 2, 64, jnp.bfloat16)
    ranges = masks.causal(jnp.arange(48)[None], window=7)
    kernel, ref16, ref32 = _run_both(q, k, v, w, ranges, block_sizes=TILES_16)
    # The float32 reference on the same (bf16) inputs is the truth; the kernel must be about as
    # close to it as the bf16 reference is.
    for i, name in enumerate(["dq", "dk", "dv"]):
        assert kernel[1][i].dtype == jnp.bfloat16, name
    assert kernel[0].dtype == jnp.bfloat16
    _assert_close(kernel, ref32, 1e-2, "window bf16 vs f32 reference")
    _assert_close(kernel, ref16, 1e-2, "window bf16 vs bf16 reference")


def test_drafter_inference_splits_mqa():
    # Keys = [context cache of 37 slots ; block of 16]; row 1 has an empty context (only its block).
    # One kv head for 4 query heads; the forward splits the key tiles over 3 programs.
    cap, g = 37, 16
    q, k, v, w = _qkv(2, 2, g, cap + g, 4, 1, 16)
    ranges = masks.drafter_inference(jnp.array([29, 0]), cap, g)
    _check_f32(q, k, v, w, ranges, "drafter inference",
               block_sizes=dataclasses.replace(TILES_16, num_splits=3))


def test_drafter_inference_default_tiles_window():
    # Default tile sizes (shrunk to the problem) and automatic split count; windowed context.
    cap, g = 45, 16
    q, k, v, w = _qkv(3, 2, g, cap + g, 2, 2, 32)
    ranges = masks.drafter_inference(jnp.array([45, 11]), cap, g, window=20)
    _check_f32(q, k, v, w, ranges, "drafter inference (defaults)")


def test_drafter_training_padding_blocks():
    # [context 30 | 3 blocks of 8]; row 0's last block is padding, row 1 uses a window.
    ctx, g, n = 30, 8, 3
    q, k, v, w = _qkv(4, 2, n * g, ctx + n * g, 4, 2, 16)
    anchors = jnp.array([[4, 17, 0], [9, 25, 28]])
    valid = jnp.array([[True, True, False], [True, True, True]])
    r0 = masks.drafter_training(anchors[:1], valid[:1], ctx, g)
    r1 = masks.drafter_training(anchors[1:], valid[1:], ctx, g, window=12)
    ranges = masks.KeyRanges(jnp.concatenate([r0.start, r1.start]), jnp.concatenate([r0.end, r1.end]))
    kernel = _check_f32(q, k, v, w, ranges, "drafter training", block_sizes=TILES_16)
    _assert_masked_rows_zero(kernel, ranges)


def test_random_ranges_empty_and_out_of_bounds_hd48():
    # Arbitrary two-range masks: empty, inverted, negative and past-the-end bounds, overlapping
    # ranges, fully masked rows; head_dim 48 (padded to 64 inside); tiles of 16 and 32; a custom
    # softmax scale.
    b, tq, tk = 2, 20, 33
    q, k, v, w = _qkv(5, b, tq, tk, 2, 2, 48)
    rng = np.random.default_rng(5)
    start = rng.integers(-5, tk + 5, size=(b, tq, 2))
    end = start + rng.integers(-3, 20, size=(b, tq, 2))
    end[0, :4] = start[0, :4]  # fully masked rows
    ranges = masks.KeyRanges(jnp.array(start, jnp.int32), jnp.array(end, jnp.int32))
    kernel = _check_f32(q, k, v, w, ranges, "random ranges", scale=0.3,
                        block_sizes=BlockSizes(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16))
    _assert_masked_rows_zero(kernel, ranges)


def test_all_rows_masked_no_nan():
    # the shapes and tiles of test_causal_with_cache_offsets_gqa_ragged: its compiled program
    q, k, v, w = _qkv(6, 2, 24, 40, 4, 2, 16)
    zeros = jnp.zeros((2, 24, 2), jnp.int32)
    ranges = masks.KeyRanges(zeros, zeros)
    kernel = _check_f32(q, k, v, w, ranges, "all masked", block_sizes=TILES_16)
    for x in (kernel[0], *kernel[1]):
        assert (np.asarray(x) == 0).all()


def test_reference_backward_option():
    q, k, v, w = _qkv(7, 1, 24, 40, 4, 2, 16)
    ranges = masks.causal(jnp.arange(24)[None] + 16)
    _check_f32(q, k, v, w, ranges, "reference backward", block_sizes=BlockSizes(block_q=16, block_k=16),
               backward="reference")


def test_with_lse():
    q, k, v, _ = _qkv(8, 1, 16, 24, 2, 2, 16)
    pos = jnp.arange(16)[None] + 8
    start = jnp.stack([jnp.zeros_like(pos), jnp.zeros_like(pos)], -1)
    end = jnp.stack([pos + 1, jnp.zeros_like(pos)], -1).at[0, :3, 0].set(0)  # 3 empty rows
    ranges = masks.KeyRanges(start.astype(jnp.int32), end.astype(jnp.int32))
    blocks = BlockSizes(block_q=16, block_k=16, num_splits=2)
    out, lse = jax.jit(lambda q, k, v: block_attention_with_lse(
        q, k, v, ranges, block_sizes=blocks, interpret=INTERPRET))(q, k, v)

    @jax.jit  # the references in one program, not op by op
    def references(q, k, v):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 16**-0.5
        scores = jnp.where(ranges.dense(24)[:, None], scores, -jnp.inf)
        return reference_attention(q, k, v, ranges), jnp.moveaxis(jax.nn.logsumexp(scores, axis=-1), 1, 2)

    ref, want = references(q, k, v)  # want: the lse [B, Tq, H]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=F32_TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want), atol=1e-5)
    assert np.isneginf(np.asarray(lse)[0, :3]).all()


@pytest.mark.slow
def test_larger_training_mask_bf16_default_tiles():
    """Qwen3-8B-like heads (D=128, 8 q heads over 2 kv heads), default tiles and splits."""
    ctx, g, n = 192, 16, 8
    q, k, v, w = _qkv(12, 1, n * g, ctx + n * g, 8, 2, 128, jnp.bfloat16)
    anchors = jnp.array([[5, 30, 31, 70, 100, 150, 180, 0]])
    valid = jnp.array([[True] * 7 + [False]])
    ranges = masks.drafter_training(anchors, valid, ctx, g)
    kernel, _, ref32 = _run_both(q, k, v, w, ranges)
    _assert_close(kernel, ref32, 1e-2, "larger training bf16")
    _assert_masked_rows_zero(kernel, ranges)


# ----------------------------------------------------------------------------------------------
# Triton lowering: the kernels lower for CUDA on a machine without a GPU (catches unsupported
# primitives, non-power-of-two tensors and indexing errors that interpret mode cannot see; the
# PTX compile itself needs a GPU).


@pytest.mark.parametrize(
    "dtype,d,tq,tk,blocks",
    [
        (jnp.bfloat16, 128, 64, 200, BlockSizes()),
        (jnp.float32, 48, 40, 130, BlockSizes(num_splits=3, block_q=32, block_k=32)),
        (jnp.float16, 64, 1, 300, BlockSizes(block_q_bwd=32, block_k_bwd=128)),
    ],
)
def test_lowers_to_triton_for_cuda(dtype, d, tq, tk, blocks):
    q = jnp.zeros((2, tq, 8, d), dtype)
    k = jnp.zeros((2, tk, 2, d), dtype)
    ranges = masks.causal(jnp.arange(tq)[None] + jnp.array([[tk - tq], [3]]))

    def fwd_and_grad(q, k, v, start, end):
        def f(q, k, v):
            return block_attention(q, k, v, masks.KeyRanges(start, end), block_sizes=blocks)

        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(out)

    try:
        with abstract_gpu():
            traced = jax.jit(fwd_and_grad).trace(q, k, k, ranges.start, ranges.end)
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
    except (TypeError, AttributeError) as e:  # an API this jax version lacks
        pytest.skip(f"cross-platform lowering unavailable: {e}")
    assert text.count("__gpu$xla.gpu.triton") == 3
    for name in ("block_attention_fwd", "block_attention_dq", "block_attention_dkdv"):
        assert name in text


# ----------------------------------------------------------------------------------------------
# Tile bookkeeping (plain jnp, fast)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def plan_and_lists(start, end, group, r_pad, bq, bk, n_kt):
    """The row tile plan and its transpose, the key tile lists, in one program (as in the kernel)."""
    plan = row_tile_plan(row_bounds(start, end, group, r_pad), bq, bk)
    return plan, key_tile_lists(plan, n_kt)


def test_tile_plan_covers_exactly_the_visible_tiles():
    rng = np.random.default_rng(0)
    b, tq, tk, group, bq, bk = 2, 24, 70, 2, 16, 16
    for trial in range(4):
        start = rng.integers(-3, tk + 3, size=(b, tq, 2))
        end = start + rng.integers(-2, 40, size=(b, tq, 2))
        if trial == 0:  # ranges that overlap in the same tiles must be visited once
            start[..., 1] = start[..., 0] + 1
        start, end = np.clip(start, 0, tk), np.clip(end, 0, tk)
        r_pad = round_up(tq * group, bq)
        n_kt = round_up(tk, bk) // bk
        plan, lists = map(np.asarray, plan_and_lists(jnp.array(start, jnp.int32), jnp.array(end, jnp.int32),
                                                     group, r_pad, bq, bk, n_kt))
        dense = np.asarray(start[..., None] <= np.arange(tk)) & np.asarray(np.arange(tk) < end[..., None])
        dense = dense.any(axis=-2)  # [B, Tq, Tk]: a key inside either range
        dense = np.repeat(dense, group, axis=1)  # folded rows
        for bb in range(b):
            for i in range(r_pad // bq):
                lo0, hi0, lo1, hi1 = plan[bb, i]
                tiles = list(range(lo0, hi0)) + list(range(lo1, hi1))
                assert len(tiles) == len(set(tiles)), "a key tile visited twice"
                assert all(0 <= t < n_kt for t in tiles)
                rows = dense[bb, i * bq : (i + 1) * bq]
                needed = {kk // bk for kk in np.nonzero(rows.any(axis=0))[0]}
                assert needed <= set(tiles)
                # The dK/dV lists are the transpose of the plan.
                for kt in tiles:
                    count, members = lists[bb, kt, 0], lists[bb, kt, 1:]
                    assert i in members[:count]
            for kt in range(n_kt):
                count, members = lists[bb, kt, 0], lists[bb, kt, 1:]
                assert list(members[:count]) == sorted(members[:count])


def test_tile_plan_drafter_training_is_tight():
    """Row tiles of 2 blocks visit only the context before their anchors and their own blocks."""
    ctx, g, n = 64, 16, 4
    anchors = jnp.array([[10, 20, 40, 60]])

    @jax.jit  # one program, not op by op
    def tile_plan(anchors):
        r = masks.drafter_training(anchors, jnp.ones((1, n), bool), ctx, g)
        return row_tile_plan(row_bounds(r.start, r.end, 1, n * g), 32, 16)

    plan = np.asarray(tile_plan(anchors))
    # Row tile 0 = blocks 0, 1: context [0, 20) -> tiles 0..1; blocks at keys [64, 96) -> 4..5.
    np.testing.assert_array_equal(plan[0, 0], [0, 2, 4, 6])
    # Row tile 1 = blocks 2, 3: context [0, 60) -> tiles 0..3; blocks [96, 128) -> 6..7.
    np.testing.assert_array_equal(plan[0, 1], [0, 4, 6, 8])


@pytest.mark.parametrize("field,value,message", [
    ("block_q", 24, "BlockSizes.block_q must be a power of two >= 16"),
    ("block_k_bwd", 8, "BlockSizes.block_k_bwd must be a power of two >= 16"),
    ("num_splits", 0, "BlockSizes.num_splits must be None or >= 1"),
    ("num_warps", 6, "BlockSizes.num_warps must be None or a power of two"),
    ("num_stages", 0, "BlockSizes.num_stages must be >= 1"),
])
def test_block_sizes_reject_bad_tiles(field, value, message):
    with pytest.raises(ValueError, match=message):
        BlockSizes(**{field: value})


# ----------------------------------------------------------------------------------------------
# Dispatcher


def test_dispatcher_impls():
    q, k, v, _ = _qkv(9, 2, 16, 24, 2, 1, 16)
    ranges = masks.causal(jnp.arange(16)[None] + 8)  # batch 1: broadcast over the batch
    # each compiled as one program, as the models call them (not op by op)
    ref = jax.jit(lambda q, k, v: reference_attention(q, k, v, ranges))(q, k, v)
    run = lambda **kw: jax.jit(lambda q, k, v: attention(q, k, v, ranges, **kw))(q, k, v)
    np.testing.assert_array_equal(np.asarray(run(impl="reference")), ref)
    if jax.default_backend() != "gpu":
        np.testing.assert_array_equal(np.asarray(run()), ref)
    out = run(impl=KERNEL_IMPL)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=F32_TOL)
    with pytest.raises(ValueError, match="unknown attention impl"):
        attention(q, k, v, ranges, impl="flash")


def test_dispatcher_falls_back_with_logged_reason(monkeypatch, caplog):
    q, k, v, _ = _qkv(10, 1, 8, 8, 2, 1, 16)
    k = k.astype(jnp.bfloat16)  # mixed dtypes: the kernel declines
    ranges = masks.causal(jnp.arange(8)[None])
    assert "mixed dtypes" in unsupported_reason(q, k, v, ranges)
    with pytest.raises(ValueError, match="mixed dtypes"):
        attention(q, k, v, ranges, impl="pallas")
    monkeypatch.setattr(attention_mod.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention_mod, "_logged_reasons", set())
    with caplog.at_level(logging.WARNING, logger="dflash_jax.layers.attention"):
        out1 = attention(q, k, v, ranges)
        out2 = attention(q, k, v, ranges)
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(reference_attention(q, k, v, ranges)))
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))
    hits = [r for r in caplog.records if "mixed dtypes" in r.getMessage()]
    assert len(hits) == 1, "the reason is logged once"


def test_unsupported_reasons():
    q, k, v, _ = _qkv(11, 1, 8, 8, 3, 2, 16)
    ranges = masks.causal(jnp.arange(8)[None])
    assert "multiple of kv heads" in unsupported_reason(q, k, v, ranges)
    q, k, v, _ = _qkv(11, 1, 8, 8, 2, 1, 16)
    assert unsupported_reason(q, k, v, ranges) is None
    reasons = []
    jax.jit(lambda s: reasons.append(unsupported_reason(q, k, v, ranges, s)) or s)(0.5)
    assert "traced" in reasons[0]
    assert "ranges" in unsupported_reason(q, k, v, masks.causal(jnp.arange(4)[None]))
