"""The decode caches share one declared interface (`dflash_jax.models.cache.Cache`): the model commits a
forward's pending outputs and the sharding rules place a cache through it, whatever the family."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dflash_jax.families.qwen3_5.cache import HybridCache
from dflash_jax.models.cache import Cache, KVCache
from dflash_jax.models.config import LinearAttentionConfig, ModelConfig
from dflash_jax.sharding import cache_shardings

HYBRID = ModelConfig(arch="qwen3_5", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=8, qk_norm=True, partial_rotary_factor=0.5,
                     layer_types=("linear_attention", "full_attention"),
                     linear=LinearAttentionConfig(conv_kernel_dim=4, num_key_heads=1, num_value_heads=2,
                                                  key_head_dim=4, value_head_dim=4))


def test_both_caches_are_caches_and_commit_by_length():
    kv = KVCache.zeros(2, 3, 16, 1, 8)
    hybrid = HybridCache.for_model(HYBRID, 3, 16)
    assert isinstance(kv, Cache) and isinstance(hybrid, Cache)
    assert not isinstance(jnp.zeros(3), Cache)
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.normal(size=(2, 3, 4, 1, 8)), jnp.float32) for _ in range(2))
    committed = kv.commit((k, v), jnp.asarray([4, 2, 0]))
    appended = kv.append(k, v, jnp.asarray([4, 2, 0]))
    np.testing.assert_array_equal(np.asarray(committed.lengths), [4, 2, 0])
    np.testing.assert_array_equal(np.asarray(committed.k), np.asarray(appended.k))
    assert committed.capacity == 16 and committed.with_lengths(jnp.asarray([1, 1, 1])).lengths.tolist() == [1, 1, 1]
    assert hybrid.with_lengths(jnp.asarray([5, 0, 2])).lengths.tolist() == [5, 0, 2]


def test_the_sharding_rules_ask_the_cache():
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "expert", "tensor"))
    for cache in (KVCache.zeros(2, 3, 16, 1, 8), HybridCache.for_model(HYBRID, 3, 16)):
        placed = cache_shardings(mesh, cache)
        assert type(placed) is type(cache)
        assert jax.tree_util.tree_structure(placed) == jax.tree_util.tree_structure(cache)
        assert placed == cache.shardings(mesh)


def test_every_cache_lays_rows_out_alike_and_clears():
    """Every array of a cache is [B] or [L, B, ...] (what take_row / put_row rely on); cleared() empties
    every row (a hybrid's recurrent state back to zero), and a row taken out and put back is the same."""
    from dflash_jax.families.deepseek_v3 import LatentCache
    from dflash_jax.models.cache import GroupedKVCache, put_row, RingKVCache, take_row

    rng = np.random.default_rng(0)
    randomised = lambda c: jax.tree_util.tree_map(  # noqa: E731
        lambda x: jnp.asarray(rng.integers(1, 5, size=x.shape), x.dtype), c)
    caches = [KVCache.zeros(2, 3, 16, 1, 8), HybridCache.for_model(HYBRID, 3, 16),
              GroupedKVCache((KVCache.zeros(1, 3, 16, 2, 4), KVCache.zeros(2, 3, 16, 1, 8))),
              LatentCache(kv=jnp.zeros((2, 3, 16, 1, 12)), lengths=jnp.zeros((3,), jnp.int32)),
              RingKVCache.for_window(ModelConfig(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                                                 num_layers=2, num_heads=1, num_kv_heads=1, head_dim=8), 3, 4, 8)]
    for cache in caches:
        cache = randomised(cache)
        for x in jax.tree_util.tree_leaves(cache):
            assert x.shape[0 if x.ndim == 1 else 1] == 3, (type(cache).__name__, x.shape)
        cleared = cache.cleared()
        assert type(cleared) is type(cache) and cleared.lengths.tolist() == [0, 0, 0]
        if isinstance(cache, HybridCache):
            assert not np.any(np.asarray(cleared.state)) and not np.any(np.asarray(cleared.conv))
        row = take_row(cache, jnp.int32(1))
        assert row.lengths.shape == (1,) and row.lengths[0] == cache.lengths[1]
        back = put_row(cache.cleared(), row, jnp.int32(1))
        assert back.lengths.tolist() == [0, int(cache.lengths[1]), 0]
        for got, want in zip(jax.tree_util.tree_leaves(put_row(cache, row, jnp.int32(1))),
                             jax.tree_util.tree_leaves(cache)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_stack_reads_every_cache_by_its_named_parts():
    """What the decoder stack reads of a cache (`Cache.attention_cache`, `Cache.layer_states`): the KV
    part the attention layers read, and the stateful layers' state by name, each [Nl, B, ...] with one
    entry per stateful layer, named and shaped as the family's start state of one layer
    (`Family.initial_layer_state`, what the stack hands a layer without a cache)."""
    from dflash_jax.families.deepseek_v3 import LatentCache
    from dflash_jax.models.cache import GroupedKVCache

    kv = KVCache.zeros(2, 3, 16, 1, 8)
    grouped = GroupedKVCache((KVCache.zeros(1, 3, 16, 2, 4), kv))
    latent = LatentCache(kv=jnp.zeros((2, 3, 16, 1, 12)), lengths=jnp.zeros((3,), jnp.int32))
    for cache in (kv, grouped, latent):
        assert cache.attention_cache is cache and cache.layer_states == {}
    hybrid = HybridCache.for_model(HYBRID, 3, 16)
    assert hybrid.attention_cache is hybrid.kv and hybrid.attention_cache.k.shape[0] == 1  # the one attention layer
    family = HYBRID.family
    assert family.stateful_mixers == ("linear_attention",)
    start = family.initial_layer_state(HYBRID, "linear_attention", 3, jnp.float32)
    assert set(hybrid.layer_states) == set(start) == {"conv", "state"}
    for name, x in hybrid.layer_states.items():
        assert x.shape == (len(HYBRID.linear_layer_ids), *start[name].shape) and x.dtype == start[name].dtype, name
