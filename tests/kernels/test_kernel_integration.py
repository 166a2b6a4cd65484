"""The models run through the Pallas kernel (interpret mode on CPU; compiled on a GPU with
DFLASH_PALLAS_BACKEND=compiled) and agree with the reference:
the target's cached causal/sliding attention, drafter inference and the packed training entry."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.drafters.drafter import Drafter, drafter_param_shapes
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.target import Target, target_param_shapes
from support.families import drawn_params

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
    drafter = Drafter(DRAFTER, drawn_params(drafter_param_shapes(DRAFTER), seed, scale=0.2))
    return *both(drafter), np.random.default_rng(seed)


def normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape).astype(np.float32))


def test_target_cached_forward_through_kernel():
    ref, ker = both(Target(TARGET, drawn_params(target_param_shapes(TARGET), 0, scale=0.2)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 49, size=(2, 7)))
    outs = []
    for t in (ref, ker):
        def run(params, tokens, cache, t=t):  # one program per model, not op by op
            h1, f1, cache = t.forward(params, tokens, cache, capture=(0,), num_new=jnp.asarray([7, 4]))
            h2, _, _ = t.forward(params, tokens[:, :3], cache)
            return h1, f1, h2

        outs.append(jax.jit(run)(t.params, tokens, t.init_cache(2, 20)))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


@pytest.fixture(scope="module")
def drafter_runs():
    """For the reference drafter and the kernel drafter (the same random params): the context
    appended to the cache and a block drafted from it, the packed training entry's hidden states and
    the gradients of a random scalar of them (the second row's last block padding), in one program
    per drafter (the training entry's forward traced once for its output and its gradient)."""
    ref, ker, rng = drafters_and_rng(1)
    feats, block, packed = normal(rng, 2, 9, 64), normal(rng, 2, 4, 32), normal(rng, 2, 8, 32)
    anchors, valid = jnp.asarray([[3, 7], [5, 0]]), jnp.asarray([[True, True], [True, False]])
    weights = normal(rng, 2, 8, 32)
    results = []
    for d in (ref, ker):
        def run(params, cache, d=d):
            cache = d.append_context(params, cache, feats, num_new=jnp.asarray([9, 6]))
            trained, vjp = jax.vjp(lambda p: d.train_hidden(p, feats, packed, anchors, valid), params)
            return (d.draft_hidden(params, block, cache), trained), vjp(weights)[0]

        results.append(jax.jit(run)(d.params, d.init_cache(2, 16)))
    return results


def test_drafter_inference_and_training_through_kernel(drafter_runs):
    (ref, _), (ker, _) = drafter_runs
    for a, b in zip(ref, ker):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_drafter_training_gradients_through_kernel(drafter_runs):
    (_, ref_grads), (_, ker_grads) = drafter_runs
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), ref_grads, ker_grads)


def test_cached_paths_lower_to_triton_inside_the_layer_scans():
    """The target's cached forward and the drafter's block, with the Pallas kernel reading the
    caches inside their layer scans, lower for CUDA here (an abstract GPU: no device needed). On
    jax 0.11.2 / flax 0.12.10 with flax's scan constancy check on, this raised "broadcasted
    variable has a data dependency on the scan body", the failure first seen compiling on a GPU;
    the scans skip that check (`check_constancy_invariants=False`), so the kernel traces there."""
    from support.pallas import abstract_gpu

    target = Target(TARGET, drawn_params(target_param_shapes(TARGET), 0, scale=0.2), attn_impl="pallas")
    drafter = Drafter(DRAFTER, drawn_params(drafter_param_shapes(DRAFTER), 1, scale=0.2), attn_impl="pallas")
    cases = {
        "target": (lambda p, t, c: target.forward(p, t, c, capture=(0,)),
                   (target.params, jnp.zeros((2, 7), jnp.int32), target.init_cache(2, 64))),
        "drafter": (drafter.draft_hidden, (drafter.params, jnp.zeros((2, 4, 32)), drafter.init_cache(2, 64))),
    }
    for name, (f, args) in cases.items():
        try:
            with abstract_gpu():
                text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        except (TypeError, AttributeError) as e:  # an API this jax version lacks
            pytest.skip(f"cross-platform lowering unavailable: {e}")
        # one layer body, traced once inside the scan: the cache read and the new keys' part
        assert text.count("__gpu$xla.gpu.triton") == 2, name


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sink_kernel_lowers_to_triton_for_cuda(num_splits):
    """The kernel with attention sinks (gpt-oss), forward and the custom VJP in q, k, v and the
    sinks, lowers for CUDA here (an abstract H100): three Triton calls as without sinks, the
    forward with one more operand (the folded sink logits); with the key tiles split over programs
    the sink enters the first split's softmax (a program-id test inside the kernel)."""
    from dflash_jax.kernels import block_attention, BlockSizes, masks
    from support.pallas import abstract_gpu
    import re

    blocks = BlockSizes(block_q=32, block_k=32, num_splits=num_splits)
    q = jnp.zeros((2, 24, 8, 64), jnp.bfloat16)
    k = jnp.zeros((2, 200, 2, 64), jnp.bfloat16)
    ranges = masks.causal(jnp.arange(24)[None] + jnp.array([[176], [3]]), window=128)

    def lowered(sinks):
        def fwd_and_grad(q, k, v, sinks, start, end):
            def f(q, k, v, sinks):
                return block_attention(q, k, v, masks.KeyRanges(start, end), block_sizes=blocks, sinks=sinks)

            out, vjp = jax.vjp(f, q, k, v, sinks)
            return out, vjp(out)

        with abstract_gpu():
            traced = jax.jit(fwd_and_grad).trace(q, k, k, sinks, ranges.start, ranges.end)
            return traced.lower(lowering_platforms=("cuda",)).as_text()

    try:
        with_sinks, without = lowered(jnp.zeros((8,), jnp.float32)), lowered(None)
    except (TypeError, AttributeError) as e:  # an API this jax version lacks
        pytest.skip(f"cross-platform lowering unavailable: {e}")

    def operand_counts(text):
        calls = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(([^)]*)\)", text)
        return [len(c.split(",")) for c in calls]

    assert len(operand_counts(with_sinks)) == 3
    for name in ("block_attention_fwd", "block_attention_dq", "block_attention_dkdv"):
        assert name in with_sinks
    # the forward comes first: plan, bounds, sinks, q, k, v; the backward kernels are unchanged
    assert operand_counts(with_sinks) == [operand_counts(without)[0] + 1] + operand_counts(without)[1:]


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_auto_reads_caches_with_the_kernel_on_a_gpu_and_the_reference_elsewhere(monkeypatch, platform):
    """What "auto" chooses for a model's cache reads (the choice, not a timing): the Pallas
    kernel on a GPU, for the cached part and the new keys alike; the chunked reference on a CPU
    (the XLA backend's models: the CPU backend's kernel is its own choice, tests/backends/test_cpu_attention.py)."""
    import dataclasses

    from dflash_jax.kernels import reference_attention_with_lse, registry
    from dflash_jax.layers import attention as _attention

    calls = []

    def kernel(q, k, v, ranges, *, scale=None, interpret=False):
        calls.append(("kernel", k.shape[1], interpret))
        return reference_attention_with_lse(q, k, v, ranges, scale=scale)

    chunked = _attention.chunked_cache_attention_with_lse

    def reference(*args, **kwargs):
        calls.append(("reference",))
        return chunked(*args, **kwargs)

    monkeypatch.setattr(_attention, "_platform", lambda: platform)
    gpu = dataclasses.replace(registry.KERNELS["gpu"], attention_with_lse=kernel)  # the GPU's kernel, recorded
    monkeypatch.setitem(registry.KERNELS, "gpu", gpu)
    monkeypatch.setattr(_attention, "chunked_cache_attention_with_lse", reference)
    target = Target(TARGET, drawn_params(target_param_shapes(TARGET), 0, scale=0.2))  # attn_impl "auto"
    assert target.attn_impl == "auto" and target.module_for(target.params).backend == "xla"
    cache = target.init_cache(2, 20)
    # the spec's forward, traced on each call (`Target.forward` would reuse the program it compiled
    # under the other platform's patch)
    target.spec.forward(target.params, jnp.zeros((2, 3), jnp.int32), cache)
    if platform == "gpu":  # the cache's 20 slots, then the 3 new keys; never the reference
        assert calls == [("kernel", 20, False), ("kernel", 3, False)], calls
    else:
        assert calls == [("reference",)], calls
