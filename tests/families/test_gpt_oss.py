"""gpt-oss targets, what is theirs alone: the router (softmax of the top-k logits), the experts'
biases and clamped SwiGLU in both grouped forms, the loaded config (attention sinks, biases, sliding
windows, YaRN), the RMS norm's float32 scaling, MXFP4 experts dequantised as transformers does, and
the config's fields and refusals. Parity with transformers (sinks, biases, windows shorter than the
prompt, YaRN), cached ragged prefill, the export's round trip, speculative decoding with rejections
and sampling, and the decode step's HLO are the conformance suite's (test_family_conformance.py, the
gpt_oss row of support/families.py)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax._errors import CheckpointError, ConfigError
from dflash_jax.formats import mxfp4
from dflash_jax.formats.safetensors_io import save_safetensors
from dflash_jax.layers import moe
from dflash_jax.models.config import ModelConfig, MoEConfig
from support import families
from support.tolerance import assert_model_close

HF = families.GPT_OSS


def _hf():
    """(torch, transformers) for the tests against transformers, which skip without them (the
    jax-latest leg has no torch); the rest of this file needs neither."""
    return families.hf_modules("gpt_oss")


@pytest.mark.parametrize("form", ["auto", *moe.FORMS])
def test_router_and_clamped_experts_equal_a_loop_over_experts(form):
    """Every grouped form (gathered experts, `ragged_dot` over the sorted pairs,
    and this platform's choice) with expert biases and the clamped SwiGLU, after the
    top-k-then-softmax router; fewer pairs than experts and more."""
    rng = np.random.default_rng(0)
    d, i, e, k, limit, alpha = 8, 6, 5, 2, 0.7, 1.702
    gate, up = (jnp.asarray(rng.normal(size=(e, d, i)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(e, i, d)), jnp.float32)
    biases = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((e, i), (e, i), (e, d)))
    def act(g, u):
        g = np.minimum(g, limit)
        return (np.clip(u, -limit, limit) + 1) * g / (1 + np.exp(-alpha * g))
    for n in (2, 13):
        x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
        logits = rng.normal(size=(n, e)).astype(np.float32)
        weights, experts = jax.jit(moe.route_top_k_softmax, static_argnums=1)(jnp.asarray(logits), k)
        top = np.argsort(-logits, axis=-1)[:, :k]
        np.testing.assert_array_equal(np.asarray(experts), top)
        chosen = np.take_along_axis(logits, top, -1)
        softmax = np.exp(chosen) / np.exp(chosen).sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(weights), softmax, rtol=1e-6)
        got = jax.jit(lambda *a: moe.grouped_experts(
            *a, biases=biases, activation=lambda g, u: moe.clamped_swiglu(g, u, limit=limit, alpha=alpha),
            form=form))(
                x, experts, weights, gate, up, down)
        want = np.zeros((n, d), np.float32)
        xs, w = np.asarray(x), np.asarray(weights)
        g_, u_, d_, (gb, ub, db) = np.asarray(gate), np.asarray(up), np.asarray(down), map(np.asarray, biases)
        for t in range(n):
            for j in range(k):
                ex = top[t, j]
                h = act(xs[t] @ g_[ex] + gb[ex], xs[t] @ u_[ex] + ub[ex])
                want[t] += w[t, j] * (h @ d_[ex] + db[ex])
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# The loaded model

@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    from dflash_jax import load_target

    directory = tmp_path_factory.mktemp("gpt-oss")
    model = families.make_hf("gpt_oss", directory)  # the unquantised layout
    return model, load_target(directory, tokenizer=False), directory


def test_loaded_config_has_windows_sinks_and_yarn(hf_pair):
    _, target, _ = hf_pair
    cfg = target.config
    assert cfg == families.target_config("gpt_oss")
    assert (cfg.arch, cfg.num_experts, cfg.layer_windows) == ("gpt_oss", 8, (4, 0))
    assert cfg.attention_sinks and cfg.rope["rope_type"] == "yarn"


def test_rms_norm_scales_in_float32_as_transformers_does():
    """GptOssRMSNorm multiplies by its weight in float32 and rounds once: in bfloat16 ours does the
    same (the other families' norm, rounding before it scales, differs in about half the values)."""
    torch, transformers = _hf()
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    from dflash_jax.layers.common import RMSNorm

    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 64)).astype(np.float32)
    weight = (1 + 0.1 * rng.normal(size=64)).astype(np.float32)
    hf = GptOssRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.as_tensor(weight))
        want = hf(torch.as_tensor(x).to(torch.bfloat16)).float().numpy()
    params = {"params": {"scale": jnp.asarray(weight, jnp.bfloat16)}}
    xb = jnp.asarray(x, jnp.bfloat16)
    ours = np.asarray(RMSNorm(1e-5, jnp.bfloat16, True).apply(params, xb).astype(jnp.float32))
    rounded_first = np.asarray(RMSNorm(1e-5, jnp.bfloat16).apply(params, xb).astype(jnp.float32))
    np.testing.assert_array_equal(ours, want)
    assert (rounded_first != want).mean() > 0.1


# ---------------------------------------------------------------------------------------------
# MXFP4

def test_mxfp4_dequantisation_equals_transformers_bit_for_bit():
    torch, _ = _hf()
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, size=(3, 10, 2, 16), dtype=np.uint8)
    scales = rng.integers(0, 256, size=(3, 10, 2), dtype=np.uint8)
    scales[0, 0] = [0, 255]  # the extremes: 2 ** -127 (subnormal), 2 ** 128 (infinite)
    tensor = mxfp4.Mxfp4Tensor(blocks, scales)
    ours = np.asarray(tensor)
    assert ours.shape == tensor.shape == (3, 64, 10)
    for dtype, bits in ((torch.float32, np.uint32), (torch.bfloat16, np.uint16)):
        theirs = convert_moe_packed_tensors(torch.as_tensor(blocks), torch.as_tensor(scales), dtype=dtype)
        theirs = theirs.view(torch.int32 if bits is np.uint32 else torch.int16).numpy().view(bits)
        mine = ours if dtype == torch.float32 else ours.astype(jnp.bfloat16)
        np.testing.assert_array_equal(mine.view(bits), theirs)
    for start in (0, 1):
        np.testing.assert_array_equal(tensor.columns(start, 2).view(np.uint32), ours[..., start::2].view(np.uint32))


def test_mxfp4_nibble_order_scales_and_transpose():
    """Without transformers: byte 0x2F of row r holds values 0 (low nibble: -6.0) and 1 (high: +1.0) of
    its block, times 2 ** (scale - 127); rows become the last axis."""
    blocks = np.zeros((1, 2, 1, 16), np.uint8)
    blocks[0, 0, 0, 0], blocks[0, 1, 0, 15] = 0x2F, 0x9B  # row 1, values 30 and 31: -1.5, -0.5
    scales = np.array([[[128], [125]]], np.uint8)
    out = np.asarray(mxfp4.Mxfp4Tensor(blocks, scales))
    want = np.zeros((1, 32, 2), np.float32)
    want[0, :2, 0] = [-12.0, 2.0]
    want[0, 30:, 1] = [-1.5 / 4, -0.5 / 4]
    np.testing.assert_array_equal(out, want)
    with pytest.raises(CheckpointError, match=r"ckpt: .*without both _blocks and _scales.*x\.down_proj"):
        mxfp4.dequantized({"x.down_proj_blocks": blocks}, "ckpt")


def _pack_random(rng, rows: int, cols: int, experts: int):
    """Random MXFP4 blocks [E, rows, cols / 32, 16] and scales in a model's range of magnitudes."""
    blocks = rng.integers(0, 256, size=(experts, rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(122, 127, size=(experts, rows, cols // 32), dtype=np.uint8)
    return blocks, scales


def test_mxfp4_checkpoint_loads_as_transformers_dequantises_it(hf_pair, tmp_path):
    """A released-layout directory (experts as *_blocks / *_scales, quantization_config mxfp4) loads to
    the experts transformers' dequantiser makes, and the model then equals transformers' with them."""
    torch, _ = _hf()
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from dflash_jax import load_target
    from dflash_jax.formats.checkpoint_files import open_checkpoint

    model, _, directory = hf_pair
    rng = np.random.default_rng(3)
    e, d, i = HF["num_local_experts"], HF["hidden_size"], HF["intermediate_size"]
    tensors = {k: np.asarray(v) for k, v in open_checkpoint(directory).items()}
    packed = {}
    for layer in range(HF["num_hidden_layers"]):
        for proj, (rows, cols) in (("gate_up_proj", (2 * i, d)), ("down_proj", (d, i))):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            del tensors[name]
            packed[name] = _pack_random(rng, rows, cols, e)
            tensors[name + "_blocks"], tensors[name + "_scales"] = packed[name]
    save_safetensors(tensors, tmp_path / "model.safetensors")
    hf = json.loads((directory / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    target = load_target(tmp_path, tokenizer=False)
    with torch.no_grad():
        for name, (blocks, scales) in packed.items():
            weight = convert_moe_packed_tensors(torch.as_tensor(blocks), torch.as_tensor(scales), dtype=torch.float32)
            layer, proj = int(name.split(".")[2]), name.rsplit(".", 1)[1]
            mlp = target.params["layers"]["mlp"]
            if proj == "gate_up_proj":
                np.testing.assert_array_equal(np.asarray(mlp["gate_proj"][layer]), weight[..., ::2].numpy())
                np.testing.assert_array_equal(np.asarray(mlp["up_proj"][layer]), weight[..., 1::2].numpy())
            else:
                np.testing.assert_array_equal(np.asarray(mlp["down_proj"][layer]), weight.numpy())
            getattr(model.model.layers[layer].mlp.experts, proj).copy_(weight)
        ids = np.random.default_rng(4).integers(0, 96, size=(2, 12))
        want = model(input_ids=torch.as_tensor(ids)).logits.numpy()
    hidden, _, _ = target.forward(target.params, jnp.asarray(ids, jnp.int32))
    assert_model_close(np.asarray(target.logits(target.params, hidden)), want, target.config, tokens=ids.shape[1])
    # half a pair is one clear error
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_safetensors(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="down_proj"):
        load_target(tmp_path, tokenizer=False)


# ---------------------------------------------------------------------------------------------
# Config

def test_config_fields_and_refusals():
    released = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
                "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
                "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "experts_per_token": 4,
                "num_experts_per_tok": 4, "sliding_window": 128, "swiglu_limit": 7.0, "rope_theta": 150000,
                "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                                 "original_max_position_embeddings": 4096, "truncate": False},
                "quantization_config": {"quant_method": "mxfp4"}}
    cfg = ModelConfig.from_hf_config(released)
    assert (cfg.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.intermediate_size) == (32, 4, 2880)
    assert cfg.layer_windows[:4] == (128, 0, 128, 0) and cfg.attention_bias and cfg.rms_norm_eps == 1e-5
    assert (cfg.moe.router, cfg.moe.router_bias, cfg.moe.expert_bias, cfg.moe.swiglu_limit) == ("topk_softmax", True,
                                                                                                  True, 7.0)
    with pytest.raises(ConfigError, match="quant_method"):
        ModelConfig.from_hf_config({**released, "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match="a llama target has a dense MLP"):  # MoE settings on a dense family
        ModelConfig(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                    num_kv_heads=1, head_dim=8, moe=MoEConfig(num_experts=2, num_experts_per_tok=1, intermediate_size=8,
                                                              swiglu_limit=7.0))
