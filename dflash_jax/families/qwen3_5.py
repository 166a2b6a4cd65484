"""Qwen3.5 / Qwen3.6 hybrids (`Qwen3_5ForCausalLM`, and the text model of `Qwen3_5ForConditionalGeneration`)
and their MoE variants (`Qwen3_5MoeForCausalLM` / `...ForConditionalGeneration`: every MLP an MoE block
with a sigmoid-gated shared expert): Gated DeltaNet ("linear_attention") layers between gated
full-attention layers, centred RMSNorms, partial rotary. The layers are `dflash_jax._hybrid`'s."""
from __future__ import annotations

import logging

from dflash_jax._config import LINEAR, ConfigFields, LinearAttentionConfig, MoEConfig
from dflash_jax.families import register
from dflash_jax.families.base import ATTENTION_PROJECTIONS, Family
from dflash_jax.loading.names import Rule, _linear_rules

log = logging.getLogger(__name__)

# What a Qwen3.5 checkpoint carries beside its text model: the vision tower, the multi-token
# prediction head. Not read (a note says how many), never an error.
UNUSED = ("model.visual.", "mtp.")
LINEAR_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


class Qwen3_5(Family):
    name = "qwen3_5"
    hf_classes = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")  # the latter: its text model
    model_types = ("qwen3_5", "qwen3_5_text")
    qk_norm = True
    hybrid = True
    checkpoint_prefixes = ("model.language_model.", "model.")

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
        from dflash_jax._hybrid import HybridLayer

        return HybridLayer

    def final_norm(self, config, dtype):
        from dflash_jax._hybrid import CenteredRMSNorm

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
