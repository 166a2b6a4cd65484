"""Static-shape KV cache with per-row lengths. Rolling back is setting lengths."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Keys/values of every layer: [layers, batch, capacity, kv_heads, head_dim], lengths [batch].

    Slot i of a row holds position i; slots >= lengths[b] are garbage and never attended to.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def zeros(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
              dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch, capacity, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))


def write_rows(buffer: jax.Array, layer: jax.Array, new: jax.Array, offsets: jax.Array) -> jax.Array:
    """Write new [B, T, H, D] into buffer [L, B, S, H, D] at (layer, b, offsets[b]:offsets[b]+T)."""

    def write_one(row_buffer, row_new, offset):  # [L, S, H, D], [T, H, D], []
        return jax.lax.dynamic_update_slice(row_buffer, row_new[None].astype(row_buffer.dtype),
                                            (layer, offset, 0, 0))

    return jax.vmap(write_one, in_axes=(1, 0, 0), out_axes=1)(buffer, new, offsets)


def read_layer(buffer: jax.Array, layer: jax.Array) -> jax.Array:
    """[L, B, S, H, D] -> [B, S, H, D] of one (traced) layer."""
    return jax.lax.dynamic_index_in_dim(buffer, layer, axis=0, keepdims=False)
