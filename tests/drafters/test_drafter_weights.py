"""Q8_0 drafter weights (`load_drafter(..., decode_weights="q8_0")`, `--drafter-weights`): the
quantizer keeps every weight within half a step of its block's scale, the rows kernel multiplies
the quantized panels as XLA multiplies their floats, a CPU drafts with them, and greedy output
stays identical to plain decoding (a draft is only a proposal)."""
import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.cli import common
from dflash_jax.drafters.drafter import DECODE_WEIGHTS, DrafterSpec
from dflash_jax.backends.cpu.matmul import (PANEL_BLOCK_BYTES, QUANT_BLOCK, available, dequantize_panels,
                                           pack_kernel, quantize_q8_0, rows_matmul)
from dflash_jax.engine.generator import generate
from dflash_jax.loading.drafter_io import load_drafter
from support.speculative import plain_greedy, prompts_mix

needs_kernel = pytest.mark.skipif(not available(), reason="the CPU kernels are not built here")


def _panel_floats(panels, n):
    """Narrow panels [..., P, K / 32, bytes] -> the float kernel [..., K, n] the kernel multiplies by."""
    floats = np.asarray(dequantize_panels(panels))  # [..., P, K, 16]
    *lead, p, k, _ = floats.shape
    return np.swapaxes(floats, -3, -2).reshape(*lead, k, p * 16)[..., :n]


def test_q8_0_blocks_keep_every_weight_within_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32) * np.geomspace(1e-3, 10, 40, dtype=np.float32)
    w[:32, 3] = 0.0  # a block of zeros: scale 0, values 0
    blocks = quantize_q8_0(w)
    assert blocks.shape == (40, 3, 34) and blocks.dtype == np.uint8
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K / 32]
    values = blocks[..., 2:].view(np.int8).astype(np.float32)  # [N, K / 32, 32]
    assert np.abs(values).max() <= 127
    rebuilt = (values * scales[..., None]).reshape(40, 96).T
    step = np.repeat(scales.T, QUANT_BLOCK, axis=0)  # [K, N]: each weight's block scale
    assert np.all(np.abs(rebuilt - w) <= step / 2 * 1.01 + 1e-12)
    assert np.all(rebuilt[:32, 3] == 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(w[:40])


@needs_kernel
def test_q8_0_panels_multiply_as_their_floats_stacked_and_side_by_side():
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((3, 64, n)).astype(np.float32) for n in (48, 20))  # [L, K, N], 48 = 3 panels
    packed = pack_kernel(a, b, quantize="q8_0")
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, 2, PANEL_BLOCK_BYTES["Q8_0"])
    floats = _panel_floats(packed, 68)  # [L, K, 68]
    both = np.concatenate([a, b], axis=-1)
    np.testing.assert_allclose(floats, both, atol=np.abs(both).max() / 127)  # within a step
    x = jnp.asarray(rng.standard_normal((2, 64)).astype(np.float32))
    for layer in range(3):
        got = rows_matmul(x, packed, 68, jnp.asarray(layer, jnp.int32))
        np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ floats[layer], rtol=2e-5, atol=2e-5)
    odd = rng.standard_normal((40, 16)).astype(np.float32)  # K not a multiple of 32: float panels
    assert pack_kernel(odd, quantize="q8_0").dtype == jnp.float32
    with pytest.raises(ValueError, match="quantize must be one of"):
        pack_kernel(odd, quantize="q4_0")


@needs_kernel
def test_a_q8_0_drafter_drafts_from_q8_0_panels_and_greedy_stays_plain(fitted):
    target, drafter = fitted
    quantized = dataclasses.replace(drafter, decode_weights="q8_0")
    packed = quantized.spec.decode_params(quantized.loop_params)
    for path, w in jax.tree_util.tree_flatten_with_path(packed)[0]:
        if "kernel" in jax.tree_util.keystr(path):
            assert w.dtype == jnp.uint8 and w.shape[-1] == PANEL_BLOCK_BYTES["Q8_0"], jax.tree_util.keystr(path)
    prompts = prompts_mix(7)
    result = generate(target, quantized, prompts, max_new_tokens=30, stop_token_ids=())
    stored = generate(target, drafter, prompts, max_new_tokens=30, stop_token_ids=())
    assert result.tokens == stored.tokens
    for prompt, row in zip(prompts, result.tokens):
        assert row == plain_greedy(target, prompt, 30)
    assert max(max(lengths) for lengths in result.acceptance_lengths) > 1  # its drafts still land


def test_bad_decode_weights_are_refused(fitted, tmp_path):
    _, drafter = fitted
    with pytest.raises(ValueError, match="decode_weights must be one of"):
        DrafterSpec(drafter.config, decode_weights="int4")
    with pytest.raises(ValueError, match="decode_weights must be one of"):
        load_drafter(tmp_path / "missing", decode_weights="int4")  # before the path is looked at


def test_the_clis_draft_with_q8_0_weights_of_the_shipped_drafter_only(tmp_path, capsys):
    shipped = common.shipped_drafter_dir()
    resolve = lambda value, path: common.drafter_weights_for(argparse.Namespace(drafter_weights=value), path)
    if shipped is not None:
        assert resolve(None, shipped) == common.SHIPPED_DRAFTER_WEIGHTS == "q8_0"
        assert resolve("stored", shipped) == "stored"
    assert resolve(None, tmp_path) == "stored" and resolve("q8_0", tmp_path) == "q8_0"
    assert resolve(None, None) == "stored"
    resolve("q8_0", None)
    assert "--drafter-weights only applies with a drafter" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    common.add_drafting_flags(parser)
    assert parser.parse_args([]).drafter_weights is None
    for name in DECODE_WEIGHTS:  # the flag offers every choice the drafter takes
        assert parser.parse_args(["--drafter-weights", name]).drafter_weights == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--drafter-weights", "int4"])
