"""Static-shape decode caches with per-row lengths: the `Cache` protocol every target cache implements,
`KVCache` (keys and values), `GroupedKVCache` (KV caches of different shapes side by side) and
`RingKVCache` (the last W positions). A family whose layers keep other state defines its cache in its
own module (Qwen3.5's `HybridCache`, DeepSeek-V3's `LatentCache`) and returns it from
`Family.init_cache`. Rolling back is setting lengths."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

UNROLLED_ROWS = 16  # batch rows written by unrolled updates; more rows use a loop
KV_CACHE_DTYPE_NAMES = ("float32", "float16", "bfloat16")  # what a target's KV cache may store


def resolve_kv_cache_dtype(dtype, compute_dtype) -> jnp.dtype:
    """The dtype a KV cache stores: `dtype` (a name of KV_CACHE_DTYPE_NAMES or a dtype), or the
    model's compute dtype where it is None or "auto"."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return jnp.dtype(compute_dtype)
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(f"KV cache dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)} or auto, got {dtype!r}")
    return resolved


@runtime_checkable
class Cache(Protocol):
    """What a target's decode cache offers the model, the decode loop and the sharding rules: per-row
    `lengths` [B] (the positions it holds; rolling back is setting them), its `capacity`, `with_lengths`,
    `commit(pending, num_new)` (the cache after the first num_new[b] of a forward's per-position outputs,
    `TargetModel`'s write_cache=False result) and `shardings(mesh)` (the cache of NamedShardings that
    places it on a mesh), and `cleared()` (the cache with every row empty: what a row reused for a new
    sequence starts from). The decoder stack reads it by name: `attention_cache` (what the attention
    layers read: the cache itself, or the KV part of a cache that holds more) and `layer_states` (the
    state of the layers that keep no keys, by name, each [Nl, B, ...] over those layers in order; empty
    where there are none). What `attention_cache` returns is read per KV group (`ModelConfig.kv_groups`):
    `kv_group(g)` is the cache group g's layers read, and `pending_kv(groups)` what its `commit` takes
    from the new keys of each group ((k, v) [Lg, B, T, ...], None for a group with none); a cache of
    one group is its own group 0. Every array in it is [B] (per row, like `lengths`) or [L, B, ...] (per
    layer, then per row): `take_row` / `put_row` rely on that. `KVCache`, `GroupedKVCache`, Qwen3.5's
    `HybridCache` and DeepSeek-V3's `LatentCache` implement it."""

    lengths: Any
    capacity: int
    attention_cache: Any
    layer_states: Any

    def with_lengths(self, lengths) -> "Cache": ...

    def commit(self, pending, num_new) -> "Cache": ...

    def shardings(self, mesh) -> "Cache": ...

    def cleared(self) -> "Cache": ...


def mesh_size(mesh, axis: str) -> int:
    return int(mesh.shape[axis]) if axis in mesh.shape else 1


def rows_axis(mesh, batch: int):
    """The mesh axis a cache's batch rows split over: `data` where it divides them, else none."""
    data = mesh_size(mesh, "data")
    return "data" if data > 1 and batch % data == 0 else None


class OneGroupCache:
    """The `Cache` protocol's named parts of a cache that the attention layers read as it is, one KV
    group, and that holds no layer state: `KVCache`, `RingKVCache`, DeepSeek-V3's `LatentCache`
    (`GroupedKVCache` overrides the groups)."""

    attention_cache = property(lambda self: self)  # the `Cache` protocol's named parts
    layer_states = property(lambda self: {})

    def kv_group(self, group: int):
        """The cache KV group `group` reads: this one (a cache of one group)."""
        return self

    @staticmethod
    def pending_kv(groups):
        """What `commit` takes of the groups' new keys: the one group's (k, v), or (None, None)."""
        return groups[0] if groups and groups[0] is not None else (None, None)


@struct.dataclass
class KVCache(OneGroupCache):
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

    @classmethod
    def for_model(cls, config, batch: int, capacity: int, dtype=jnp.float32, kv_replicas: int = 1) -> "KVCache":
        """An empty cache for a model config (fields num_layers, num_kv_heads, head_dim), of
        num_kv_heads x kv_replicas heads (`dflash_jax.sharding`: each kv head repeated for a tensor
        axis larger than the kv heads)."""
        return cls.zeros(config.num_layers, batch, capacity, config.num_kv_heads * kv_replicas, config.head_dim,
                         dtype)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

    def cleared(self) -> "KVCache":
        return self.with_lengths(jnp.zeros_like(self.lengths))

    def append(self, k_new: jax.Array, v_new: jax.Array, num_new) -> "KVCache":
        """Write k_new, v_new [L, B, T, Hkv, Dh] at each row's length; lengths += num_new ([B] or
        a scalar; slots written past a row's num_new are garbage, overwritten later)."""
        return KVCache(k=write_rows(self.k, k_new, self.lengths, axis=1),
                       v=write_rows(self.v, v_new, self.lengths, axis=1),
                       lengths=self.lengths + jnp.asarray(num_new, jnp.int32))


    def commit(self, pending, num_new) -> "KVCache":
        """`append` of a forward's pending (k_new, v_new): what every target cache offers (a hybrid
        target's `HybridCache.commit` also rolls its recurrent state)."""
        return self.append(*pending, num_new)

    def shardings(self, mesh) -> "KVCache":
        """k / v [L, B, S, H, D] over `data` on B (where it divides) and `tensor` on H, lengths over
        `data`. ValueError when the tensor axis does not divide the heads."""
        _, batch, _, heads, _ = self.k.shape
        tensor = mesh_size(mesh, "tensor")
        if heads % tensor:
            raise ValueError(f"KV cache of shape {list(self.k.shape)}: its {heads} kv-heads are not a multiple of the "
                             f"mesh's tensor axis of size {tensor} (a cache for this mesh holds kv_heads x "
                             "kv_replicas heads: sharding.spec_for_mesh)")
        rows = rows_axis(mesh, batch)
        kv = NamedSharding(mesh, P(None, rows, None, "tensor" if tensor > 1 else None, None))
        return self.replace(k=kv, v=kv, lengths=NamedSharding(mesh, P(rows)))



@struct.dataclass
class GroupedKVCache(OneGroupCache):
    """The KV cache of a target whose attention layers differ in the shape of their keys and values (Gemma 4's
    sliding and full layers): one `KVCache` per group of alike layers (`ModelConfig.kv_groups`, in its order;
    a layer's index in its group is its slot there), their lengths kept equal. `commit` takes a forward's
    pending (k, v) per group."""

    groups: tuple

    @classmethod
    def for_model(cls, config, batch: int, capacity: int, dtype=jnp.float32,
                  kv_replicas: int | tuple[int, ...] = 1) -> "GroupedKVCache":
        """Each group's heads x its copies (kv_replicas: one count, or one per group: `sharding.group_kv_replicas`)."""
        copies = kv_replicas if isinstance(kv_replicas, tuple) else (kv_replicas,) * len(config.kv_groups)
        return cls(tuple(KVCache.zeros(len(ids), batch, capacity, heads * r, dim, dtype)
                         for ((heads, dim), ids), r in zip(config.kv_groups, copies)))

    lengths = property(lambda self: self.groups[0].lengths)
    capacity = property(lambda self: self.groups[0].capacity)

    def kv_group(self, group: int) -> KVCache:
        """The KV cache of group `group`'s layers."""
        return self.groups[group]

    @staticmethod
    def pending_kv(groups):
        """What `commit` takes: each group's (k, v)."""
        return tuple(groups)

    def with_lengths(self, lengths) -> "GroupedKVCache":
        return self.replace(groups=tuple(g.with_lengths(lengths) for g in self.groups))

    def cleared(self) -> "GroupedKVCache":
        return self.replace(groups=tuple(g.cleared() for g in self.groups))

    def commit(self, pending, num_new) -> "GroupedKVCache":
        """Each group's `KVCache.append` of its pending (k, v) [Lg, B, T, Hg, Dg]."""
        return self.replace(groups=tuple(g.append(k, v, num_new) for g, (k, v) in zip(self.groups, pending)))

    def shardings(self, mesh) -> "GroupedKVCache":
        return self.replace(groups=tuple(g.shardings(mesh) for g in self.groups))


def write_rows(buffer: jax.Array, new: jax.Array, offsets: jax.Array, *, axis: int = 0) -> jax.Array:
    """Write `new` into `buffer` row by row: row b of `new` (rows along `axis`) lands at
    positions offsets[b] .. offsets[b] + T - 1 of the axis after `axis`; other axes are whole.

    buffer [..., B, S, ...], new [..., B, T, ...] (same rank, T <= S), offsets [B] int.
    One `dynamic_update_slice` with scalar offsets per row: XLA updates the buffer in place and
    touches only the T new positions (a vmapped update with per-row offsets would lower to a
    scatter over the whole buffer). Up to UNROLLED_ROWS rows the writes are unrolled; larger
    batches write in a `fori_loop` so the program does not grow with the batch. Offsets past
    S - T are clamped by XLA; callers size S.
    """
    new = new.astype(buffer.dtype)
    zero = jnp.zeros((), jnp.int32)

    def write(row, buffer):
        start = [zero] * buffer.ndim
        start[axis] = jnp.asarray(row, jnp.int32)
        start[axis + 1] = offsets[row].astype(jnp.int32)
        row_new = jax.lax.dynamic_slice_in_dim(new, row, 1, axis=axis)
        return jax.lax.dynamic_update_slice(buffer, row_new, start)

    rows = buffer.shape[axis]
    if rows > UNROLLED_ROWS:
        return jax.lax.fori_loop(0, rows, write, buffer)
    for row in range(rows):
        buffer = write(row, buffer)
    return buffer


@struct.dataclass
class RingKVCache(KVCache):
    """A KVCache that keeps only the last `capacity` positions of each row: position p in slot
    p % capacity (its keys carry their rotary phase, so a slot's place in the buffer means nothing
    to attention). `lengths` count every position appended. A drafter's context cache bounded for
    long contexts: readers see the last `window` positions (static; <= capacity, which may be
    rounded up for kernels' tiles; `kernels.masks.drafter_cached` with ring_window=window)."""

    window: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def for_window(cls, config, batch: int, window: int, capacity: int, dtype=jnp.float32,
                   kv_replicas: int = 1) -> "RingKVCache":
        if not 0 < window <= capacity:
            raise ValueError(f"a ring cache's window must lie in [1, capacity={capacity}], got {window}")
        return cls.for_model(config, batch, capacity, dtype, kv_replicas).replace(window=window)

    def append(self, k_new: jax.Array, v_new: jax.Array, num_new) -> "RingKVCache":
        """Write the first num_new[b] positions of k_new, v_new [L, B, T, Hkv, Dh] of each row; of
        more than `capacity` new positions only the last `capacity` land (nothing past num_new is
        written, so no slot a reader still sees is overwritten by garbage)."""
        b, t = k_new.shape[1], k_new.shape[2]
        num_new = jnp.broadcast_to(jnp.asarray(num_new, jnp.int32), (b,))
        offsets = jnp.arange(t, dtype=jnp.int32)[None, :]
        kept = (offsets < num_new[:, None]) & (offsets >= num_new[:, None] - self.capacity)
        slots = jnp.where(kept, (self.lengths[:, None] + offsets) % self.capacity, self.capacity)  # [B, T]
        rows = jnp.arange(b)[:, None]
        write = lambda buffer, new: buffer.at[:, rows, slots].set(new.astype(buffer.dtype), mode="drop")
        return self.replace(k=write(self.k, k_new), v=write(self.v, v_new), lengths=self.lengths + num_new)


def _row_axis(x) -> int:
    """The batch axis of a cache array (the `Cache` layout: [B] or [L, B, ...])."""
    return 0 if x.ndim == 1 else 1


def take_row(cache, row):
    """Row `row` (a traced int) of a cache, as a cache of batch 1 (its arrays copied)."""
    return jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1, axis=_row_axis(x)), cache)


def put_row(cache, one, row):
    """`cache` with row `row` replaced by the batch-1 cache `one` (of the same type and shapes)."""
    return jax.tree_util.tree_map(
        lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), row, axis=_row_axis(x)), cache, one)
