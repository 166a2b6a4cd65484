"""Qwen3.5 / Qwen3.6 hybrids (`Qwen3_5ForCausalLM`, and the text model of `Qwen3_5ForConditionalGeneration`)
and their MoE variants (`Qwen3_5MoeForCausalLM` / `...ForConditionalGeneration`: every MLP an MoE block
with a sigmoid-gated shared expert): the family and its layers. Gated DeltaNet ("linear_attention")
token mixers between gated full-attention layers, centred RMSNorms, partial rotary. The decoder stack
(`dflash_jax.models.target.TargetModel`) scans the layers in groups of the layer pattern; their cache is
`dflash_jax.families.qwen3_5.cache.HybridCache`: the attention layers' keys and values and, per linear-attention layer
and row, the last K-1 conv inputs and the delta-rule state [Hv, Dk, Dv], which do not grow with the
context.

Exact rollback. A verify (`write_cache=False`) returns what the cache needs per position, `pending`:
the attention layers' keys and values and the linear layers' conv inputs, normalised q and k, v,
decay and write strength. `HybridCache.commit(pending, num_new)` writes the first num_new[b]
positions of row b: keys by length as for every target, the conv tail by slicing, and the state by
running the delta rule over the block again with the positions past num_new[b] masked to decay 1
and write 0 (`dflash_jax.families.qwen3_5.gated_delta.masked`), which leave the state exactly unchanged. No
per-position state is kept (for Qwen3.5-9B that would be 24 layers x 32 heads x 128 x 128 floats
per position).
"""
from __future__ import annotations

import logging
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.families import register
from dflash_jax.families.base import ATTENTION_PROJECTIONS, Family
from dflash_jax.families.qwen3_5 import gated_delta as gd
from dflash_jax.families.qwen3_5.cache import HybridCache
from dflash_jax.formats.names import _linear_rules, Rule
from dflash_jax.layers.attention import causal_attention
from dflash_jax.layers.common import apply_rotary, capture_into, make_dense, MLP, rms_normalize
from dflash_jax.layers.moe import MoE
from dflash_jax.models.cache import KVCache
from dflash_jax.models.config import ConfigFields, LINEAR, LinearAttentionConfig, ModelConfig, MoEConfig

log = logging.getLogger(__name__)

# What a Qwen3.5 checkpoint carries beside its text model: the vision tower, the multi-token
# prediction head. Not read (a note says how many), never an error.
UNUSED = ("model.visual.", "mtp.")
LINEAR_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


# ---------------------------------------------------------------------------------------------
# The layers


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
        hk, hv = cfg.linear.num_key_heads, cfg.linear.num_value_heads
        dk, dv = cfg.linear.key_head_dim, cfg.linear.value_head_dim
        b, t, _ = x.shape
        dense = lambda n, name: make_dense(n, False, self.dtype, name=name)
        mixed = dense(cfg.linear.conv_dim, "in_proj_qkv")(x)
        z = dense(hv * dv, "in_proj_z")(x).reshape(b, t, hv, dv)
        write, gate = dense(hv, "in_proj_b")(x), dense(hv, "in_proj_a")(x)
        kernel = self.param("conv1d", nn.initializers.lecun_normal(), (cfg.linear.conv_kernel_dim, 1,
                                                                         cfg.linear.conv_dim), self.dtype)
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
        attended, (k, v) = causal_attention(q, k, v, positions, 0, cache, layer, impl=self.attn_impl)
        out = attended.reshape(b, t, h * d) * jax.nn.sigmoid(gate)
        return dense(cfg.hidden_size, "o_proj")(out), (k, v)


class HybridLayer(nn.Module):
    """A pre-norm decoder layer of either kind (Hugging Face's `Qwen3_5DecoderLayer`; with experts,
    `Qwen3_5MoeDecoderLayer`, whose MLP is the MoE block with its shared expert), called as every
    layer of the stack is (`dflash_jax.models.target.TargetLayer`): carry (hidden, features | None), xs
    (KV-cache layer index, window, capture slot); `cache` is the KV cache (or None) for an attention
    layer, its state by name for a linear one ({"conv": tail, "state": delta-rule state}). ys: the
    new (k, v), or the linear layer's pending inputs (`HybridCache.commit`)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    backend: str = "xla"  # the XLA backend's products: hybrids have no other layout
    kv_replicas: int = 1  # sharding (`TargetSpec`)
    linear_groups: int = 1
    mixer: str = "attention"  # or "linear_attention" (`ModelConfig.layer_kinds`)
    mlp: str = "dense"

    @nn.compact
    def __call__(self, carry, layer_xs, positions, cos, sin, cache):
        cfg = self.config
        hidden, features = carry
        layer, _, slot = layer_xs
        x = CenteredRMSNorm(cfg.rms_norm_eps, self.dtype, name="input_layernorm")(hidden)
        if self.mixer == LINEAR:
            mixed, out = GatedDeltaNet(cfg, self.dtype, self.linear_groups, name="linear_attn")(
                x, cache["conv"], cache["state"])
        else:
            mixed, out = GatedAttention(cfg, self.dtype, self.attn_impl, self.kv_replicas, name="self_attn")(
                x, positions, cos, sin, cache, layer)
            out = None if cache is None else out
        hidden = hidden + mixed
        x = CenteredRMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(hidden)
        if self.mlp == "moe":
            moe = cfg.moe
            mlp = MoE(moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.norm_topk_prob,
                      self.dtype, moe.shared_expert_intermediate_size, backend=self.backend, name="mlp")
        else:
            mlp = MLP(cfg.intermediate_size, cfg.mlp_bias, self.dtype, name="mlp")
        hidden = hidden + mlp(x)
        return (hidden, capture_into(features, slot, hidden)), out


# ---------------------------------------------------------------------------------------------
# The family


class Qwen3_5(Family):
    name = "qwen3_5"
    hf_classes = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")  # the latter: its text model
    model_types = ("qwen3_5", "qwen3_5_text")
    qk_norm = True
    hybrid = True
    checkpoint_prefixes = ("model.language_model.", "model.")

    stateful_mixers = (LINEAR,)  # a Gated DeltaNet layer: its "conv" tail and delta-rule "state"

    def initial_layer_state(self, config, mixer, batch, dtype):
        """A Gated DeltaNet layer's state before any position: a zero conv tail [B, K-1, C] (in the
        compute dtype) and a zero delta-rule state [B, Hv, Dk, Dv] (float32)."""
        linear = config.linear
        return {"conv": jnp.zeros((batch, linear.conv_kernel_dim - 1, linear.conv_dim), dtype),
                "state": jnp.zeros((batch, linear.num_value_heads, linear.key_head_dim, linear.value_head_dim),
                                   jnp.float32)}

    def init_cache(self, config, batch, capacity, dtype, *, kv_replicas=1, groups=1):
        """The attention layers' KV cache beside the linear layers' conv tails and states (`HybridCache`)."""
        return HybridCache.for_model(config, batch, capacity, dtype, kv_replicas=kv_replicas, groups=groups)

    def config_fields(self, fields: ConfigFields) -> ConfigFields:
        """A multimodal checkpoint's config: the text model's fields, the top level's where it has none."""
        if not isinstance(fields.hf.get("text_config"), dict):
            return fields
        top = {k: v for k, v in fields.hf.items() if k in ("tie_word_embeddings", "eos_token_id", "bos_token_id",
                                                            "pad_token_id")}
        return ConfigFields({**top, **{k: v for k, v in fields.hf["text_config"].items() if v is not None}},
                            fields.source, "text_config.")

    def family_fields(self, fields: ConfigFields) -> dict:
        return dict(linear=fields.build(
            LinearAttentionConfig, conv_kernel_dim=fields.int("linear_conv_kernel_dim", 4),
            num_key_heads=fields.int("linear_num_key_heads", 16),
            num_value_heads=fields.int("linear_num_value_heads", 32),
            key_head_dim=fields.int("linear_key_head_dim", 128),
            value_head_dim=fields.int("linear_value_head_dim", 128)))

    def validate(self, config):
        super().validate(config)
        if config.linear is None:
            raise ValueError(f"a {self.name} target needs its linear attention sizes (linear=)")
        if config.attention_sinks:
            raise ValueError(f"a {self.name} target has no attention sinks")
        if config.moe is not None:
            raise ValueError("a qwen3_5 target has dense MLPs; qwen3_5_moe is the MoE variant")

    def layer_module(self, mixer: str):
        return HybridLayer

    def final_norm(self, config, dtype):
        return CenteredRMSNorm(config.rms_norm_eps, dtype)

    def mixer_rules(self, config, mixer: str, hf: str, path: tuple, ids) -> list[Rule]:
        if mixer != LINEAR:  # gated attention: q_proj emits the query and its gate; centred q/k norms
            attn = (*path, "self_attn")
            return (_linear_rules(f"{hf}.self_attn", attn, ATTENTION_PROJECTIONS, config.attention_bias, ids)
                    + [Rule(f"{hf}.self_attn.{n}.weight", (*attn, n, "scale"), layer_ids=ids)
                       for n in ("q_norm", "k_norm")])
        mixer_path = (*path, "linear_attn")
        return (_linear_rules(f"{hf}.linear_attn", mixer_path, LINEAR_PROJECTIONS, False, ids)
                + [Rule(f"{hf}.linear_attn.conv1d.weight", (*mixer_path, "conv1d"), transpose=True, layer_ids=ids),
                   Rule(f"{hf}.linear_attn.A_log", (*mixer_path, "A_log"), layer_ids=ids),
                   Rule(f"{hf}.linear_attn.dt_bias", (*mixer_path, "dt_bias"), layer_ids=ids),
                   Rule(f"{hf}.linear_attn.norm.weight", (*mixer_path, "norm", "scale"), layer_ids=ids)])

    def unused_tensors(self, name: str) -> bool:
        return name.startswith(UNUSED)

    def allow_extra(self, config, tensors, source, prefix):
        unused = sum(1 for n in tensors if n.startswith(UNUSED))
        if unused:
            log.info("%s: %d tensor(s) of the vision tower / multi-token prediction head are not read (text model "
                     "only)", source, unused)
        return super().allow_extra(config, tensors, source, prefix)


class Qwen3_5Moe(Qwen3_5):
    name = "qwen3_5_moe"
    hf_classes = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")

    def default_intermediate_size(self, fields):
        return 3 * fields.int("hidden_size")  # no dense MLP: the Qwen family's dense width (a drafter's default)

    def family_fields(self, fields: ConfigFields) -> dict:
        # transformers' Qwen3_5MoeTextConfig: every layer's MLP is the sparse block (it deletes
        # mlp_only_layers, decoder_sparse_step and norm_topk_prob: its router always renormalises the
        # top k, `Qwen3_5MoeTopKRouter`); a shared expert beside the routed ones
        moe = fields.build(MoEConfig, num_experts=fields.int("num_experts", 256),
                           num_experts_per_tok=fields.int("num_experts_per_tok", 8),
                           intermediate_size=fields.int("moe_intermediate_size", 512),
                           shared_expert_intermediate_size=fields.int("shared_expert_intermediate_size", 512),
                           norm_topk_prob=True)
        return {**super().family_fields(fields), "moe": moe}

    def validate(self, config):
        Family.validate(self, config)
        if config.linear is None:
            raise ValueError(f"a {self.name} target needs its linear attention sizes (linear=)")
        moe = config.moe
        if moe is None or not moe.shared_expert_intermediate_size:
            raise ValueError("a qwen3_5_moe target's MLPs are MoE blocks with a shared expert "
                             "(moe.shared_expert_intermediate_size > 0)")
        if not moe.norm_topk_prob:
            raise ValueError("a qwen3_5_moe router always renormalises its top-k weights: norm_topk_prob must be True")
        if moe.dense_layers or moe.router != "softmax_topk" or moe.router_bias or moe.expert_bias:
            raise ValueError("a qwen3_5_moe layer's MLP is always the MoE block, routed by the softmax's top k")


QWEN3_5 = register(Qwen3_5())
QWEN3_5_MOE = register(Qwen3_5Moe())
