"""GLM-4 MoE targets, what is theirs alone: reading config.json (the partial rotary default, q/k norms, the
dense prefix, the router's fields, what is refused by name), a released checkpoint's multi-token prediction
layers left unread, fused experts read as per-expert ones, FP8 checkpoints (GLM-4.5-Air-FP8's per-row scales,
block-scaled FP8) loaded dequantised and the schemes not read refused by name, every weight's sharding rule and
an 8-device sharded generation equal to one device's, the glm-4.5-air random-target preset, and (slow) drafter training
with a GLM target online and offline. Parity with transformers,
the cached ragged prefill, speculative decoding with rejections and sampling are the conformance suite's
(the glm4_moe row of support/families.py)."""
import json

import jax
import numpy as np
import pytest

from dflash_jax import sharding
from dflash_jax._errors import CheckpointError, ConfigError
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.stack import stack_segments
from dflash_jax.models.target import target_param_shapes
from support import families, fp8
from support.devices import run_8_devices

GLM = {"architectures": ["Glm4MoeForCausalLM"], **families.GLM4_MOE}


def test_config_reads_the_family_fields():
    cfg = ModelConfig.from_hf_config(GLM)
    assert cfg.arch == "glm4_moe" and cfg.qk_norm and cfg.attention_bias
    assert cfg.partial_rotary_factor == 0.5 and cfg.rotary_dim == 8  # Glm4MoeConfig's default
    moe = cfg.moe
    assert (moe.router, moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size) == (
        "sigmoid_grouped", 8, 2, 16)
    assert (moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.norm_topk_eps) == (4, 2, 2.5, 1e-20)
    assert moe.shared_expert_intermediate_size == 16 and not moe.shared_expert_gate and moe.norm_topk_prob
    assert cfg.mlp_kinds == ("dense", "moe", "moe") and moe.dense_layers == (0,)
    plain = ModelConfig.from_hf_config({**GLM, "use_qk_norm": False, "first_k_dense_replace": 2, "n_shared_experts": 3,
                                        "num_hidden_layers": 5, "rope_parameters": {"rope_theta": 1e6,
                                                                                    "partial_rotary_factor": 0.25}})
    assert not plain.qk_norm and plain.rotary_dim == 4 and plain.rope_theta == 1e6
    assert plain.mlp_kinds == ("dense",) * 2 + ("moe",) * 3 and plain.moe.shared_expert_intermediate_size == 48
    # the stack: a segment of the dense prefix, one of the MoE layers
    assert [(s.start, s.pattern, s.repeats) for s in stack_segments(plain.layer_kinds)] == [
        (0, (("attention", "dense"),), 2), (2, (("attention", "moe"),), 3)]
    params = target_param_shapes(plain)
    assert "q_norm" not in params["layers_0"]["layer_0"]["self_attn"]
    assert "bias" not in params["layers_1"]["layer_0"]["self_attn"]["o_proj"]  # GLM's o_proj never has one
    assert params["layers_1"]["layer_0"]["mlp"]["e_score_correction_bias"].shape == (3, 8)


@pytest.mark.parametrize("fields, message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported for glm4_moe"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"topk_method": "greedy"}, "topk_method 'greedy' is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quantization_config.quant_method 'gptq' is not supported for glm4_moe"),
    ({"first_k_dense_replace": 4}, r"first_k_dense_replace must be in \[0, num_hidden_layers=3\]"),
    ({"n_group": 3}, r"n_group \(3\) must be >= 1 and divide num_experts"),
    ({"topk_group": 5}, "topk_group must be in"),
    ({"n_shared_experts": -1}, "n_shared_experts must be >= 0"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"], "sliding_window": 4},
     "sliding_attention layers are not supported for glm4_moe"),
])
def test_config_refuses_what_it_cannot_compute(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config({**GLM, **fields})


def _saved(tmp_path, tensors_of=lambda tensors: tensors):
    """An HF directory of a tiny GLM target (our random weights through the export name table), its tensors
    passed through `tensors_of` first -> (the target, the directory)."""
    from dflash_jax.formats.names import params_to_hf, target_rules
    from dflash_jax.formats.safetensors_io import save_safetensors

    target = families.tiny_target("glm4_moe")
    cfg = target.config
    tensors = tensors_of(params_to_hf(target_rules(cfg), target.params, cfg.num_layers))
    save_safetensors(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(GLM))
    return target, tmp_path


def test_the_multi_token_prediction_layers_are_not_read(tmp_path):
    """The released checkpoints carry their MTP layer as `model.layers.{L}.*` (L = num_hidden_layers): not
    read, not an error. An unknown tensor inside the decoder still is."""
    from dflash_jax import load_target

    mtp = {"model.layers.3.eh_proj.weight": np.ones((32, 64), np.float32),
           "model.layers.3.enorm.weight": np.ones(32, np.float32),
           "model.layers.3.mlp.experts.0.gate_proj.weight": np.ones((16, 32), np.float32)}
    target, directory = _saved(tmp_path, lambda tensors: {**tensors, **mtp})
    loaded = load_target(directory, tokenizer=False, layout="stacked")
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.params, target.params)
    stray = tmp_path / "stray"
    stray.mkdir()
    _saved(stray, lambda tensors: {**tensors, "model.layers.1.mlp.gate.extra": np.ones(8, np.float32)})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.gate\.extra"):
        load_target(stray, tokenizer=False, layout="stacked")


def test_a_bfloat16_load_keeps_the_correction_bias_in_float32(tmp_path):
    """The routers' correction bias decides between close scores: loaded in bfloat16, the model keeps it in
    float32 (as transformers does), bit for bit the checkpoint's; every other weight is bfloat16."""
    import jax.numpy as jnp

    from dflash_jax import load_target

    target, directory = _saved(tmp_path)
    loaded = load_target(directory, "bfloat16", tokenizer=False, layout="stacked")
    moe = loaded.params["layers_1"]["layer_0"]["mlp"]
    assert moe["e_score_correction_bias"].dtype == jnp.float32
    np.testing.assert_array_equal(moe["e_score_correction_bias"],
                                  target.params["layers_1"]["layer_0"]["mlp"]["e_score_correction_bias"])
    others = [leaf.dtype for path, leaf in jax.tree_util.tree_leaves_with_path(loaded.params)
              if "e_score_correction_bias" not in jax.tree_util.keystr(path)]
    assert set(others) == {jnp.dtype(jnp.bfloat16)}
    tokens = jnp.asarray([[3, 9, 4, 7, 1]], jnp.int32)
    hidden, _, _ = loaded.forward(loaded.params, tokens, loaded.init_cache(1, 8))
    assert hidden.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(hidden)))


def test_fused_experts_read_as_per_expert_ones(tmp_path):
    """transformers' in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj`
    [E, D, I]) loads to the same params as the released per-expert tensors."""
    from dflash_jax import load_target

    def fuse(tensors):
        out = {n: v for n, v in tensors.items() if ".mlp.experts." not in n}
        for i in (1, 2):
            prefix = f"model.layers.{i}.mlp.experts"
            each = lambda proj: np.stack([tensors[f"{prefix}.{e}.{proj}.weight"] for e in range(8)])  # noqa: E731
            out[f"{prefix}.gate_up_proj"] = np.concatenate([each("gate_proj"), each("up_proj")], axis=1)
            out[f"{prefix}.down_proj"] = each("down_proj")
        return out

    target, directory = _saved(tmp_path, fuse)
    loaded = load_target(directory, tokenizer=False, layout="stacked")
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.params, target.params)


def test_every_weight_has_a_sharding_rule():
    """On tensor=2 and expert=2: the experts over `expert` (their width over `tensor`), the shared expert and
    the dense prefix's MLP over `tensor`, the router and its correction bias replicated."""
    cfg = families.target_config("glm4_moe")
    specs = {jax.tree_util.keystr(path): tuple(sharding.param_spec(path, leaf.shape, cfg, 2, 2))
             for path, leaf in jax.tree_util.tree_leaves_with_path(target_param_shapes(cfg))}
    moe = "['layers_1']['layer_0']['mlp']"
    assert specs[f"{moe}['gate_proj']"] == (None, "expert", None, "tensor")
    assert specs[f"{moe}['e_score_correction_bias']"] == (None, None)
    assert specs[f"{moe}['router']['kernel']"] == (None, None, None)
    assert specs[f"{moe}['shared_expert']['down_proj']['kernel']"] == (None, "tensor", None)
    assert specs["['layers_0']['layer_0']['mlp']['up_proj']['kernel']"] == (None, None, "tensor")
    assert specs["['layers_0']['layer_0']['self_attn']['q_proj']['bias']"] == (None, "tensor")


def sharded_findings(out: str) -> None:
    """In an 8-device process: greedy tokens of a tiny GLM target on one device (plain), on an expert x tensor
    x data mesh of 2 x 2 x 2 (speculative, a random drafter) and on a tensor axis of 4 over the 2 kv heads
    (each replicated twice; plain) -> `out`."""
    from dflash_jax.engine.generator import Generator
    from support.speculative import tiny_drafter

    target = families.tiny_target("glm4_moe")
    drafter = tiny_drafter(target, block_size=4)
    prompts = [[3, 9, 4, 7], [5, 5, 20, 31, 2, 8, 11]]
    found = {}
    for name, mesh, pair in (("one/plain", None, None),
                             ("expert2_tensor2_data2/speculative", sharding.make_mesh(data=2, tensor=2, expert=2),
                              drafter),
                             ("tensor4_data2/plain", sharding.make_mesh(data=2, tensor=4), None)):
        generator = Generator(target, pair, mesh=mesh, **({"backend": "xla"} if mesh is None else {}))
        found[name] = generator.generate(prompts, max_new_tokens=12, stop_token_ids=()).tokens
    with open(out, "w") as f:
        json.dump(found, f)


@pytest.mark.slow  # make test-all; the sigmoid-routed MoE's 8-device run by default is test_deepseek_v3's
def test_sharded_generation_equals_one_device():
    found = run_8_devices("sharded_findings({out})", "test_glm4_moe")
    reference = found.pop("one/plain")
    assert len(found) == 2
    for key, tokens in found.items():
        assert tokens == reference, key


def test_random_target_preset_builds_cut_to_a_few_layers():
    """glm-4.5-air's released shapes; cut to 3 layers: the dense first layer and 2 MoE ones (shapes only)."""
    from dflash_jax.cli.bench_random import random_configs

    config, drafter = random_configs("glm-4.5-air", 3, None)
    assert (config.arch, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.rotary_dim, config.vocab_size, config.intermediate_size) == (
        "glm4_moe", 4096, 96, 8, 128, 64, 151552, 10944)
    assert config.mlp_kinds == ("dense", "moe", "moe") and config.attention_bias and not config.qk_norm
    moe = config.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.shared_expert_intermediate_size,
            moe.n_group, moe.routed_scaling_factor) == (128, 8, 1408, 1408, 1, 1.0)
    shapes = target_param_shapes(config, "bfloat16")
    assert shapes["layers_1"]["layer_0"]["mlp"]["gate_proj"].shape == (2, 128, 4096, 1408)
    assert drafter.num_target_layers == 3 and drafter.mask_token_id == 151551
    full, _ = random_configs("glm-4.5-air", None, None)
    assert full.num_layers == 46 and full.moe.dense_layers == (0,)


@pytest.mark.slow  # the training machinery is every family's; test_moe_train runs it by default
def test_drafter_training_online_and_from_cached_features(tmp_path):
    """`train.train` with a GLM target (a dense prefix, then the sigmoid-routed MoE): online from its
    checkpoint directory (the target sharded by the training rules), and offline from `train.cache_features`."""
    from dflash_jax import load_target
    from dflash_jax.formats.names import params_to_hf, target_rules
    from dflash_jax.formats.safetensors_io import save_safetensors
    from support import fitted_models
    from train.cache_features import cache_features
    from train.config import config_from_dict
    from train.data import load_token_records
    from train.train import train

    built = families.tiny_target("glm4_moe")
    cfg = built.config
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    save_safetensors(params_to_hf(target_rules(cfg), built.params, cfg.num_layers), target_dir / "model.safetensors")
    (target_dir / "config.json").write_text(json.dumps(GLM))
    target = load_target(target_dir, tokenizer=False)
    prompts = fitted_models.pattern_batch(np.random.default_rng(1), 10, 4).tolist()
    data = tmp_path / "train.jsonl"
    fitted_models.write_self_continuations(target, data, prompts, 8, 12)

    def config(path, out, steps, **extra):
        return config_from_dict({
            "model": {"target": str(target_dir), "num_layers": 1, "intermediate_size": 64, "block_size": 4,
                      "target_layer_ids": [0, 2], "mask_token_id": cfg.vocab_size - 1},
            "data": {"path": str(path), "max_length": 32, "batch_size": 4, "seed": 3, **extra},
            "optim": {"learning_rate": 3e-3, "warmup_ratio": 0.05},
            "run": {"out_dir": str(out), "steps": steps, "num_anchors": 8, "log_every": steps,
                    "checkpoint_every": steps, "async_checkpointing": False, "shard_target": True}})

    online = train(config(data, tmp_path / "online", 3))
    assert online["step"] == 3 and np.isfinite(online["loss"])
    records = load_token_records(data, None, 32)
    cache_features(target, records, tmp_path / "cache", (0, 2), batch_size=4, buckets=(32,), progress=False)
    offline = train(config(tmp_path / "cache", tmp_path / "offline", 2, buckets=[32]), target=target)
    assert offline["step"] == 2 and np.isfinite(offline["loss"])


# ---------------------------------------------------------------------------------------------
# FP8 checkpoints: GLM-4.5 / GLM-4.5-Air FP8 (compressed-tensors, a scale per row), and block-scaled FP8

# zai-org/GLM-4.5-Air-FP8's quantization_config (llm-compressor's FP8 channel scheme), cut to the tiny model
GLM_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": None,
           "sparsity_config": {}, "quantization_status": "compressed",
           "ignore": ["lm_head", "model.layers.1.mlp.gate", "model.layers.2.mlp.gate"],
           "config_groups": {"group_0": {
               "targets": ["Linear"], "output_activations": None,
               "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
               "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}


def test_fp8_channel_dequantisation_is_the_reference_bit_for_bit():
    """Random e4m3 weights (every finite code) and random scales per row or per tensor, float32, bfloat16 or
    float16: the dequantised values equal the float64 product rounded once to the scale's dtype, whole or a few
    rows at a time."""
    import ml_dtypes

    from dflash_jax.formats.fp8_channel import Fp8ChannelTensor
    from support.fp8 import float64_channel

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(300, 70), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes
    weight = codes.view(ml_dtypes.float8_e4m3fn)
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        for shape in ((300, 1), (300,), (1, 1), (1,)):
            scale = (rng.random(shape) * 2.0 ** rng.integers(-12, 3, size=shape)).astype(dtype)
            expected = float64_channel(weight, scale)
            tensor = Fp8ChannelTensor(weight, scale, "w")
            assert tensor.dtype == np.dtype(dtype) and tensor.shape == (300, 70)
            bits = lambda a: np.asarray(a).view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)  # noqa: E731
            np.testing.assert_array_equal(bits(np.asarray(tensor)), bits(expected), err_msg=f"{dtype} {shape}")
            for rows in (slice(0, 128), slice(130, 290), slice(5, 6)):
                np.testing.assert_array_equal(bits(tensor.first_axis(rows)), bits(expected[rows]))
    with pytest.raises(CheckpointError, match="weight_scale must be"):
        Fp8ChannelTensor(weight, np.ones((70, 1), np.float32), "w.weight")


def test_glm_fp8_checkpoint_loads_dequantised(tmp_path):
    """GLM-4.5-Air-FP8's format: every Linear of the layers float8_e4m3fn with a bfloat16 scale per row
    (`weight_scale`), the routers, norms, embedding and head unquantised."""
    fp8.assert_loads_dequantised(tmp_path, {**GLM, "quantization_config": GLM_FP8}, "channel", "glm4_moe")


def test_glm_block_fp8_checkpoint_loads_dequantised(tmp_path):
    """A GLM checkpoint in DeepSeek's block-scaled FP8 (`weight_scale_inv`, 128 x 128 blocks)."""
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    fp8.assert_loads_dequantised(tmp_path, {**GLM, "quantization_config": quant}, "block", "glm4_moe")


@pytest.mark.parametrize("quant, named", [
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme"),
    ({**GLM_FP8, "config_groups": {"group_0": {**GLM_FP8["config_groups"]["group_0"],
                                               "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                           "symmetric": True}}}}, "'strategy': 'block'"),
    ({**GLM_FP8, "config_groups": {"group_0": {**GLM_FP8["config_groups"]["group_0"],
                                               "input_activations": {"num_bits": 8, "type": "float",
                                                                     "dynamic": False}}}}, "input_activations"),
    ({**GLM_FP8, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ({**GLM_FP8, "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config")])
def test_quantisation_configs_it_cannot_read_are_refused_by_name(quant, named):
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf_config({**GLM, "quantization_config": quant})


@pytest.mark.parametrize("suffix, scheme", [(".qweight", "GPTQ / AWQ"),
                                            (".weight_scale", "integers with a weight_scale"),
                                            (".input_scale", "FP8 with static activation scales")])
def test_a_quantisation_scheme_it_does_not_read_is_named(tmp_path, suffix, scheme):
    """Tensors of a scheme not read (an int8 weight with a `weight_scale` among them) fail naming it."""
    from dflash_jax import load_target

    base = "model.layers.0.mlp.down_proj"

    def add(tensors):
        out = {**tensors, f"{base}{suffix}": np.ones((32, 1), np.float32)}
        if suffix == ".weight_scale":
            out[f"{base}.weight"] = np.ones(tensors[f"{base}.weight"].shape, np.int8)
        return out

    _, directory = _saved(tmp_path, add)
    with pytest.raises(CheckpointError, match=f"{base}{suffix} is quantised as {scheme}"):
        load_target(directory, tokenizer=False, layout="stacked")
