"""The models run through the Pallas kernel (interpret mode on CPU; compiled on a GPU with
DFLASH_PALLAS_BACKEND=compiled) and agree with the reference:
the target's cached causal/sliding attention, drafter inference and the packed training entry."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax._config import ModelConfig
from dflash_jax._drafter import Drafter, init_drafter_params
from dflash_jax._drafter_config import DrafterConfig
from dflash_jax._target import Target, init_target_params

KERNEL_IMPL = "pallas" if os.environ.get("DFLASH_PALLAS_BACKEND") == "compiled" else "pallas_interpret"

TARGET = ModelConfig(arch="qwen3", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                     layer_types=("sliding_attention", "full_attention"), sliding_window=5)
DRAFTER = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=16, vocab_size=50, num_target_layers=2, target_layer_ids=(0, 1),
                        block_size=4, mask_token_id=49, layer_types=("full_attention", "sliding_attention"),
                        sliding_window=3)


def both(model):
    return model, dataclasses.replace(model, attn_impl=KERNEL_IMPL)


def drafters_and_rng(seed):
    """(reference drafter, kernel drafter) with the same random params, and a numpy generator."""
    drafter = Drafter(DRAFTER, init_drafter_params(DRAFTER, jax.random.PRNGKey(seed)))
    return *both(drafter), np.random.default_rng(seed)


def normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape).astype(np.float32))


# Compiled on an H200 (jax 0.11.2, flax 0.12.10) the cached paths failed to trace inside the layer
# scan ("broadcasted variable has a data dependency on the scan body", flax's constancy check,
# which the scans have skipped since); interpret mode passes. Not strict: an XPASS on the next
# GPU says the kernel may become "auto"'s cache read there.
KNOWN_COMPILED_FAILURE = pytest.mark.xfail(KERNEL_IMPL == "pallas", strict=False,
                                           reason="kernel cache attention inside nn.scan on jax 0.11 GPU")


@KNOWN_COMPILED_FAILURE
def test_target_cached_forward_through_kernel():
    ref, ker = both(Target(TARGET, init_target_params(TARGET, jax.random.PRNGKey(0))))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 49, size=(2, 7)))
    outs = []
    for t in (ref, ker):
        cache = t.init_cache(2, 20)
        h1, f1, cache = t.forward(t.params, tokens, cache, capture=(0,), num_new=jnp.asarray([7, 4]))
        h2, _, _ = t.forward(t.params, tokens[:, :3], cache)
        outs.append((h1, f1, h2))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


@KNOWN_COMPILED_FAILURE
def test_drafter_inference_and_training_through_kernel():
    ref, ker, rng = drafters_and_rng(1)
    feats, block, packed = normal(rng, 2, 9, 64), normal(rng, 2, 4, 32), normal(rng, 2, 8, 32)
    anchors, valid = jnp.asarray([[3, 7], [5, 0]]), jnp.asarray([[True, True], [True, False]])
    results = []
    for d in (ref, ker):
        cache = d.append_context(d.params, d.init_cache(2, 16), feats, num_new=jnp.asarray([9, 6]))
        results.append((d.draft_hidden(d.params, block, cache),
                        d.train_hidden(d.params, feats, packed, anchors, valid)))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_drafter_training_gradients_through_kernel():
    ref, ker, rng = drafters_and_rng(2)
    feats, packed, weights = normal(rng, 1, 9, 64), normal(rng, 1, 8, 32), normal(rng, 1, 8, 32)
    anchors, valid = jnp.asarray([[2, 6]]), jnp.asarray([[True, True]])

    def grads(d):
        loss = lambda p: jnp.sum(weights * d.train_hidden(p, feats, packed, anchors, valid))
        return jax.grad(loss)(d.params)

    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                           grads(ref), grads(ker))
