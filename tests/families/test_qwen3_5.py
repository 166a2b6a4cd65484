"""Qwen3.5 hybrid targets (Gated DeltaNet + gated attention), what is theirs alone: the delta rule's
forms against transformers' reference, masked positions and rollback of the recurrent state, the
vision tower of a multimodal checkpoint, and their loading errors. Parity with transformers,
cached ragged prefill, speculative decoding with rejections and sampling are the conformance
suite's (test_family_conformance.py, the qwen3_5 row of support/families.py)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax._errors import CheckpointError
from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.drafters.drafter import Drafter, init_drafter_params
from dflash_jax.engine.generator import generate
from dflash_jax.families.qwen3_5 import gated_delta as gd
from dflash_jax.models.config import LinearAttentionConfig, ModelConfig
from dflash_jax.models.target import init_target_params, Target
from support import families

ROW = families.FAMILIES["qwen3_5"]


def _hf():
    """(torch, transformers) for the tests against transformers, which skip without them (the
    jax-latest leg has no torch); the rest of this file needs neither."""
    return families.hf_modules("qwen3_5")


# ---------------------------------------------------------------------------------------------
# The delta rule and its rollback

def _delta_inputs(rng, b=2, t=37, hk=2, hv=4, dk=8, dv=8):
    q = gd.l2_normalize(jnp.asarray(rng.normal(size=(b, t, hk, dk)), jnp.float32))
    k = gd.l2_normalize(jnp.asarray(rng.normal(size=(b, t, hk, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(b, t, hv, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 2.0, size=(b, t, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, size=(b, t, hv)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(b, hv, dk, dv)), jnp.float32)
    return q, k, v, g, beta, state


def test_delta_rule_forms_agree_with_transformers_reference():
    torch, _ = _hf()
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    q, k, v, g, beta, state = _delta_inputs(np.random.default_rng(2), t=150)
    t = lambda x: torch.as_tensor(np.array(x))
    rule = jax.jit(gd.delta_rule, static_argnames="form")  # compiled, as the model runs it
    for form in ("recurrent", "chunked"):
        out, final = rule(q, k, v, g, beta, state, form=form)
        fn = ref.torch_recurrent_gated_delta_rule if form == "recurrent" else ref.torch_chunk_gated_delta_rule
        want, want_final = fn(t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=t(state), output_final_state=True)
        np.testing.assert_allclose(np.asarray(out), want.numpy(), atol=2e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(final), want_final.numpy(), atol=2e-5, rtol=0)


def test_unit_lower_inverse_by_doubling():
    rng = np.random.default_rng(7)
    inverse = jax.jit(gd.unit_lower_inverse)  # compiled, as the chunked form runs it
    for c in (1, 3, 16, 37, 64):
        m = np.tril(rng.uniform(-1, 1, size=(3, c, c)), -1) + np.eye(c)
        want = np.linalg.inv(m)
        got = np.asarray(inverse(jnp.asarray(m, jnp.float32)))
        np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_masked_positions_leave_the_state_exactly_unchanged(form):
    """valid[b] = n gives the state after the first n positions alone, for every n of a block."""
    # the inputs as numpy arrays: cut on the host, not by an eager slice compiled per shape
    q, k, v, g, beta, state = map(np.asarray, _delta_inputs(np.random.default_rng(3), t=16))
    rule = jax.jit(lambda *args: gd.delta_rule(*args, form=form)[1])
    for n in range(17):
        masked = np.asarray(rule(q, k, v, g, beta, state, np.asarray([n, 16 - n])))
        for row, m in enumerate((n, 16 - n)):
            cut = lambda x: x[row:row + 1, :m]
            if m == 0:
                np.testing.assert_array_equal(masked[row], state[row])
                continue
            alone = rule(*map(cut, (q, k, v, g, beta)), state[row:row + 1], None)
            tol = 0 if form == "recurrent" else 1e-6  # the chunk's inverse over 16 vs m positions
            np.testing.assert_allclose(masked[row], np.asarray(alone[0]), atol=tol, rtol=0)


def tiny_hybrid(seed=0, vocab=48, scale=4.0, layer_types=("linear_attention",) * 3 + ("full_attention",)):
    cfg = ModelConfig(arch="qwen3_5", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_layers=len(layer_types), num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                      partial_rotary_factor=0.25, layer_types=layer_types,
                      linear=LinearAttentionConfig(conv_kernel_dim=4, num_key_heads=2, num_value_heads=4,
                                                   key_head_dim=8, value_head_dim=8))
    params = init_target_params(cfg, jax.random.PRNGKey(seed))
    params = jax.tree_util.tree_map(lambda x: x * scale if x.ndim >= 2 else x, params)  # sharper logits
    return Target(cfg, params)


# make test-all: the masked-state test and test_family_conformance's rejections test (every acceptance length)
# check rollback by default
@pytest.mark.slow
def test_state_after_rollback_equals_plain_decoding_of_the_accepted_tokens():
    """A verify of 8 tokens committed for n = 0..8 (two rows, n and 8 - n) holds what a forward of
    the first n tokens alone writes: the first layer's conv tail bit for bit (its inputs are the
    embeddings), the rest to the float32 rounding of an 8-position chunk against an n-position one
    (a later layer's inputs went through an earlier layer's delta rule)."""
    target = tiny_hybrid()
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, 40, size=(2, 11)), jnp.int32)
    block = jnp.asarray(rng.integers(0, 40, size=(2, 8)), jnp.int32)
    forward = jax.jit(lambda p, t, c: target.forward(p, t, c))
    _, _, cache = forward(target.params, prompt, target.init_cache(2, 64))
    _, _, pending = jax.jit(lambda p, t, c: target.forward(p, t, c, write_cache=False))(target.params, block, cache)
    commit = jax.jit(lambda c, pd, n: c.commit(pd, n))
    for n in range(9):
        counts = jnp.asarray([n, 8 - n])
        rolled = commit(cache, pending, counts)
        for row, m in enumerate((n, 8 - n)):
            one = cache.replace(kv=cache.kv.replace(k=cache.kv.k[:, row:row + 1], v=cache.kv.v[:, row:row + 1],
                                                    lengths=cache.kv.lengths[row:row + 1]),
                                conv=cache.conv[:, row:row + 1], state=cache.state[:, row:row + 1])
            if m:
                _, _, one = forward(target.params, block[row:row + 1, :m], one)
            assert int(rolled.lengths[row]) == 11 + m
            np.testing.assert_array_equal(np.asarray(rolled.conv[0, row]), np.asarray(one.conv[0, 0]))
            close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)
            close(rolled.conv[:, row], one.conv[:, 0])
            close(rolled.state[:, row], one.state[:, 0])
            used = slice(0, 11 + m)
            close(rolled.kv.k[:, row, used], one.kv.k[:, 0, used])
            close(rolled.kv.v[:, row, used], one.kv.v[:, 0, used])


# ---------------------------------------------------------------------------------------------
# Loading and bad input

@pytest.mark.parametrize("variant", [pytest.param(v, marks=[pytest.mark.slow] if v in ROW.slow_variants else [])
                                     for v in ROW.variants])
def test_vision_tower_is_not_read_and_packed_layout_is_refused(variant, tmp_path):
    from dflash_jax import load_target

    families.make_hf("qwen3_5", tmp_path, variant=variant)
    target = load_target(tmp_path, tokenizer=False)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert target.config.num_layers == (hf.get("text_config") or hf)["num_hidden_layers"]
    with pytest.raises(ValueError, match="no packed layout"):
        load_target(tmp_path, tokenizer=False, layout="packed")


def test_missing_linear_attention_tensor_is_one_clear_error(tmp_path):
    from safetensors.numpy import load_file, save_file

    from dflash_jax import load_target

    families.make_hf("qwen3_5", tmp_path, num_hidden_layers=4)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.linear_attn.in_proj_b.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.2\.linear_attn\.in_proj_b"):
        load_target(tmp_path, tokenizer=False)


def test_drafter_reading_layers_the_target_lacks_is_refused():
    from dflash_jax.loading.drafter_io import DrafterMismatchError

    target = families.tiny_target("qwen3_5", num_hidden_layers=4, vocab_size=48)  # (numpy weights: no compile)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                        vocab_size=48, num_target_layers=8, target_layer_ids=(1, 6), block_size=4, mask_token_id=47)
    drafter = Drafter(cfg, init_drafter_params(cfg, jax.random.PRNGKey(0)))
    with pytest.raises(DrafterMismatchError, match="layers"):
        generate(target, drafter, [[1, 2, 3]], max_new_tokens=4)
