"""Loading targets: bad input gives clear errors; sharded safetensors and pytorch_model.bin load."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dflash_jax.models.config import ModelConfig  # noqa: E402
from dflash_jax.formats.safetensors_io import SafetensorsFile, save_safetensors  # noqa: E402
from dflash_jax.loading.target_loader import load_target  # noqa: E402
from support.families import make_hf  # noqa: E402


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen")
    make_hf("qwen3", d)
    return d


def copy_model(src, dst, edit=None, config_edit=None):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = {k: np.array(v) for k, v in SafetensorsFile(src / "model.safetensors").items()}
    if edit:
        edit(tensors)
    save_safetensors(tensors, dst / "model.safetensors")
    return dst


def test_unknown_architecture_lists_supported(qwen_dir, tmp_path):
    d = copy_model(qwen_dir, tmp_path / "m", config_edit=lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_target(d)


def test_missing_tensor_is_named(qwen_dir, tmp_path):
    d = copy_model(qwen_dir, tmp_path / "m", edit=lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match="missing.*model.layers.2.self_attn.k_norm.weight"):
        load_target(d)


def test_wrong_shape_is_named(qwen_dir, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:, :10].copy()
    d = copy_model(qwen_dir, tmp_path / "m", edit=edit)
    expected = r"model.layers.0.mlp.up_proj.weight has shape \(128, 10\), expected \(128, 64\)"
    with pytest.raises(ValueError, match=expected):
        load_target(d)


def test_unexpected_tensor_is_named(qwen_dir, tmp_path):
    d = copy_model(qwen_dir, tmp_path / "m", edit=lambda t: t.update(extra=np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match="does not use.*extra"):
        load_target(d)


def test_missing_files(tmp_path, qwen_dir):
    with pytest.raises(FileNotFoundError):
        load_target(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((qwen_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_target(tmp_path / "empty")


def test_bad_dtype(qwen_dir):
    with pytest.raises(ValueError, match="dtype"):
        load_target(qwen_dir, "float16")


def test_sharded_and_torch_bin_load_the_same(qwen_dir, tmp_path):
    base = load_target(qwen_dir)
    tensors = dict(SafetensorsFile(qwen_dir / "model.safetensors"))
    names = sorted(tensors)
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_text((qwen_dir / "config.json").read_text())
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_safetensors({n: np.array(tensors[n]) for n in part}, shard / fname)
        weight_map.update({n: fname for n in part})
    (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((qwen_dir / "config.json").read_text())
    torch.save({n: torch.tensor(np.array(tensors[n])) for n in names}, binary / "pytorch_model.bin")
    tokens = jnp.asarray([[1, 2, 3, 4]])
    want = base.forward(base.params, tokens)[0]
    for d in (shard, binary):
        other = load_target(d)
        np.testing.assert_array_equal(other.forward(other.params, tokens)[0], want)


def test_layouts(qwen_dir):
    """On a CPU a loaded target holds its params laid out for decoding (kernels packed, what generate
    runs on: one copy of the weights); layout="stacked" keeps them as training and conversion read
    them; the two compute the same."""
    from dflash_jax.backends.cpu.layout import is_packed_layout

    packed, stacked = load_target(qwen_dir), load_target(qwen_dir, layout="stacked")
    assert is_packed_layout(packed.params) and not is_packed_layout(stacked.params)
    tokens = jnp.asarray([[1, 2, 3, 4]])
    want = np.asarray(stacked.forward(stacked.params, tokens)[0])
    np.testing.assert_allclose(np.asarray(packed.forward(packed.params, tokens)[0]), want, rtol=1e-5, atol=1e-5)
    # Target.module is the module that reads the target's own params, whichever the layout
    for target in (packed, stacked):
        hidden = target.module.apply({"params": target.params}, tokens)[0]
        np.testing.assert_allclose(np.asarray(hidden), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layout must be one of"):
        load_target(qwen_dir / "nowhere", layout="rolled")  # checked before anything is read


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ModelConfig(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=3, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="unsupported rope type"):
        ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                                    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                                    "rope_scaling": {"rope_type": "longrope"}})


def test_generation_config_stop_ids_are_merged(qwen_dir, tmp_path):
    d = copy_model(qwen_dir, tmp_path / "m", config_edit=lambda c: c.update(eos_token_id=5))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    assert load_target(d).config.eos_token_ids == (5, 7)
