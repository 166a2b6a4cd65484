"""The DFlash drafter: fused context projection and K/V-injected decoder layers (pure Flax).

context = hidden_norm(fc(concat(target features)))                      [B, C, D]
each layer: q from the (input-normed) block states; k, v from the SAME k_proj/v_proj applied to
the context (not normed by input_layernorm) and to the block states; k_norm on both; RoPE at each
token's own position; non-causal attention over [visible context ; block]; pre-norm residual
attention + SwiGLU MLP. The output goes through `norm`, then the TARGET's LM head.

Two entry points share the layers:
* inference: `append_context` projects the features of newly committed tokens into every layer's
  context K/V and appends them to a static-shape draft cache (`KVCache`, rollback by length);
  `draft_hidden` runs one block per row against the cached context. Block K/V are never kept.
* training: `train_hidden` runs a packed sequence [context | N blocks] where block j sees context
  positions < anchor_j and its own block only.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import masks
from dflash_jax.attention import attention
from dflash_jax.cache import KVCache
from dflash_jax.drafter_config import DrafterConfig
from dflash_jax.layers import MLP, AttentionProjections, RMSNorm, rope_frequencies, rotary_cos_sin


def _select_ranges(windowed: bool, windowed_ranges, full_ranges):
    return jax.tree_util.tree_map(lambda w, f: jnp.where(windowed, w, f), windowed_ranges, full_ranges)


class DrafterLayer(nn.Module):
    """One K/V-injected layer. Both methods are scanned over layers (carry, per-layer xs)."""

    config: DrafterConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"

    def setup(self):
        cfg = self.config
        self.self_attn = AttentionProjections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                              cfg.head_dim, True, cfg.attention_bias, cfg.rms_norm_eps,
                                              self.dtype)
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.mlp = MLP(cfg.intermediate_size, False, self.dtype)

    def context_kv(self, carry, _):
        """carry (context [B, C, D], cos, sin) -> per-layer context keys/values [B, C, Hkv, Dh]."""
        context, cos, sin = carry
        return carry, self.self_attn.keys_values(context, cos, sin)

    def __call__(self, carry, layer_xs):
        """carry (hidden [B, Tq, D], cos, sin, full ranges, windowed ranges);
        layer_xs (context k, context v [B, C, Hkv, Dh], windowed flag)."""
        hidden, cos, sin, full_ranges, windowed_ranges = carry
        k_ctx, v_ctx, windowed = layer_xs
        x = self.input_layernorm(hidden)
        q = self.self_attn.queries(x, cos, sin)
        k_blk, v_blk = self.self_attn.keys_values(x, cos, sin)
        k = jnp.concatenate([k_ctx.astype(k_blk.dtype), k_blk], axis=1)
        v = jnp.concatenate([v_ctx.astype(v_blk.dtype), v_blk], axis=1)
        ranges = _select_ranges(windowed, windowed_ranges, full_ranges)
        hidden = hidden + self.self_attn.output(attention(q, k, v, ranges, impl=self.attn_impl))
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return (hidden, cos, sin, full_ranges, windowed_ranges), None


class DrafterModel(nn.Module):
    config: DrafterConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"

    def setup(self):
        cfg = self.config
        self.fc = nn.Dense(cfg.hidden_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype)
        self.hidden_norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.layers = nn.scan(
            DrafterLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=cfg.num_layers,
            methods=["context_kv", "__call__"],
        )(cfg, self.dtype, self.attn_impl)
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        inv_freq, self._rope_scale = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope,
                                                      cfg.max_position_embeddings)
        self._inv_freq = np.asarray(inv_freq)

    def _rope(self, positions):
        return rotary_cos_sin(positions, self._inv_freq, self._rope_scale)

    def context_kv(self, features, positions):
        """features [B, C, n*D] at positions [B, C] -> keys, values [L, B, C, Hkv, Dh]."""
        if features.shape[-1] != self.config.num_features * self.config.hidden_size:
            raise ValueError(f"features have width {features.shape[-1]}, expected "
                             f"{self.config.num_features} x {self.config.hidden_size}")
        context = self.hidden_norm(self.fc(features.astype(self.dtype)))
        cos, sin = self._rope(positions)
        _, (k, v) = self.layers.context_kv((context, cos, sin), None)
        return k, v

    def blocks(self, block_embeds, positions, k_ctx, v_ctx, full_ranges, windowed_ranges):
        """block_embeds [B, Tq, D] at positions [B, Tq] against context K/V [L, B, C, Hkv, Dh]."""
        cos, sin = self._rope(positions)
        windowed = jnp.asarray([w > 0 for w in self.config.layer_windows])
        carry = (block_embeds.astype(self.dtype), cos, sin, full_ranges, windowed_ranges)
        (hidden, *_), _ = self.layers(carry, (k_ctx, v_ctx, windowed))
        return self.norm(hidden)

    def __call__(self, features, positions, block_embeds, block_positions, full_ranges, windowed_ranges):
        """Context K/V and blocks in one call (used by `init` and by training)."""
        k, v = self.context_kv(features, positions)
        return self.blocks(block_embeds, block_positions, k, v, full_ranges, windowed_ranges)


def append_rows(cache: KVCache, k_new, v_new, num_new) -> KVCache:
    """Write [L, B, T, Hkv, Dh] at each row's length; lengths += num_new."""

    def write_one(buffer, new, offset):  # [L, S, H, D], [L, T, H, D]
        return jax.lax.dynamic_update_slice(buffer, new.astype(buffer.dtype), (0, offset, 0, 0))

    write = jax.vmap(write_one, in_axes=(1, 1, 0), out_axes=1)
    return KVCache(k=write(cache.k, k_new, cache.lengths), v=write(cache.v, v_new, cache.lengths),
                   lengths=cache.lengths + jnp.asarray(num_new, jnp.int32))


@dataclasses.dataclass
class Drafter:
    """A loaded drafter: config, params, the config.json it came from, and pure functions."""

    config: DrafterConfig
    params: Any
    hf_config: dict = dataclasses.field(default_factory=dict)
    dtype: Any = jnp.float32
    attn_impl: str = "auto"

    @property
    def module(self) -> DrafterModel:
        return DrafterModel(self.config, self.dtype, self.attn_impl)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache.zeros(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, self.dtype)

    def append_context(self, params, cache: KVCache, features, num_new=None) -> KVCache:
        """Append the features [B, T, n*D] of newly committed tokens (positions lengths .. +T-1).
        Rows commit num_new[b] <= T tokens (default T); slots past that are overwritten later."""
        t = features.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        k, v = self.module.apply({"params": params}, features, positions, method=DrafterModel.context_kv)
        return append_rows(cache, k, v, t if num_new is None else num_new)

    def draft_hidden(self, params, block_embeds, cache: KVCache):
        """One block per row, block_embeds [B, G, D] at positions lengths .. lengths + G - 1 (the
        anchor sits at position lengths[b]); sees the row's cached context. -> hidden [B, G, D]."""
        g = block_embeds.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]
        full = masks.drafter_inference(cache.lengths, cache.capacity, g)
        windowed = masks.drafter_inference(cache.lengths, cache.capacity, g, self.config.sliding_window)
        return self.module.apply({"params": params}, block_embeds, positions, cache.k, cache.v, full,
                                 windowed, method=DrafterModel.blocks)

    def train_hidden(self, params, features, block_embeds, anchors, block_valid):
        """Packed training forward.

        features [B, C, n*D] of the whole sequence (positions 0..C-1); block_embeds [B, N*G, D]
        (block j = [token at anchors[j], mask x (G-1)]); anchors [B, N]; block_valid [B, N].
        -> hidden [B, N*G, D]; slot k of block j predicts the token at anchors[j] + k.
        """
        b, c = features.shape[:2]
        n = anchors.shape[1]
        g = block_embeds.shape[1] // n
        if g * n != block_embeds.shape[1]:
            raise ValueError(f"block_embeds length {block_embeds.shape[1]} is not N={n} blocks")
        positions = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
        block_positions = (anchors[:, :, None] + jnp.arange(g, dtype=jnp.int32)).reshape(b, n * g)
        full = masks.drafter_training(anchors, block_valid, c, g)
        windowed = masks.drafter_training(anchors, block_valid, c, g, self.config.sliding_window)
        return self.module.apply({"params": params}, features, positions, block_embeds, block_positions,
                                 full, windowed)


def init_drafter_params(config: DrafterConfig, rng, dtype=jnp.float32):
    b, c, g = 1, 2, config.block_size
    features = jnp.zeros((b, c, config.num_features * config.hidden_size), dtype)
    positions = jnp.zeros((b, c), jnp.int32)
    block = jnp.zeros((b, g, config.hidden_size), dtype)
    block_positions = jnp.zeros((b, g), jnp.int32)
    ranges = masks.drafter_inference(jnp.zeros((b,), jnp.int32), c, g)
    return DrafterModel(config, dtype).init(rng, features, positions, block, block_positions, ranges,
                                            ranges)["params"]


def drafter_param_shapes(config: DrafterConfig, dtype=jnp.float32):
    return jax.eval_shape(lambda: init_drafter_params(config, jax.random.PRNGKey(0), dtype))
