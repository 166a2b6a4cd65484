"""A float16 KV cache under a float32 target (`kv_cache_dtype`): the cache stores float16, the
logits stay close to the float32 cache's, and speculative decoding stays bit-identical to plain
decoding with the same cache (a block's new keys are rounded as a later step reads them from the
cache), through the CPU kernel and through the jnp reference alike."""
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.backends.cpu.attention import applies
from dflash_jax.backends.cpu.layout import pack_layers
from dflash_jax.engine.generator import generate
from dflash_jax.loading.target_loader import load_target
from dflash_jax.models.cache import KV_CACHE_DTYPE_NAMES, resolve_kv_cache_dtype
from dflash_jax.models.target import init_target_params, Target, TargetSpec
from support.cli import kwargs_given_to_load_target
from support.fitted_models import TARGET_CONFIG
from support.speculative import plain_greedy_rows, prompts_mix


def _prefill_and_steps(target, tokens, prefix: int):
    """Logits of tokens[prefix:] fed one at a time after a prefill of tokens[:prefix], and the cache."""
    fwd = jax.jit(lambda p, t, c: target.forward(p, t, c))
    cache = target.init_cache(1, 64)
    _, _, cache = fwd(target.params, jnp.asarray([tokens[:prefix]], jnp.int32), cache)
    logits = []
    for token in tokens[prefix:]:
        hidden, _, cache = fwd(target.params, jnp.asarray([[token]], jnp.int32), cache)
        logits.append(np.asarray(target.logits(target.params, hidden))[0, 0])
    return np.stack(logits), cache


@pytest.fixture(scope="module")
def float32_steps(fitted):
    """(tokens, the float32 cache's logits and cache): one run for both narrow dtypes."""
    target, _ = fitted
    tokens = [int(t) for t in prompts_mix(3)[2]] + [5, 9, 11, 2, 7, 30]
    return tokens, *_prefill_and_steps(target, tokens, 8)


@pytest.mark.parametrize("kv_cache_dtype,tolerance", [("float16", 2e-2), ("bfloat16", 6e-2)])
def test_a_narrow_cache_stores_its_dtype_and_its_logits_stay_close(fitted, float32_steps, kv_cache_dtype,
                                                                   tolerance):
    """float16 goes through the CPU kernel, bfloat16 through XLA's path (the reference)."""
    target, _ = fitted
    narrow = dataclasses.replace(target, kv_cache_dtype=kv_cache_dtype)
    tokens, want, cache32 = float32_steps
    got, cache = _prefill_and_steps(narrow, tokens, 8)
    assert cache32.k.dtype == jnp.float32 and cache.k.dtype == cache.v.dtype == jnp.dtype(kv_cache_dtype)
    # the first layer's keys come from the same embeddings: the float32 ones, rounded
    np.testing.assert_array_equal(np.asarray(cache.k[0].astype(jnp.float32)),
                                  np.asarray(cache32.k[0].astype(kv_cache_dtype).astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(cache.k, np.float32), np.asarray(cache32.k), atol=tolerance,
                               rtol=tolerance)
    assert not np.array_equal(got, want)  # the rounding is there ...
    np.testing.assert_allclose(got, want, atol=tolerance * np.abs(want).max())  # ... and small


@pytest.mark.skipif(not applies(jnp.zeros(1), jnp.zeros(1, jnp.float16), jnp.zeros(1, jnp.float16)),
                    reason="the CPU kernels are not built here")
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
@pytest.mark.parametrize("head_dim", [16, 64])  # the kernel's generic and vectorised paths
def test_a_block_through_the_cache_equals_its_tokens_one_step_at_a_time(kv_cache_dtype, head_dim):
    """What makes a verify agree with plain decoding, bit for bit, on a CPU (the packed layout
    `generate` decodes with there): a block's hidden states are those of its tokens fed one at a
    time. With a float16 cache that holds only because the block's own keys are rounded to
    float16 before its later tokens read them, as a step reads them from the cache."""
    config = dataclasses.replace(TARGET_CONFIG, head_dim=head_dim)
    target = Target(config, pack_layers(init_target_params(config, jax.random.PRNGKey(0))),
                    kv_cache_dtype=kv_cache_dtype)
    forward = jax.jit(lambda p, x, c: target.forward(p, x, c))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, 16)), jnp.int32)
    _, _, cache = forward(target.params, tokens[:, :12], target.init_cache(1, 32))
    block, _, _ = forward(target.params, tokens[:, 12:], cache)
    steps = []
    for t in range(12, 16):
        hidden, _, cache = forward(target.params, tokens[:, t:t + 1], cache)
        steps.append(hidden[:, 0])
    np.testing.assert_array_equal(np.asarray(block), np.stack(steps, axis=1))


# [reference] on the newer-jax leg only (`one_leg`): both legs run [auto] (the same loop over a float16
# cache) and the reference attention's own checks (test_block_attention.py)
@pytest.mark.parametrize("attn_impl", ["auto", pytest.param("reference", marks=pytest.mark.one_leg)])
def test_greedy_with_a_float16_cache_equals_plain_decoding_with_it(fitted, attn_impl):
    """"auto" is the CPU kernel here (float16 K/V read as float32), "reference" the jnp path."""
    target, drafter = fitted
    half = dataclasses.replace(target, kv_cache_dtype="float16", attn_impl=attn_impl)
    prompts = prompts_mix(5)
    result = generate(half, drafter, prompts, max_new_tokens=30, stop_token_ids=(), lookup=3)
    assert max(max(lengths) for lengths in result.acceptance_lengths) > 1  # drafts were accepted
    # plain decoding of the prompts as one ragged batch: two compiled programs, not one per prompt length
    assert result.tokens == plain_greedy_rows(half, prompts, 30)


def test_the_kv_cache_dtype_is_part_of_the_spec():
    assert TargetSpec(TARGET_CONFIG).kv_cache_dtype == jnp.float32
    assert TargetSpec(TARGET_CONFIG, kv_cache_dtype="auto") == TargetSpec(TARGET_CONFIG)
    half = TargetSpec(TARGET_CONFIG, kv_cache_dtype=np.float16)
    assert half == TargetSpec(TARGET_CONFIG, kv_cache_dtype="float16") != TargetSpec(TARGET_CONFIG)
    assert hash(half) == hash(TargetSpec(TARGET_CONFIG, kv_cache_dtype="float16"))
    assert half.init_cache(2, 8).k.dtype == jnp.float16
    assert TargetSpec(TARGET_CONFIG, jnp.bfloat16).init_cache(1, 4).v.dtype == jnp.bfloat16


@pytest.mark.parametrize("bad", ["int8", "float64", "half-ish", jnp.int32])
def test_a_bad_kv_cache_dtype_is_refused_before_anything_is_read(bad, tmp_path):
    with pytest.raises(ValueError, match="KV cache dtype must be one of float32, float16, bfloat16"):
        resolve_kv_cache_dtype(bad, jnp.float32)
    with pytest.raises(ValueError, match="KV cache dtype"):
        load_target(tmp_path / "missing", kv_cache_dtype=bad)


def test_the_clis_take_kv_cache_dtype_and_pass_it_to_load_target(monkeypatch):
    from dflash_jax.cli import benchmark, generate as generate_cli

    for cli, required in ((generate_cli, ["--prompt", "Hi"]), (benchmark, [])):
        parse = lambda *argv: cli.build_parser().parse_args([*required, *argv])
        assert parse().kv_cache_dtype == "auto"
        for name in KV_CACHE_DTYPE_NAMES:  # the flag offers every dtype the cache takes
            assert parse("--kv-cache-dtype", name).kv_cache_dtype == name
        assert parse("--kv-cache-dtype", "float16").kv_cache_dtype == "float16"
        with pytest.raises(SystemExit):
            parse("--kv-cache-dtype", "int8")
    assert kwargs_given_to_load_target(monkeypatch, Path("some-target"), kv_cache_dtype="float16") == {
        "kv_cache_dtype": "float16", "decode_activations": "float32", "mesh": None}  # one device: no mesh
