"""The sharding rules of `dflash_jax.sharding` in this process (one device; the 8-device checks are
tests/engine/test_sharded_generate.py's): parameter kinds declared as logical axes and mapped to the mesh
by one table; an undeclared weight is an error naming it; a family declares its own kinds; a tensor
axis that does not divide the query heads, or neither divides nor is a multiple of the kv heads, is
refused naming both numbers, and kv heads fewer than it are replicated; every parameter of every
family gets a spec on tensor=2 (a Qwen3.5 hybrid's Gated DeltaNet split); and the layouts a mesh
gives a model (kv heads repeated, Gated DeltaNet channels regrouped per shard) compute what one
device's layout computes.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import sharding
from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.drafters.drafter import drafter_param_shapes
from dflash_jax.models.config import LinearAttentionConfig, ModelConfig, MoEConfig
from dflash_jax.models.target import target_param_shapes, TargetSpec
from support.families import drawn_params
from support.tolerance import float32_atol, model_depth, model_summation_length

QWEN3 = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, qk_norm=True)
QWEN3_5 = ModelConfig(arch="qwen3_5", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=1, head_dim=8, qk_norm=True, partial_rotary_factor=0.25,
                      layer_types=("linear_attention", "full_attention"),
                      linear=LinearAttentionConfig(conv_kernel_dim=4, num_key_heads=2, num_value_heads=4,
                                                   key_head_dim=8, value_head_dim=8))
# one tiny config per family (the family test files' shapes, built here)
FAMILIES = {
    "qwen3": QWEN3,
    "llama": ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=1, head_dim=8, qk_norm=False, tie_word_embeddings=True),
    "qwen3_moe": dataclasses.replace(QWEN3, arch="qwen3_moe",
                                     moe=MoEConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=16,
                                                   norm_topk_prob=True)),
    "qwen3_5": QWEN3_5,
    "qwen3_5_moe": dataclasses.replace(QWEN3_5, arch="qwen3_5_moe",
                                       moe=MoEConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=16,
                                                     shared_expert_intermediate_size=16, norm_topk_prob=True)),
    "gpt_oss": ModelConfig.from_hf_config({
        "architectures": ["GptOssForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4, "max_position_embeddings": 256}),
}
DRAFTER = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                        vocab_size=64, num_target_layers=2, target_layer_ids=(0, 1), block_size=4, mask_token_id=63)


def spec(path, shape, config=QWEN3, tensor=2, expert=1):
    return tuple(sharding.param_spec(path, shape, config, tensor, expert))


def test_an_undeclared_weight_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"layers/mixer/w_in/kernel of shape \[2, 32, 64\]: no sharding rule"):
        spec(("layers", "mixer", "w_in", "kernel"), (2, 32, 64))
    with pytest.raises(ValueError, match=r"layers/mixer/w_in/kernel of shape \[2, 32, 64\]"):
        spec(("layers", "mixer", "w_in", "kernel"), (2, 32, 64), tensor=1)  # on any mesh
    assert spec(("mixer", "gain"), (32,)) == (None,)  # an undeclared vector: replicated
    with pytest.raises(ValueError, match=r"o_proj/kernel of shape \[2, 2, 32, 32\]: its declared axes"):
        spec(("layers", "self_attn", "o_proj", "kernel"), (2, 2, 32, 32))  # two stacked axes: not its kind


def test_a_family_declares_its_own_parameter_kinds():
    kind = ("mixer", "w_in", "kernel")
    try:
        sharding.declare_param_axes({kind: ("embed", "mlp")})
        assert spec(("layers", *kind), (2, 32, 64)) == (None, None, "tensor")
        sharding.declare_param_axes({kind: ("embed", "mlp")})  # the same again: fine
        with pytest.raises(ValueError, match="declared .* already"):
            sharding.declare_param_axes({kind: ("mlp", "embed")})
    finally:
        sharding.PARAM_AXES.pop(kind, None)
    with pytest.raises(ValueError, match=r"unknown logical axes \['heads'\]"):
        sharding.declare_param_axes({kind: ("embed", "heads")})
    assert kind not in sharding.PARAM_AXES


def test_the_logical_axes_map_to_the_mesh():
    assert spec(("layers", "self_attn", "q_proj", "kernel"), (2, 32, 32)) == (None, None, "tensor")
    assert spec(("layers", "self_attn", "o_proj", "kernel"), (2, 32, 32)) == (None, "tensor", None)
    assert spec(("layers", "self_attn", "k_proj", "kernel"), (2, 32, 16)) == (None, None, "tensor")
    assert spec(("layers", "mlp", "down_proj", "kernel"), (2, 64, 32)) == (None, "tensor", None)
    assert spec(("layers", "mlp", "gate_proj"), (2, 4, 32, 16), tensor=2, expert=4) == (None, "expert", None, "tensor")
    assert spec(("lm_head", "kernel"), (32, 64)) == (None, "tensor")
    assert spec(("lm_head", "kernel"), (32, 63)) == (None, None)  # a vocabulary it does not divide
    assert spec(("layers", "self_attn", "sinks"), (2, 4)) == (None, None)
    for name in sharding.LOGICAL_AXIS_RULES.values():
        assert name in (None, *sharding.AXES)
    for axes in sharding.PARAM_AXES.values():
        assert set(axes) <= set(sharding.LOGICAL_AXIS_RULES)


def test_kv_heads_fewer_than_the_tensor_axis_are_replicated():
    """2 kv heads on tensor=4 (a multiple): k_proj / v_proj replicated, the attention repeats each kv
    head twice; the query side split as ever."""
    assert spec(("layers", "self_attn", "k_proj", "kernel"), (2, 32, 16), tensor=4) == (None, None, None)
    assert spec(("layers", "self_attn", "v_proj", "bias"), (2, 16), tensor=4) == (None, None)
    assert spec(("layers", "self_attn", "q_proj", "kernel"), (2, 32, 32), tensor=4) == (None, None, "tensor")
    assert [sharding.kv_replicas(8, kv, t) for kv, t in ((8, 4), (2, 4), (1, 4), (2, 8), (8, 1))] == [1, 2, 4, 4, 1]


def test_a_tensor_axis_the_heads_do_not_take_is_refused_naming_both_numbers():
    six_heads = dataclasses.replace(QWEN3, num_heads=6, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"q_proj/kernel of shape \[2, 32, 48\]: its 6 query heads are not a "
                                         r"multiple of the mesh's tensor axis of size 4; choose a tensor size "
                                         r"that divides 6"):
        spec(("layers", "self_attn", "q_proj", "kernel"), (2, 32, 48), six_heads, tensor=4)
    neither = dataclasses.replace(QWEN3, num_heads=12, num_kv_heads=6)
    with pytest.raises(ValueError, match=r"k_proj/kernel of shape \[2, 32, 48\]: its 6 kv-heads are neither a "
                                         r"multiple nor a divisor of the mesh's tensor axis of size 4"):
        spec(("layers", "self_attn", "k_proj", "kernel"), (2, 32, 48), neither, tensor=4)
    with pytest.raises(ValueError, match="drafter: its 6 query heads .* tensor axis of size 4"):
        sharding.kv_replicas(6, 2, 4, "drafter")


def _family_specs(shapes, config, tensor, expert):
    return {jax.tree_util.keystr(path): tuple(sharding.param_spec(path, leaf.shape, config, tensor, expert))
            for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_parameter_of_every_family_has_a_spec(family):
    """Every weight of each family's target (and a drafter) gets a spec on tensor=2 (and expert=2):
    none undeclared; the stacked layer axis never split; a hybrid's Gated DeltaNet weights split."""
    config = FAMILIES[family]
    expert = 2 if config.num_experts else 1
    specs = _family_specs(target_param_shapes(config), config, 2, expert)
    drafter = dataclasses.replace(DRAFTER, num_kv_heads=config.num_kv_heads)
    specs.update(_family_specs(drafter_param_shapes(drafter), drafter, 2, 1))
    assert all(s[0] is None for name, s in specs.items() if name.startswith("['layers']")), specs
    assert any("tensor" in s for s in specs.values())
    if config.is_hybrid_arch:
        linear = {name: s for name, s in specs.items() if "linear_attn" in name}
        assert len(linear) == 9, linear
        for name, s in linear.items():
            assert ("tensor" in s) == ("'norm'" not in name), (name, s)


def test_gated_deltanet_is_replicated_where_the_tensor_axis_does_not_divide_its_key_heads():
    specs = _family_specs(target_param_shapes(QWEN3_5), QWEN3_5, 4, 1)  # 2 key heads, tensor=4
    linear = {name: s for name, s in specs.items() if "linear_attn" in name}
    assert linear and all("tensor" not in s for s in linear.values()), linear
    assert sharding.linear_groups(QWEN3_5, 4) == 1 and sharding.linear_groups(QWEN3_5, 2) == 2
    assert sharding.linear_groups(QWEN3, 2) == 1  # no Gated DeltaNet


def test_grouped_channels_give_each_shard_its_own_heads():
    """The order regrouping in_proj_qkv's columns and conv1d's channels for 2 shards: each half holds
    its q, k and v heads, and the model's split of the grouped channels gives the checkpoint's q, k, v."""
    from dflash_jax.families.qwen3_5 import split_qkv

    order = sharding.linear_channel_order(QWEN3_5, 2)  # q, k: 2 heads x 8; v: 4 heads x 8
    assert sorted(order) == list(range(64))
    first = set(order[:32].tolist())
    assert first == set(range(0, 8)) | set(range(16, 24)) | set(range(32, 48))  # q0, k0, v0 v1
    channels = jnp.arange(64.0)[None, None]
    for got, want in zip(split_qkv(channels[..., order], 2, 16), jnp.split(channels, [16, 32], axis=-1)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(sharding.linear_channel_order(QWEN3_5, 1), np.arange(64))


@functools.partial(jax.jit, static_argnums=0)
def _forward(spec, params, tokens):
    """Prefill `tokens` through a cache, then one more token: (logits of both, the cache)."""
    cache = spec.init_cache(tokens.shape[0], 16)
    hidden, _, cache = spec.forward(params, tokens[:, :-1], cache)
    last, _, cache = spec.forward(params, tokens[:, -1:], cache)
    return spec.logits(params, jnp.concatenate([hidden, last], axis=1)), cache


@pytest.mark.parametrize("family", [
    "qwen3",
    # make test-all: covered by default: test_sharded_generate.py::
    # test_kv_heads_fewer_than_the_tensor_axis_are_replicated_and_agree[qwen3_5_kv1-tensor2_data4-*] (the same
    # layout, a 1-kv-head hybrid's kv heads in 2 copies and its Gated DeltaNet regrouped for 2 shards, run on
    # tensor=2: one device's greedy tokens, plain and speculative) and ::test_gated_deltanet_is_split_over_tensor_
    # in_the_compiled_programs (its conv tail and state per shard); qwen3 here keeps the one-device check
    pytest.param("qwen3_5", marks=pytest.mark.slow),
])
def test_a_mesh_layout_computes_what_one_device_computes(family):
    """kv heads repeated (2 copies: tensor=4 over 2 kv heads, or 2 over 1) and, for the hybrid, its
    Gated DeltaNet params regrouped for 2 shards: the logits of one device's layout, and a cache of
    the kv heads' copies, on one device."""
    config = FAMILIES[family]
    params = drawn_params(target_param_shapes(config), scale=0.18)  # the initialiser's spread at these widths
    tokens = jnp.asarray([[3, 9, 4, 7, 1, 2], [5, 5, 20, 31, 2, 8]], jnp.int32)
    want, cache = _forward(TargetSpec(config), params, tokens)
    groups = 2 if config.is_hybrid_arch else 1
    laid_out = TargetSpec(config, kv_replicas=2, linear_groups=groups)
    got, replicated_cache = _forward(laid_out, sharding.regroup_linear(params, config, groups), tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=float32_atol(want, model_summation_length(config, 6),
                                                                     model_depth(config)))
    kv = getattr(cache, "kv", cache)
    replicated = getattr(replicated_cache, "kv", replicated_cache)
    assert replicated.k.shape[3] == 2 * kv.k.shape[3]
    np.testing.assert_allclose(replicated.k[..., ::2, :], kv.k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(replicated.k[..., 1::2, :], kv.k, rtol=1e-6, atol=1e-6)
    if groups > 1:  # the conv tails in the grouped channel order
        order = sharding.linear_channel_order(config, groups)
        np.testing.assert_allclose(replicated_cache.conv, cache.conv[..., order], rtol=1e-6, atol=1e-6)
