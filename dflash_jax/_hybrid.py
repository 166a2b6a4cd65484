"""Qwen3.5 / Qwen3.6 hybrid targets: Gated DeltaNet ("linear_attention") layers between gated
full-attention layers, as a pure functional Flax module with a static-shape cache.

`HybridTargetModel` has `TargetModel`'s interface (same call, same captured features, same
`embed` / `logits`); `TargetSpec` builds it for a hybrid config. Its cache (`HybridCache`) holds the
attention layers' keys and values (a `KVCache`) and, per linear-attention layer and row, the last
K-1 conv inputs and the delta-rule state [Hv, Dk, Dv], which do not grow with the context. A
Qwen3.5-MoE / Qwen3.6-MoE target ("qwen3_5_moe") is the same model whose MLPs are `dflash_jax._moe.MoE`
blocks with a shared expert.

The layers repeat a pattern (three linear layers then a full one, Qwen3.5's default): the model
scans over repeats of it (`nn.scan` over groups; params stacked [groups, ...] under
"layers/layer_{p}" for position p of the pattern), each group running its layers in turn. A pattern
that does not repeat is one group of all the layers.

Exact rollback. A verify (`write_cache=False`) returns what the cache needs per position, `pending`:
the attention layers' keys and values and the linear layers' conv inputs, normalised q and k, v,
decay and write strength. `HybridCache.commit(pending, num_new)` writes the first num_new[b]
positions of row b: keys by length as for every target, the conv tail by slicing, and the state by
running the delta rule over the block again with the positions past num_new[b] masked to decay 1
and write 0 (`dflash_jax._gated_delta.masked`), which leave the state exactly unchanged. No
per-position state is kept (for Qwen3.5-9B that would be 24 layers x 32 heads x 128 x 128 floats
per position).
"""
from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax import _gated_delta as gd, _masks as masks
from dflash_jax._attention import attention, cache_attention
from dflash_jax._cache import HybridCache, KVCache
from dflash_jax._config import LINEAR, ModelConfig, layer_pattern
from dflash_jax._layers import (MLP, Capture, Rotary, apply_rotary, capture_into, make_dense, rms_normalize,
                               token_positions)
from dflash_jax._moe import MoE


class CenteredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: the weight is stored centred on zero and scales by (1 + weight), in
    float32, before the cast back."""

    eps: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],), self.dtype)
        return (rms_normalize(x, self.eps) * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nn.Module):
    """The RMSNorm at a Gated DeltaNet's output, gated by SiLU(z): weight * norm(x) * silu(z)."""

    eps: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, z):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        normed = rms_normalize(x, self.eps).astype(x.dtype)
        return (scale * normed * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention token mixer. (x [B, T, D], conv tail [B, K-1, C], state [B, Hv, Dk, Dv])
    -> (output [B, T, D], pending: this block's conv inputs and delta-rule inputs, [B, T, ...] each,
    for `HybridCache.commit`). The outputs are those of running the T positions from the state."""

    config: ModelConfig
    dtype: Any = jnp.float32
    linear_groups: int = 1  # sharding: the q | k | v channels' layout (`split_qkv`, `TargetSpec.linear_groups`)

    @nn.compact
    def __call__(self, x, tail, state):
        cfg = self.config
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        b, t, _ = x.shape
        dense = lambda n, name: make_dense(n, False, self.dtype, name=name)
        mixed = dense(cfg.linear_conv_dim, "in_proj_qkv")(x)
        z = dense(hv * dv, "in_proj_z")(x).reshape(b, t, hv, dv)
        write, gate = dense(hv, "in_proj_b")(x), dense(hv, "in_proj_a")(x)
        kernel = self.param("conv1d", nn.initializers.lecun_normal(), (cfg.linear_conv_kernel_dim, 1,
                                                                         cfg.linear_conv_dim), self.dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (hv,), self.dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (hv,), self.dtype)
        conv = gd.causal_conv(mixed, tail, kernel)
        q, k, v = split_qkv(conv, self.linear_groups, hk * dk)
        q = gd.l2_normalize(q.reshape(b, t, hk, dk))
        k = gd.l2_normalize(k.reshape(b, t, hk, dk))
        v = v.reshape(b, t, hv, dv)
        beta = jax.nn.sigmoid(write).astype(jnp.float32)
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(gate.astype(jnp.float32)
                                                                  + dt_bias.astype(jnp.float32))
        out, _ = gd.delta_rule(q, k, v, g, beta, state)
        out = GatedRMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(out.astype(x.dtype), z)
        out = dense(cfg.hidden_size, "out_proj")(out.reshape(b, t, hv * dv))
        return out, {"conv_in": mixed, "q": q, "k": k, "v": v.astype(jnp.float32), "g": g, "beta": beta}


def split_qkv(channels, groups: int, qk_width: int):
    """q, k [..., qk_width] and v of conv channels [..., C] laid out in `groups` groups [q heads of
    group s | k heads of s | v heads of s] (1 group: the checkpoint's [q | k | v]; more: the params
    regrouped for a tensor axis, `dflash_jax.sharding.linear_channel_order`), heads in order."""
    *lead, c = channels.shape
    grouped = channels.reshape(*lead, groups, c // groups)
    parts = jnp.split(grouped, [qk_width // groups, 2 * qk_width // groups], axis=-1)
    return tuple(part.reshape(*lead, -1) for part in parts)


class GatedAttention(nn.Module):
    """Qwen3.5's full attention: q_proj emits each head's query and a gate side by side, q/k
    (centred) RMSNorm, RoPE on the first `rotary_dim` dims, sigmoid(gate) on the attended values."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    kv_replicas: int = 1  # sharding: copies of each kv head (`TargetSpec.kv_replicas`)

    @nn.compact
    def __call__(self, x, positions, cos, sin, cache: KVCache | None, layer):
        cfg = self.config
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b, t, _ = x.shape
        dense = lambda n, name: make_dense(n, cfg.attention_bias, self.dtype, name=name)
        q_gate = dense(2 * h * d, "q_proj")(x).reshape(b, t, h, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:].reshape(b, t, h * d)
        q = apply_rotary(CenteredRMSNorm(cfg.rms_norm_eps, self.dtype, name="q_norm")(q), cos, sin)
        k = dense(hkv * d, "k_proj")(x).reshape(b, t, hkv, d)
        k = apply_rotary(CenteredRMSNorm(cfg.rms_norm_eps, self.dtype, name="k_norm")(k), cos, sin)
        v = dense(hkv * d, "v_proj")(x).reshape(b, t, hkv, d)
        if self.kv_replicas > 1:  # sharding: kv-head replication
            k, v = jnp.repeat(k, self.kv_replicas, axis=2), jnp.repeat(v, self.kv_replicas, axis=2)
        ranges = masks.causal(positions, 0)
        if cache is None:
            attended = attention(q, k, v, ranges, impl=self.attn_impl)
        else:
            offsets = cache.lengths
            k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
            attended = cache_attention(q, cache.k, cache.v, layer, ranges.segment(0, offsets), k, v,
                                       ranges.segment(offsets, offsets + t), impl=self.attn_impl)
        out = attended.reshape(b, t, h * d) * jax.nn.sigmoid(gate)
        return dense(cfg.hidden_size, "o_proj")(out), (k, v)


class HybridGroup(nn.Module):
    """One repeat of the layer pattern; the scan body. carry: (hidden, features | None); xs: (group
    index, capture slots [P], conv tails [Pl, B, K-1, C] | None, states [Pl, B, Hv, Dk, Dv] | None);
    broadcast: positions, cos, sin, the KV cache | None. ys: the attention layers' (k, v) and the
    linear layers' pending inputs, stacked over the group's layers of each kind."""

    config: ModelConfig
    pattern: tuple[str, ...]
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    kv_replicas: int = 1  # sharding (`TargetSpec`)
    linear_groups: int = 1

    @nn.compact
    def __call__(self, carry, xs, positions, cos, sin, kv_cache: KVCache | None):
        cfg = self.config
        hidden, features = carry
        group, slots, tails, states = xs
        per_group = sum(kind != LINEAR for kind in self.pattern)
        b = hidden.shape[0]
        kv, pending = [], []
        for p, kind in enumerate(self.pattern):
            layer = _Layer(cfg, kind, self.dtype, self.attn_impl, self.kv_replicas, self.linear_groups,
                           name=f"layer_{p}")
            if kind == LINEAR:
                i = len(pending)
                tail = tails[i] if tails is not None else jnp.zeros(
                    (b, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim), self.dtype)
                state = states[i] if states is not None else jnp.zeros(
                    (b, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), jnp.float32)
                hidden, out = layer(hidden, (tail, state), positions, cos, sin, None, None)
                pending.append(out)
            else:
                hidden, out = layer(hidden, None, positions, cos, sin, kv_cache, group * per_group + len(kv))
                kv.append(out)
            features = capture_into(features, slots[p], hidden)
        stack = lambda items: jax.tree_util.tree_map(lambda *x: jnp.stack(x), *items) if items else None
        return (hidden, features), (stack(kv), stack(pending))


class _Layer(nn.Module):
    """A pre-norm decoder layer of either kind (Hugging Face's `Qwen3_5DecoderLayer`; with experts,
    `Qwen3_5MoeDecoderLayer`, whose MLP is the MoE block with its shared expert)."""

    config: ModelConfig
    kind: str
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    kv_replicas: int = 1  # sharding (`TargetSpec`)
    linear_groups: int = 1

    @nn.compact
    def __call__(self, hidden, linear_state, positions, cos, sin, kv_cache, layer):
        cfg = self.config
        x = CenteredRMSNorm(cfg.rms_norm_eps, self.dtype, name="input_layernorm")(hidden)
        if self.kind == LINEAR:
            mixed, out = GatedDeltaNet(cfg, self.dtype, self.linear_groups, name="linear_attn")(x, *linear_state)
        else:
            mixed, out = GatedAttention(cfg, self.dtype, self.attn_impl, self.kv_replicas, name="self_attn")(
                x, positions, cos, sin, kv_cache, layer)
        hidden = hidden + mixed
        x = CenteredRMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(hidden)
        if cfg.num_experts:
            mlp = MoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
                      self.dtype, cfg.shared_expert_intermediate_size, name="mlp")
        else:
            mlp = MLP(cfg.intermediate_size, cfg.mlp_bias, self.dtype, name="mlp")
        return hidden + mlp(x), out


class HybridTargetModel(nn.Module):
    """A Qwen3.5 hybrid target over params stacked per pattern position (module docstring); the
    call and outputs of `TargetModel.__call__`. With a cache and write_cache=False, the third output
    is `pending` for `HybridCache.commit` in place of the cache."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    backend: str = "xla"  # the XLA backend's products: hybrids have no other layout
    kv_replicas: int = 1  # sharding: the tensor-parallel layout (`TargetSpec`)
    linear_groups: int = 1

    def setup(self):
        cfg = self.config
        self.pattern = layer_pattern(cfg.layer_types)
        self.groups = cfg.num_layers // len(self.pattern)
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        self.layers = nn.scan(
            HybridGroup, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast), length=self.groups,
            check_constancy_invariants=False,  # as TargetModel's scan (see there)
        )(cfg, self.pattern, self.dtype, self.attn_impl, self.kv_replicas, self.linear_groups)
        self.norm = CenteredRMSNorm(cfg.rms_norm_eps, self.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype)
        self.rotary = Rotary(cfg)

    def __call__(self, tokens, cache: HybridCache | None = None, *, positions=None,
                 capture: Sequence[int] = (), num_new=None, write_cache: bool = True):
        cfg = self.config
        hidden = self.embed_tokens(tokens)
        b, t = tokens.shape
        positions = token_positions(tokens, cache, positions)
        cos, sin = self.rotary(positions)
        plan = Capture(capture, cfg.num_layers)
        buffer = plan.buffer(b, t, cfg.hidden_size, self.dtype)
        period = len(self.pattern)
        per_group = lambda x: None if x is None else x.reshape(self.groups, -1, *x.shape[1:])
        xs = (jnp.arange(self.groups, dtype=jnp.int32), jnp.asarray(plan.slots.reshape(self.groups, period)),
              per_group(cache.conv) if cache is not None else None,
              per_group(cache.state) if cache is not None else None)
        (hidden, buffer), (kv, linear) = self.layers((hidden, buffer), xs, positions, cos, sin,
                                                     cache.kv if cache is not None else None)
        hidden = self.norm(hidden)
        features = plan.features(hidden, buffer)
        if cache is None:
            return hidden, features, None
        flat = lambda x: x.reshape(-1, *x.shape[2:])  # [G, P, ...] -> [G * P, ...]
        k, v = (None, None) if kv is None else jax.tree_util.tree_map(flat, kv)
        pending = (k, v, None if linear is None else jax.tree_util.tree_map(flat, linear))
        if not write_cache:
            return hidden, features, pending
        return hidden, features, cache.commit(pending, t if num_new is None else num_new)

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def logits(self, hidden):
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)
