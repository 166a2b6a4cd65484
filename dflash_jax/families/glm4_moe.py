"""GLM-4 MoE (`Glm4MoeForCausalLM`; GLM-4.5, GLM-4.5-Air, GLM-4.6): the family and its layers.

What differs from Qwen3-MoE, as transformers' `glm4_moe` computes it:
- attention: q/k/v biases where `attention_bias` (o_proj never has one), an RMSNorm of each head's
  query and key only where `use_qk_norm`, RoPE on the first `partial_rotary_factor` of each head
  (0.5 where the config is silent) in the half-split layout (`rotate_half`, as Llama);
- the MoE block: the sigmoid router with its correction bias (`layers.moe.route_sigmoid_grouped`: `n_group`,
  `topk_group`, `norm_topk_prob` with DeepSeek's 1e-20 in the denominator, `routed_scaling_factor`) and
  `n_shared_experts` shared experts, one SwiGLU of width moe_intermediate_size x n_shared_experts added
  ungated;
- the first `first_k_dense_replace` layers have the dense MLP of `intermediate_size` (the stack gives
  them a segment of their own, `dflash_jax.models.stack`).
The released checkpoints name the router `mlp.gate` (its correction bias `mlp.gate.e_score_correction_bias`)
and the experts one by one (`mlp.experts.{e}.gate_proj.weight`, ...); their multi-token-prediction layers
(`model.layers.{L}...`, past the decoder) are not read. FP8 releases load dequantised: GLM-4.5(-Air)-FP8's
compressed-tensors FP8 with a scale per output row (`loading.fp8_channel`), or block-scaled FP8 as DeepSeek's
(`loading.fp8_block`); `check_quantization` says which configs are read.

`SigmoidMoeLayer` is also MiniMax-M2's (`families.minimax_m2`), which normalises q and k over all heads.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from dflash_jax._errors import CheckpointError
from dflash_jax.families import register
from dflash_jax.families.base import Family, MLP_PROJECTIONS
from dflash_jax.formats import fp8_block, fp8_channel
from dflash_jax.formats.names import _linear_rules, moe_layer_rules, Rule
from dflash_jax.layers.attention import causal_attention
from dflash_jax.layers.common import apply_rotary, make_dense, RMSNorm
from dflash_jax.models.cache import KVCache
from dflash_jax.models.config import ConfigFields, ModelConfig, MoEConfig
from dflash_jax.models.decoder_layer import PreNormLayer

log = logging.getLogger(__name__)

# config.json fields that would change the math and that this family does not implement: refused by name
# unless they hold the value given here (the one transformers' Glm4MoeConfig computes with)
FIXED = {"hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
# the quantised checkpoints these families read (`quantization_config.quant_method`): block-scaled FP8
# (MiniMax-M2's release; `loading.fp8_block`) and compressed-tensors FP8 with a scale per row or tensor
# (GLM-4.5 / GLM-4.5-Air FP8; `loading.fp8_channel`); the weights are dequantised as they load
QUANT_METHODS = (None, "fp8", "compressed-tensors")
# what an "fp8" quantization_config may say (a field absent, or one of these values): 128 x 128 blocks of e4m3
# values with float32 scales; activations quantised dynamically by an engine, here run unquantised as in
# transformers' dequantising load. `modules_to_not_convert` / `ignored_layers` are not read: a weight stored
# without its scale is an unquantised one.
FP8_BLOCK_FIELDS = {"weight_block_size": ([fp8_block.BLOCK] * 2,), "fmt": ("e4m3", "float8_e4m3fn"),
                    "activation_scheme": ("dynamic",), "scale_fmt": ("float",), "expert_dtype": ("fp8",)}
# tensor name endings of quantisation schemes these families do not read -> the scheme, named in the error
UNREAD_SCHEMES = {".weight_zero_point": "compressed-tensors with zero points (asymmetric)",
                  ".weight_packed": "compressed-tensors pack-quantized integers", ".qweight": "GPTQ / AWQ",
                  ".qzeros": "GPTQ / AWQ", ".g_idx": "GPTQ", ".weight_blocks": "MXFP4",
                  ".weight_scale_2": "NVFP4", ".input_scale": "FP8 with static activation scales",
                  ".weight_scale": "integers with a weight_scale (only float8_e4m3fn weights are read)"}


def check_quantization(fields: ConfigFields, family: str) -> None:
    """ConfigError naming the field unless the config's `quantization_config` is absent, block-scaled FP8
    (`FP8_BLOCK_FIELDS`) or compressed-tensors "float-quantized" FP8 of strategy "channel" or "tensor" with no
    static activation scales, KV-cache quantisation, sparsity or transforms."""
    quant = fields.section("quantization_config").hf
    method = quant.get("quant_method")
    if method not in QUANT_METHODS:
        raise fields.error(f"quantization_config.quant_method {method!r} is not supported for {family} "
                           f"(supported: {[m for m in QUANT_METHODS if m]})")
    if method == "fp8":
        for name, allowed in FP8_BLOCK_FIELDS.items():
            if quant.get(name) is not None and quant[name] not in allowed:
                raise fields.error(f"quantization_config.{name} {quant[name]!r} is not supported for an fp8 "
                                   f"{family} checkpoint (supported: {list(allowed)})")
    if method != "compressed-tensors":
        return
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise fields.error("quantization_config: a compressed-tensors checkpoint without config_groups")
    for name, what in (("kv_cache_scheme", "a quantised KV cache"), ("sparsity_config", "sparse weights"),
                       ("transform_config", "rotated weights")):
        if quant.get(name):
            raise fields.error(f"quantization_config.{name} {quant[name]!r} is not supported for {family} ({what})")
    for name, group in groups.items():
        group = group or {}
        weights, act = group.get("weights") or {}, group.get("input_activations")
        scheme = {"format": group.get("format") or quant.get("format"), "num_bits": weights.get("num_bits"),
                  "type": weights.get("type"), "symmetric": weights.get("symmetric"),
                  "strategy": weights.get("strategy"), "output_activations": group.get("output_activations"),
                  "input_activations": None if act is None or act.get("dynamic") is True else act}
        wanted = {"format": "float-quantized", "num_bits": 8, "type": "float", "symmetric": True,
                  "strategy": ("channel", "tensor"), "output_activations": None, "input_activations": None}
        wrong = {k: v for k, v in scheme.items() if v != wanted[k] and not (isinstance(wanted[k], tuple)
                                                                            and v in wanted[k])}
        if wrong:
            raise fields.error(f"quantization_config.config_groups.{name}: compressed-tensors scheme {wrong} is not "
                               f"supported for {family} (8-bit float weights with a scale per row or tensor, "
                               f"activations unquantised or dynamic, are: {wanted})")


class SigmoidMoeAttention(nn.Module):
    """Attention of GLM-4 MoE and MiniMax-M2: q/k/v projections (biases where the config's
    `attention_bias`), o_proj without a bias, a q/k RMSNorm of kind `qk_norm` ("head": per head, weight
    [Dh]; "all": over the whole projection of every head, weights [H * Dh] and [Hkv * Dh]; "": none), RoPE
    on the first `rotary_dim` dims of each head. With a cache the keys are read from it as in every
    target (`cache_attention`). -> (output [B, T, D], (k, v) of the new tokens)."""

    config: ModelConfig
    qk_norm: str = ""
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    backend: str = "xla"
    kv_replicas: int = 1  # sharding: copies of each kv head (`TargetSpec.kv_replicas`)

    @nn.compact
    def __call__(self, x, positions, window, cos, sin, cache: KVCache | None, layer):
        cfg = self.config
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b, t, _ = x.shape
        dense = lambda n, bias, name: make_dense(n, bias, self.dtype, self.backend, name=name)  # noqa: E731
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, name=name)  # noqa: E731
        q = dense(h * d, cfg.attention_bias, "q_proj")(x)
        k = dense(hkv * d, cfg.attention_bias, "k_proj")(x)
        v = dense(hkv * d, cfg.attention_bias, "v_proj")(x).reshape(b, t, hkv, d)
        if self.qk_norm == "all":
            q, k = norm("q_norm")(q), norm("k_norm")(k)
        q, k = q.reshape(b, t, h, d), k.reshape(b, t, hkv, d)
        if self.qk_norm == "head":
            q, k = norm("q_norm")(q), norm("k_norm")(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_replicas > 1:  # sharding: kv-head replication
            k, v = jnp.repeat(k, self.kv_replicas, axis=2), jnp.repeat(v, self.kv_replicas, axis=2)
        attended, (k, v) = causal_attention(q, k, v, positions, window, cache, layer, impl=self.attn_impl,
                                            backend=self.backend)
        out = dense(cfg.hidden_size, False, "o_proj")(attended.reshape(b, t, h * d))
        return out, (k, v)


class SigmoidMoeLayer(PreNormLayer):
    """A pre-norm decoder layer of GLM-4 MoE or MiniMax-M2 (`PreNormLayer`: `SigmoidMoeAttention` with the
    family's `qk_norm_kind`, then the dense SwiGLU or the MoE block of `config.moe`); ys: the new (k, v), or
    None without a cache."""

    def attend(self, x, positions, window, cos, sin, cache: KVCache | None, layer):
        cfg = self.config
        return SigmoidMoeAttention(cfg, cfg.family.qk_norm_kind(cfg), self.dtype, self.attn_impl, self.backend,
                                   self.kv_replicas, name="self_attn")(x, positions, window, cos, sin, cache, layer)


class SigmoidMoeFamily(Family):
    """What GLM-4 MoE and MiniMax-M2 share: `SigmoidMoeLayer`s, partial rotary, the sigmoid router, the
    refusal of a quantised checkpoint's config and of `FIXED` fields with other values. A subclass says how
    it reads q/k norms (`reads_qk_norm`, `qk_norm_kind`) and its MoE fields and names."""

    partial_rotary = True
    fixed: dict = FIXED

    def read_config(self, fields: ConfigFields) -> ModelConfig:
        """The common fields, the family's (`family_fields`) and its q/k norms (`reads_qk_norm`); a field of
        `fixed` with another value, or a `quantization_config` not of `QUANT_METHODS`' kinds, is refused by name."""
        for name, value in self.fixed.items():
            if fields.hf.get(name) not in (None, value):
                raise fields.error(f"{name} {fields.hf[name]!r} is not supported for {self.name} (only {value!r})")
        check_quantization(fields, self.name)
        config, qk_norm = super().read_config(fields), self.reads_qk_norm(fields)
        return config if config.qk_norm == qk_norm else dataclasses.replace(config, qk_norm=qk_norm)

    def reads_qk_norm(self, fields: ConfigFields) -> bool:
        """Whether the config's attention normalises q and k (the class's `qk_norm` by default)."""
        return self.qk_norm

    def qk_norm_kind(self, config) -> str:
        """How the attention normalises q and k (`SigmoidMoeAttention.qk_norm`)."""
        raise NotImplementedError

    def layer_module(self, mixer: str):
        return SigmoidMoeLayer

    def adapt_tensors(self, config, tensors, source):
        """FP8 weights dequantised as read (`loading.fp8_channel`'s `weight_scale`, `loading.fp8_block`'s
        `weight_scale_inv`), fused experts shown per expert; the tensors of a quantisation scheme not read here
        are a CheckpointError naming the scheme and the tensor."""
        tensors = fp8_channel.dequantized(tensors, source)
        for name in tensors:
            scheme = next((s for end, s in UNREAD_SCHEMES.items() if name.endswith(end)), None)
            if scheme is not None:
                raise CheckpointError(f"{source}: tensor {name} is quantised as {scheme}, which {self.name} "
                                      "checkpoints are not read in (block-scaled FP8, compressed-tensors FP8 with a "
                                      "scale per row or tensor, and unquantised ones are)")
        return super().adapt_tensors(config, fp8_block.dequantized(tensors, source), source)

    def validate(self, config):
        super().validate(config)
        moe = config.moe
        if moe is None or moe.router != "sigmoid_grouped" or moe.expert_bias or moe.swiglu_limit:
            raise ValueError(f"a {self.name} target's MoE blocks use the sigmoid_grouped router, without expert "
                             "biases or a clamped SwiGLU")
        if config.attention_sinks or config.mlp_bias or config.linear is not None:
            raise ValueError(f"a {self.name} target has no attention sinks, MLP biases or linear attention")
        if "sliding_attention" in config.layer_types:
            raise ValueError(f"sliding_attention layers are not supported for {self.name}: every layer attends to "
                             "the whole context")


class Glm4Moe(SigmoidMoeFamily):
    name = "glm4_moe"
    hf_classes = ("Glm4MoeForCausalLM",)
    model_types = ("glm4_moe",)
    default_max_positions = 131072

    def config_fields(self, fields: ConfigFields) -> ConfigFields:
        """The config with Glm4MoeConfig's partial_rotary_factor of 0.5 where it states none."""
        params = fields.hf.get("rope_parameters") or {}
        if fields.hf.get("partial_rotary_factor") is None and params.get("partial_rotary_factor") is None:
            return ConfigFields({**fields.hf, "partial_rotary_factor": 0.5}, fields.source, fields.prefix)
        return fields

    def reads_qk_norm(self, fields: ConfigFields) -> bool:
        return fields.bool("use_qk_norm", False)

    def qk_norm_kind(self, config) -> str:
        return "head" if config.qk_norm else ""

    def family_fields(self, fields: ConfigFields) -> dict:
        experts = fields.int("n_routed_experts", None)
        experts = fields.int("num_local_experts") if experts is None else experts
        moe_width = fields.int("moe_intermediate_size")
        shared = fields.int("n_shared_experts", 1)
        if shared < 0:
            raise fields.error(f"n_shared_experts must be >= 0, got {shared}")
        dense = fields.int("first_k_dense_replace", 1)
        layers = fields.int("num_hidden_layers")
        if not 0 <= dense <= layers:
            raise fields.error(f"first_k_dense_replace must be in [0, num_hidden_layers={layers}], got {dense}")
        return dict(moe=fields.build(
            MoEConfig, num_experts=experts, num_experts_per_tok=fields.int("num_experts_per_tok"),
            intermediate_size=moe_width, norm_topk_prob=fields.bool("norm_topk_prob", True),
            shared_expert_intermediate_size=moe_width * shared, router="sigmoid_grouped",
            n_group=fields.int("n_group", 1), topk_group=fields.int("topk_group", 1),
            routed_scaling_factor=fields.float("routed_scaling_factor", 1.0), norm_topk_eps=1e-20,
            shared_expert_gate=False, dense_layers=tuple(range(dense))))

    def validate(self, config):
        super().validate(config)
        moe = config.moe
        if moe.shared_expert_gate or moe.norm_topk_eps != 1e-20:
            raise ValueError(f"a {self.name} target's shared experts are ungated and its router adds 1e-20 to the "
                             "sum it renormalises by")
        if moe.dense_layers != tuple(range(len(moe.dense_layers))):
            raise ValueError(f"a {self.name} target's dense layers are its first ones, got {moe.dense_layers}")

    def mixer_rules(self, config, mixer, hf, path, ids):
        attn = (*path, "self_attn")
        rules = _linear_rules(f"{hf}.self_attn", attn, ("q_proj", "k_proj", "v_proj"), config.attention_bias, ids)
        rules += _linear_rules(f"{hf}.self_attn", attn, ("o_proj",), False, ids)
        if config.qk_norm:
            rules += [Rule(f"{hf}.self_attn.{n}.weight", (*attn, n, "scale"), layer_ids=ids)
                      for n in ("q_norm", "k_norm")]
        return rules

    def mlp_rules(self, config, mlp, hf, path, ids):
        """The dense MLP `mlp.{gate,up,down}_proj`; the MoE block: the router `mlp.gate` [E, D], its
        `mlp.gate.e_score_correction_bias` [E], the experts one by one and the shared experts
        `mlp.shared_experts.*`."""
        if mlp != "moe":
            return _linear_rules(f"{hf}.mlp", path, MLP_PROJECTIONS, False, ids)
        rules = moe_layer_rules(hf, config.num_experts, path, ids)
        rules.append(Rule(f"{hf}.mlp.gate.e_score_correction_bias", (*path, "e_score_correction_bias"), layer_ids=ids))
        if config.moe.shared_expert_intermediate_size:
            rules += _linear_rules(f"{hf}.mlp.shared_experts", (*path, "shared_expert"), MLP_PROJECTIONS, False, ids)
        return rules

    def allow_extra(self, config, tensors, source, prefix):
        """Also the multi-token-prediction layers the released checkpoints carry past the decoder
        (`model.layers.{L}.*` for L >= num_hidden_layers: a note says how many tensors)."""
        beyond = re.compile(rf"^{re.escape(prefix)}layers\.(\d+)\.")

        def mtp(name: str) -> bool:
            match = beyond.match(name)
            return match is not None and int(match[1]) >= config.num_layers

        count = sum(1 for n in tensors if mtp(n))
        if count:
            log.info("%s: %d tensor(s) of the multi-token prediction layers are not read", source, count)
        base = super().allow_extra(config, tensors, source, prefix)
        return lambda n: mtp(n) or base(n)


GLM4_MOE = register(Glm4Moe())
