"""Mask builders against hand-written dense masks (small cases, written out by hand)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kernels import masks

# jitted, as the models build them: one program per shape, not one compiled program per eager op
_dense_mask = jax.jit(lambda ranges, num_keys: ranges.dense(num_keys), static_argnums=1)
_drafter_training = functools.partial(jax.jit, static_argnums=(2, 3), static_argnames=("window", "causal"))(
    masks.drafter_training)


def _dense(ranges: masks.KeyRanges, num_keys: int) -> np.ndarray:
    return np.asarray(_dense_mask(ranges, num_keys)).astype(int)


def _rows(*rows: str) -> np.ndarray:
    """Dense mask from strings like '11100': one string per query."""
    return np.array([[int(c) for c in r.replace(" ", "")] for r in rows])


def _assert_empty_ranges_are_zero(ranges: masks.KeyRanges):
    start, end = np.asarray(ranges.start), np.asarray(ranges.end)
    empty = end <= start
    assert (start[empty] == 0).all() and (end[empty] == 0).all()
    assert ranges.start.dtype == jnp.int32 and ranges.end.dtype == jnp.int32


def test_causal_full_sequence():
    r = masks.causal(jnp.arange(4)[None])
    assert r.start.shape == (1, 4, 2)
    want = _rows("1000", "1100", "1110", "1111")
    np.testing.assert_array_equal(_dense(r, 4)[0], want)
    _assert_empty_ranges_are_zero(r)


def test_causal_with_cache_offsets_ragged_rows():
    # Row 0 decodes 2 tokens at positions 3, 4; row 1 at positions 0, 1; cache of 6 slots.
    r = masks.causal(jnp.array([[3, 4], [0, 1]]))
    d = _dense(r, 6)
    np.testing.assert_array_equal(d[0], _rows("111100", "111110"))
    np.testing.assert_array_equal(d[1], _rows("100000", "110000"))
    np.testing.assert_array_equal(np.asarray(r.any_visible()), [[True, True], [True, True]])


def test_causal_sliding_window():
    # Hugging Face's rule: position p sees [p - window + 1, p].
    r = masks.causal(jnp.arange(5)[None], window=2)
    want = _rows("10000", "11000", "01100", "00110", "00011")
    np.testing.assert_array_equal(_dense(r, 5)[0], want)
    # A traced / array window, and window <= 0 meaning none.
    r0 = masks.causal(jnp.arange(5)[None], window=jnp.int32(0))
    np.testing.assert_array_equal(_dense(r0, 5)[0], np.tril(np.ones((5, 5), int)))


def test_drafter_inference():
    # Keys = [context cache of 4 slots ; block of 2]. Row 0 has 3 context tokens, row 1 none.
    r = masks.drafter_inference(jnp.array([3, 0]), context_capacity=4, block_size=2)
    d = _dense(r, 6)
    np.testing.assert_array_equal(d[0], _rows("1110 11", "1110 11"))
    np.testing.assert_array_equal(d[1], _rows("0000 11", "0000 11"))
    _assert_empty_ranges_are_zero(r)
    # Row 1's context range is empty and stored as [0, 0); its block range is [4, 6).
    np.testing.assert_array_equal(np.asarray(r.start[1, 0]), [0, 4])
    np.testing.assert_array_equal(np.asarray(r.end[1, 0]), [0, 6])


def test_drafter_inference_window():
    """The window is measured from each query's own position (row 0's block at positions 3, 4)."""
    r = masks.drafter_inference(jnp.array([3, 1]), context_capacity=4, block_size=2, window=2)
    d = _dense(r, 6)
    np.testing.assert_array_equal(d[0], _rows("0010 11", "0000 11"))
    np.testing.assert_array_equal(d[1], _rows("1000 11", "0000 11"))


def test_drafter_inference_causal_window():
    """A causal layer's block query sees the block keys at or before it; the window bounds those
    too (block of 4, window 2)."""
    r = masks.drafter_inference(jnp.array([3]), context_capacity=4, block_size=4, window=2, causal=True)
    np.testing.assert_array_equal(_dense(r, 8)[0], _rows("0010 1000", "0000 1100", "0000 0110", "0000 0011"))
    r = masks.drafter_inference(jnp.array([3]), context_capacity=4, block_size=4, window=2)
    np.testing.assert_array_equal(_dense(r, 8)[0], _rows("0010 1100", "0000 1110", "0000 0111", "0000 0011"))
    r = masks.drafter_inference(jnp.array([3]), context_capacity=4, block_size=4, causal=True)
    np.testing.assert_array_equal(_dense(r, 8)[0], _rows("1110 1000", "1110 1100", "1110 1110", "1110 1111"))


def test_drafter_training_hand_written():
    # Context of 7 tokens, 3 blocks of 3 slots; block 2 is padding.
    # Keys = [context 0..6 | block0 7..9 | block1 10..12 | block2 13..15].
    anchors = jnp.array([[2, 5, 0]])
    valid = jnp.array([[True, True, False]])
    r = _drafter_training(anchors, valid, 7, 3)
    assert r.start.shape == (1, 9, 2)
    d = _dense(r, 16)[0]
    want = _rows(
        # context  | b0  | b1  | b2
        "1100000 111 000 000",  # block 0 (anchor 2): context 0, 1 only
        "1100000 111 000 000",
        "1100000 111 000 000",
        "1111100 000 111 000",  # block 1 (anchor 5): context 0..4
        "1111100 000 111 000",
        "1111100 000 111 000",
        "0000000 000 000 000",  # block 2: padding sees nothing
        "0000000 000 000 000",
        "0000000 000 000 000",
    )
    np.testing.assert_array_equal(d, want)
    _assert_empty_ranges_are_zero(r)
    np.testing.assert_array_equal(np.asarray(r.any_visible())[0], [1] * 6 + [0] * 3)


def test_drafter_training_window():
    anchors = jnp.array([[2, 6]])
    valid = jnp.array([[True, True]])
    r = _drafter_training(anchors, valid, 7, 2, window=3)
    d = _dense(r, 11)[0]
    want = _rows(
        "1100000 11 00",  # anchor 2, query at 2: context positions p < 2 with 2 - p < 3
        "0100000 11 00",  # query at 3: p < 2 with 3 - p < 3
        "0000110 00 11",  # anchor 6: query at 6
        "0000010 00 11",  # query at 7
    )
    np.testing.assert_array_equal(d, want)


def test_drafter_training_properties_random():
    """Block j never sees its anchor's position, anything at or after it, or another block."""
    rng = np.random.default_rng(0)
    ctx, g, n = 20, 4, 5
    for _ in range(5):
        anchors = np.sort(rng.choice(np.arange(1, ctx - 1), size=(2, n), replace=False), axis=1)
        valid = rng.random((2, n)) < 0.7
        r = _drafter_training(jnp.array(anchors), jnp.array(valid), ctx, g)
        d = np.asarray(_dense_mask(r, ctx + n * g))
        for b in range(2):
            for j in range(n):
                rows = d[b, j * g : (j + 1) * g]
                if not valid[b, j]:
                    assert not rows.any()
                    continue
                want = np.zeros(ctx + n * g, bool)
                want[: anchors[b, j]] = True
                want[ctx + j * g : ctx + (j + 1) * g] = True
                assert (rows == want[None]).all()
                assert not rows[:, anchors[b, j]].any()  # the anchor's own feature: the known leak
