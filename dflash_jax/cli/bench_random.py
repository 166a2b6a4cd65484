"""Random-weight models of real shapes for `--random-target`: the official config values of the
targets it builds, their DFlash drafters' configs, and random parameters drawn on the device."""
from __future__ import annotations

# Official config values (Hugging Face config.json) of the targets `--random-target` builds, and the
# mask token id of their DFlash drafters.
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
          "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
          "bos_token_id": 151643, "eos_token_id": 151645}
# Gemma 4's text models (gemma-4-31B-it, gemma-4-26B-A4B-it: what their text_config states alike)
_GEMMA4 = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 262144,
           "head_dim": 256, "global_head_dim": 512, "attention_k_eq_v": True, "sliding_window": 1024,
           "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "final_logit_softcapping": 30.0,
           "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
           "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
           "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                  "rope_theta": 1000000.0}}}
RANDOM_TARGETS = {
    "qwen3-8b": ({**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
                 151669),
    "qwen3-4b": ({**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
                 151669),
    "llama3-8b": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
                   "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
                   "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128009]},
                  128002),  # <|reserved_special_token_0|>
    # Qwen3.5-9B's text model (transformers' Qwen3_5TextConfig defaults are its shapes): 24 Gated
    # DeltaNet and 8 gated full-attention layers. Mask id: the last one (random weights; no
    # official drafter config is read here).
    "qwen3.5-9b": ({"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
                    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
                    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25}},
                   248319),
    # Qwen3-30B-A3B (Qwen3-Coder-30B-A3B has its shapes): 48 layers, each an MoE of 128 experts, 8 per token
    "qwen3-30b-a3b": ({**_QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                       "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                       "num_attention_heads": 32, "num_key_value_heads": 4, "moe_intermediate_size": 768,
                       "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                       "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
                       "tie_word_embeddings": False},
                      151669),
    # Qwen3.5-35B-A3B's text model (Qwen3.6-35B-A3B has its shapes): 40 layers, 30 Gated DeltaNet and 10
    # gated full-attention ones, each with an MoE of 256 experts (8 per token) and a shared expert. The
    # released config.json nests these under text_config (Qwen3_5MoeForConditionalGeneration), lists
    # layer_types in full (the default interval-4 pattern) and has no intermediate_size; the drafter here
    # gets ModelConfig's stand-in, 3 x hidden = 6144 (no official drafter config is read). Mask id: the
    # last one, as for qwen3.5-9b.
    "qwen3.5-35b-a3b": ({"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                         "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                         "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                         "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                         "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
                         "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                         "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6,
                         "max_position_embeddings": 262144, "tie_word_embeddings": False,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                             "partial_rotary_factor": 0.25}},
                        248319),
    # gpt-oss-20b (openai/gpt-oss-20b config.json: gpt-oss-120b's with 24 layers and 32 experts): 24 layers
    # alternating a 128-token sliding window and full attention, attention sinks, q/k/v/o biases, YaRN
    # (factor 32 from 4,096, not truncated), 32 experts with biases, 4 per token, the clamped SwiGLU.
    # Its experts are MXFP4 in the release; here they are random floats of the dequantised shapes. The
    # released layer_types (sliding, full) x 12 are left to the default, which is the same rule for any
    # --layers.
    # Mask id: the last one (random weights; no official drafter config is read here).
    "gpt-oss-20b": ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
                     "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
                     "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
                     "attention_bias": True,
                     "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "rope_theta": 150000,
                     "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "original_max_position_embeddings": 4096, "truncate": False},
                     "max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": 199998,
                     "eos_token_id": 200002, "pad_token_id": 199999},
                    201087),
    # Qwen3-Coder-Next (Qwen3-Next-80B-A3B's shapes): 48 layers, 12 x (3 Gated DeltaNet, 1 gated full attention),
    # each with an MoE of 512 experts (10 per token) and a shared expert; a quarter of each 256-wide attention
    # head rotated. rope_theta: Qwen3-Next-80B-A3B's. Mask id: the Qwen3 tokenizer's first unused id, as for the
    # Qwen3 targets (random weights; no official drafter config is read here).
    "qwen3-coder-next": ({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
                          "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
                          "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                          "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                          "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
                          "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                          "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
                          "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 10000000.0,
                          "partial_rotary_factor": 0.25, "max_position_embeddings": 262144,
                          "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645},
                         151669),
    # GLM-4.5-Air (zai-org/GLM-4.5-Air config.json): 46 layers, the first with a dense MLP (10,944 wide), the
    # others an MoE of 128 experts (8 per token, the sigmoid router with its correction bias, one group, not
    # scaled) and one shared expert of 1,408; 96 query heads of 128 over 8 kv heads, q/k/v biases, no q/k
    # norms, RoPE on half of each head. Its multi-token prediction layer is not part of the target. Mask
    # id: the last one (random weights; no official drafter config is read here).
    "glm-4.5-air": ({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552,
                     "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
                     "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
                     "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False,
                     "moe_intermediate_size": 1408, "n_routed_experts": 128, "num_experts_per_tok": 8,
                     "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                     "norm_topk_prob": True, "first_k_dense_replace": 1, "rms_norm_eps": 1e-5,
                     "rope_theta": 1000000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                     "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338]},
                    151551),
    # MiniMax-M2 (MiniMaxAI/MiniMax-M2 config.json): 62 layers, each an MoE of 256 experts of 1,536 (8 per
    # token, the sigmoid router with its correction bias); 48 query heads of 128 over 8 kv heads, q and k
    # each RMS-normalised over all heads, RoPE on 64 of each head's 128 dims. Released in FP8; here random
    # floats of the dequantised shapes. The drafter here gets the config's intermediate_size (the experts'
    # width; no official drafter config is read). Mask id: the last one.
    "minimax-m2": ({"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 200064,
                    "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
                    "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64,
                    "num_local_experts": 256, "num_experts_per_tok": 8, "use_qk_norm": True,
                    "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
                    "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "max_position_embeddings": 196608,
                    "tie_word_embeddings": False, "bos_token_id": 200034, "eos_token_id": 200020},
                   200063),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): 61 layers of multi-head latent attention (128 heads,
    # q through a 1536 low-rank path, a 512 kv latent + a 64-dim shared rotary key: 576 cached values per
    # token and layer), the first 3 with a dense MLP, then MoE layers of 256 experts (8 per token from 4 of 8
    # groups, sigmoid scores with a correction bias, x 2.5) and one shared expert; YaRN (factor 40 from 4,096,
    # mscale_all_dim 1 in the softmax scale). Its released weights are block-scaled FP8; here random floats.
    # --layers 4 keeps one MoE layer. head_dim and num_key_value_heads: the drafter's (the target reads
    # qk_rope_head_dim and one key per head). Mask id: the last one (no official drafter config is read).
    "deepseek-v3": ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
                     "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                     "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "head_dim": 128,
                     "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                     "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
                     "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                     "first_k_dense_replace": 3, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                     "rms_norm_eps": 1e-6, "rope_theta": 10000, "max_position_embeddings": 163840,
                     "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
                     "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1},
                    129279),
    # Kimi-K2.5's text model (DeepSeek-V3's architecture; Kimi-K2's shapes): 64 heads, 384 experts in one
    # group (8 per token, x 2.827), one dense layer first, rope theta 50,000 with YaRN (factor 64 from 4,096).
    # Its released routed experts are compressed-tensors INT4; here random floats. Mask id: the last one.
    "kimi-k2.5": ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
                   "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                   "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128,
                   "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                   "v_head_dim": 128, "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
                   "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "norm_topk_prob": True,
                   "first_k_dense_replace": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                   "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 262144,
                   "rope_scaling": {"type": "yarn", "factor": 64.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
                   "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163585},
                  163839),
    # gemma-4-31B-it's text model (its config.json nests these under text_config,
    # Gemma4ForConditionalGeneration): 60 layers, five sliding (window 1,024; 16 kv heads of 256) to one full
    # (4 kv heads of 512, keys and values from one projection, proportional RoPE on a quarter of each head),
    # logits softcapped at 30. layer_types are left to Gemma4TextConfig's default rule, which is the released
    # list and holds for any --layers (the last layer full). Mask id: the last one (random weights; no
    # official drafter config is read here).
    "gemma-4-31b": (_GEMMA4 | {"hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 60,
                               "num_attention_heads": 32, "num_key_value_heads": 16, "num_global_key_value_heads": 4},
                    262143),
    # gemma-4-26B-A4B-it's text model: 30 layers as gemma-4-31b's pattern (8 kv heads of 256 on sliding layers,
    # 2 of 512 on full ones), each with a dense GeGLU (2,112) and beside it the MoE block: 128 experts of 704,
    # 8 per token.
    "gemma-4-26b-a4b": (_GEMMA4 | {"hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
                                   "num_attention_heads": 16, "num_key_value_heads": 8,
                                   "num_global_key_value_heads": 2, "enable_moe_block": True, "num_experts": 128,
                                   "top_k_experts": 8, "moe_intermediate_size": 704},
                        262143),
    # SmolLM2-135M (the embedded GGUF's config: 30 layers, 9 query heads of 64 over 3 kv heads, tied
    # embeddings): small shapes for CPU runs. Mask id: the shipped SmolLM2 drafter's (2).
    "smollm2-135m": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
                      "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                      "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
                      "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
                      "bos_token_id": 1, "eos_token_id": 2},
                     2),
}
RANDOM_DRAFT_LAYERS = 5  # the official DFlash drafters of these targets
# The drafter generations `--random-drafter` builds, each with its released drafters' settings
# (`Generation.published`, `published_verify_block`): DFlash's block of 16; DFlash2's convolution and
# selector over a block of 8; DSpark's Markov and confidence heads over blocks of 7 slots, all
# proposing (8 verified). The names of `dflash_jax.drafters.generations`, kept here so that the CLI's
# --help loads no jax (tests/drafters/test_generations.py checks they agree).
DRAFTER_GENERATIONS = ("dflash", "dflash2", "dspark")


def random_params(shapes, seed: int, block_elements: int = 1 << 26):
    """Params of the given shapes (a pytree of ShapeDtypeStruct) drawn on the default device:
    normal(0, 0.02) weights, unit norm scales (leaves named "scale": a Qwen3.5 target's centred norms
    then scale by 2, which changes no cost). One leaf at a time, and a leaf of more than
    `block_elements` values in blocks of rows: drawing all at once holds every leaf's random bits
    together (30 GB for Qwen3.5-9B cut to 4 layers, whose two 248,320 x 4,096 tables dominate), and
    one draw of gemma-4-31b's 262,144 x 5,376 table holds its bits and float32 values beside it."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    @functools.partial(jax.jit, static_argnums=(1, 2, 3))
    def draw(key, shape, dtype, ones):
        return jnp.ones(shape, dtype) if ones else 0.02 * jax.random.normal(key, shape, dtype)

    def leaf(key, shape, dtype, ones):
        size = int(np.prod(shape))
        if ones or size <= block_elements or len(shape) < 2:
            return jax.block_until_ready(draw(key, shape, dtype, ones))
        rows = max(1, block_elements // (size // shape[0]))
        blocks = [jax.block_until_ready(draw(jax.random.fold_in(key, i), (min(rows, shape[0] - start), *shape[1:]),
                                             dtype, False))
                  for i, start in enumerate(range(0, shape[0], rows))]
        return jax.block_until_ready(jnp.concatenate(blocks))

    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return treedef.unflatten([
        leaf(k, tuple(s.shape), jnp.dtype(s.dtype), getattr(path[-1], "key", None) == "scale")
        for k, (path, s) in zip(keys, leaves)])


def random_configs(name: str, layers: int | None, block_size: int | None, generation: str = "dflash"):
    """(ModelConfig, DrafterConfig) of `name`'s official shapes, from their config.json values.
    `layers` cuts the target to that many layers (and the drafter to at most that many, its
    target layers spread over the cut target). `generation` (one of DRAFTER_GENERATIONS) makes the
    drafter a DFlash, DFlash2 or DSpark one with that generation's published settings; block_size
    is the number of tokens a cycle verifies (None: the generation's `published_verify_block`), so G gives a DFlash or
    DFlash2 block of G slots and a DSpark block of G - 1 (all of its slots propose)."""
    import numpy as np

    from dflash_jax.drafters import generations
    from dflash_jax.drafters.config import default_target_layer_ids, DrafterConfig
    from dflash_jax.models.config import ModelConfig

    kind = generations.get(generation)  # ValueError naming the known ones
    hf, mask_token_id = RANDOM_TARGETS[name]
    verify = block_size or kind.published_verify_block
    num_layers = layers or hf["num_hidden_layers"]
    config = ModelConfig.from_hf_config({**hf, "num_hidden_layers": num_layers})
    draft_layers = min(RANDOM_DRAFT_LAYERS, num_layers)
    if layers is None:
        layer_ids = default_target_layer_ids(num_layers, draft_layers)
    else:  # the official rule needs more layers than a cut target may have
        layer_ids = tuple(int(i) for i in np.linspace(0, num_layers - 1, draft_layers).round())
    drafter_config = DrafterConfig.from_hf_config({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        **{k: hf[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                              "vocab_size", "rms_norm_eps", "max_position_embeddings")},
        "intermediate_size": config.intermediate_size,  # the config's, or its stand-in (qwen3.5-35b-a3b)
        "rope_theta": config.rope_theta,
        "num_hidden_layers": draft_layers, "num_target_layers": num_layers, "block_size": verify,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)}})
    drafter_config = kind.published(drafter_config)
    return config, drafter_config


def random_models(name: str, layers: int | None, block_size: int | None, dtype: str, seed: int,
                  kv_cache_dtype: str = "auto", generation: str = "dflash"):
    """(target, drafter) of `random_configs`, random weights drawn on the device, no tokenizer."""
    from dflash_jax.formats.dtypes import resolve_dtype
    from dflash_jax.models.target import Target, target_param_shapes

    config, _ = random_configs(name, layers, block_size, generation)
    jdtype = resolve_dtype(dtype)
    target = Target(config=config, params=random_params(target_param_shapes(config, jdtype), seed),
                    dtype=jdtype, kv_cache_dtype=kv_cache_dtype)
    return target, random_drafter(name, layers, block_size, dtype, seed, generation)


def random_drafter(name: str, layers: int | None, block_size: int | None, dtype: str, seed: int,
                   generation: str = "dflash"):
    """The drafter of `random_configs` for `generation`, random weights (seed + 1) drawn on the device."""
    from dflash_jax.drafters.drafter import Drafter, drafter_param_shapes
    from dflash_jax.formats.dtypes import resolve_dtype

    _, drafter_config = random_configs(name, layers, block_size, generation)
    jdtype = resolve_dtype(dtype)
    return Drafter(config=drafter_config, dtype=jdtype,
                   params=random_params(drafter_param_shapes(drafter_config, jdtype), seed + 1))
