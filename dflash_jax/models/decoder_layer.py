"""`PreNormLayer`: the skeleton of a pre-norm decoder layer that attends and then runs a dense SwiGLU MLP
or an MoE block, the scan body of the target's stack (`dflash_jax.models.target.StackGroup`). A family's layer
subclasses it and says only what its attention is (`attend`)."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from dflash_jax import backends
from dflash_jax.layers.common import capture_into, MLP, RMSNorm
from dflash_jax.layers.moe import moe_block
from dflash_jax.models.config import ModelConfig


class PreNormLayer(nn.Module):
    """h += self_attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h)); the hidden state
    captured where the layer's slot says.

    carry: (hidden [B, T, D], features [B, T, n, D] | None); xs: (cache layer index, window, capture
    slot or -1); broadcast: (positions [B, T], cos, sin, the layer's cache | None). ys: what `attend`
    gives for the cache to take (the new rows), None without a cache. The norms scale in float32
    where the family says so (`Family.norm_scale_in_float32`); the MLP is `config.moe`'s block where
    the layer's MLP kind is "moe" (`mlp`; "auto": the first layer's, a stack of identical layers),
    else the dense SwiGLU (its products side by side where the backend's layout fuses them)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    backend: str = "xla"  # whose products and cache read (`dflash_jax.backends`)
    kv_replicas: int = 1  # sharding: copies of each kv head (`TargetSpec.kv_replicas`)
    mixer: str = "attention"  # `ModelConfig.layer_kinds` (full or sliding: the window comes in layer_xs)
    mlp: str = "auto"  # "dense" | "moe"; "auto": the first layer's (a stack of identical layers)

    def attend(self, x, positions, window, cos, sin, cache, layer):
        """The layer's attention of the normed x [B, T, D] -> (output [B, T, D], what the cache takes of
        the new tokens). Defines the submodule named "self_attn"."""
        raise NotImplementedError

    @nn.compact
    def __call__(self, carry, layer_xs, positions, cos, sin, cache):
        cfg = self.config
        hidden, features = carry
        layer, window, slot = layer_xs
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.family.norm_scale_in_float32,  # noqa: E731
                                    name=name)
        mixed, new = self.attend(norm("input_layernorm")(hidden), positions, window, cos, sin, cache, layer)
        hidden = hidden + mixed
        x = norm("post_attention_layernorm")(hidden)
        if (cfg.mlp_kinds[0] if self.mlp == "auto" else self.mlp) == "moe":
            hidden = hidden + moe_block(cfg.moe, self.dtype, self.backend)(x)
        else:
            fused = backends.get(self.backend).fuses(cfg.intermediate_size, cfg.intermediate_size)
            hidden = hidden + MLP(cfg.intermediate_size, cfg.mlp_bias, self.dtype, self.backend, fused, name="mlp")(x)
        return (hidden, capture_into(features, slot, hidden)), (None if cache is None else new)
