"""FP8 checkpoints of tiny targets for the loading tests: quantisers in the released formats and the float64
references of their dequantisation."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0


def quantise_block(weight: np.ndarray, block: int = 128):
    """(float8_e4m3fn weight, float32 scale_inv [ceil(R / block), ceil(C / block)]) of a float32 matrix: each
    block scaled so its largest value is e4m3's largest, as DeepSeek's and MiniMax's checkpoints are."""
    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    scale = np.zeros(grid, np.float32)
    quantised = np.zeros(weight.shape, E4M3)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = max(float(np.abs(part).max()), 1e-12) / E4M3_MAX
            quantised[i * block:(i + 1) * block, j * block:(j + 1) * block] = (part / scale[i, j]).astype(E4M3)
    return quantised, scale


def quantise_channel(weight: np.ndarray, scale_dtype=ml_dtypes.bfloat16):
    """(float8_e4m3fn weight, scale [R, 1] in `scale_dtype`) of a float32 matrix: each row scaled so its largest
    value is e4m3's largest, as llm-compressor's FP8 channel scheme stores it."""
    scale = (np.maximum(np.abs(weight).max(axis=1, keepdims=True), 1e-12) / E4M3_MAX).astype(scale_dtype)
    return (weight / scale.astype(np.float32)).astype(E4M3), scale


def float64_block(weight, scale, block: int = 128) -> np.ndarray:
    """The block format in float64: every value times its block's scale, rounded once to float32."""
    out = np.zeros(weight.shape, np.float64)
    for i in range(weight.shape[0]):
        for j in range(weight.shape[1]):
            out[i, j] = float(weight[i, j]) * float(scale[i // block, j // block])
    return out.astype(np.float32)


def float64_channel(weight, scale) -> np.ndarray:
    """The channel (or per-tensor) format in float64: every value times its row's scale, rounded once to the
    scale's dtype."""
    scale = np.asarray(scale)
    column = scale.astype(np.float64).reshape(-1, 1)
    return (weight.astype(np.float64) * column).astype(scale.dtype)


def is_quantised(name: str, value: np.ndarray) -> bool:
    """The Linear weights a released FP8 checkpoint stores in FP8: attention, dense MLP, experts and shared
    experts; not the routers (`mlp.gate`, `block_sparse_moe.gate`), norms, embedding or head."""
    return (value.ndim == 2 and name.endswith(".weight") and ".layers." in name
            and any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj", "w1", "w2", "w3")))


def write_quantised(directory, tensors: dict, config: dict, kind: str) -> dict:
    """Write `tensors` (float32) to directory/model.safetensors with every `is_quantised` weight quantised
    (`kind` "block": `weight_scale_inv`, float32 blocks; "channel": `weight_scale`, bfloat16 rows) and
    `config` to its config.json; -> the float64 reference's dequantised tensors (the others as given)."""
    from dflash_jax.formats.safetensors_io import save_safetensors

    out, expected = {}, {}
    for name, value in tensors.items():
        if not is_quantised(name, value):
            out[name] = expected[name] = value
        elif kind == "block":
            weight, scale = quantise_block(value)
            out[name], out[f"{name}_scale_inv"], expected[name] = weight, scale, float64_block(weight, scale)
        else:
            weight, scale = quantise_channel(value)
            out[name], out[f"{name}_scale"], expected[name] = weight, scale, float64_channel(weight, scale)
    save_safetensors(out, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return expected


def assert_loads_dequantised(tmp_path, config: dict, kind: str, family: str) -> None:
    """A tiny target's checkpoint with its Linear weights quantised (`kind`), loaded (whole and through a
    one-device mesh's placement): its params are the float64 reference's dequantised weights bit for bit, and
    its logits equal those of the model of the dequantised weights saved unquantised."""
    import jax
    from jax.sharding import Mesh

    from dflash_jax import load_target
    from dflash_jax.formats.names import params_to_hf, target_rules
    from dflash_jax.formats.safetensors_io import save_safetensors
    from support import families
    from support.tolerance import assert_model_close

    built = families.tiny_target(family)
    cfg = built.config
    quantised_dir, reference_dir = tmp_path / "fp8", tmp_path / "reference"
    quantised_dir.mkdir()
    reference_dir.mkdir()
    tensors = params_to_hf(target_rules(cfg), built.params, cfg.num_layers)
    expected = write_quantised(quantised_dir, tensors, config, kind)
    assert sum(1 for n in tensors if not np.array_equal(tensors[n], expected[n])) > 20
    save_safetensors({n: np.asarray(v, np.float32) for n, v in expected.items()},
                     reference_dir / "model.safetensors")
    (reference_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                           if k != "quantization_config"}))
    reference = load_target(reference_dir, tokenizer=False, layout="stacked")
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "expert", "tensor"))
    tokens = jax.numpy.asarray([[3, 9, 4, 7, 1, 30, 22, 5]], jax.numpy.int32)
    want = reference.logits(reference.params, reference.forward(reference.params, tokens)[0])
    for target in (load_target(quantised_dir, tokenizer=False, layout="stacked"),
                   load_target(quantised_dir, tokenizer=False, layout="stacked", mesh=mesh)):
        exported = params_to_hf(target_rules(target.config), target.params, target.config.num_layers)
        assert sorted(exported) == sorted(expected)
        for name, value in exported.items():
            np.testing.assert_array_equal(value, np.asarray(expected[name], np.float32), err_msg=name)
        got = target.logits(target.params, target.forward(target.params, tokens)[0])
        assert_model_close(np.asarray(got), np.asarray(want), cfg, tokens=tokens.shape[1])
