"""Qwen3-MoE (`Qwen3MoeForCausalLM`; Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention, and an MoE
block (top k of the router's softmax, renormalised where `norm_topk_prob`) in every layer but the
dense ones: those `mlp_only_layers` lists, and with `decoder_sparse_step` s > 1 every layer i with
(i + 1) % s != 0, as transformers' `Qwen3MoeDecoderLayer` decides. The stack groups them into scanned
segments (`dflash_jax.models.stack`)."""
from dflash_jax.families import register
from dflash_jax.families.base import Family
from dflash_jax.models.config import MoEConfig


class Qwen3Moe(Family):
    name = "qwen3_moe"
    hf_classes = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    qk_norm = True

    def family_fields(self, fields):
        # released configs say num_experts; transformers 5 writes its alias num_local_experts
        experts = fields.int("num_experts", None)
        experts = fields.int("num_local_experts") if experts is None else experts
        if not experts:
            return {}
        num_layers = fields.int("num_hidden_layers")
        step = fields.int("decoder_sparse_step", 1)
        if step < 1:
            raise fields.error(f"decoder_sparse_step must be >= 1, got {step}")
        dense = set(fields.int_list("mlp_only_layers", ())) | {i for i in range(num_layers) if (i + 1) % step}
        return dict(moe=fields.build(
            MoEConfig, num_experts=experts, num_experts_per_tok=fields.int("num_experts_per_tok"),
            intermediate_size=fields.int("moe_intermediate_size"), norm_topk_prob=fields.bool("norm_topk_prob", False),
            dense_layers=tuple(sorted(dense))))

    def validate(self, config):
        super().validate(config)
        if config.moe is not None and (config.moe.router != "softmax_topk" or config.moe.router_bias
                                       or config.moe.expert_bias or config.moe.swiglu_limit
                                       or config.moe.shared_expert_intermediate_size):
            raise ValueError("a qwen3_moe router is the softmax's top k, without biases or a shared expert")


QWEN3_MOE = register(Qwen3Moe())
