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


def drafter_inference(
    context_lengths: jax.Array, context_capacity: int, block_size: int, window=0
) -> KeyRanges:
    """Keys = [context cache (capacity slots) ; block (block_size slots)].

    Every block query of row b sees context slots [max(0, len_b - window), len_b) and the whole block.
    """
    end0 = context_lengths.astype(jnp.int32)[:, None] * jnp.ones((1, block_size), jnp.int32)
    start1 = jnp.full_like(end0, context_capacity)
    return _stack(_window_start(end0, window), end0, start1, start1 + block_size)


def drafter_training(
    anchors: jax.Array, block_valid: jax.Array, context_length: int, block_size: int, window=0
) -> KeyRanges:
    """Keys = [context (context_length) | N blocks of block_size], queries = the N blocks.

    anchors: [B, N] anchor positions; block_valid: [B, N] bool. A query of block j sees context
    positions strictly before anchors[j] (the anchor's own feature is NOT visible) and the slots of
    its own block; padding blocks see nothing.
    """
    n = anchors.shape[1]
    end0 = jnp.repeat(anchors.astype(jnp.int32), block_size, axis=1)  # [B, N*G]
    block_ids = jnp.repeat(jnp.arange(n, dtype=jnp.int32), block_size)[None, :]
    start1 = context_length + block_ids * block_size
    valid = jnp.repeat(block_valid, block_size, axis=1)
    start0 = _window_start(end0, window)
    end0 = jnp.where(valid, end0, 0)
    end1 = jnp.where(valid, start1 + block_size, 0)
    return _stack(start0, end0, jnp.broadcast_to(start1, end0.shape), end1)
