"""The target families the conformance suite (tests/support/conformance.py) runs over: one row
per family, with its tiny Hugging Face config, the transformers class that is its reference, how
its weights are randomised, and the knobs its checks need. Also the tiny models built from a row:
`make_hf` (transformers' model, saved with save_pretrained; no hub) and `tiny_target` (ours, built
directly from the row's config, no torch).

Adding a family: one row in FAMILIES and its name in one group of support/conformance.py's GROUPS
(test_family_conformance.py fails until both are there), and its own tests in its own file.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import pytest

DEFAULT = "default"  # the name of a row's only variant


def _dense_init(name, p, torch):
    """Qwen3 / Llama: norms near 1, every other weight small."""
    p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))


def _moe_init(name, p, torch):
    """Qwen3-MoE: as dense, the other weights twice as wide (routers that spread)."""
    p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))


def _hybrid_init(name, p, torch, router_scale=1.0):
    """Qwen3.5: every weight random, the centred norms and the decay's A_log too; routers (of the MoE
    hybrid) `router_scale` times wider, so that their logits spread."""
    p.copy_((0.1 if "norm" in name else 0.08) * torch.randn_like(p))
    if name.endswith("mlp.gate.weight"):
        p.mul_(router_scale)
    if "A_log" in name:
        p.uniform_(-2.0, 1.0)


def _gpt_oss_init(name, p, torch):
    """gpt-oss: every weight random, sinks and biases too (transformers starts some at zero); the
    routers' logits far apart (no near-tie in the top k)."""
    if "norm" in name:
        p.copy_(1 + 0.1 * torch.randn_like(p))
    elif name.endswith("sinks") or "router" in name:
        p.copy_(torch.randn_like(p))
    else:
        p.copy_(0.1 * torch.randn_like(p))


def _sigmoid_moe_init(name, p, torch):
    """GLM-4 MoE, MiniMax-M2: as Qwen3-MoE, the routers' logits far apart (no near-tie in the top k)."""
    if "norm" in name:
        p.copy_(1 + 0.1 * torch.randn_like(p))
    elif name.endswith("gate.weight"):
        p.copy_(torch.randn_like(p))
    else:
        p.copy_(0.1 * torch.randn_like(p))


def _correction_bias_init(name, b, torch):
    """The sigmoid routers' correction bias (a buffer transformers starts at zero): random, so that it
    changes which experts are chosen."""
    if name.endswith("e_score_correction_bias"):
        b.copy_(0.3 * torch.randn_like(b))


# the vision tower of a multimodal (ConditionalGeneration) checkpoint: the smallest that builds
_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)


@dataclasses.dataclass(frozen=True)
class Family:
    """One target family of the library and its conformance knobs."""

    name: str  # the library's family (ModelConfig.arch)
    hf_class: str  # transformers' causal LM: the reference, and the `architectures` entry
    hf_config_class: str
    config: dict  # the tiny Hugging Face config
    init: Callable  # (parameter name, parameter, torch) -> None: randomise transformers' weights in place
    # variant name -> (config overrides, multimodal); the parity checks run over every variant
    variants: dict = dataclasses.field(default_factory=lambda: {DEFAULT: {}})
    conditional: tuple[str, str] | None = None  # (config class, model class) of the multimodal checkpoint
    parity_tokens: int = 24  # positions of the logits / captured layers parity check
    # the cached ragged prefill: rows' lengths (the longest fills the batch), cache capacity, chunk
    prefill: dict = dataclasses.field(default_factory=lambda: dict(lengths=(40, 17, 3), capacity=64, chunk_size=16))
    router: str | None = None  # name suffix of routers whose top-k gap the prefill check asserts
    max_new_tokens: int = 24  # of the greedy checks against transformers' generate (and of the rejections')
    # our tiny target (`tiny_target`): config overrides for the decoding checks, weights' spread
    decode_overrides: dict = dataclasses.field(default_factory=dict)
    # the rejections at every position on our tiny target (decode_overrides) even where transformers is
    # installed: where those overrides are what they check (else, with torch, the loaded target against
    # transformers' greedy continuations)
    tiny_rejections: bool = False
    scale: float = 0.3
    sampling_scale: float = 0.2
    # what only `make test-all` runs: checks ("rejections"), a check of one variant
    # ("prefill[raw-topk]"), or every check of a variant (slow_variants); see `params`
    slow: frozenset = frozenset()
    slow_variants: frozenset = frozenset()
    # (buffer name, buffer, torch) -> None: randomise transformers' persistent buffers in place (None: left)
    init_buffers: Callable | None = None
    # config overrides (after decode_overrides) of the sampling chi-square's target: 6,000 rows, where
    # every layer costs
    sampling_overrides: dict = dataclasses.field(default_factory=dict)

    @property
    def default_variant(self) -> str:
        return next(iter(self.variants))

    def hf_config(self, variant: str | None = None, **overrides) -> dict:
        """The row's config with a variant's overrides (the first variant's by default; the text
        config of a multimodal one)."""
        variant = variant or self.default_variant
        extra = {k: v for k, v in self.variants[variant].items() if k != "multimodal"}
        return {**self.config, **extra, **overrides}

    def multimodal(self, variant: str | None = None) -> bool:
        return bool(self.variants[variant or self.default_variant].get("multimodal"))


# Qwen3 and Llama: test_generate (fitted models), test_sampling and test_decode_hlo check their
# speculative decoding, sampling and decode HLO by default; these rows' run under `make test-all`
_DENSE_SLOW = frozenset({"speculative", "rejections", "sampling", "decode_step_hlo", "decode_loop_hlo"})

QWEN3 = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             max_position_embeddings=256, tie_word_embeddings=False)
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-5,
             max_position_embeddings=256, tie_word_embeddings=True)
QWEN3_MOE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=256)
QWEN3_5 = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=512)
QWEN3_5_MOE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
                   shared_expert_intermediate_size=20, rms_norm_eps=1e-6, max_position_embeddings=512)
# key and value heads of different widths, two value heads per key head: the fused projections' groups
QWEN3_NEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=12, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=12, shared_expert_intermediate_size=20, rms_norm_eps=1e-6,
                  max_position_embeddings=512)
# hidden and expert widths multiples of 32 (an MXFP4 block); a window of 4 under 12-token prompts; a
# small swiglu_limit so that the clamps bite
GPT_OSS = dict(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
               max_position_embeddings=256, swiglu_limit=0.5)
# a dense first layer, then MoE layers of the sigmoid router (groups, scaling) and a shared expert; q/k/v
# biases, partial rotary (GLM's default 0.5)
GLM4_MOE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                norm_topk_prob=True, attention_bias=True, use_qk_norm=True, max_position_embeddings=256)
# q and k normalised over all heads, rotary on 8 of 16 dims; bos / eos inside the tiny vocabulary
MINIMAX_M2 = dict(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, rotary_dim=8,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
# MLA with a low-rank q path and interleaved rope; a dense first layer, then MoE layers of the grouped
# sigmoid router (4 groups, the best 2 kept, scaling) and a shared expert; no EOS (DeepseekV3Config says 1,
# which min_new_tokens would suppress in transformers' generate)
DEEPSEEK_V3 = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                   v_head_dim=8, rope_interleave=True, first_k_dense_replace=1, n_routed_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, n_group=4, topk_group=2,
                   routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6,
                   eos_token_id=None)

# Gemma 4: two sliding layers (window 5, under the prompts and the prefill chunk) and two full ones of
# another shape (head 16, one kv head with attention_k_eq_v); a softcap that bends the logits; no per-layer
# inputs (transformers' default has them)
GEMMA4 = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
              attention_k_eq_v=True, sliding_window=5, hidden_size_per_layer_input=0, final_logit_softcapping=3.0,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
              max_position_embeddings=256, tie_word_embeddings=True)


_GEMMA4_PLE_KV_SHARED = dict(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                             hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, num_kv_shared_layers=3,
                             use_double_wide_mlp=True)


def _gemma4_init(name, p, torch):
    """Gemma 4: as dense, the other weights twice as wide; the routers' scales near 1 and their projections
    wide (logits far apart: no near-tie in the top k)."""
    if "norm" in name or name.endswith("scale"):
        p.copy_(1 + 0.1 * torch.randn_like(p))
    else:
        p.copy_((0.5 if "router" in name else 0.1) * torch.randn_like(p))


FAMILIES = {row.name: row for row in [
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", QWEN3, _dense_init, slow=_DENSE_SLOW | {
        "prefill[sliding-yarn]", "greedy[sliding-yarn]"}, variants={
        DEFAULT: {},
        # sliding layers between full ones (a window under the prompts and the prefill chunk), yarn
        "sliding-yarn": dict(layer_types=["full_attention", "sliding_attention", "full_attention",
                                          "sliding_attention"], sliding_window=5, use_sliding_window=True,
                             rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 64, "rope_theta": 10000.0})}),
    # its cached ragged prefill and greedy decoding: the qwen3 row's stand for the KV cache and the decode
    # loop by default (llama's layers: its logits checks against transformers, both variants)
    Family("llama", "LlamaForCausalLM", "LlamaConfig", LLAMA, _dense_init, slow=_DENSE_SLOW | {
        "prefill", "greedy"}, variants={
        DEFAULT: {},  # GQA 4:1, tied head
        "llama3-rope": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                             "rope_theta": 500000.0})}),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE, _moe_init, parity_tokens=40,
           variants={"norm-topk": dict(norm_topk_prob=True), "raw-topk": dict(norm_topk_prob=False)},
           # the MoE hybrid's rejections, random drafter and decode loop stand for these by default; its
           # layers are Qwen3's attention and KV cache with PreNormLayer's MoE block (`layers.moe.moe_block`), so its
           # cached ragged prefill and decode step's HLO are the qwen3 row's prefill and test_decode_hlo's Qwen3
           # steps (that attention and cache) with the deepseek_v3 row's (the same MoE block in PreNormLayer,
           # experts of the same shapes at the same prefill lengths: the same expert forms) by default
           slow=frozenset({"prefill", "greedy[raw-topk]", "speculative", "rejections", "sampling",
                           "decode_step_hlo", "decode_loop_hlo"})),
    Family("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", QWEN3_5, _hybrid_init,
           conditional=("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"), variants={
               # the default pattern (3 linear, 1 full) twice; GQA 2:1 in both kinds of layer
               DEFAULT: {},
               # every other layer full, GQA 4:1, one linear key head per 4 value heads, tied head
               "interval2-tied": dict(num_hidden_layers=6, num_key_value_heads=1, full_attention_interval=2,
                                      linear_num_key_heads=1, tie_word_embeddings=True),
               # the text model of a multimodal checkpoint (its vision tower is not read)
               "conditional-generation": dict(num_hidden_layers=4, multimodal=True)},
           slow_variants=frozenset({"interval2-tied"}),  # its checks repeat the others' on another pattern
           # the MoE hybrid's prefill, random drafter against transformers' generate, rejections, decode
           # step and loop stand for these by default (the same hybrid cache and layers); the multimodal
           # checkpoint's logits: the qwen3_5_moe row's conditional-generation variant by default (its family
           # subclasses this one: the same text_config reading and checkpoint prefixes), this row's default
           # variant (its layers) and its own export check (its multimodal checkpoint's names and tensors).
           # Its sampling chi-square: test_sampling's (the acceptance rules on a KV cache) with the MoE
           # hybrid's rejections at every position (the recurrent states rolled back to any acceptance
           # length, by the same lengths a sampled cycle accepts) by default
           slow=frozenset({"prefill", "greedy", "speculative", "rejections", "sampling", "decode_step_hlo",
                           "decode_loop_hlo", "parity[conditional-generation]"}),
           parity_tokens=77,  # two chunks of the chunked delta rule
           # the chi-square (make test-all) on one repeat of the pattern (3 linear, 1 full): every kind of
           # layer, half the cost
           sampling_overrides=dict(num_hidden_layers=4),
           # 300 tokens: a 256-token prefill chunk and a remainder, each row's recurrent state stopping
           # at its own length
           prefill=dict(lengths=(300, 131, 5), capacity=512, chunk_size=None)),
    Family("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", QWEN3_5_MOE,
           lambda name, p, torch: _hybrid_init(name, p, torch, router_scale=5.0),
           conditional=("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
           variants={
               DEFAULT: {},  # the default pattern (3 linear, 1 full); GQA 2:1 in both kinds of layer
               # the text model of a multimodal checkpoint: every other layer full, 3 experts per token, tied
               "conditional-generation": dict(full_attention_interval=2, num_experts_per_tok=3,
                                              tie_word_embeddings=True, multimodal=True)},
           parity_tokens=77,
           # 100 tokens: two chunks of the delta rule, the experts as `ragged_dot`; the next step's
           # one token per row: the gathered-experts form
           prefill=dict(lengths=(100, 41, 5), capacity=128, chunk_size=None), router="mlp.gate",
           # the rejections at every position (speculative decoding against transformers' greedy generate)
           # stand for the speculative and the plain greedy checks against it by default, with the cached
           # prefill's next step (one token per row through the hybrid cache) and test_bench_families'
           # plain greedy decoding of linear layers; the hybrid's sampling is the qwen3_5 row's (make
           # test-all); its decode step's HLO runs by default, the decode loop's (test_decode_hlo's for Qwen3)
           # under make test-all
           slow=frozenset({"prefill[conditional-generation]", "greedy", "speculative", "sampling",
                           "decode_loop_hlo"}),
           # two attention layers in the decoding checks' target: with only one, the hybrid's compiled
           # decode step copies that layer's whole KV cache (seen 2026-12-06, jax 0.10.2; released
           # Qwen3.5 models have many attention layers)
           decode_overrides=dict(full_attention_interval=2)),
    Family("gpt_oss", "GptOssForCausalLM", "GptOssConfig", GPT_OSS, _gpt_oss_init, parity_tokens=12,
           # 6 tokens per chunk: windows across chunks
           prefill=dict(lengths=(12, 7, 3), capacity=32, chunk_size=6), max_new_tokens=40,
           # the rejections at every position (speculative decoding against transformers' greedy generate,
           # windows rolled back) and the cached prefill's next step stand for the plain greedy check by default
           slow=frozenset({"greedy", "speculative", "sampling", "decode_loop_hlo"})),
    Family("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig", QWEN3_NEXT,
           lambda name, p, torch: _hybrid_init(name, p, torch, router_scale=5.0), variants={
               DEFAULT: {},  # the default pattern (3 linear, 1 full), every MLP an MoE block, top k renormalised
               # every other layer full; dense MLPs by decoder_sparse_step (layers 0, 2) and mlp_only_layers (3);
               # the top k not renormalised; 3 experts per token; tied head
               "dense-raw-topk": dict(full_attention_interval=2, decoder_sparse_step=2, mlp_only_layers=[3],
                                      norm_topk_prob=False, num_experts_per_tok=3, tie_word_embeddings=True)},
           parity_tokens=77,  # two chunks of the delta rule
           prefill=dict(lengths=(100, 41, 5), capacity=128, chunk_size=None), router="mlp.gate",
           # the hybrid's cached ragged prefill, greedy decoding, rejections, sampling and decode HLO are the
           # qwen3_5 / qwen3_5_moe rows' (the same layers and cache); test_qwen3_next checks the rollback of
           # this row's recurrent state (make test-all)
           slow=frozenset({"prefill", "greedy", "speculative", "rejections", "sampling", "decode_step_hlo",
                           "decode_loop_hlo"}),
           decode_overrides=dict(full_attention_interval=2)),
    Family("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig", GLM4_MOE, _sigmoid_moe_init,
           init_buffers=_correction_bias_init, parity_tokens=40, variants={
               DEFAULT: {},  # q/k norms, groups, scaling, a dense prefix of 1
               # no q/k norms, a dense prefix of 2, one group, the top k not renormalised, 2 shared experts,
               # a partial rotary factor stated in rope_parameters
               "dense2-plain": dict(num_hidden_layers=4, first_k_dense_replace=2, use_qk_norm=False, n_group=1,
                                    topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, n_shared_experts=2,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.25})},
           # the rejections at every position stand for the speculative check by default; the cached ragged
           # prefill and the decode step's HLO are the qwen3 row's / test_decode_hlo's (a KV cache) and the
           # deepseek_v3 row's (a dense prefix before MoE layers of the grouped sigmoid router) by default
           slow=frozenset({"prefill", "greedy[dense2-plain]", "speculative", "sampling", "decode_step_hlo",
                           "decode_loop_hlo"})),
    Family("minimax_m2", "MiniMaxM2ForCausalLM", "MiniMaxM2Config", MINIMAX_M2, _sigmoid_moe_init,
           init_buffers=_correction_bias_init, parity_tokens=40,
           # the glm4_moe row's rejections (speculative decoding against transformers' greedy generate),
           # sampling, decode step and loop stand for these and its speculative check by default (the same
           # layers), the qwen3 row's and the deepseek_v3 row's cached ragged prefill (a KV cache; MoE layers
           # of the sigmoid router); its greedy check runs
           slow=frozenset({"prefill", "speculative", "rejections", "sampling", "decode_step_hlo",
                           "decode_loop_hlo"})),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config", DEEPSEEK_V3, _sigmoid_moe_init,
           init_buffers=_correction_bias_init, parity_tokens=40, variants={
               DEFAULT: {},  # q low-rank path, interleaved rope, groups, a dense prefix of 1
               # a plain q_proj, rope dims not interleaved, biases (kv_a_proj_with_mqa, o_proj), YaRN whose
               # mscale_all_dim scales the softmax (and, unequal to its mscale, the cos and sin); a dense prefix
               # of 2, one group, the top k not renormalised, 2 shared experts
               "plain-q-yarn-dense2": dict(
                   num_hidden_layers=4, first_k_dense_replace=2, n_group=1, topk_group=1, norm_topk_prob=False,
                   n_shared_experts=2, routed_scaling_factor=1.5, q_lora_rank=None, rope_interleave=False,
                   attention_bias=True, rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                         "mscale_all_dim": 0.8, "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 64}),
               # every layer dense (no routed or shared experts)
               "dense": dict(first_k_dense_replace=3, n_routed_experts=0, n_shared_experts=0)},
           # the default variant's cached ragged prefill stands for the others' (the same latent cache); its
           # rejections at every position (speculative decoding against transformers' greedy generate), the
           # prefill's next step and test_deepseek_v3's latent cache decoding step by step against transformers
           # stand for the plain greedy check by default
           slow=frozenset({"prefill[dense]", "prefill[plain-q-yarn-dense2]", "greedy", "speculative", "sampling",
                           "decode_loop_hlo"})),
    Family("gemma4", "Gemma4ForCausalLM", "Gemma4TextConfig", GEMMA4, _gemma4_init, parity_tokens=12,
           conditional=("Gemma4Config", "Gemma4ForConditionalGeneration"),
           variants={
               DEFAULT: {},  # gemma-4-31B's layers: k=v full layers of their own shape
               # per-layer inputs, the last 3 of 6 layers reading the keys of the last sliding / full layer
               # before them, with MLPs twice as wide
               "ple-kv-shared": _GEMMA4_PLE_KV_SHARED,
               # keys and values of their own on the full layers, as many kv heads as the sliding ones; an
               # untied head
               "separate-v": dict(attention_k_eq_v=False, tie_word_embeddings=False),
               # gemma-4-26B-A4B's layers: the MoE block (8 experts, 2 per token) beside each dense MLP
               "moe": dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16),
               # the text model of a multimodal checkpoint (its vision tower is not read)
               "conditional-generation": dict(multimodal=True)},
           slow_variants=frozenset({"ple-kv-shared", "separate-v", "moe", "conditional-generation"}),
           prefill=dict(lengths=(12, 7, 3), capacity=32, chunk_size=6),
           # our own target's decoding checks (rejections, sampling, decode HLO) on the richest layers; by
           # default the speculative check with a random drafter (drafts rejected at every kind of place)
           # and the cached prefill's next step stand for the plain greedy check against transformers
           decode_overrides=_GEMMA4_PLE_KV_SHARED, tiny_rejections=True,
           slow=frozenset({"greedy", "rejections", "sampling", "decode_step_hlo", "decode_loop_hlo"})),
]}


def hf_modules(family: str):
    """(torch, transformers) for a check against transformers' class of `family`, or a skip (the
    jax-latest leg has no torch; an older transformers may lack the class)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, FAMILIES[family].hf_class):
        pytest.skip(f"this transformers has no {FAMILIES[family].hf_class}")
    return torch, transformers


def has_hf(family: str) -> bool:
    """Whether torch and a transformers with the row's class are installed (`hf_modules` would not skip)."""
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        return False
    return hasattr(transformers, FAMILIES[family].hf_class)


def make_hf(family: str, out_dir=None, seed: int = 0, variant: str | None = None, **overrides):
    """transformers' float32 model of a row's config (a variant's, with `overrides`), its weights
    randomised by the row's `init` from `seed`, in eval mode; saved with save_pretrained to out_dir
    (when given)."""
    torch, transformers = hf_modules(family)
    row = FAMILIES[family]
    torch.manual_seed(seed)
    text = row.hf_config(variant, **overrides)
    if row.multimodal(variant):
        config_class, model_class = row.conditional
        config = getattr(transformers, config_class)(
            text_config=text, tie_word_embeddings=text.get("tie_word_embeddings", False), vision_config=_VISION)
        model = getattr(transformers, model_class)(config)
    else:
        model = getattr(transformers, row.hf_class)(getattr(transformers, row.hf_config_class)(**text))
    with torch.no_grad():
        for name, p in model.named_parameters():
            row.init(name, p, torch)
        for name, b in model.named_buffers() if row.init_buffers else ():
            row.init_buffers(name, b, torch)
    model.eval()
    if out_dir is not None:
        model.save_pretrained(out_dir)
    return model


def target_config(family: str, **overrides):
    """Our ModelConfig of a row's config.json (with `overrides`), read as `load_target` reads it."""
    from dflash_jax.models.config import ModelConfig

    row = FAMILIES[family]
    return ModelConfig.from_hf_config({"architectures": [row.hf_class], **row.config, **row.decode_overrides,
                                       **overrides})


def drawn_params(shapes, seed=0, scale: float = 0.3, host: bool = False):
    """Params of `shapes` (a tree of ShapeDtypeStructs, e.g. `target_param_shapes(config)`) drawn with
    numpy, so that no initialiser is compiled: norms ("scale" leaves) near 1, the rest N(0, scale),
    float32. seed: an int or a numpy Generator (to draw several trees from one stream). On the device,
    or as numpy arrays with host=True (a mesh placement slices those on the host, no program per shard)."""
    import jax
    import jax.numpy as jnp

    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)

    def draw(path, s):
        value = (1 + 0.1 * rng.standard_normal(s.shape) if path[-1].key == "scale"
                 else scale * rng.standard_normal(s.shape)).astype(np.float32)
        return value if host else jnp.asarray(value)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def tiny_target(family: str, seed: int = 0, scale: float | None = None, **overrides):
    """Our target of the row's config (`decode_overrides`, then `overrides`) with every weight drawn
    with numpy (no initialiser to compile): norms near 1, the rest N(0, scale) (the row's `scale`
    by default), large enough for peaked distributions."""
    from dflash_jax.models.target import Target, target_param_shapes

    config = target_config(family, **overrides)
    scale = FAMILIES[family].scale if scale is None else scale
    return Target(config, drawn_params(target_param_shapes(config), seed, scale))


def save_target_dir(target, directory) -> None:
    """An HF directory (config.json + model.safetensors) of a Qwen3, Llama or Qwen3-MoE Target built
    in memory."""
    import json
    from pathlib import Path

    from dflash_jax.formats.names import params_to_hf, target_rules
    from dflash_jax.formats.safetensors_io import save_safetensors

    c, directory = target.config, Path(directory)
    if c.arch not in ("qwen3", "llama", "qwen3_moe"):
        raise ValueError(f"save_target_dir writes flat Qwen3 / Llama / Qwen3-MoE configs, not {c.arch}")
    directory.mkdir(parents=True, exist_ok=True)
    hf = {"architectures": [FAMILIES[c.arch].hf_class],
          "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
          "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
          "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
          "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
          "tie_word_embeddings": c.tie_word_embeddings, "torch_dtype": "float32"}
    if c.num_experts:
        hf.update(num_experts=c.num_experts, num_experts_per_tok=c.moe.num_experts_per_tok,
                  moe_intermediate_size=c.moe.intermediate_size, norm_topk_prob=c.moe.norm_topk_prob)
    (directory / "config.json").write_text(json.dumps(hf))
    save_safetensors(params_to_hf(target_rules(c), target.params, c.num_layers), directory / "model.safetensors")


def library_family_names() -> set[str]:
    """The target families the library registers (`dflash_jax.families`)."""
    from dflash_jax import families

    return set(families.names())


def params(check: str, variants: bool = False, keys: bool = True) -> list[Any]:
    """pytest params of `check` over the rows: (family, variant) keys (`variants`: every variant of
    each row, else its first), or family names (`keys=False`); marked slow where the row puts
    `check`, `check[variant]` or the variant under `make test-all`."""
    out = []
    for row in FAMILIES.values():
        for variant in (row.variants if variants else [row.default_variant]):
            slow = {check, f"{check}[{variant}]"} & row.slow or variant in row.slow_variants
            ident = row.name if variant == row.default_variant else f"{row.name}-{variant}"
            out.append(pytest.param((row.name, variant) if keys else row.name, id=ident,
                                    marks=[pytest.mark.slow] if slow else []))
    return out
