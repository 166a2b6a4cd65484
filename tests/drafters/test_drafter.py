"""Drafter: parity with a PyTorch reference, incremental cache, training == inference, checkpoints."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dflash_jax.loading.drafter_io import DrafterMismatchError, load_drafter, save_drafter  # noqa: E402
from dflash_jax.loading.target_loader import load_target  # noqa: E402
from support.dflash_torch_reference import drafter_hf_config, write_official_checkpoint  # noqa: E402
from support.families import make_hf  # noqa: E402


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    make_hf("qwen3", d)
    return load_target(d, "float32")


def official(tmp_path, **kw):
    hf = drafter_hf_config(**kw)
    ref = write_official_checkpoint(tmp_path, hf)
    return hf, ref


def block_logits_via_cache(drafter, target, features, block_tokens, chunks):
    """Append the context in `chunks` (lengths), then draft one block."""
    cache = drafter.init_cache(features.shape[0], 64)
    start = 0
    for n in chunks:
        cache = drafter.append_context(drafter.params, cache, features[:, start:start + n])
        start += n
    embeds = target.embed(target.params, block_tokens)
    hidden = drafter.draft_hidden(drafter.params, embeds, cache)
    return np.asarray(target.logits(target.params, hidden))


@pytest.mark.parametrize("ctx_len,block", [(1, 4), (7, 8), (20, 16)])
def test_parity_with_torch_reference(tmp_path, target, ctx_len, block):
    hf, ref = official(tmp_path, block_size=block, layers=2)
    drafter = load_drafter(tmp_path, target, "float32")
    assert drafter.config.target_layer_ids == (1, 3)
    rng = np.random.default_rng(ctx_len)
    features = rng.normal(size=(2, ctx_len, 2 * 64)).astype(np.float32)
    tokens = rng.integers(0, 128, size=(2, block))
    tokens[:, 1:] = 127
    got = block_logits_via_cache(drafter, target, jnp.asarray(features), jnp.asarray(tokens), [ctx_len])
    with torch.no_grad():
        embeds = torch.tensor(np.asarray(target.embed(target.params, jnp.asarray(tokens))))
        hidden = ref(torch.tensor(features), embeds).numpy()
    want = np.asarray(target.logits(target.params, jnp.asarray(hidden)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_sliding_window_layers_match_reference(tmp_path, target):
    hf, ref = official(tmp_path, layers=2, layer_types=["sliding_attention", "full_attention"],
                       sliding_window=3, block_size=4)
    drafter = load_drafter(tmp_path, target)
    features = np.random.default_rng(0).normal(size=(1, 9, 128)).astype(np.float32)
    tokens = jnp.asarray([[5, 127, 127, 127]])
    got = block_logits_via_cache(drafter, target, jnp.asarray(features), tokens, [9])
    with torch.no_grad():
        hidden = ref(torch.tensor(features), torch.tensor(np.asarray(target.embed(target.params, tokens))))
    want = np.asarray(target.logits(target.params, jnp.asarray(hidden.numpy())))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_incremental_cache_with_rollback_equals_recompute(tmp_path, target):
    official(tmp_path, layers=2, block_size=4)
    drafter = load_drafter(tmp_path, target)
    rng = np.random.default_rng(3)
    features = jnp.asarray(rng.normal(size=(1, 12, 128)).astype(np.float32))
    tokens = jnp.asarray([[9, 127, 127, 127]])
    want = block_logits_via_cache(drafter, target, features, tokens, [12])
    # Cycles of different sizes, with a rollback of garbage in between.
    cache = drafter.init_cache(1, 64)
    cache = drafter.append_context(drafter.params, cache, features[:, :5])
    junk = jnp.asarray(rng.normal(size=(1, 4, 128)).astype(np.float32))
    cache = drafter.append_context(drafter.params, cache, junk)
    cache = cache.with_lengths(cache.lengths - 4)
    cache = drafter.append_context(drafter.params, cache, features[:, 5:9], num_new=jnp.asarray([3]))
    cache = drafter.append_context(drafter.params, cache, features[:, 8:12])
    hidden = drafter.draft_hidden(drafter.params, target.embed(target.params, tokens), cache)
    np.testing.assert_allclose(target.logits(target.params, hidden), want, rtol=1e-5, atol=1e-5)


def test_training_entry_equals_inference_entry(tmp_path, target):
    official(tmp_path, layers=2, block_size=4)
    drafter = load_drafter(tmp_path, target)
    rng = np.random.default_rng(4)
    features = jnp.asarray(rng.normal(size=(2, 10, 128)).astype(np.float32))
    anchors = np.array([[6, 2], [3, 8]])
    seq = rng.integers(0, 127, size=(2, 10))
    blocks = np.full((2, 2, 4), 127)
    blocks[:, :, 0] = np.take_along_axis(seq, anchors, 1)
    embeds = target.embed(target.params, jnp.asarray(blocks.reshape(2, 8)))
    hidden = drafter.train_hidden(drafter.params, features, embeds, jnp.asarray(anchors),
                                  jnp.ones((2, 2), bool))
    for row in range(2):
        for j in range(2):
            a = anchors[row, j]
            # the row's whole context given, its first a positions committed (num_new): one shape for
            # every anchor, so the eager ops compile once, not once per context length
            cache = drafter.append_context(drafter.params, drafter.init_cache(1, 64), features[row:row + 1],
                                           num_new=jnp.asarray([a]))
            hidden_a = drafter.draft_hidden(drafter.params,
                                            target.embed(target.params, jnp.asarray(blocks[row:row + 1, j])), cache)
            want = np.asarray(target.logits(target.params, hidden_a))
            got = target.logits(target.params, hidden[row:row + 1, 4 * j:4 * j + 4])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_packed_drafter_equals_the_scan(tmp_path, target):
    """What a CPU drafts with (`DrafterSpec.decode_params`: kernels packed in their stacks, read by
    the CPU backend) gives the scanned drafter's context cache, blocks and training blocks."""
    from dflash_jax.backends.cpu.matmul import available, pack_kernel

    official(tmp_path, layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=3,
             block_size=4)
    drafter = load_drafter(tmp_path, target)
    spec = drafter.spec
    packed = spec.decode_params(drafter.loop_params)
    assert (spec.module_for(packed).backend == "cpu") == available()
    assert spec.module_for(drafter.loop_params).backend == "xla"
    assert spec.decode_params(packed)["layers"]["mlp"]["up_proj"]["kernel"] is \
        packed["layers"]["mlp"]["up_proj"]["kernel"]
    kernel = drafter.params["layers"]["mlp"]["up_proj"]["kernel"]
    np.testing.assert_array_equal(np.asarray(packed["layers"]["mlp"]["up_proj"]["kernel"]),
                                  np.asarray(pack_kernel(kernel)))
    rng = np.random.default_rng(6)
    features = jnp.asarray(rng.normal(size=(2, 9, 128)).astype(np.float32))
    embeds = target.embed(target.params, jnp.asarray([[5, 127, 127, 127], [8, 127, 127, 127]]))
    results = []
    for params in (drafter.loop_params, packed):
        cache = drafter.append_context(params, drafter.init_cache(2, 32), features, num_new=jnp.asarray([9, 6]))
        results.append((cache.k, cache.v, drafter.draft_hidden(params, embeds, cache)))
    for got, want in zip(results[1], results[0]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    anchors, valid = jnp.asarray([[6, 2], [3, 8]]), jnp.ones((2, 2), bool)
    blocks = target.embed(target.params, jnp.full((2, 8), 127))
    want = drafter.train_hidden(drafter.params, features, blocks, anchors, valid)
    got = drafter.train_hidden(packed, features, blocks, anchors, valid)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_save_load_is_bit_exact(tmp_path, target, dtype):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    official(src, layers=2)
    first = load_drafter(src, target, dtype)
    save_drafter(first, out)
    second = load_drafter(out, target, dtype)
    assert first.config == second.config
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                           first.params, second.params)
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["model_type"] == "qwen3"
    assert saved["dflash_config"]["target_layer_ids"] == [1, 3]
    # The saved tensors carry exactly the official names and shapes.
    from safetensors import safe_open
    with safe_open(src / "model.safetensors", "pt") as a, safe_open(out / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            assert a.get_slice(k).get_shape() == b.get_slice(k).get_shape()


def test_saved_drafter_loads_in_torch_reference(tmp_path, target):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    hf, ref = official(src, layers=2)
    save_drafter(load_drafter(src, target), out)
    from support.dflash_torch_reference import RefDrafter
    from safetensors.torch import load_file
    again = RefDrafter(json.loads((out / "config.json").read_text()))
    again.load_state_dict(load_file(out / "model.safetensors"), strict=False)
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], p, rtol=0, atol=0)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 32, "hidden size"),
    ("num_target_layers", 36, "number of target layers"),
    ("vocab_size", 200, "vocab size"),
])
def test_mismatched_target_raises(tmp_path, target, field, value, message):
    hf = drafter_hf_config()
    hf[field] = value
    if field == "hidden_size":
        hf["head_dim"] = 8
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(DrafterMismatchError, match=message):
        load_drafter(tmp_path, target)


def test_mask_token_outside_vocab_raises(tmp_path, target):
    hf = drafter_hf_config(mask_token_id=500)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(DrafterMismatchError, match="mask token"):
        load_drafter(tmp_path, target)


def test_missing_directory_and_tensor(tmp_path, target):
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "nope", target)
    official(tmp_path, layers=2)
    from safetensors.numpy import load_file, save_file
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj.weight"):
        load_drafter(tmp_path, target)


def test_default_layer_selection_rule():
    from dflash_jax.drafters.config import default_target_layer_ids
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(30, 1) == (15,)
    assert default_target_layer_ids(28, 5) == (1, 7, 13, 19, 25)


def test_block_size_inside_dflash_config_and_default_ids(tmp_path):
    from dflash_jax.drafters.config import DrafterConfig
    hf = drafter_hf_config(layers=5, num_target_layers=36)
    del hf["block_size"]
    del hf["dflash_config"]["target_layer_ids"]
    hf["dflash_config"]["block_size"] = 10
    cfg = DrafterConfig.from_hf_config(hf)
    assert cfg.block_size == 10 and cfg.target_layer_ids == (1, 9, 17, 25, 33)


def test_mask_token_resolution_order():
    from types import SimpleNamespace

    from dflash_jax.drafters.config import resolve_mask_token_id

    class Tok(SimpleNamespace):
        def __len__(self):
            return self.n

    assert resolve_mask_token_id(7, Tok(n=5, mask_token_id=3), 10) == 7
    assert resolve_mask_token_id(None, Tok(n=5, mask_token_id=3), 10) == 3
    assert resolve_mask_token_id(None, Tok(n=5, mask_token_id=None), 10) == 5  # first unused row
    assert resolve_mask_token_id(None, Tok(n=10, mask_token_id=None, pad_token_id=1), 10) == 1
    assert resolve_mask_token_id(None, Tok(n=10, mask_token_id=None, pad_token_id=None, eos_token_id=2), 10) == 2
    with pytest.raises(ValueError, match="mask token"):
        resolve_mask_token_id(None, None, 10)


def test_missing_num_target_layers_comes_from_target(tmp_path, target):
    hf = drafter_hf_config(layers=2)
    del hf["num_target_layers"]
    hf["torch_dtype"] = "bfloat16"
    write_official_checkpoint(tmp_path, hf)
    drafter = load_drafter(tmp_path, target)
    assert drafter.config.num_target_layers == target.config.num_layers
    save_drafter(drafter, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["num_target_layers"] == 4 and saved["dtype"] == "float32" and "torch_dtype" not in saved
