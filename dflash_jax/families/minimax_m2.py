"""MiniMax-M2 (`MiniMaxM2ForCausalLM`; MiniMax-M2, M2.1, M2.5): GLM-4 MoE's layers (`glm4_moe.SigmoidMoeLayer`)
with these differences, as transformers' `minimax_m2` computes them:
- q and k are each normalised by ONE RMSNorm over the whole projection, every head together (weights
  [H * Dh] and [Hkv * Dh]), before they are split into heads; no attention biases;
- RoPE on the first `rotary_dim` dims of each head (transformers: partial_rotary_factor = rotary_dim /
  head_dim), half-split layout;
- every layer's MLP is the MoE block: the sigmoid router with its correction bias, no groups, the top k
  always renormalised (nothing added to the sum), no scaling, no shared expert; the experts' width is the
  config's `intermediate_size`.
The released checkpoints name the block `block_sparse_moe`: its router `block_sparse_moe.gate`, the bias
`block_sparse_moe.e_score_correction_bias`, the experts one by one as `experts.{e}.w1` (gate), `w3` (up)
and `w2` (down); in FP8 (the release's `quantization_config` quant_method "fp8", 128 x 128 blocks) attention
and experts are float8_e4m3fn with `weight_scale_inv` block scales, dequantised as they load
(`loading.fp8_block`)."""
from __future__ import annotations

from dflash_jax.families import register
from dflash_jax.families.base import ATTENTION_PROJECTIONS
from dflash_jax.families.glm4_moe import FIXED, SigmoidMoeFamily
from dflash_jax.formats.names import _linear_rules, Rule
from dflash_jax.models.config import ConfigFields, MoEConfig

# What transformers' MiniMaxM2Config fills in where a config.json is silent (the released configs state them).
DEFAULTS = {"head_dim": 128, "rope_theta": 5000000.0, "max_position_embeddings": 196608}
# the released config.json's own fields that would change the math: refused by name unless they hold these
MINIMAX_FIXED = {**FIXED, "use_qk_norm": True, "qk_norm_type": "per_layer", "use_routing_bias": True,
                 "shared_intermediate_size": 0}
# (our expert param, the checkpoint's per-expert name)
EXPERT_NAMES = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


class MiniMaxM2(SigmoidMoeFamily):
    name = "minimax_m2"
    hf_classes = ("MiniMaxM2ForCausalLM",)
    model_types = ("minimax_m2",)
    default_max_positions = 196608
    fixed = MINIMAX_FIXED
    qk_norm = True  # always (`fixed` refuses use_qk_norm: false), over all heads

    def config_fields(self, fields: ConfigFields) -> ConfigFields:
        """The config with MiniMaxM2Config's defaults where it is silent (`DEFAULTS`), and `rotary_dim` as
        the partial_rotary_factor it gives (rotary_dim / head_dim); `attn_type_list` must say full attention
        (1) in every layer."""
        hf = fields.hf
        out = {k: v for k, v in DEFAULTS.items() if hf.get(k) is None}
        if out.get("rope_theta") and (hf.get("rope_parameters") or {}).get("rope_theta") is not None:
            del out["rope_theta"]
        head_dim = hf.get("head_dim") or DEFAULTS["head_dim"]
        rotary_dim = fields.int("rotary_dim", None)
        stated = hf.get("partial_rotary_factor", (hf.get("rope_parameters") or {}).get("partial_rotary_factor"))
        if rotary_dim is not None:
            if stated is not None and stated * head_dim != rotary_dim:
                raise fields.error(f"rotary_dim {rotary_dim} and partial_rotary_factor {stated} disagree "
                                   f"(head_dim {head_dim})")
            out["partial_rotary_factor"] = rotary_dim / head_dim
        kinds = hf.get("attn_type_list")
        if kinds is not None and any(k != 1 for k in kinds):
            raise fields.error(f"attn_type_list {kinds} has layers other than full attention (1); lightning "
                               f"attention is not supported for {self.name}")
        return ConfigFields({**{k: v for k, v in hf.items() if v is not None}, **out}, fields.source, fields.prefix)

    def qk_norm_kind(self, config) -> str:
        return "all"

    def family_fields(self, fields: ConfigFields) -> dict:
        experts = fields.int("num_local_experts", None)
        return dict(moe=fields.build(
            MoEConfig, num_experts=fields.int("num_experts") if experts is None else experts,
            num_experts_per_tok=fields.int("num_experts_per_tok"), intermediate_size=fields.int("intermediate_size"),
            norm_topk_prob=True, router="sigmoid_grouped"))

    def validate(self, config):
        super().validate(config)
        moe = config.moe
        if (moe.dense_layers or moe.shared_expert_intermediate_size or not moe.norm_topk_prob or moe.n_group != 1
                or moe.routed_scaling_factor != 1.0 or moe.norm_topk_eps):
            raise ValueError(f"every {self.name} layer's MLP is the MoE block, its router's top k renormalised "
                             "(nothing added to the sum) and not scaled, without groups or a shared expert")
        if not config.qk_norm or config.attention_bias:
            raise ValueError(f"a {self.name} target normalises q and k over all heads and has no attention biases")

    def mixer_rules(self, config, mixer, hf, path, ids):
        attn = (*path, "self_attn")
        return (_linear_rules(f"{hf}.self_attn", attn, ATTENTION_PROJECTIONS, False, ids)
                + [Rule(f"{hf}.self_attn.{n}.weight", (*attn, n, "scale"), layer_ids=ids)
                   for n in ("q_norm", "k_norm")])

    def mlp_rules(self, config, mlp, hf, path, ids):
        """`block_sparse_moe.gate` [E, D], `block_sparse_moe.e_score_correction_bias` [E], and each expert's
        w1 / w3 / w2 (gate / up / down) stacked [L, E, ...]."""
        block = f"{hf}.block_sparse_moe"
        return [Rule(f"{block}.gate.weight", (*path, "router", "kernel"), transpose=True, layer_ids=ids),
                Rule(f"{block}.e_score_correction_bias", (*path, "e_score_correction_bias"), layer_ids=ids),
                *[Rule(f"{block}.experts.{{e}}.{name}.weight", (*path, proj), transpose=True,
                       experts=config.num_experts, layer_ids=ids) for proj, name in EXPERT_NAMES]]


MINIMAX_M2 = register(MiniMaxM2())
