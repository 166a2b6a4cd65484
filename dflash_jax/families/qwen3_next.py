"""Qwen3-Next (`Qwen3NextForCausalLM`; Qwen3-Next-80B-A3B, Qwen3-Coder-Next): the Qwen3.5 hybrid's layers
(Gated DeltaNet and gated full attention, zero-centred RMSNorms, partial rotary; `families.qwen3_5`)
with Qwen3-MoE's choice of MLP per layer: an MoE block with a sigmoid-gated shared expert (the top k of
the router's softmax, renormalised where `norm_topk_prob`) in every layer but the dense ones, which
`mlp_only_layers` lists and, with `decoder_sparse_step` s > 1, every layer i with (i + 1) % s != 0.

What differs from Qwen3.5 is the checkpoint: each Gated DeltaNet's input projections are two fused
tensors, grouped per key head (transformers' `fix_query_key_value_ordering`). For key head h, with
r = value heads / key heads:
- `in_proj_qkvz` [Hk * (2 Dk + 2 r Dv), D]: group h is [q_h (Dk) | k_h (Dk) | v of value heads h r ..
  h r + r - 1 (r Dv) | z of the same heads (r Dv)];
- `in_proj_ba` [2 Hv, D]: group h is [b of those r value heads | a of them].
They load as Qwen3.5's four projections (`in_proj_qkv` [q | k | v] in head order, the conv's channel
order; `in_proj_z`, `in_proj_b`, `in_proj_a`), by rows (`loading.names.Rows`), and export back to the
same fused tensors; so the layers, their sharding over `tensor` (`sharding.linear_channel_order`) and
the cache's rollback are Qwen3.5's. The multi-token prediction head (`mtp.*`) is not read.
"""
from __future__ import annotations

import logging

import numpy as np

from dflash_jax.families import register
from dflash_jax.families.base import Family
from dflash_jax.families.qwen3_5 import Qwen3_5
from dflash_jax.formats.names import Rows, Rule
from dflash_jax.models.config import ConfigFields, LINEAR, MoEConfig

log = logging.getLogger(__name__)

UNUSED = ("mtp.",)  # the multi-token prediction head the released checkpoints carry

# What transformers' Qwen3NextConfig fills in where a config.json is silent (and changes the model).
DEFAULTS = {"head_dim": 256, "intermediate_size": 5632, "num_key_value_heads": 2, "max_position_embeddings": 32768,
            "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1}
PARTIAL_ROTARY_FACTOR = 0.25  # Qwen3NextConfig's default


def fused_rows(linear) -> dict[str, Rows]:
    """The rows of the fused checkpoint tensors that each of our projections holds (module docstring):
    "in_proj_qkv" and "in_proj_z" of `in_proj_qkvz`, "in_proj_b" and "in_proj_a" of `in_proj_ba`,
    for a `LinearAttentionConfig`."""
    hk, hv, dk, dv = linear.num_key_heads, linear.num_value_heads, linear.key_head_dim, linear.value_head_dim
    r = hv // hk
    width = 2 * dk + 2 * r * dv  # one key head's group of in_proj_qkvz
    starts = np.arange(hk)[:, None] * width

    def part(offset: int, size: int) -> np.ndarray:  # rows offset .. offset + size of every group, in order
        return (starts + offset + np.arange(size)[None, :]).reshape(-1)

    q, k, v, z = part(0, dk), part(dk, dk), part(2 * dk, r * dv), part(2 * dk + r * dv, r * dv)
    ba_starts = np.arange(hk)[:, None] * 2 * r
    b, a = ((ba_starts + offset + np.arange(r)[None, :]).reshape(-1) for offset in (0, r))
    rows = lambda index, total: Rows(tuple(int(i) for i in index), total)  # noqa: E731
    return {"in_proj_qkv": rows(np.concatenate([q, k, v]), hk * width), "in_proj_z": rows(z, hk * width),
            "in_proj_b": rows(b, 2 * hv), "in_proj_a": rows(a, 2 * hv)}


class Qwen3Next(Qwen3_5):
    name = "qwen3_next"
    hf_classes = ("Qwen3NextForCausalLM",)
    model_types = ("qwen3_next",)
    checkpoint_prefixes = ("model.",)

    def config_fields(self, fields: ConfigFields) -> ConfigFields:
        """The config with Qwen3NextConfig's defaults where it is silent (`DEFAULTS`; a quarter of each
        head rotated). Refuses an activation other than SiLU (`hidden_act`)."""
        hf = fields.hf
        act = hf.get("hidden_act")
        if act not in (None, "silu"):
            raise fields.error(f"hidden_act {act!r} is not supported for qwen3_next (silu is)")
        out = dict(DEFAULTS)
        rope = [hf.get("rope_parameters"), hf.get("rope_scaling")]
        if hf.get("partial_rotary_factor") is None and not any(
                isinstance(r, dict) and r.get("partial_rotary_factor") is not None for r in rope):
            out["partial_rotary_factor"] = PARTIAL_ROTARY_FACTOR
        return ConfigFields({**out, **{k: v for k, v in hf.items() if v is not None}}, fields.source)

    def family_fields(self, fields: ConfigFields) -> dict:
        linear = super().family_fields(fields)
        experts = fields.int("num_experts")
        if experts == 0:  # transformers: every MLP the dense one
            return linear
        num_layers = fields.int("num_hidden_layers")
        step = fields.int("decoder_sparse_step")
        if step < 1:
            raise fields.error(f"decoder_sparse_step must be >= 1, got {step}")
        dense = set(fields.int_list("mlp_only_layers", ())) | {i for i in range(num_layers) if (i + 1) % step}
        moe = fields.build(MoEConfig, num_experts=experts, num_experts_per_tok=fields.int("num_experts_per_tok"),
                           intermediate_size=fields.int("moe_intermediate_size"),
                           shared_expert_intermediate_size=fields.int("shared_expert_intermediate_size"),
                           norm_topk_prob=fields.bool("norm_topk_prob"), dense_layers=tuple(sorted(dense)))
        return {**linear, "moe": moe}

    def validate(self, config):
        Family.validate(self, config)
        if config.linear is None:
            raise ValueError("a qwen3_next target needs its linear attention sizes (linear=)")
        if config.attention_sinks:
            raise ValueError("a qwen3_next target has no attention sinks")
        kinds = sorted(set(config.layer_types) - {LINEAR, "full_attention"})
        if kinds:
            raise ValueError(f"a qwen3_next layer is linear_attention or full_attention, not {kinds}")
        moe = config.moe
        if moe is None:
            return
        if not moe.shared_expert_intermediate_size:
            raise ValueError("a qwen3_next MoE block has a shared expert: shared_expert_intermediate_size must be > 0")
        if moe.router != "softmax_topk" or moe.router_bias or moe.expert_bias or moe.swiglu_limit:
            raise ValueError("a qwen3_next router is the softmax's top k, without biases; its experts plain SwiGLU")

    def mixer_rules(self, config, mixer: str, hf: str, path: tuple, ids) -> list[Rule]:
        """Qwen3.5's rules, the linear layers' four input projections read from (and written to) the
        two fused tensors by rows (`fused_rows`)."""
        rules = super().mixer_rules(config, mixer, hf, path, ids)
        if mixer != LINEAR:
            return rules
        rows = fused_rows(config.linear)
        fused = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz", "in_proj_b": "in_proj_ba",
                 "in_proj_a": "in_proj_ba"}
        out = []
        for rule in rules:
            proj = rule.path[-2] if rule.path[-1] == "kernel" else None
            if proj in fused:
                rule = Rule(f"{hf}.linear_attn.{fused[proj]}.weight", rule.path, transpose=True, layer_ids=ids,
                            rows=rows[proj])
            out.append(rule)
        return out

    def unused_tensors(self, name: str) -> bool:
        return name.startswith(UNUSED)

    def allow_extra(self, config, tensors, source, prefix):
        unused = sum(1 for n in tensors if n.startswith(UNUSED))
        if unused:
            log.info("%s: %d tensor(s) of the multi-token prediction head are not read", source, unused)
        return Family.allow_extra(self, config, tensors, source, prefix)


QWEN3_NEXT = register(Qwen3Next())
