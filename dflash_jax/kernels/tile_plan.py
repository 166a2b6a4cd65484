"""Which tiles the block-attention kernels visit: plain-jnp bookkeeping computed outside them.

Rows are folded (query x head-in-group, row ``r = t * G + g``; see `block_attention`). For every
tile of ``block_q`` rows, `row_tile_plan` gives the key-tile intervals ``[lo0, hi0)`` and
``[lo1, hi1)`` that hold the tile's visible keys (merged into one when they intersect, so no key
tile is visited twice); `key_tile_lists` transposes it for the dK/dV kernel.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.kernels.masks import KeyRanges


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= n."""
    return -(-n // multiple) * multiple


def clip_ranges(ranges: KeyRanges, batch: int, num_queries: int, num_keys: int):
    """`ranges` broadcast to [batch, num_queries, 2] int32 bounds, clipped to [0, num_keys):
    -> (start, end), so that padded keys lie outside every range."""
    start = jnp.broadcast_to(ranges.start, (batch, num_queries, 2)).astype(jnp.int32)
    end = jnp.broadcast_to(ranges.end, (batch, num_queries, 2)).astype(jnp.int32)
    return jnp.clip(start, 0, num_keys), jnp.clip(end, 0, num_keys)


def row_bounds(start: jax.Array, end: jax.Array, group: int, rows_padded: int) -> jax.Array:
    """Per folded row bounds: start, end [B, Tq, 2] -> int32 [B, 4, R_pad] = (start0, end0, start1,
    end1), each query's bounds repeated for its `group` heads; padding rows see nothing."""
    bounds = jnp.stack([start[..., 0], end[..., 0], start[..., 1], end[..., 1]], axis=1)  # [B,4,Tq]
    bounds = jnp.repeat(bounds, group, axis=2)
    return jnp.pad(bounds, [(0, 0), (0, 0), (0, rows_padded - bounds.shape[2])])


def row_tile_plan(bounds: jax.Array, block_q: int, block_k: int) -> jax.Array:
    """Key-tile intervals per row tile: bounds [B, 4, R_pad] -> int32 [B, nRt, 4] = (lo0, hi0,
    lo1, hi1), disjoint.

    Over the tile's rows whose range r is non-empty: lo_r = min start // block_k and
    hi_r = ceil(max end / block_k). Intersecting intervals are merged into the first.
    """
    b, _, r_pad = bounds.shape
    n_rt = r_pad // block_q
    t = bounds.reshape(b, 2, 2, n_rt, block_q)  # [B, range, (start,end), nRt, rows]
    s, e = t[:, :, 0], t[:, :, 1]  # [B, 2, nRt, rows]
    nonempty = e > s
    big = jnp.iinfo(jnp.int32).max
    lo = jnp.min(jnp.where(nonempty, s, big), axis=-1)
    hi = jnp.max(jnp.where(nonempty, e, 0), axis=-1)
    has = nonempty.any(axis=-1)
    lo_t = jnp.where(has, lo // block_k, 0)
    hi_t = jnp.where(has, -(-hi // block_k), 0)
    a0, a1 = lo_t[:, 0], lo_t[:, 1]
    b0, b1 = hi_t[:, 0], hi_t[:, 1]
    overlap = (b0 > a0) & (b1 > a1) & (a1 < b0) & (a0 < b1)
    plan = jnp.stack(
        [
            jnp.where(overlap, jnp.minimum(a0, a1), a0),
            jnp.where(overlap, jnp.maximum(b0, b1), b0),
            jnp.where(overlap, 0, a1),
            jnp.where(overlap, 0, b1),
        ],
        axis=-1,
    )
    return plan.astype(jnp.int32)


def key_tile_lists(plan: jax.Array, num_key_tiles: int) -> jax.Array:
    """For every key tile, the row tiles that visit it: plan [B, nRt, 4] -> int32 [B, nKt, 1 + nRt].

    Column 0 is the count; columns 1.. are the visiting row tiles in increasing order (then junk).
    """
    kt = jnp.arange(num_key_tiles, dtype=jnp.int32)[None, None, :]
    lo0, hi0, lo1, hi1 = (plan[..., i : i + 1] for i in range(4))
    visits = ((kt >= lo0) & (kt < hi0)) | ((kt >= lo1) & (kt < hi1))  # [B, nRt, nKt]
    count = visits.sum(axis=1, dtype=jnp.int32)  # [B, nKt]
    order = jnp.argsort(jnp.logical_not(visits), axis=1, stable=True).astype(jnp.int32)
    return jnp.concatenate([count[..., None], jnp.swapaxes(order, 1, 2)], axis=-1)
