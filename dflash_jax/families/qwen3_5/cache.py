"""The decode cache of a hybrid target (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the attention layers' KV
cache beside each Gated DeltaNet layer's conv tail and delta-rule state (`HybridCache`, what
`Qwen3_5.init_cache` returns). Rolling back is setting lengths: a commit writes only the accepted
positions into the recurrent state (`gated_delta`'s masked recompute)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from dflash_jax.families.qwen3_5 import gated_delta as gd
from dflash_jax.models.cache import KVCache, mesh_size, rows_axis


@struct.dataclass
class HybridCache:
    """A hybrid target's decode state: `kv` (a KVCache over the attention layers only, in their
    order), `conv` [Nl, B, K-1, C] (each linear layer's last K-1 conv inputs) and `state`
    [Nl, B, Hv, Dk, Dv] float32 (its delta-rule state). `lengths` are the KV cache's: the state
    holds exactly the first lengths[b] positions of row b. `groups` (static): the layout of conv's
    channels, the model's `linear_groups` (`groups` groups of [q | k | v] heads, one per tensor
    shard; 1: the checkpoint's [q | k | v]), which `sharding.cache_shardings` splits by."""

    kv: KVCache
    conv: jax.Array
    state: jax.Array
    groups: int = struct.field(pytree_node=False, default=1)

    @classmethod
    def for_model(cls, config, batch: int, capacity: int, dtype=jnp.float32,
                  conv_dtype=jnp.float32, kv_replicas: int = 1, groups: int = 1) -> "HybridCache":
        kv = KVCache.zeros(len(config.attention_layer_ids), batch, capacity, config.num_kv_heads * kv_replicas,
                           config.head_dim, dtype)
        n = len(config.linear_layer_ids)
        linear = config.linear
        conv = jnp.zeros((n, batch, linear.conv_kernel_dim - 1, linear.conv_dim), conv_dtype)
        state = jnp.zeros((n, batch, linear.num_value_heads, linear.key_head_dim, linear.value_head_dim),
                          jnp.float32)
        return cls(kv, conv, state, groups)

    lengths = property(lambda self: self.kv.lengths)
    capacity = property(lambda self: self.kv.capacity)
    attention_cache = property(lambda self: self.kv)  # the `Cache` protocol's named parts
    layer_states = property(lambda self: {"conv": self.conv, "state": self.state})

    def with_lengths(self, lengths) -> "HybridCache":
        return self.replace(kv=self.kv.with_lengths(lengths))

    def cleared(self) -> "HybridCache":
        """Empty rows: no positions, and the recurrent states at their start (zero)."""
        return self.replace(kv=self.kv.cleared(), conv=jnp.zeros_like(self.conv), state=jnp.zeros_like(self.state))

    def commit(self, pending, num_new) -> "HybridCache":
        """The cache after the first num_new[b] positions of `pending` (a forward's or a verify's
        per-position outputs: (k, v, linear)); the rest leave no trace (module docstring)."""
        k, v, linear = pending
        valid = jnp.broadcast_to(jnp.asarray(num_new, jnp.int32), self.lengths.shape)
        kv = self.kv.with_lengths(self.lengths + valid) if k is None else self.kv.append(k, v, valid)
        if linear is None:
            return self.replace(kv=kv)
        conv = jax.vmap(lambda tail, x: gd.conv_tail(tail, x, valid))(self.conv, linear["conv_in"])
        state = jax.vmap(lambda s, q, k_, v_, g, beta: gd.delta_rule(q, k_, v_, g, beta, s, valid)[1])(
            self.state, linear["q"], linear["k"], linear["v"], linear["g"], linear["beta"])
        return self.replace(kv=kv, conv=conv, state=state)

    def shardings(self, mesh) -> "HybridCache":
        """Its KV cache as `KVCache.shardings`; conv tails and states over `data` on B, and over `tensor`
        where the channel groups (`groups`, the model's `linear_groups`) are a multiple of it."""
        rows = rows_axis(mesh, self.conv.shape[1])
        tensor = mesh_size(mesh, "tensor")
        heads = "tensor" if tensor > 1 and self.groups % tensor == 0 else None  # whole channel groups
        return self.replace(kv=self.kv.shardings(mesh), conv=NamedSharding(mesh, P(None, rows, None, heads)),
                            state=NamedSharding(mesh, P(None, rows, heads, None, None)))
