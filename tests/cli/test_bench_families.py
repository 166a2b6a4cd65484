"""The random-target benchmark presets of the newer families cut to the layer counts a CPU can hold
(docs/results/families-cpu.md): each builds its param shapes at one and two layers, and a hybrid cut
to fewer layers than its attention interval (Gated DeltaNet layers only, no attention layer, as
`--random-target qwen3-coder-next --layers 1` is) decodes as transformers' model of that config."""
import jax
import numpy as np
import pytest

from support import families

PROMPTS = [list(map(int, np.random.default_rng(5).integers(0, 40, size=n))) for n in (2, 11, 19)]
PRESETS = ("qwen3-coder-next", "glm-4.5-air", "minimax-m2", "deepseek-v3", "kimi-k2.5", "gemma-4-31b",
           "gemma-4-26b-a4b")


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("preset", PRESETS)
def test_cut_presets_build_their_param_and_cache_shapes(preset, layers):
    """Shapes only (nothing drawn): the cut target's params and its decode cache, and the drafter's."""
    from dflash_jax.cli.bench_memory import cache_bytes_per_token
    from dflash_jax.cli.bench_random import random_configs
    from dflash_jax.drafters.drafter import drafter_param_shapes
    from dflash_jax.models.target import target_param_shapes, TargetSpec

    config, drafter_config = random_configs(preset, layers, None)
    assert config.num_layers == layers
    assert jax.tree_util.tree_leaves(target_param_shapes(config))
    assert jax.tree_util.tree_leaves(drafter_param_shapes(drafter_config))
    spec = TargetSpec(config)
    assert cache_bytes_per_token(spec) >= 0
    if config.is_hybrid_arch and "full_attention" not in config.layer_types:
        assert cache_bytes_per_token(spec) == 0  # recurrent states only: nothing grows per token


def test_random_params_draws_big_leaves_in_blocks_of_rows():
    """A leaf over the block limit (gemma-4-31b's 262,144 x 5,376 table) is drawn a block of rows at a
    time: the same shape and dtype, scales still ones, the blocks independent draws of normal(0, 0.02)."""
    import jax.numpy as jnp

    from dflash_jax.cli.bench_random import random_params

    shapes = {"embed": jax.ShapeDtypeStruct((1000, 64), jnp.bfloat16), "norm": {"scale": jax.ShapeDtypeStruct(
        (64,), jnp.bfloat16)}, "small": jax.ShapeDtypeStruct((3, 4), jnp.float32)}
    whole = random_params(shapes, 0)
    blocked = random_params(shapes, 0, block_elements=64 * 300)
    assert jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), blocked) == jax.tree_util.tree_map(
        lambda s: (s.shape, s.dtype), shapes)
    assert np.all(np.asarray(blocked["norm"]["scale"]) == 1)
    np.testing.assert_array_equal(np.asarray(blocked["small"]), np.asarray(whole["small"]))
    table = np.asarray(blocked["embed"], np.float32)
    assert abs(table.std() - 0.02) < 0.001 and abs(table.mean()) < 0.001
    heads = [table[start:start + 100] for start in (0, 300, 600, 900)]  # four blocks: none repeats another
    assert all(not np.array_equal(heads[i], heads[j]) for i in range(4) for j in range(i + 1, 4))
    assert not np.array_equal(table, np.asarray(whole["embed"], np.float32))


def hf_greedy(model, prompts, max_new_tokens):
    """transformers' greedy continuation of each prompt alone, each token from a full forward of the
    sequence so far (its `generate` needs an attention layer in the cache to size its mask)."""
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(max_new_tokens):
                ids.append(int(model(torch.as_tensor([ids]), use_cache=False).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


def _linear_only(tmp_path):
    """Qwen3-Next cut to 2 layers under its interval of 4: both Gated DeltaNet, no KV cache at all ->
    (our target, transformers' model)."""
    pytest.importorskip("torch")  # transformers' model (no torch on the newer-jax leg)
    from dflash_jax import load_target

    model = families.make_hf("qwen3_next", tmp_path, num_hidden_layers=2, full_attention_interval=4)
    target = load_target(tmp_path, tokenizer=False)
    assert target.config.layer_types == ("linear_attention", "linear_attention")
    return target, model


def test_hybrid_of_linear_layers_only_decodes_as_transformers(tmp_path):
    """Plain greedy decoding of a stack with no attention layer equals transformers' generate."""
    from dflash_jax.engine.generator import generate

    target, model = _linear_only(tmp_path)
    assert generate(target, None, PROMPTS, max_new_tokens=12, stop_token_ids=()).tokens == hf_greedy(model, PROMPTS, 12)


@pytest.mark.slow
def test_hybrid_of_linear_layers_only_decodes_speculatively_as_transformers(tmp_path):
    """The same speculatively (a random drafter of block 4, so drafts are rejected at every kind of
    place and the recurrent states rolled back)."""
    from dflash_jax.engine.generator import generate
    from support.speculative import tiny_drafter

    target, model = _linear_only(tmp_path)
    drafter = tiny_drafter(target, block_size=4, seed=3)
    assert generate(target, drafter, PROMPTS, max_new_tokens=12, stop_token_ids=()).tokens == \
        hf_greedy(model, PROMPTS, 12)


@pytest.mark.parametrize("preset, layers, moe_layers", [("deepseek-v3", 1, 0), ("deepseek-v3", 4, 1),
                                                        ("glm-4.5-air", 1, 0),
                                                        ("glm-4.5-air", 2, 1), ("qwen3-coder-next", 1, 1),
                                                        ("gemma-4-26b-a4b", 2, 2)])
def test_profile_cycle_counts_only_the_moe_layers_experts(preset, layers, moe_layers):
    """profile_cycle's expert bytes: one expert's three projections, over the MoE layers of the cut target only
    (a dense prefix holds none)."""
    from infer.profile_cycle import expert_bytes, random_target_config

    config = random_target_config(preset, layers)
    per_expert, count = expert_bytes(config, "bfloat16")
    assert count == moe_layers
    expect = 0 if config.moe is None else 3 * config.hidden_size * config.moe.intermediate_size * 2  # bfloat16
    assert per_expert == expect


@pytest.mark.parametrize("preset, layers", [("gemma-4-26b-a4b", 2), ("gemma-4-31b", 1), ("deepseek-v3", 1),
                                            ("glm-4.5-air", 1), ("qwen3-coder-next", 1), ("qwen3-8b", 2)])
def test_profile_cycle_cuts_a_random_target_as_the_benchmark_does(preset, layers):
    """`profile_cycle --random-target P --layers N` times the target `infer.benchmark` runs: the
    preset's config with N layers (Gemma 4's last layer full, DeepSeek-V3's dense prefix without
    experts), not the first N layers of the full config."""
    from dflash_jax.cli.bench_random import random_configs
    from infer.profile_cycle import random_target_config

    config = random_target_config(preset, layers)
    assert config == random_configs(preset, layers, None)[0]
    assert config.num_layers == layers
    if config.arch == "gemma4":
        assert config.layer_types[-1] == "full_attention"
    if preset == "deepseek-v3":
        assert config.num_experts == 0 and set(config.mlp_kinds) == {"dense"}
