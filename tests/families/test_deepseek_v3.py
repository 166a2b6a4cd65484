"""DeepSeek-V3 / Kimi-K2 (`dflash_jax.families.deepseek_v3`): what only this family has. Multi-head latent
attention read from a latent cache step by step against transformers' materialised keys and values,
the cache's size, the softmax scale, the config fields it refuses, the multi-token prediction layers a
checkpoint carries, its sharding declarations. The conformance suite (tests/support/families.py's
deepseek_v3 row) covers the parity, prefill, greedy and speculative checks."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import families, fp8
from support.families import DEEPSEEK_V3

from dflash_jax._errors import ConfigError
from dflash_jax.families.deepseek_v3 import LatentCache
from dflash_jax.models.cache import Cache
from dflash_jax.models.config import ModelConfig
from support.tolerance import assert_model_close

ARCH = {"architectures": ["DeepseekV3ForCausalLM"]}


# [plain-q] under make test-all: covered by default by [q-lora] (the same latent cache, decoded step by step) and
# the conformance row's logits of its plain-q variant (the query projection, one pass)
@pytest.mark.parametrize("q_lora_rank", [pytest.param(None, marks=pytest.mark.slow), 16], ids=["plain-q", "q-lora"])
def test_latent_cache_decode_equals_transformers_step_by_step(q_lora_rank, tmp_path):
    """A prompt through the cache, then one token at a time: each step's logits equal transformers'
    cached decoding, whose cache expands the latent into every head's keys and values."""
    torch = pytest.importorskip("torch")  # the jax-latest leg has none

    from dflash_jax import load_target

    model = families.make_hf("deepseek_v3", tmp_path, q_lora_rank=q_lora_rank)
    target = load_target(tmp_path, tokenizer=False)
    assert (target.config.mla.q_lora_rank or None) == q_lora_rank
    ids = np.random.default_rng(2).integers(0, 96, size=(1, 16))

    @jax.jit  # forward and logits in one program per token count (the prompt's, a step's)
    def step(params, tokens, cache):
        hidden, _, cache = target.forward(params, tokens, cache)
        return target.logits(params, hidden), cache

    logits, cache = step(target.params, jnp.asarray(ids[:, :6], jnp.int32), target.init_cache(1, 32))
    assert isinstance(cache, LatentCache)
    ours = [np.asarray(logits)[0]]
    for i in range(6, 16):
        logits, cache = step(target.params, jnp.asarray(ids[:, i:i + 1], jnp.int32), cache)
        ours.append(np.asarray(logits)[0])
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids[:, :6]), use_cache=True)
        theirs, past = [out.logits[0].numpy()], out.past_key_values
        for i in range(6, 16):
            out = model(input_ids=torch.as_tensor(ids[:, i:i + 1]), cache=past, use_cache=True)
            theirs.append(out.logits[0].numpy())
            past = out.past_key_values
    assert_model_close(np.concatenate(ours), np.concatenate(theirs), target.config, tokens=16)


def test_cache_bytes_per_token_are_the_latents():
    """Per layer and token the cache holds kv_lora_rank + qk_rope_head_dim values: 576 for DeepSeek-V3's
    shapes, where materialised heads would hold 128 x (192 + 128)."""
    config = families.target_config("deepseek_v3")
    cache = families.tiny_target("deepseek_v3").init_cache(2, 64)
    mla = config.mla
    assert cache.kv.shape == (config.num_layers, 2, 64, 1, mla.kv_lora_rank + mla.qk_rope_head_dim)
    assert cache.kv.nbytes == config.num_layers * 2 * 64 * (16 + 4) * 4
    real = ModelConfig.from_hf_config({**ARCH, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                                       "num_hidden_layers": 61, "num_attention_heads": 128,
                                       "moe_intermediate_size": 2048, "n_routed_experts": 256})
    shape = jax.eval_shape(lambda: LatentCache.for_model(real, 1, 1024, jnp.bfloat16)).kv.shape
    assert shape == (61, 1, 1024, 1, 576)
    assert real.num_heads * (real.mla.qk_head_dim + real.mla.v_head_dim) == 40960  # materialised: 71 x more


def test_latent_cache_is_a_cache_and_rolls_back_by_length():
    from jax.sharding import Mesh

    from dflash_jax.sharding import cache_shardings

    cache = LatentCache.for_model(families.target_config("deepseek_v3"), 3, 16)
    assert isinstance(cache, Cache)
    rows = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3, 4, 1, 20)), jnp.float32)
    committed = cache.commit((rows, None), jnp.asarray([4, 2, 0]))
    assert committed.lengths.tolist() == [4, 2, 0] and committed.capacity == 16
    np.testing.assert_array_equal(np.asarray(committed.kv[:, 0, :4]), np.asarray(rows[:, 0]))
    assert committed.with_lengths(jnp.asarray([1, 1, 1])).lengths.tolist() == [1, 1, 1]
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "expert", "tensor"))
    placed = cache_shardings(mesh, cache)
    assert jax.tree_util.tree_structure(placed) == jax.tree_util.tree_structure(cache)


def test_softmax_scale_is_transformers_scaling():
    """qk_head_dim^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2 (`yarn_apply_mscale`), as
    `DeepseekV3Attention.scaling`; the plain rope's is qk_head_dim^-0.5."""
    pytest.importorskip("torch")  # transformers' model classes need it; the jax-latest leg has none
    transformers = pytest.importorskip("transformers")
    from dflash_jax.families.deepseek_v3 import softmax_scale

    rope = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32,
            "beta_slow": 1, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    for extra in ({}, {"rope_parameters": rope}):
        hf = {**DEEPSEEK_V3, **extra}
        attn = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf)).model.layers[0].self_attn
        assert softmax_scale(ModelConfig.from_hf_config({**ARCH, **hf})) == pytest.approx(attn.scaling, rel=1e-12)


@pytest.mark.parametrize("extra, named", [
    ({"index_topk": 2048, "index_n_heads": 64}, "index_topk, index_n_heads"),
    ({"quantization_config": {"quant_method": "awq"}}, "'awq'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "weight_block_size"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"topk_method": "greedy"}, "topk_method 'greedy'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_configs_it_cannot_run_are_refused_by_name(extra, named):
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf_config({**ARCH, **DEEPSEEK_V3, **extra})


def test_config_reads_transformers_fields():
    """head_dim is the rotary part, kv heads are the query heads (whatever num_key_value_heads says), the
    router's fields, a dense prefix, no MoE where every layer is dense."""
    config = ModelConfig.from_hf_config({**ARCH, **DEEPSEEK_V3, "num_key_value_heads": 1})
    assert (config.head_dim, config.num_kv_heads, config.mla.q_lora_rank) == (4, 4, 16)
    moe = config.moe
    assert (moe.router, moe.n_group, moe.topk_group, moe.routed_scaling_factor) == ("sigmoid_grouped", 4, 2, 2.5)
    assert moe.dense_layers == (0,) and moe.shared_expert_intermediate_size == 16 and not moe.shared_expert_gate
    assert config.mlp_kinds == ("dense", "moe", "moe")
    dense = ModelConfig.from_hf_config({**ARCH, **DEEPSEEK_V3, "first_k_dense_replace": 3})
    assert dense.moe is None and dense.mlp_kinds == ("dense",) * 3


def test_multi_token_prediction_layers_are_not_read(tmp_path):
    """A checkpoint's layers past num_hidden_layers (DeepSeek-V3's MTP module, `model.layers.61.*`) are
    skipped; any other extra tensor still fails."""
    from safetensors.numpy import load_file, save_file

    from dflash_jax import load_target
    from dflash_jax._errors import CheckpointError

    families.make_hf("deepseek_v3", tmp_path, variant="dense")
    tensors = load_file(tmp_path / "model.safetensors")
    extra = {"model.layers.3.eh_proj.weight": np.ones((4, 4), np.float32),
             "model.layers.3.self_attn.kv_b_proj.weight": np.ones((4, 4), np.float32)}
    save_file({**tensors, **extra}, tmp_path / "model.safetensors")
    target = load_target(tmp_path, tokenizer=False)
    assert target.config.num_layers == 3
    save_file({**tensors, **extra, "model.extra.weight": np.ones((2,), np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        load_target(tmp_path, tokenizer=False)


def test_every_weight_has_a_sharding_rule():
    """MLA's projections are declared: the low-rank ones replicated, q_b_proj / kv_b_proj split by query
    heads, as q_proj and o_proj; the correction bias replicated."""
    from dflash_jax.sharding import param_axes

    target = families.tiny_target("deepseek_v3")
    axes = {"/".join(str(k.key) for k in path): param_axes(path, leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(target.params)}
    assert axes["layers_1/layer_0/self_attn/kv_b_proj/kernel"] == (None, "latent", "q_heads")
    assert axes["layers_1/layer_0/self_attn/q_b_proj/kernel"] == (None, "latent", "q_heads")
    assert axes["layers_1/layer_0/self_attn/kv_a_proj_with_mqa/kernel"] == (None, "embed", "latent")
    assert axes["layers_1/layer_0/mlp/e_score_correction_bias"] == (None, "router")


# ---------------------------------------------------------------------------------------------
# DeepSeek's block-scaled FP8 checkpoints


def test_fp8_block_dequantisation_is_the_reference_bit_for_bit():
    """Random e4m3 weights (every finite code, edge blocks partial both ways) and random float32 scales:
    the dequantised float32 equals the float64 product rounded once, whole or a few rows at a time."""
    import ml_dtypes

    from dflash_jax.formats.fp8_block import Fp8BlockTensor

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(300, 200), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes
    weight = codes.view(ml_dtypes.float8_e4m3fn)
    scale = (rng.random((3, 2)) * 2.0 ** rng.integers(-20, 5, size=(3, 2))).astype(np.float32)
    expected = fp8.float64_block(weight, scale)
    tensor = Fp8BlockTensor(weight, scale, "w")
    np.testing.assert_array_equal(np.asarray(tensor).view(np.uint32), expected.view(np.uint32))
    for rows in (slice(0, 128), slice(130, 290), slice(256, 300), slice(5, 6)):
        np.testing.assert_array_equal(tensor.first_axis(rows).view(np.uint32), expected[rows].view(np.uint32))


def test_fp8_checkpoint_loads_dequantised(tmp_path):
    """A checkpoint whose Linear weights are block-scaled FP8 (quantization_config fp8, 128 x 128; the tiny
    model's blocks all partial) loads each weight as its dequantised values, whole and through a mesh's
    per-device placement, and the router, norms, embedding and head as saved."""
    import json

    from jax.sharding import Mesh
    from safetensors.numpy import load_file, save_file

    from dflash_jax import load_target
    from dflash_jax.formats.fp8_block import dequantize_block_fp8
    from dflash_jax.formats.names import params_to_hf, target_rules

    families.make_hf("deepseek_v3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    quantised, expected = {}, dict(tensors)
    for name, value in tensors.items():
        if value.ndim == 2 and ("self_attn." in name or "experts" in name) and name.endswith("proj.weight"):
            weight, scale = fp8.quantise_block(value)
            quantised[name], quantised[name.replace(".weight", ".weight_scale_inv")] = weight, scale
            expected[name] = dequantize_block_fp8(weight, scale)
    assert len(quantised) > 20
    save_file({**tensors, **quantised}, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "expert", "tensor"))
    for target in (load_target(tmp_path, tokenizer=False), load_target(tmp_path, tokenizer=False, mesh=mesh)):
        exported = params_to_hf(target_rules(target.config), target.params, target.config.num_layers)
        assert sorted(exported) == sorted(expected)
        for name, value in exported.items():
            np.testing.assert_array_equal(value, expected[name], err_msg=name)


@pytest.mark.parametrize("tensor, scheme", [("model.layers.0.mlp.down_proj.qweight", "is quantised as GPTQ / AWQ"),
                                            ("model.layers.1.mlp.experts.0.up_proj.weight_zero_point",
                                             r"is quantised as compressed-tensors with zero points \(asymmetric\)"),
                                            ("model.layers.0.self_attn.indexer.wq_b.weight",
                                             "belongs to DeepSeek-V3.2's sparse-attention indexer")])
def test_a_quantisation_scheme_it_does_not_read_is_named(tmp_path, tensor, scheme):
    """So are DeepSeek-V3.2's indexer tensors."""
    from safetensors.numpy import load_file, save_file

    from dflash_jax import load_target
    from dflash_jax._errors import CheckpointError

    families.make_hf("deepseek_v3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, tensor: np.zeros((2, 2), np.int32)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{tensor} {scheme}"):
        load_target(tmp_path, tokenizer=False)


@pytest.mark.parametrize("name, heads, experts, dense", [("deepseek-v3", 128, 256, 3), ("kimi-k2.5", 64, 384, 1)])
def test_random_target_presets_have_the_released_shapes(name, heads, experts, dense):
    """`--random-target deepseek-v3` / `kimi-k2.5` cut to 4 layers: MLA of the released sizes (a 576-value
    latent cache per token and layer), the dense prefix, the routed experts."""
    from dflash_jax.cli.bench_random import random_configs

    config, drafter = random_configs(name, 4, None)
    assert (config.num_heads, config.num_experts, config.moe.dense_layers) == (heads, experts, tuple(range(dense)))
    assert config.mla.latent_dim == 576 and config.mla.q_lora_rank == 1536 and config.hidden_size == 7168
    assert drafter.hidden_size == 7168 and drafter.num_target_layers == 4


def test_kimi_k2_5_checkpoint_reads_its_language_model(tmp_path):
    """Kimi-K2.5's multimodal checkpoint (`KimiK25ForConditionalGeneration`): the config's text_config, the
    text model under `language_model.model.` with its head `language_model.lm_head.weight`, the vision tower
    and projector not read; the logits are the text model's."""
    import json

    torch = pytest.importorskip("torch")  # the jax-latest leg has none
    from safetensors.numpy import load_file, save_file

    from dflash_jax import load_target
    from dflash_jax.formats.names import params_to_hf, target_rules

    model = families.make_hf("deepseek_v3", tmp_path)
    text = json.loads((tmp_path / "config.json").read_text())
    tensors = {("language_model.lm_head.weight" if n == "lm_head.weight" else f"language_model.{n}"): v
               for n, v in load_file(tmp_path / "model.safetensors").items()}
    vision = {"vision_tower.patch_embed.proj.weight": np.ones((4, 3), np.float32),
              "mm_projector.proj.0.weight": np.ones((4, 4), np.float32)}
    save_file({**tensors, **vision}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
        "vision_config": {"patch_size": 14}, "tie_word_embeddings": False}))
    target = load_target(tmp_path, tokenizer=False)
    assert target.config.arch == "deepseek_v3" and target.config.num_experts == 8
    ids = np.random.default_rng(3).integers(0, 96, size=(1, 12))
    logits = jax.jit(lambda params, tokens: target.logits(params, target.forward(params, tokens)[0]))(
        target.params, jnp.asarray(ids, jnp.int32))  # forward and logits in one program
    with torch.no_grad():
        expected = model(input_ids=torch.as_tensor(ids)).logits.numpy()
    assert_model_close(np.asarray(logits), expected, target.config, tokens=12)
    exported = params_to_hf(target_rules(target.config, "language_model.model."), target.params,
                            target.config.num_layers)
    assert sorted(exported) == sorted(tensors)


# ---------------------------------------------------------------------------------------------
# Kimi's compressed-tensors pack-quantized INT4 experts


def _pack_int4(values: np.ndarray) -> np.ndarray:
    """int [R, C] in -8 .. 7 -> int32 [R, ceil(C / 8)]: value c in word c // 8, bits 4 (c % 8) .., stored + 8."""
    rows, cols = values.shape
    words = np.zeros((rows, -(-cols // 8)), np.uint32)
    for c in range(cols):
        words[:, c // 8] |= (values[:, c].astype(np.int64) + 8).astype(np.uint32) << np.uint32(4 * (c % 8))
    return words.view(np.int32)


def _int4_quantise(weight: np.ndarray, group: int):
    """(packed, bfloat16 scales [R, C / group], shape) of a float32 matrix, symmetric groups."""
    import ml_dtypes

    rows, cols = weight.shape
    grouped = weight.reshape(rows, cols // group, group)
    scale = (np.abs(grouped).max(-1) / 7.0 + 1e-8).astype(ml_dtypes.bfloat16)
    values = np.clip(np.round(grouped / scale.astype(np.float32)[..., None]), -8, 7).reshape(rows, cols)
    return _pack_int4(values), scale, np.asarray([rows, cols], np.int32)


def test_int4_pack_dequantisation_is_the_reference_bit_for_bit():
    """Random 4-bit values (a row length that leaves the last word part empty) and random bfloat16 group
    scales: the dequantised weight equals the float64 product rounded once to bfloat16, whole or by rows."""
    import ml_dtypes

    from dflash_jax.formats.int4_pack import Int4PackedTensor

    rng = np.random.default_rng(1)
    values = rng.integers(-8, 8, size=(6, 70))
    scale = (rng.standard_normal((6, 7)) * 2.0 ** rng.integers(-12, 4, size=(6, 7))).astype(ml_dtypes.bfloat16)
    expected = (values * np.repeat(scale.astype(np.float64), 10, axis=1)).astype(ml_dtypes.bfloat16)
    tensor = Int4PackedTensor(_pack_int4(values), scale, np.asarray([6, 70]), "w")
    assert tensor.shape == (6, 70) and tensor.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(tensor).view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(tensor.first_axis(slice(2, 5)).view(np.uint16), expected[2:5].view(np.uint16))


def test_int4_expert_checkpoint_loads_dequantised(tmp_path):
    """A checkpoint whose routed experts are compressed-tensors pack-quantized INT4 (groups of 8) loads
    them as their dequantised values; a scheme with zero points is refused by name."""
    import json

    from safetensors.numpy import load_file, save_file

    from dflash_jax import load_target
    from dflash_jax.formats.int4_pack import dequantize_int4
    from dflash_jax.formats.names import params_to_hf, target_rules

    families.make_hf("deepseek_v3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    stored, expected = {}, {}
    for name, value in tensors.items():
        if ".mlp.experts." in name and name.endswith(".weight"):
            packed, scale, shape = _int4_quantise(value, 8)
            base = name[:-len(".weight")]
            stored.update({f"{base}.weight_packed": packed, f"{base}.weight_scale": scale,
                           f"{base}.weight_shape": shape})
            expected[name] = dequantize_int4(packed, scale, shape[1]).astype(np.float32)
        else:
            stored[name] = expected[name] = value
    assert len(expected) < len(stored)
    save_file(stored, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 8}
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                     "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                   "input_activations": None}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    target = load_target(tmp_path, tokenizer=False)
    exported = params_to_hf(target_rules(target.config), target.params, target.config.num_layers)
    assert sorted(exported) == sorted(expected)
    for name, value in exported.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    weights["symmetric"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="config_groups.group_0: compressed-tensors scheme {'symmetric': False}"):
        load_target(tmp_path, tokenizer=False)


# ---------------------------------------------------------------------------------------------
# On a device mesh


# The default suite runs DeepSeek-V3 on MESHES, `make test-all` on MORE_MESHES too: heads over a tensor axis
# of 4 (one per device) with the experts replicated over `expert`. The default mesh runs the same rules (MLA's
# heads and each expert's width over `tensor`, the latent cache by rows over `data`) with the experts over
# `expert` besides.
MESHES = {"expert2_tensor2_data2": dict(expert=2, tensor=2, data=2)}
MORE_MESHES = {"tensor4_data2": dict(tensor=4, data=2)}


def sharded_run(out: str, meshes: str = "MESHES") -> None:
    """(In a subprocess with 8 CPU devices: `support.devices.run_8_devices`.) Greedy speculative tokens of
    the row's tiny MoE target and a random drafter on one device and on the meshes of `meshes` (MESHES or
    MORE_MESHES: experts over `expert`, heads over `tensor`, rows over `data`), and the latent cache's
    shardings -> JSON at `out`."""
    import json

    from dflash_jax import sharding
    from dflash_jax.engine.generator import Generator
    from support.speculative import tiny_drafter

    target = families.tiny_target("deepseek_v3")
    drafter = tiny_drafter(target, block_size=4)
    # their weights on the host (numpy): placed on each mesh by slicing there, no program compiled per shard
    target = dataclasses.replace(target, params=jax.device_get(target.params))
    drafter = dataclasses.replace(drafter, params=jax.device_get(drafter.params))
    prompts = [[3, 9, 4], [7, 1, 2, 5, 8, 6, 11], [12], [5, 5, 20, 31, 2]]
    found = {"reference": Generator(target, drafter, backend="xla").generate(
        prompts, max_new_tokens=12, stop_token_ids=()).tokens}
    for name, axes in globals()[meshes].items():
        mesh = sharding.make_mesh(**axes)
        found[name] = Generator(target, drafter, mesh=mesh).generate(prompts, max_new_tokens=12,
                                                                     stop_token_ids=()).tokens
        placed = sharding.cache_shardings(mesh, target.init_cache(4, 32))
        found[f"{name}_cache"] = [list(placed.kv.spec), list(placed.lengths.spec)]
    with open(out, "w") as f:
        json.dump(found, f)


def _check_sharded(meshes: str) -> None:
    from support.devices import run_8_devices

    found = run_8_devices(f"sharded_run({{out}}, {meshes!r})", "test_deepseek_v3")
    for name in globals()[meshes]:
        assert found[name] == found["reference"], name
        assert found[f"{name}_cache"] == [[None, "data", None, None, None], ["data"]]


# newer-jax leg only (`one_leg`); both legs run the latent cache's speculative decoding
# (test_conformance_deepseek_v3.py) and the mesh rules on 8 devices (test_sharded_generate.py)
@pytest.mark.one_leg
def test_sharded_greedy_equals_one_device():
    """On 8 devices, experts split over `expert` and heads (q_b_proj, kv_b_proj, o_proj) over `tensor`, the
    latent cache split by rows and replicated over `tensor`: the tokens of one device."""
    _check_sharded("MESHES")


# make test-all; test_sharded_greedy_equals_one_device (newer-jax leg) runs the same rules on expert x tensor x data
@pytest.mark.slow
def test_sharded_greedy_on_a_wider_tensor_axis_equals_one_device():
    """Heads over a tensor axis of 4 (one per device), the experts not over `expert`: the tokens of one device."""
    _check_sharded("MORE_MESHES")


def test_benchmark_reports_the_latent_caches_bytes_per_token():
    """The benchmark's `cache_bytes_per_token`: DeepSeek-V3's 576 values per layer (bfloat16), where
    materialised keys and values would be 128 heads x (192 + 128)."""
    from dflash_jax.cli.bench_memory import cache_bytes_per_token
    from dflash_jax.cli.bench_random import random_configs
    from dflash_jax.models.target import TargetSpec

    config, _ = random_configs("deepseek-v3", 4, None)
    assert cache_bytes_per_token(TargetSpec(config, jnp.bfloat16)) == 4 * 576 * 2
    qwen3 = families.target_config("qwen3")  # 4 layers, 2 kv heads of 16
    assert cache_bytes_per_token(TargetSpec(qwen3)) == 4 * 2 * 2 * 16 * 4


# newer-jax leg only (`one_leg`); both legs run the latent cache's prefill (test_conformance_deepseek_v3.py)
# and the feature cache against a forward (test_train_data.py::test_feature_cache_round_trip)
@pytest.mark.one_leg
def test_training_features_through_the_latent_cache_equal_one_pass():
    """`train.cache_features` runs the target as prefill does (through its cache, here the latent one):
    the captured features are one uncached pass's (training's online path, `train.step`)."""
    from train.cache_features import _feature_fn

    target = families.tiny_target("deepseek_v3")
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 96, size=(2, 20)), jnp.int32)
    features, next_tokens = _feature_fn(target, (0, 2))(target.params, tokens)

    @jax.jit  # forward and logits in one program
    def one_pass(params, tokens):
        hidden, expected, _ = target.forward(params, tokens, capture=(0, 2))
        return expected, target.logits(params, hidden).argmax(-1)

    expected, greedy = one_pass(target.params, tokens)
    np.testing.assert_allclose(np.asarray(features, np.float32), np.asarray(expected.astype(jnp.bfloat16), np.float32),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(np.asarray(next_tokens), np.asarray(greedy))


@pytest.mark.slow  # make test-all; float16 caches under speculative decoding by default: test_kv_cache_dtype
def test_a_float16_latent_cache_decodes_speculatively_as_plainly():
    """`kv_cache_dtype="float16"` under a float32 model: the latent cache holds float16 (half the bytes),
    and speculative greedy decoding with a random drafter equals plain decoding through the same cache."""
    from dflash_jax.engine.generator import generate
    from support.speculative import tiny_drafter

    target = dataclasses.replace(families.tiny_target("deepseek_v3"), kv_cache_dtype="float16")
    assert target.init_cache(1, 8).kv.dtype == jnp.float16
    prompts = [[3, 9, 4], [7, 1, 2, 5, 8, 6, 11, 40, 2]]
    plain = generate(target, None, prompts, max_new_tokens=16, stop_token_ids=()).tokens
    assert generate(target, tiny_drafter(target, block_size=4), prompts, max_new_tokens=16,
                    stop_token_ids=()).tokens == plain
