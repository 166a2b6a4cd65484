"""gpt-oss (`GptOssForCausalLM`): attention with q/k/v/o biases and learned sinks, sliding (128) and
full layers alternating, YaRN; an MoE block whose router takes the softmax of its top k (with a
bias), experts with biases and a clamped SwiGLU; RMSNorm scaled in float32 (`GptOssRMSNorm`). The
released checkpoints hold the experts fused (gate and up columns interleaved) and in MXFP4, dequantised
as they are read (`loading.mxfp4`)."""
from __future__ import annotations

from dflash_jax.families import register
from dflash_jax.families.base import Family
from dflash_jax.formats.mxfp4 import dequantized
from dflash_jax.formats.names import Rule
from dflash_jax.models.config import ConfigFields, MoEConfig

# What transformers' GptOssConfig fills in where a gpt-oss config.json is silent (its defaults are
# gpt-oss-120b's shapes; the released configs state these fields anyway).
DEFAULTS = {
    "rope_theta": 150000.0, "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "attention_bias": True, "tie_word_embeddings": False, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
}


class GptOss(Family):
    name = "gpt_oss"
    hf_classes = ("GptOssForCausalLM",)
    model_types = ("gpt_oss",)
    norm_scale_in_float32 = True

    def config_fields(self, fields: ConfigFields) -> ConfigFields:
        """The config with GptOssConfig's defaults where it is silent (`DEFAULTS`; layer_types: sliding and
        full layers alternating, the first sliding). Its MXFP4 `quantization_config` is the only one read."""
        hf = fields.hf
        quant = fields.section("quantization_config").hf.get("quant_method")
        if quant not in (None, "mxfp4"):
            raise fields.error(f"quantization_config.quant_method {quant!r} is not supported for gpt-oss (mxfp4 is)")
        out = {k: v for k, v in DEFAULTS.items() if k not in ("rope_scaling", "rope_theta")}
        if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
            out["rope_scaling"] = DEFAULTS["rope_scaling"]
        if hf.get("rope_theta") is None and (hf.get("rope_parameters") or {}).get("rope_theta") is None:
            out["rope_theta"] = DEFAULTS["rope_theta"]
        layers = hf.get("num_hidden_layers")
        if hf.get("layer_types") is None and isinstance(layers, int):
            out["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return ConfigFields({**out, **{k: v for k, v in hf.items() if v is not None}}, fields.source)

    def family_fields(self, fields: ConfigFields) -> dict:
        experts = fields.int("num_local_experts", None)
        top_k = fields.int("num_experts_per_tok", None)
        moe = fields.build(
            MoEConfig, num_experts=fields.int("num_experts") if experts is None else experts,
            num_experts_per_tok=fields.int("experts_per_token") if top_k is None else top_k,
            intermediate_size=fields.int("intermediate_size"), router="topk_softmax", router_bias=True,
            expert_bias=True, swiglu_limit=fields.float("swiglu_limit"), swiglu_alpha=fields.float("swiglu_alpha"))
        return dict(moe=moe, attention_sinks=True)

    def validate(self, config):
        super().validate(config)
        if config.moe is None or config.moe.dense_layers or config.moe.shared_expert_intermediate_size:
            raise ValueError("every gpt_oss layer's MLP is the MoE block, without a shared expert")

    def mixer_rules(self, config, mixer, hf, path, ids):
        return super().mixer_rules(config, mixer, hf, path, ids) + [
            Rule(f"{hf}.self_attn.sinks", (*path, "self_attn", "sinks"), layer_ids=ids)]

    def mlp_rules(self, config, mlp, hf, path, ids):
        """The router Linear (weight [E, D], bias [E]) and the experts stacked in one tensor each,
        gate_up_proj [E, D, 2I] with gate and up columns interleaved (gate ::2, up 1::2; split into our
        gate_proj / up_proj [E, D, I]), its bias [E, 2I] alike, down_proj [E, I, D] and its bias [E, D]."""
        experts = f"{hf}.mlp.experts"
        return [Rule(f"{hf}.mlp.router.weight", (*path, "router", "kernel"), transpose=True, layer_ids=ids),
                Rule(f"{hf}.mlp.router.bias", (*path, "router", "bias"), layer_ids=ids),
                Rule(f"{experts}.gate_up_proj", (*path, "gate_proj"), columns=(0, 2), layer_ids=ids),
                Rule(f"{experts}.gate_up_proj", (*path, "up_proj"), columns=(1, 2), layer_ids=ids),
                Rule(f"{experts}.gate_up_proj_bias", (*path, "gate_bias"), columns=(0, 2), layer_ids=ids),
                Rule(f"{experts}.gate_up_proj_bias", (*path, "up_bias"), columns=(1, 2), layer_ids=ids),
                Rule(f"{experts}.down_proj", (*path, "down_proj"), layer_ids=ids),
                Rule(f"{experts}.down_proj_bias", (*path, "down_bias"), layer_ids=ids)]

    def adapt_tensors(self, config, tensors, source):
        return dequantized(tensors, source)  # the released checkpoints' MXFP4 experts, dequantised as read


GPT_OSS = register(GptOss())
