"""One mask language for every attention in the project.

Every attention here lets each query see at most two contiguous key ranges:

* the target: range 0 is the causal prefix of the row's cache (optionally windowed), range 1 empty;
* drafter inference: range 0 is the row's visible context, range 1 the block itself;
* drafter training: range 0 is the context strictly before the block's anchor, range 1 the block's
  own slots inside the packed sequence; padding blocks have both ranges empty.

`KeyRanges` stores half-open bounds ``[start, end)`` per query, shape ``[B, Tq, 2]``. Kernels take
the min/max of the bounds over a query tile and skip key tiles outside them; the reference
materialises the dense mask with `KeyRanges.dense`.

A window ``w > 0`` keeps only the last ``w`` keys of range 0; ``w <= 0`` means no window. Windows may
be traced scalars (the target scans over layers whose windows differ).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KeyRanges:
    """Per-query visible key ranges: key ``k`` is visible iff it lies in any ``[start[r], end[r])``."""

    start: jax.Array  # [B, Tq, 2] int32
    end: jax.Array  # [B, Tq, 2] int32

    def dense(self, num_keys: int) -> jax.Array:
        """Boolean mask [B, Tq, num_keys]."""
        return self.visible(jnp.arange(num_keys, dtype=jnp.int32))

    def visible(self, keys: jax.Array) -> jax.Array:
        """Boolean mask [B, Tq, K] of the key indices keys [K]."""
        k = keys.astype(jnp.int32)[None, None, None, :]
        inside = (k >= self.start[..., None]) & (k < self.end[..., None])  # [B, Tq, 2, K]
        return inside.any(axis=2)

    def any_visible(self) -> jax.Array:
        """[B, Tq] True where the query sees at least one key."""
        return (self.end > self.start).any(axis=-1)

    def segment(self, lo, hi) -> "KeyRanges":
        """The ranges restricted to keys [lo, hi) and re-indexed so that key lo becomes key 0.

        lo, hi: [B] per row (or scalars). Splits one attention into parts over separate buffers
        (a cache and the new keys) whose results are merged with their softmax statistics.
        """
        lo = jnp.asarray(lo, jnp.int32).reshape(-1, 1, 1)
        hi = jnp.asarray(hi, jnp.int32).reshape(-1, 1, 1)
        start = jnp.clip(self.start, lo, hi) - lo
        end = jnp.clip(self.end, lo, hi) - lo
        empty = end <= start
        return KeyRanges(start=jnp.where(empty, 0, start), end=jnp.where(empty, 0, end))

    def bounds(self) -> tuple[jax.Array, jax.Array]:
        """(lowest start, highest end) over every non-empty range: scalar int32 key bounds that
        hold every visible key ((0, 0) when none is visible)."""
        nonempty = self.end > self.start
        big = jnp.iinfo(jnp.int32).max
        lo = jnp.min(jnp.where(nonempty, self.start, big))
        hi = jnp.max(jnp.where(nonempty, self.end, 0))
        return jnp.where(hi > 0, lo, 0), hi


def _window_start(end: jax.Array, window) -> jax.Array:
    window = jnp.asarray(window, jnp.int32)
    return jnp.where(window > 0, jnp.maximum(end - window, 0), 0)


def _stack(start0, end0, start1, end1) -> KeyRanges:
    start = jnp.stack(jnp.broadcast_arrays(start0, start1), axis=-1).astype(jnp.int32)
    end = jnp.stack(jnp.broadcast_arrays(end0, end1), axis=-1).astype(jnp.int32)
    # An empty range is stored as [0, 0) so kernels can treat it uniformly.
    empty = end <= start
    return KeyRanges(start=jnp.where(empty, 0, start), end=jnp.where(empty, 0, end))


def causal(query_positions: jax.Array, window=0) -> KeyRanges:
    """Causal attention where key index == position (a KV cache buffer, or a full sequence).

    query_positions: [B, Tq] int. Query at position p sees keys [p - window + 1, p] (all of [0, p]
    without a window), which is Hugging Face's sliding-window rule.
    """
    end = query_positions.astype(jnp.int32) + 1
    zero = jnp.zeros_like(end)
    return _stack(_window_start(end, window), end, zero, zero)


def _block_range(offsets, block_size: int, window, causal: bool):
    """The block keys (slot indices [0, block_size)) each block query of slot `offsets` [..., G]
    sees: those at or before it where causal, within `window` slots of it (0: no window) on the
    sides the layer looks at."""
    window = jnp.asarray(window, jnp.int32)
    windowed = window > 0
    start = jnp.where(windowed, jnp.maximum(offsets - window + 1, 0), 0)
    if causal:
        end = offsets + 1
    else:
        end = jnp.where(windowed, jnp.minimum(offsets + window, block_size), block_size)
    return start, end


def drafter_inference(
    context_lengths: jax.Array, context_capacity: int, block_size: int, window=0, causal: bool = False
) -> KeyRanges:
    """Keys = [context cache (capacity slots) ; block (block_size slots)], the reference's rule
    over positions (context slot = position; the block at len_b .. len_b + G - 1).

    The block query at position q of row b sees the context positions p < len_b with q - p < window
    (all of them without a window), and the block keys at positions k with q - k < window, and
    k <= q where `causal` or k - q < window otherwise: each query has its own window.
    """
    offsets = jnp.arange(block_size, dtype=jnp.int32)[None, :]  # [1, G]
    end0 = context_lengths.astype(jnp.int32)[:, None] * jnp.ones((1, block_size), jnp.int32)
    start1, end1 = _block_range(offsets, block_size, window, causal)
    return _stack(_window_start(end0 + offsets + 1, window), end0, context_capacity + start1,
                  context_capacity + end1)


def drafter_cached(
    context_lengths: jax.Array, slots: int, block_size: int, window=0, causal: bool = False, ring_window: int = 0
) -> tuple[KeyRanges, KeyRanges]:
    """`drafter_inference`'s ranges split by buffer: (over the context cache's `slots` slots, over
    the block's own block_size keys), for `cache_attention`. ring_window > 0: the cache is a ring
    (`RingKVCache`, position p in slot p % slots) and the context visible is bounded to its last
    ring_window positions (<= slots); those may wrap around the buffer's end, so range 1 then
    holds the wrapped part."""
    offsets = jnp.arange(block_size, dtype=jnp.int32)[None, :]  # [1, G]
    end = context_lengths.astype(jnp.int32)[:, None] * jnp.ones((1, block_size), jnp.int32)
    start = _window_start(end + offsets + 1, window)
    block = _block_range(offsets, block_size, window, causal)
    block = _stack(block[0], block[1], jnp.zeros_like(end), jnp.zeros_like(end))
    if not ring_window:
        return _stack(start, end, jnp.zeros_like(end), jnp.zeros_like(end)), block
    if ring_window > slots:
        raise ValueError(f"ring_window {ring_window} exceeds the cache's {slots} slots")
    start = jnp.maximum(start, end - ring_window)
    first = start % slots
    stop = first + (end - start)  # one past the last slot, before wrapping
    return _stack(first, jnp.minimum(stop, slots), jnp.zeros_like(end), jnp.maximum(stop - slots, 0)), block


def drafter_training(
    anchors: jax.Array, block_valid: jax.Array, context_length: int, block_size: int, window=0,
    causal: bool = False
) -> KeyRanges:
    """Keys = [context (context_length) | N blocks of block_size], queries = the N blocks.

    anchors: [B, N] anchor positions; block_valid: [B, N] bool. A query of block j sees context
    positions strictly before anchors[j] (the anchor's own feature is NOT visible) and slots of its
    own block, both as `drafter_inference` would at that anchor (per-query windows, `causal`);
    padding blocks see nothing.
    """
    n = anchors.shape[1]
    offsets = jnp.tile(jnp.arange(block_size, dtype=jnp.int32), n)[None, :]  # [1, N*G]
    end0 = jnp.repeat(anchors.astype(jnp.int32), block_size, axis=1)  # [B, N*G]
    block_ids = jnp.repeat(jnp.arange(n, dtype=jnp.int32), block_size)[None, :]
    first = context_length + block_ids * block_size
    start1, end1 = _block_range(offsets, block_size, window, causal)
    valid = jnp.repeat(block_valid, block_size, axis=1)
    start0 = _window_start(end0 + offsets + 1, window)
    end0 = jnp.where(valid, end0, 0)
    end1 = jnp.where(valid, first + end1, 0)
    return _stack(start0, end0, jnp.broadcast_to(first + start1, end0.shape), end1)
