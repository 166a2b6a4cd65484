"""The target model (Qwen3 / Llama) as a pure functional Flax module with a static-shape KV cache.

`TargetModel.__call__(tokens, cache, capture=...)` runs T new tokens per row at that row's own
offset (`cache.lengths`), returns the final-normed hidden states, the features of the captured
layers concatenated on the last axis (layer id i = Hugging Face `hidden_states[i + 1]`: the output
of decoder layer i, except that the last layer's entry is after the final norm, as in HF),
and the NEW cache. Layers run under `nn.scan` over stacked per-layer params.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import masks
from dflash_jax.attention import attention
from dflash_jax.cache import KVCache, read_layer, write_rows
from dflash_jax.config import ModelConfig
from dflash_jax.layers import MLP, AttentionProjections, RMSNorm, rope_frequencies, rotary_cos_sin


class TargetLayer(nn.Module):
    """One pre-norm decoder layer; the scan body. Carry: (hidden, features, k_cache, v_cache)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"

    @nn.compact
    def __call__(self, carry, layer_xs, positions, cos, sin):
        cfg = self.config
        hidden, features, k_cache, v_cache, offsets = carry
        layer, window, slot = layer_xs
        attn = AttentionProjections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.qk_norm, cfg.attention_bias, cfg.rms_norm_eps, self.dtype,
                                    name="self_attn")
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="input_layernorm")(hidden)
        q = attn.queries(x, cos, sin)
        k, v = attn.keys_values(x, cos, sin)
        if k_cache is not None:
            k_cache = write_rows(k_cache, layer, k, offsets)
            v_cache = write_rows(v_cache, layer, v, offsets)
            k, v = read_layer(k_cache, layer), read_layer(v_cache, layer)
        attended = attention(q, k, v, masks.causal(positions, window), impl=self.attn_impl)
        hidden = hidden + attn.output(attended)
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(hidden)
        hidden = hidden + MLP(cfg.intermediate_size, cfg.mlp_bias, self.dtype, name="mlp")(x)
        if features is not None:
            index = jnp.maximum(slot, 0)
            current = jax.lax.dynamic_index_in_dim(features, index, axis=2, keepdims=False)
            update = jnp.where(slot >= 0, hidden.astype(features.dtype), current)
            features = jax.lax.dynamic_update_index_in_dim(features, update, index, axis=2)
        return (hidden, features, k_cache, v_cache, offsets), None


class TargetModel(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"

    def setup(self):
        cfg = self.config
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype,
                                     param_dtype=self.dtype)
        self.layers = nn.scan(
            TargetLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
        )(cfg, self.dtype, self.attn_impl)
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype,
                                    param_dtype=self.dtype)
        inv_freq, self._rope_scale = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope,
                                                      cfg.max_position_embeddings)
        self._inv_freq = np.asarray(inv_freq)

    def __call__(self, tokens, cache: KVCache | None = None, *, positions=None,
                 capture: Sequence[int] = (), num_new=None):
        """tokens [B, T] -> (hidden [B, T, D], features [B, T, len(capture) * D] | None, cache).

        With a cache, row b's tokens go to positions lengths[b] .. lengths[b] + T - 1, and the
        returned cache has lengths + num_new (default T: pass fewer for right-padded rows).
        Without a cache, `positions` defaults to 0..T-1 and attention is causal over the T tokens.
        """
        hidden = self.embed(tokens)
        return self.run_layers(hidden, cache, positions=positions, capture=capture, num_new=num_new)

    def run_layers(self, hidden, cache: KVCache | None = None, *, positions=None,
                   capture: Sequence[int] = (), num_new=None):
        cfg = self.config
        b, t = hidden.shape[:2]
        offsets = cache.lengths if cache is not None else jnp.zeros((b,), jnp.int32)
        if positions is None:
            positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        cos, sin = rotary_cos_sin(positions, self._inv_freq, self._rope_scale)
        for layer in capture:
            if not 0 <= layer < cfg.num_layers:
                raise ValueError(f"capture layer {layer} out of range for {cfg.num_layers} layers")
        # Hugging Face's hidden_states[L] (layer id L-1) is the final-NORMED output; every other id
        # is a raw decoder-layer output, captured inside the scan once even when listed twice.
        last = cfg.num_layers - 1
        inner = sorted({layer for layer in capture if layer != last})
        slots = np.full((cfg.num_layers,), -1, np.int32)
        slots[inner] = np.arange(len(inner))
        buffer = jnp.zeros((b, t, len(inner), cfg.hidden_size), self.dtype) if inner else None
        layer_xs = (jnp.arange(cfg.num_layers, dtype=jnp.int32),
                    jnp.asarray(cfg.layer_windows, jnp.int32), jnp.asarray(slots))
        carry = (hidden, buffer, cache.k if cache else None, cache.v if cache else None, offsets)
        (hidden, buffer, k, v, _), _ = self.layers(carry, layer_xs, positions, cos, sin)
        hidden = self.norm(hidden)
        features = None
        if capture:
            features = jnp.concatenate(
                [hidden if layer == last else buffer[:, :, slots[layer]] for layer in capture], axis=-1)
        if cache is not None:
            added = t if num_new is None else num_new
            cache = KVCache(k=k, v=v, lengths=cache.lengths + jnp.asarray(added, jnp.int32))
        return hidden, features, cache

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def logits(self, hidden):
        """Final-normed hidden [..., D] -> float32 logits [..., V]."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)


@dataclasses.dataclass
class Target:
    """A loaded target: config, params, tokenizer, and pure functions over (params, ...)."""

    config: ModelConfig
    params: Any
    tokenizer: Any = None
    dtype: Any = jnp.float32
    attn_impl: str = "auto"

    @property
    def module(self) -> TargetModel:
        return TargetModel(self.config, self.dtype, self.attn_impl)

    def forward(self, params, tokens, cache=None, **kwargs):
        if cache is not None:
            check_fits(cache, tokens.shape[1])
        return self.module.apply({"params": params}, tokens, cache, **kwargs)

    def run_layers(self, params, hidden, cache=None, **kwargs):
        return self.module.apply({"params": params}, hidden, cache, method=TargetModel.run_layers, **kwargs)

    def embed(self, params, tokens):
        return self.module.apply({"params": params}, tokens, method=TargetModel.embed)

    def logits(self, params, hidden):
        return self.module.apply({"params": params}, hidden, method=TargetModel.logits)

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache.zeros(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, self.dtype)


def check_fits(cache: KVCache, num_tokens: int) -> None:
    """Raise when num_tokens more positions do not fit in the cache (checked when lengths are
    concrete; under jit the caller sizes the cache, as `generate` does)."""
    if num_tokens > cache.capacity:
        raise ValueError(f"{num_tokens} tokens are longer than the cache ({cache.capacity} positions)")
    try:
        need = int(jnp.max(cache.lengths)) + num_tokens
    except jax.errors.ConcretizationTypeError:  # traced lengths: the caller sized the cache
        return
    if need > cache.capacity:
        raise ValueError(f"prompt too long for the cache: {need} positions needed, "
                         f"capacity {cache.capacity}")


def init_target_params(config: ModelConfig, rng, dtype=jnp.float32):
    """Random params (for tests and shape templates)."""
    def forward_and_logits(module, tokens):
        hidden, _, _ = module(tokens)
        return module.logits(hidden)

    tokens = jnp.zeros((1, 1), jnp.int32)
    return TargetModel(config, dtype).init(rng, tokens, method=forward_and_logits)["params"]


def target_param_shapes(config: ModelConfig, dtype=jnp.float32):
    return jax.eval_shape(lambda: init_target_params(config, jax.random.PRNGKey(0), dtype))
