"""Q4_1 products with int8 activations (`load_target(..., decode_activations="int8")`, llama.cpp's
CPU arithmetic): the panels hold the file's own weights, the kernel multiplies them with each row
of x rounded to int8 per block of 32 (`round_activations`), every row's result is independent of
the rows beside it (so a verify equals its tokens one step at a time and greedy speculative
decoding equals plain decoding of this model), and the model stays close to the float32 one."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.backends.cpu.matmul import (ACTIVATIONS, INT8_TARGET_NAME, PANEL, PANEL_BLOCK_BYTES, _xla_panels,
                                           available, dequantize_panels, pack_quantized, round_activations,
                                           uses_int8_activations)
from support.cli import kwargs_given_to_load_target
from support.cpu_kernels import (check_rows_products, check_stacked_layers_are_their_own_products, ggml_blocks,
                                 needs_kernel)


def test_rounded_activations_are_int8_steps_of_one_scale_per_block():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 96)).astype(np.float32) * np.array([1e-3, 1.0, 40.0], np.float32)[:, None]
    x[1, 32:64] = 0.0  # an all-zero block stays zero
    got = np.asarray(round_activations(jnp.asarray(x))).reshape(3, 3, 32)
    blocks = x.reshape(3, 3, 32)
    step = np.abs(blocks).max(-1, keepdims=True) / 127
    q = np.divide(got, step, out=np.zeros_like(got), where=step > 0)
    np.testing.assert_allclose(q, np.round(q), atol=1e-3)  # d * integer ...
    assert np.abs(np.round(q)).max() == 127  # ... the largest |x| of a block at 127 steps
    assert np.all(np.abs(got - blocks) <= step / 2 * (1 + 1e-5))  # within half a step of x
    assert not got[1, 1].any()


@needs_kernel
@pytest.mark.parametrize("n,k", [(48, 64), (40, 576), (96, 1536)])
def test_int8_panels_multiply_their_weights_by_the_rounded_activations(n, k):
    """The same weights as the float32-activation Q4_1 panels (bit for bit) in as many bytes (320
    per block of 32 x 16), typed int8 to tell them apart; the kernel's
    product is that of the rounded x with them to float rounding (XLA's path computes exactly
    that), and a row's result is the same bit for bit whatever rows share the call (1-6 rows in a
    tile, groups of tiles)."""
    blocks = ggml_blocks("Q4_1", n, k, seed=n + k)
    panels, floats = pack_quantized(blocks, "Q4_1", activations="int8"), pack_quantized(blocks, "Q4_1")
    assert uses_int8_activations(panels) and not uses_int8_activations(floats)
    assert panels.shape == floats.shape == (-(-n // PANEL), k // 32, PANEL_BLOCK_BYTES["Q4_1"])
    assert panels.dtype == jnp.int8 and floats.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(dequantize_panels(panels)), np.asarray(dequantize_panels(floats)))
    x = np.random.default_rng(k).standard_normal((40, k)).astype(np.float32)
    weights = np.asarray(dequantize_panels(floats)).transpose(1, 0, 2).reshape(k, -1)[:, :n].astype(np.float64)
    want = np.asarray(round_activations(jnp.asarray(x)), np.float64) @ weights
    alone = check_rows_products(panels, x, want, n, INT8_TARGET_NAME, (1, 2, 3, 4, 5, 6, 7, 13, 40))
    reference = np.asarray(jax.jit(_xla_panels)(x, panels))[:, :n]  # where the kernel does not run
    np.testing.assert_allclose(alone, reference, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    check_stacked_layers_are_their_own_products(
        pack_quantized(np.stack([blocks, ggml_blocks("Q4_1", n, k, seed=1)]), "Q4_1", activations="int8"), k, n)


def test_int8_activations_are_for_q4_1_blocks_only():
    with pytest.raises(ValueError, match="int8 activations multiply Q4_1 blocks, not Q8_0"):
        pack_quantized(ggml_blocks("Q8_0", 16, 64), "Q8_0", activations="int8")
    with pytest.raises(ValueError, match="activations must be one of"):
        pack_quantized(ggml_blocks("Q4_1", 16, 64), "Q4_1", activations="int4")


@pytest.fixture(scope="module")
def targets(gguf_path):
    from dflash_jax.loading.target_loader import load_target

    if not available():
        pytest.skip("the CPU rows kernel is not built here")
    return load_target(gguf_path, "float32"), load_target(gguf_path, "float32", decode_activations="int8")


def test_smollm2_with_int8_activations_stays_close_to_float32(targets):
    """The layers' Q4_1 products take int8 activations (320-byte blocks), the Q8_0 head does not;
    the logits of a chat prompt differ from the float32 activations' by the rounding (a few
    percent of the largest logit, the same next token at most positions), as llama.cpp's do."""
    import flax

    from dflash_jax.cli.common import encode_prompt

    floats, int8 = targets
    assert (floats.decode_activations, int8.decode_activations) == ("float32", "int8")
    kernels = flax.traverse_util.flatten_dict(int8.params["layers"])
    kernels = {path: w for path, w in kernels.items() if path[-1] == "kernel"}
    assert len(kernels) == 4 and all(uses_int8_activations(w) for w in kernels.values())
    assert int8.params["head"].shape[-1] == PANEL_BLOCK_BYTES["Q8_0"]
    ids = jnp.asarray([encode_prompt(floats.tokenizer, "What is the capital of France?")], jnp.int32)

    def logits(target):
        hidden, _, _ = target.forward(target.params, ids, target.init_cache(1, 64))
        return np.asarray(target.logits(target.params, hidden))[0]

    got, want = logits(int8), logits(floats)
    assert not np.array_equal(got, want)
    assert np.abs(got - want).max() < 0.15 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.8


def test_smollm2_with_int8_activations_verifies_a_block_as_its_steps(targets):
    """A block of 5 tokens through the cache gives, bit for bit, the logits of the 5 tokens fed
    one step at a time: what makes speculative decoding of this model lossless."""
    target = targets[1]
    forward = jax.jit(lambda p, x, c: target.forward(p, x, c))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, target.config.vocab_size, (1, 17)), jnp.int32)
    _, _, cache = forward(target.params, tokens[:, :12], target.init_cache(1, 32))
    block, _, _ = forward(target.params, tokens[:, 12:], cache)
    steps = []
    for t in range(12, 17):
        hidden, _, cache = forward(target.params, tokens[:, t:t + 1], cache)
        steps.append(hidden[:, 0])
    np.testing.assert_array_equal(np.asarray(block), np.stack(steps, axis=1))


# newer-jax leg only (`one_leg`); both legs: a block verified as its steps, bit for bit (above), which
# makes speculative decoding lossless, and the speculative loop's own checks (test_generate.py)
@pytest.mark.one_leg
def test_greedy_speculative_decoding_of_the_int8_model_equals_its_plain_decoding(targets):
    from dflash_jax.cli.common import encode_prompt, shipped_drafter_dir
    from dflash_jax.engine.generator import generate
    from dflash_jax.loading.drafter_io import load_drafter

    target = targets[1]
    if shipped_drafter_dir() is None:
        pytest.skip("no shipped drafter")
    drafter = load_drafter(shipped_drafter_dir(), target, decode_weights="q8_0")
    prompts = [encode_prompt(target.tokenizer, q) for q in ("Name three colours of the rainbow.",
                                                            "Write a haiku about rain.")]
    for prompt in prompts:
        spec = generate(target, drafter, [prompt], max_new_tokens=40, lookup=3, min_draft_probability=0.3)
        plain = generate(target, None, [prompt], max_new_tokens=40)
        assert spec.tokens == plain.tokens
    assert max(max(lengths) for lengths in spec.acceptance_lengths) > 1  # drafts were accepted


def test_int8_activations_are_refused_where_they_do_not_apply(tmp_path):
    from dflash_jax.loading.target_loader import load_target

    with pytest.raises(ValueError, match="decode_activations must be one of"):
        load_target(tmp_path / "missing", decode_activations="int4")  # before anything is read
    with pytest.raises(ValueError, match="a GGUF file's Q4_1 blocks"):
        load_target(tmp_path, decode_activations="int8")  # a (Hugging Face) directory


def test_int8_activations_need_a_float32_cpu_decode(gguf_path):
    from dflash_jax.loading.target_loader import load_target

    with pytest.raises(ValueError, match="bfloat16"):
        load_target(gguf_path, "bfloat16", tokenizer=False, decode_activations="int8")
    with pytest.raises(ValueError, match="'stacked'"):
        load_target(gguf_path, tokenizer=False, layout="stacked", decode_activations="int8")


def test_the_clis_take_decode_activations_and_pass_it_to_load_target(monkeypatch):
    from dflash_jax.cli import benchmark, demo, generate as generate_cli

    for cli, required in ((generate_cli, ["--prompt", "Hi"]), (benchmark, []), (demo, [])):
        parse = lambda *argv: cli.build_parser().parse_args([*required, *argv])  # noqa: E731
        assert parse().decode_activations == "float32"  # the float32 model unless asked
        for name in ACTIVATIONS:
            assert parse("--decode-activations", name).decode_activations == name
        with pytest.raises(SystemExit):
            parse("--decode-activations", "int4")
    for value in ACTIVATIONS:
        assert kwargs_given_to_load_target(monkeypatch, Path("model.gguf"), decode_activations=value)[
            "decode_activations"] == value
    assert kwargs_given_to_load_target(monkeypatch, Path("model.gguf"))["decode_activations"] == "float32"
