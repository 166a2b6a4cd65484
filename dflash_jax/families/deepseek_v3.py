"""DeepSeek-V3 and Kimi-K2 / K2.5 (`DeepseekV3ForCausalLM`, transformers `deepseek_v3`): multi-head
latent attention (MLA) in every layer, a dense SwiGLU MLP in the first `first_k_dense_replace` layers
and the MoE block after them (`DeepseekV3MoE`: sigmoid scores, `e_score_correction_bias` for the
choice only, group-limited top k, renormalised where `norm_topk_prob`, times `routed_scaling_factor`;
`n_shared_experts` ungated shared experts: `dflash_jax.layers.moe`'s "sigmoid_grouped" routing).

MLA (`DeepseekV3Attention`). Queries: `q_proj`, or the low-rank path `q_b_proj(q_a_layernorm(q_a_proj(x)))`
where `q_lora_rank` is set, each head `qk_nope_head_dim` plain dims then `qk_rope_head_dim` rotary
ones. Keys and values: `kv_a_proj_with_mqa(x)` gives a latent of `kv_lora_rank` (normed by
`kv_a_layernorm`) and one rotary key shared by all heads; transformers expands the latent through
`kv_b_proj` into each head's `qk_nope_head_dim` key dims and `v_head_dim` value dims. RoPE rotates the
rotary part only; with `rope_interleave` its dims are stored in pairs (x0, x1), (x2, x3), ... which
transformers de-interleaves (evens, then odds) before the half-by-half rotation, as done here. The
softmax scale is qk_head_dim^-0.5 times YaRN's mscale(factor, mscale_all_dim) squared
(`yarn_apply_mscale`).

Here the expansion is never materialised: with W_k, W_v the key and value halves of kv_b_proj,
q_nope . (W_k^T c) = (W_k q_nope) . c, so each head's query becomes [W_k q_nope | q_rope] against
the keys [c | k_rope] of one kv head, whose first kv_lora_rank dims are also the values; the value
half W_v is applied to each head's attended latent. The cache (`LatentCache`, below)
holds [c | k_rope] per token and layer: kv_lora_rank + qk_rope_head_dim values (576 for the
released shapes) instead of heads x (qk_head_dim + v_head_dim) (128 x 320). Prefill, decode and
verify all read it this way; rolling back is setting lengths.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from dflash_jax._errors import CheckpointError
from dflash_jax.families import register
from dflash_jax.families.base import Family, MLP_PROJECTIONS
from dflash_jax.formats import fp8_block, int4_pack
from dflash_jax.formats.names import _linear_rules, moe_layer_rules, Rule
from dflash_jax.kernels import masks
from dflash_jax.layers.attention import attention, cache_attention
from dflash_jax.layers.common import apply_rotary, make_dense, RMSNorm
from dflash_jax.models.cache import OneGroupCache, rows_axis, write_rows
from dflash_jax.models.config import ConfigFields, MLAConfig, ModelConfig, MoEConfig
from dflash_jax.models.decoder_layer import PreNormLayer
from dflash_jax.sharding import declare_param_axes

log = logging.getLogger(__name__)

# Kimi-K2.5 (`KimiK25ForConditionalGeneration`): the text model's tensors under this prefix, its head
# `language_model.lm_head.weight`; the vision tower and projector beside them are not read
KIMI_PREFIX, KIMI_HEAD = "language_model.model.", "language_model.lm_head.weight"
UNUSED = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
# a multimodal config's top-level fields that the text model's config reads too
WRAPPER_FIELDS = ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id", "quantization_config")

# config.json fields of models built on DeepSeek-V3 whose math this family does not implement, refused
# by name: DeepSeek-V3.2's sparse-attention indexer (DSA)
REFUSED_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")
# the quantised checkpoints this family reads (`quantization_config.quant_method`): DeepSeek's block-scaled
# FP8 (`loading.fp8_block`)
QUANT_METHODS = (None, "fp8", "compressed-tensors")
# tensor name endings of quantisation schemes this family does not read -> the scheme, named in the error
UNREAD_SCHEMES = {".weight_zero_point": "compressed-tensors with zero points (asymmetric)",
                  ".qweight": "GPTQ / AWQ", ".qzeros": "GPTQ / AWQ", ".g_idx": "GPTQ", ".weight_blocks": "MXFP4",
                  ".input_scale": "FP8 with static activation scales", ".weight_scale": "per-channel FP8 / INT8"}


def check_compressed_tensors(fields: ConfigFields, quant: dict) -> None:
    """A compressed-tensors `quantization_config` this family reads: every config group's weights symmetric
    4-bit integers in groups, packed ("pack-quantized", `loading.int4_pack`), no activation quantisation.
    ConfigError naming the group and what differs otherwise."""
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise fields.error("quantization_config: a compressed-tensors checkpoint without config_groups")
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        scheme = {"format": group.get("format") or quant.get("format"), "num_bits": weights.get("num_bits"),
                  "type": weights.get("type"), "symmetric": weights.get("symmetric"),
                  "strategy": weights.get("strategy"), "input_activations": group.get("input_activations")}
        wanted = {"format": "pack-quantized", "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                  "input_activations": None}
        wrong = {k: v for k, v in scheme.items() if v != wanted[k]}
        if wrong:
            raise fields.error(f"quantization_config.config_groups.{name}: compressed-tensors scheme {wrong} is not "
                               f"supported for deepseek_v3 (pack-quantized symmetric INT4 groups are: {wanted})")


def softmax_scale(config: ModelConfig) -> float:
    """The attention's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for a
    scaled rope with `mscale_all_dim` (transformers' `yarn_apply_mscale`)."""
    scale = config.mla.qk_head_dim ** -0.5
    rope = config.rope
    all_dim = rope.get("mscale_all_dim") or 0
    if rope.get("rope_type", "default") != "default" and all_dim:
        factor = rope["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def deinterleave(x):
    """[..., D] stored in pairs (x0, x1), (x2, x3), ... -> [evens | odds], the layout the half-by-half
    rotation reads (transformers' `apply_rotary_pos_emb_interleave`)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)



@struct.dataclass
class LatentCache(OneGroupCache):
    """A multi-head latent attention target's cache (DeepSeek-V3, `ModelConfig.mla`): per layer and
    token, the normed kv latent and the rotated shared key side by side, `kv` [L, B, S, 1, R + Dr]
    (kv_lora_rank + qk_rope_head_dim values, one "head" that every query head reads), lengths [B].
    The attention reads it as the keys of one kv head and its first R entries as the values, with
    the key half of kv_b_proj absorbed into the queries and the value half applied after
    (`dflash_jax.families.deepseek_v3`): nothing per head is stored. Rolling back is setting lengths."""

    kv: jax.Array
    lengths: jax.Array

    @classmethod
    def for_model(cls, config, batch: int, capacity: int, dtype=jnp.float32) -> "LatentCache":
        """An empty cache for a model config with `mla` (fields num_layers, mla.latent_dim)."""
        shape = (config.num_layers, batch, capacity, 1, config.mla.latent_dim)
        return cls(kv=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]

    def with_lengths(self, lengths) -> "LatentCache":
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

    def cleared(self) -> "LatentCache":
        return self.with_lengths(jnp.zeros_like(self.lengths))

    def commit(self, pending, num_new) -> "LatentCache":
        """Write a forward's pending (kv_new [L, B, T, 1, R + Dr], None) at each row's length; lengths +=
        num_new ([B] or a scalar; slots past a row's num_new are garbage, overwritten later)."""
        kv_new, _ = pending
        return LatentCache(kv=write_rows(self.kv, kv_new, self.lengths, axis=1),
                           lengths=self.lengths + jnp.asarray(num_new, jnp.int32))

    def shardings(self, mesh) -> "LatentCache":
        """kv [L, B, S, 1, R + Dr] over `data` on B (where it divides), replicated over `tensor` (every
        device's query heads read the whole latent); lengths over `data`."""
        rows = rows_axis(mesh, self.kv.shape[1])
        return self.replace(kv=NamedSharding(mesh, P(None, rows, None, None, None)),
                            lengths=NamedSharding(mesh, P(rows)))


class Kernel(nn.Module):
    """A Dense layer's kernel [in, out] under "kernel", read as an array (kv_b_proj: its halves are
    multiplied apart)."""

    shape: tuple
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self):
        return self.param("kernel", nn.initializers.lecun_normal(), self.shape, self.dtype)


class LatentAttention(nn.Module):
    """MLA with kv_b_proj absorbed (module docstring). x [B, T, D] -> (output [B, T, D], the new cache
    rows [B, T, 1, R + Dr]: the normed latent and the rotated shared key)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    backend: str = "xla"

    @nn.compact
    def __call__(self, x, positions, window, cos, sin, cache: LatentCache | None, layer):
        cfg, mla = self.config, self.config.mla
        h, dn, dr, r, dv = cfg.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank, mla.v_head_dim
        b, t, _ = x.shape
        dense = lambda n, bias, name: make_dense(n, bias, self.dtype, self.backend, name=name)  # noqa: E731
        if mla.q_lora_rank:
            q = dense(mla.q_lora_rank, cfg.attention_bias, "q_a_proj")(x)
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, name="q_a_layernorm")(q)
            q = dense(h * mla.qk_head_dim, False, "q_b_proj")(q)
        else:
            q = dense(h * mla.qk_head_dim, False, "q_proj")(x)
        q = q.reshape(b, t, h, mla.qk_head_dim)
        q_nope, q_rope = q[..., :dn], q[..., dn:]
        compressed = dense(r + dr, cfg.attention_bias, "kv_a_proj_with_mqa")(x)
        latent = RMSNorm(cfg.rms_norm_eps, self.dtype, name="kv_a_layernorm")(compressed[..., :r])
        k_rope = compressed[..., None, r:]  # [B, T, 1, Dr]
        if mla.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rotary(q_rope, cos, sin), apply_rotary(k_rope, cos, sin)
        kv_b = Kernel((r, h * (dn + dv)), self.dtype, name="kv_b_proj")().reshape(r, h, dn + dv)
        queries = jnp.concatenate([jnp.einsum("bthn,rhn->bthr", q_nope, kv_b[..., :dn]), q_rope], axis=-1)
        keys = jnp.concatenate([latent[:, :, None, :], k_rope], axis=-1)  # [B, T, 1, R + Dr]
        ranges, scale = masks.causal(positions, window), softmax_scale(cfg)
        if cache is None:
            attended = attention(queries, keys, keys, ranges, scale=scale, impl=self.attn_impl)
        else:
            offsets = cache.lengths
            keys = keys.astype(cache.kv.dtype)  # what a later step reads back from the cache
            attended = cache_attention(queries, cache.kv, cache.kv, layer, ranges.segment(0, offsets), keys, keys,
                                       ranges.segment(offsets, offsets + t), scale=scale, impl=self.attn_impl,
                                       backend=self.backend)
        values = jnp.einsum("bthr,rhv->bthv", attended[..., :r], kv_b[..., dn:])
        return dense(cfg.hidden_size, cfg.attention_bias, "o_proj")(values.reshape(b, t, h * dv)), keys


class DeepseekV3Layer(PreNormLayer):
    """A pre-norm decoder layer (`DeepseekV3DecoderLayer`; `PreNormLayer`): MLA, then the dense SwiGLU MLP
    or the MoE block; its cache a `LatentCache`, ys (with a cache): (the new cache rows [B, T, 1, R + Dr],
    None), what `LatentCache.commit` writes. `kv_replicas` is unused: the latent is one kv head,
    replicated on a mesh."""

    def attend(self, x, positions, window, cos, sin, cache: LatentCache | None, layer):
        mixed, rows = LatentAttention(self.config, self.dtype, self.attn_impl, self.backend, name="self_attn")(
            x, positions, window, cos, sin, cache, layer)
        return mixed, (rows, None)


# ---------------------------------------------------------------------------------------------
# The family


class DeepseekV3(Family):
    name = "deepseek_v3"
    # the last: Kimi-K2.5's multimodal checkpoint, whose text model is read (`config_fields`, `KIMI_PREFIX`)
    hf_classes = ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")
    model_types = ("deepseek_v3", "kimi_k2", "kimi_k25")
    checkpoint_prefixes = ("model.", KIMI_PREFIX)
    latent_attention = True
    default_max_positions = 4096  # DeepseekV3Config's

    def config_fields(self, fields: ConfigFields) -> ConfigFields:
        """The config as transformers reads it: `head_dim` is the rotary part of a head
        (`DeepseekV3Config` sets it so), and there are as many kv heads as query heads. Refuses the fields
        of variants whose math is not here (`REFUSED_FIELDS`) and quantised checkpoints it cannot read."""
        if isinstance(fields.hf.get("text_config"), dict):  # Kimi-K2.5: the text model's fields, the top's beside
            top = {k: v for k, v in fields.hf.items() if k in WRAPPER_FIELDS and v is not None}
            text = {k: v for k, v in fields.hf["text_config"].items() if v is not None}
            fields = ConfigFields({**top, **text}, fields.source, "text_config.")
        hf = fields.hf
        refused = [name for name in REFUSED_FIELDS if hf.get(name) is not None]
        if refused:
            raise fields.error(f"{', '.join(refused)}: DeepSeek-V3.2's sparse-attention indexer is not supported")
        quant = fields.section("quantization_config")
        method = quant.hf.get("quant_method")
        if method not in QUANT_METHODS:
            raise fields.error(f"quantization_config.quant_method {method!r} is not supported for deepseek_v3 "
                               f"(supported: {[m for m in QUANT_METHODS if m]})")
        if method == "fp8":
            for name, allowed in (("weight_block_size", [fp8_block.BLOCK] * 2), ("fmt", "e4m3"),
                                  ("activation_scheme", "dynamic")):
                value = quant.hf.get(name)
                if value is not None and value != allowed:
                    raise fields.error(f"quantization_config.{name} {value!r} is not supported for an fp8 "
                                       f"deepseek_v3 checkpoint (DeepSeek's is {allowed!r})")
        if method == "compressed-tensors":
            check_compressed_tensors(fields, quant.hf)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise fields.error(f"hidden_act {act!r} is not supported for deepseek_v3 (silu is)")
        # MLA expands one key and value per query head: `num_key_value_heads` is not read
        return ConfigFields({**hf, "head_dim": fields.int("qk_rope_head_dim", 64),
                             "num_key_value_heads": fields.int("num_attention_heads")}, fields.source, fields.prefix)

    def family_fields(self, fields: ConfigFields) -> dict:
        mla = fields.build(
            MLAConfig, kv_lora_rank=fields.int("kv_lora_rank", 512),
            qk_nope_head_dim=fields.int("qk_nope_head_dim", 128), qk_rope_head_dim=fields.int("qk_rope_head_dim", 64),
            v_head_dim=fields.int("v_head_dim", 128), q_lora_rank=fields.int("q_lora_rank", 0),
            rope_interleave=fields.bool("rope_interleave", True))
        num_layers = fields.int("num_hidden_layers")
        dense_prefix = fields.int("first_k_dense_replace", 3)
        experts = fields.int("n_routed_experts", None)
        experts = fields.int("num_local_experts", 256) if experts is None else experts
        if dense_prefix >= num_layers or not experts:
            return dict(mla=mla)
        if dense_prefix < 0:
            raise fields.error(f"first_k_dense_replace must be >= 0, got {dense_prefix}")
        for name, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
            value = fields.hf.get(name)
            if value is not None and value != allowed:
                raise fields.error(f"{name} {value!r} is not supported for deepseek_v3 (only {allowed!r}: "
                                   "DeepSeek-V3's router)")
        width = fields.int("moe_intermediate_size", 2048)
        moe = fields.build(
            MoEConfig, num_experts=experts, num_experts_per_tok=fields.int("num_experts_per_tok", 8),
            intermediate_size=width, norm_topk_prob=fields.bool("norm_topk_prob", True),
            shared_expert_intermediate_size=width * fields.int("n_shared_experts", 1), router="sigmoid_grouped",
            n_group=fields.int("n_group", 8) or 1, topk_group=fields.int("topk_group", 4) or 1,
            routed_scaling_factor=fields.float("routed_scaling_factor", 2.5), norm_topk_eps=1e-20,
            shared_expert_gate=False, dense_layers=tuple(range(dense_prefix)))
        return dict(mla=mla, moe=moe)

    def validate(self, config):
        super().validate(config)
        mla = config.mla
        if mla is None:
            raise ValueError("a deepseek_v3 target needs its latent attention sizes (mla=)")
        if config.head_dim != mla.qk_rope_head_dim:
            raise ValueError(f"a deepseek_v3 target's head_dim is its qk_rope_head_dim ({mla.qk_rope_head_dim}), "
                             f"got {config.head_dim}")
        if config.num_kv_heads != config.num_heads:
            raise ValueError(f"a deepseek_v3 target has as many kv heads as query heads ({config.num_heads}), "
                             f"got {config.num_kv_heads}")
        if config.qk_norm or config.mlp_bias or config.attention_sinks or config.sliding_window:
            raise ValueError("a deepseek_v3 target has no q/k norms, MLP biases, attention sinks or sliding windows")
        moe = config.moe
        if moe is not None and (moe.router != "sigmoid_grouped" or moe.shared_expert_gate or moe.router_bias
                                or moe.expert_bias or moe.swiglu_limit
                                or moe.dense_layers != tuple(range(len(moe.dense_layers)))):
            raise ValueError("a deepseek_v3 MoE layer is routed by the grouped sigmoid router, its shared experts "
                             "ungated, without biases, after a dense prefix")

    def layer_module(self, mixer: str):
        return DeepseekV3Layer

    def init_cache(self, config, batch, capacity, dtype, *, kv_replicas=1, groups=1):
        return LatentCache.for_model(config, batch, capacity, dtype)

    def mixer_rules(self, config, mixer, hf, path, ids):
        """MLA's projections (`DeepseekV3Attention`); biases on q_a_proj, kv_a_proj_with_mqa and o_proj
        where `attention_bias`."""
        attn, prefix, bias = (*path, "self_attn"), f"{hf}.self_attn", config.attention_bias
        norm = lambda n: Rule(f"{prefix}.{n}.weight", (*attn, n, "scale"), layer_ids=ids)  # noqa: E731
        if config.mla.q_lora_rank:
            rules = (_linear_rules(prefix, attn, ("q_a_proj",), bias, ids) + [norm("q_a_layernorm")]
                     + _linear_rules(prefix, attn, ("q_b_proj",), False, ids))
        else:
            rules = _linear_rules(prefix, attn, ("q_proj",), False, ids)
        return (rules + _linear_rules(prefix, attn, ("kv_a_proj_with_mqa",), bias, ids) + [norm("kv_a_layernorm")]
                + _linear_rules(prefix, attn, ("kv_b_proj",), False, ids)
                + _linear_rules(prefix, attn, ("o_proj",), bias, ids))

    def mlp_rules(self, config, mlp, hf, path, ids):
        """A dense SwiGLU, or the MoE block (`DeepseekV3MoE`): the router `mlp.gate` [E, D] and its
        `e_score_correction_bias` [E], each expert's projections (per expert, or fused: `unfuse_experts`),
        the shared experts `mlp.shared_experts.*` (one SwiGLU of n_shared_experts x the expert width)."""
        if mlp != "moe":
            return _linear_rules(f"{hf}.mlp", path, MLP_PROJECTIONS, False, ids)
        return (moe_layer_rules(hf, config.num_experts, path, ids)
                + [Rule(f"{hf}.mlp.gate.e_score_correction_bias", (*path, "e_score_correction_bias"), layer_ids=ids)]
                + _linear_rules(f"{hf}.mlp.shared_experts", (*path, "shared_expert"), MLP_PROJECTIONS, False, ids))

    def target_rules(self, config, prefix="model."):
        """The family's table; in Kimi-K2.5's checkpoint the head is the language model's too."""
        rules = super().target_rules(config, prefix)
        if prefix != KIMI_PREFIX:
            return rules
        return [dataclasses.replace(r, hf=KIMI_HEAD) if r.hf == "lm_head.weight" else r for r in rules]

    def unused_tensors(self, name):
        return name.startswith(UNUSED)

    def adapt_tensors(self, config, tensors, source):
        """Block-scaled FP8 weights (`loading.fp8_block`) and compressed-tensors pack-quantized INT4 ones
        (`loading.int4_pack`) dequantised as read, fused experts shown per expert; the tensors of a
        quantisation scheme not read here are a CheckpointError naming the scheme and the tensor."""
        tensors = int4_pack.dequantized(tensors, source)
        for name in tensors:
            if ".self_attn.indexer." in name:
                raise CheckpointError(f"{source}: tensor {name} belongs to DeepSeek-V3.2's sparse-attention indexer, "
                                      "which is not supported")
            scheme = next((s for end, s in UNREAD_SCHEMES.items() if name.endswith(end)), None)
            if scheme is not None:
                raise CheckpointError(f"{source}: tensor {name} is quantised as {scheme}, which deepseek_v3 "
                                      "checkpoints are not read in (block-scaled FP8, compressed-tensors "
                                      "pack-quantized INT4 and unquantised ones are)")
        return super().adapt_tensors(config, fp8_block.dequantized(tensors, source), source)

    def allow_extra(self, config, tensors, source, prefix):
        """Beside the base rule: the multi-token prediction layers a checkpoint stores after the model's
        (`num_nextn_predict_layers`, `model.layers.{num_hidden_layers}...`), which the model does not run."""
        base = super().allow_extra(config, tensors, source, prefix)
        mtp = f"{prefix}layers."
        is_mtp = lambda n: n.startswith(mtp) and n[len(mtp):].split(".", 1)[0].isdigit() and int(  # noqa: E731
            n[len(mtp):].split(".", 1)[0]) >= config.num_layers
        unused = sum(1 for n in tensors if is_mtp(n) or n.startswith(UNUSED))
        if unused:
            log.info("%s: %d tensor(s) of the multi-token prediction layers / vision tower are not read (text "
                     "model only)", source, unused)
        return lambda n: base(n) or is_mtp(n)


declare_param_axes({
    ("q_a_proj", "kernel"): ("embed", "latent"), ("q_a_proj", "bias"): ("latent",),
    ("q_b_proj", "kernel"): ("latent", "q_heads"),
    ("kv_a_proj_with_mqa", "kernel"): ("embed", "latent"), ("kv_a_proj_with_mqa", "bias"): ("latent",),
    ("kv_b_proj", "kernel"): ("latent", "q_heads"),
})

DEEPSEEK_V3 = register(DeepseekV3())
