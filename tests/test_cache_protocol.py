"""The decode caches share one declared interface (`dflash_jax._cache.Cache`): the model commits a
forward's pending outputs and the sharding rules place a cache through it, whatever the family."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dflash_jax._cache import Cache, HybridCache, KVCache
from dflash_jax._config import LinearAttentionConfig, ModelConfig
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
