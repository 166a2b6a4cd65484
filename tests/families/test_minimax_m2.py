"""MiniMax-M2 targets, what is theirs alone: reading config.json (rotary_dim, MiniMaxM2Config's defaults, the
released config's own fields and what is refused by name), q and k normalised over all heads (against a
numpy reference, and with kv heads replicated for a tensor axis), the released checkpoint names and its
block-scaled FP8 loaded dequantised, an
8-device sharded generation equal to one device's, the minimax-m2 random-target preset, and (slow) drafter
training with a MiniMax-M2 target: the features it reads and a short run's falling loss. Parity with
transformers, the cached ragged prefill, speculative decoding with rejections and sampling are the
conformance suite's (the minimax_m2 row of support/families.py)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import sharding
from dflash_jax._errors import ConfigError
from dflash_jax.formats.names import target_rules
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.target import target_param_shapes, TargetSpec
from support import families
from support.devices import run_8_devices

MINIMAX = {"architectures": ["MiniMaxM2ForCausalLM"], **families.MINIMAX_M2}
# the released checkpoints' quantization_config (MiniMaxAI/MiniMax-M2's config.json)
MINIMAX_FP8 = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
               "weight_block_size": [128, 128],
               "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}


def test_config_reads_the_family_fields():
    cfg = ModelConfig.from_hf_config(MINIMAX)
    assert cfg.arch == "minimax_m2" and cfg.qk_norm and not cfg.attention_bias
    assert cfg.rotary_dim == 8 and cfg.partial_rotary_factor == 0.5  # rotary_dim 8 of head_dim 16
    moe = cfg.moe
    assert (moe.router, moe.num_experts, moe.intermediate_size, moe.norm_topk_prob, moe.norm_topk_eps) == (
        "sigmoid_grouped", 8, 16, True, 0.0)
    assert (moe.n_group, moe.routed_scaling_factor, moe.shared_expert_intermediate_size, moe.dense_layers) == (
        1, 1.0, 0, ())
    # MiniMaxM2Config's defaults where the config is silent: head_dim 128, rope_theta 5e6
    bare = {k: v for k, v in MINIMAX.items() if k not in ("head_dim", "rotary_dim")}
    cfg = ModelConfig.from_hf_config({**bare, "hidden_size": 256, "rotary_dim": 64})
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta) == (128, 64, 5e6)
    # the released config.json's own fields, at the values it computes with
    released = {**MINIMAX, "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                "use_routing_bias": True, "shared_intermediate_size": 0, "attn_type_list": [1, 1],
                "rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.5}}
    assert ModelConfig.from_hf_config(released).rope_theta == 1e6


@pytest.mark.parametrize("fields, message", [
    ({"use_qk_norm": False}, "use_qk_norm False is not supported for minimax_m2"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type 'per_head' is not supported"),
    ({"use_routing_bias": False}, "use_routing_bias False is not supported"),
    ({"shared_intermediate_size": 64}, "shared_intermediate_size 64 is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"attn_type_list": [0, 1]}, "lightning attention is not supported"),
    ({"partial_rotary_factor": 0.25}, "rotary_dim 8 and partial_rotary_factor 0.25 disagree"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}},
     "quantization_config.quant_method 'bitsandbytes' is not supported"),
    ({"quantization_config": {**MINIMAX_FP8, "weight_block_size": [1, 32]}}, "weight_block_size"),
    ({"quantization_config": {**MINIMAX_FP8, "scale_fmt": "ue8m0"}}, "scale_fmt 'ue8m0'"),
    ({"attention_bias": True}, "no attention biases"),
])
def test_config_refuses_what_it_cannot_compute(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config({**MINIMAX, **fields})


def test_checkpoint_names_are_the_released_ones():
    cfg = families.target_config("minimax_m2")
    names = {name for rule in target_rules(cfg) for name in rule.hf_names(cfg.num_layers)}
    layer = "model.layers.1"
    assert {f"{layer}.block_sparse_moe.gate.weight", f"{layer}.block_sparse_moe.e_score_correction_bias",
            f"{layer}.block_sparse_moe.experts.7.w1.weight", f"{layer}.block_sparse_moe.experts.7.w2.weight",
            f"{layer}.block_sparse_moe.experts.7.w3.weight", f"{layer}.self_attn.q_norm.weight",
            f"{layer}.self_attn.k_norm.weight"} <= names
    assert not any(".mlp." in n or "bias" in n.replace("e_score_correction_bias", "") for n in names)
    attn = target_param_shapes(cfg)["layers"]["self_attn"]
    assert attn["q_norm"]["scale"].shape == (2, 4 * 16) and attn["k_norm"]["scale"].shape == (2, 2 * 16)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_q_and_k_are_normalised_over_all_heads():
    """One layer's keys (what the cache keeps) against numpy: k_proj, ONE RMSNorm over the kv heads together,
    then RoPE on the first rotary_dim dims of each head (half-split)."""
    target = families.tiny_target("minimax_m2")
    cfg, p = target.config, target.params
    tokens = jnp.asarray([[4, 9, 17, 30, 2]], jnp.int32)
    _, _, cache = target.forward(p, tokens, target.init_cache(1, 8))
    x = np.asarray(p["embed_tokens"]["embedding"], np.float64)[np.asarray(tokens)[0]]
    layer = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64)[0], p["layers"])  # numpy's slice: no program
    h = _rms(x, layer["input_layernorm"]["scale"], cfg.rms_norm_eps)
    k = _rms(h @ layer["self_attn"]["k_proj"]["kernel"], layer["self_attn"]["k_norm"]["scale"], cfg.rms_norm_eps)
    k = k.reshape(5, cfg.num_kv_heads, cfg.head_dim)
    r = cfg.rotary_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, r, 2) / r)
    angles = np.arange(5)[:, None] * inv
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]
    rot = k[..., :r]
    rotated = np.concatenate([-rot[..., r // 2:], rot[..., :r // 2]], -1)
    want = np.concatenate([rot * cos + rotated * sin, k[..., r:]], -1)
    np.testing.assert_allclose(np.asarray(cache.k[0, 0, :5]), want, rtol=2e-5, atol=2e-5)


def test_replicated_kv_heads_compute_what_one_device_computes():
    """kv heads repeated for a tensor axis larger than them (`kv_replicas` 2): k is normalised over the kv heads
    before they are copied, and the logits are one device's."""
    target = families.tiny_target("minimax_m2")
    tokens = jnp.asarray([[3, 9, 4, 7, 1, 2]], jnp.int32)
    want, _, _ = target.forward(target.params, tokens)
    got, _, _ = TargetSpec(target.config, kv_replicas=2).forward(target.params, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def sharded_findings(out: str) -> None:
    """In an 8-device process: greedy speculative tokens of a tiny MiniMax-M2 target on one device and on an
    expert x tensor mesh of 2 x 4 (q and k norms over heads split 4 ways, each kv head replicated twice)."""
    from dflash_jax.engine.generator import Generator
    from support.speculative import tiny_drafter

    target = families.tiny_target("minimax_m2")
    drafter = tiny_drafter(target, block_size=4)
    prompts = [[3, 9, 4, 7], [5, 5, 20, 31, 2, 8, 11]]
    found = {"one": Generator(target, None, backend="xla").generate(prompts, max_new_tokens=12,
                                                                     stop_token_ids=()).tokens,
             "expert2_tensor4": Generator(target, drafter, mesh=sharding.make_mesh(data=1, tensor=4, expert=2))
             .generate(prompts, max_new_tokens=12, stop_token_ids=()).tokens}
    with open(out, "w") as f:
        json.dump(found, f)


@pytest.mark.slow  # make test-all; the sigmoid-routed MoE's 8-device run by default is test_deepseek_v3's
def test_sharded_generation_equals_one_device():
    found = run_8_devices("sharded_findings({out})", "test_minimax_m2")
    assert found["expert2_tensor4"] == found["one"]


def test_random_target_preset_builds_cut_to_a_few_layers():
    from dflash_jax.cli.bench_random import random_configs

    config, drafter = random_configs("minimax-m2", 2, None)
    assert (config.arch, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.rotary_dim, config.vocab_size) == ("minimax_m2", 2, 3072, 48, 8, 128, 64, 200064)
    assert (config.num_experts, config.moe.num_experts_per_tok, config.moe.intermediate_size) == (256, 8, 1536)
    shapes = target_param_shapes(config, "bfloat16")
    assert shapes["layers"]["mlp"]["down_proj"].shape == (2, 256, 1536, 3072)
    assert shapes["layers"]["self_attn"]["q_norm"]["scale"].shape == (2, 48 * 128)
    assert drafter.num_target_layers == 2 and drafter.mask_token_id == 200063
    full, _ = random_configs("minimax-m2", None, None)
    assert full.num_layers == 62 and full.max_position_embeddings == 196608


def test_fp8_checkpoint_loads_dequantised(tmp_path):
    """The released format: attention and experts float8_e4m3fn with float32 128 x 128 block scales
    (`weight_scale_inv`), the routers, correction biases, norms, embedding and head unquantised; loaded, the
    params are the float64 reference's dequantised weights bit for bit and the logits those of the model of the
    dequantised weights."""
    from support.fp8 import assert_loads_dequantised

    assert_loads_dequantised(tmp_path, {**MINIMAX, "quantization_config": MINIMAX_FP8}, "block", "minimax_m2")


@pytest.mark.slow  # ~30 s; the training machinery is every family's (test_moe_train runs it by default)
def test_drafter_training_reads_the_right_layers_and_learns(tmp_path):
    """`train.train` with a MiniMax-M2 target from its checkpoint directory: the features the online step and
    `train.cache_features` read are the outputs of the chosen layers, and the loss of a short run is finite and
    falls."""
    from support import family_training

    losses = family_training.check_features_then_train("minimax_m2", tmp_path, (0, 1), vocab=96, steps=16)
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses  # measured: 5.47 -> 2.79
