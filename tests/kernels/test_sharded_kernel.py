"""The Pallas kernel on a device mesh with heads split over `tensor`: the attention seam runs it
under `jax.shard_map` (each device its own query and kv heads, the batch over `data`), so XLA's
partitioner never gathers the kernel's operands. On 8 simulated CPU devices (tensor=2 x data=4),
the kernel in interpret mode through `cache_attention` (a cache layer + new keys, with and without
sinks) and through `attention` (forward and gradients) gives the 1-device result, and the compiled
programs hold no all-gather; without the mesh in context at trace time the same program gathers
(the check can fail). And a Generator on that mesh with the kernel in the target and the drafter
(it traces its programs with the mesh in context) generates the 1-device tokens with no more
all-gathers than the same Generator with the reference attention (the vocabulary's).

Everything multi-device runs in one subprocess (conftest pins this process to 1 device), which
writes its findings as JSON for the tests below.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest


def sharded_run(out: str) -> None:
    """The multi-device checks; findings to `out` (JSON)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dflash_jax import sharding
    from dflash_jax.kernels import masks
    from dflash_jax.layers.attention import attention, cache_attention

    assert len(jax.devices()) == 8, jax.devices()
    mesh = sharding.make_mesh(data=4, tensor=2)
    rng = np.random.default_rng(0)
    b, tq, hq, hkv, d, cap = 4, 5, 4, 2, 16, 32

    def normal(*shape):  # numpy: placed on the mesh by slicing on the host, no program compiled per shard
        return rng.normal(size=shape).astype(np.float32)

    q, new_k, new_v = normal(b, tq, hq, d), normal(b, tq, hkv, d), normal(b, tq, hkv, d)
    cache_k, cache_v, sinks, w = normal(2, b, cap, hkv, d), normal(2, b, cap, hkv, d), normal(hq), normal(b, tq, hq, d)
    lengths = np.asarray([20, 7, cap - tq, 0], np.int32)  # ragged; row 3's cache is empty
    ranges = jax.device_get(masks.causal(jnp.asarray(lengths[:, None] + np.arange(tq, dtype=np.int32)[None]),
                                         window=9))

    def cached(q, cache_k, cache_v, new_k, new_v, sinks, lengths, start, end):
        r = masks.KeyRanges(start, end)
        return cache_attention(q, cache_k, cache_v, 1, r.segment(0, lengths), new_k, new_v,
                               r.segment(lengths, lengths + tq), impl="pallas_interpret", sinks=sinks)

    def no_sinks(q, cache_k, cache_v, new_k, new_v, sinks, lengths, start, end):
        return cached(q, cache_k, cache_v, new_k, new_v, None, lengths, start, end)

    def grads(q, new_k, new_v, sinks, w, start, end):
        def loss(q, k, v, s):
            out = attention(q, k, v, masks.KeyRanges(start, end), impl="pallas_interpret", sinks=s)
            return jnp.sum(w * out)

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, new_k, new_v, sinks)

    heads = NamedSharding(mesh, P("data", None, "tensor", None))
    cache = NamedSharding(mesh, P(None, "data", None, "tensor", None))
    rows, rows3 = NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data", None, None))
    head_vec = NamedSharding(mesh, P("tensor"))
    local_ranges = jax.device_get(masks.causal(jnp.arange(tq, dtype=jnp.int32)[None]
                                               + jnp.asarray([[0], [2], [1], [3]])))
    cases = {
        "cache_attention_sinks": (cached, (q, cache_k, cache_v, new_k, new_v, sinks, lengths, ranges.start, ranges.end),
                                  (heads, cache, cache, heads, heads, head_vec, rows, rows3, rows3)),
        "cache_attention": (no_sinks, (q, cache_k, cache_v, new_k, new_v, sinks, lengths, ranges.start, ranges.end),
                            (heads, cache, cache, heads, heads, head_vec, rows, rows3, rows3)),
        "attention_grads": (grads, (q, new_k, new_v, sinks, w, local_ranges.start, local_ranges.end),
                            (heads, heads, heads, head_vec, heads, rows3, rows3)),
    }
    found = {}
    for name, (fn, args, shardings) in cases.items():
        want = jax.jit(fn)(*args)  # one device
        with jax.set_mesh(mesh):  # the mesh in context while tracing, as the Generator does
            compiled = jax.jit(fn, in_shardings=shardings).lower(*args).compile()
        got = compiled(*jax.device_put(args, shardings))
        # each output's max abs error as a fraction of max(1, its largest 1-device value)
        errors = jax.tree_util.tree_map(
            lambda a, b: float(jnp.abs(a - b).max()) / max(1.0, float(jnp.abs(b).max())), got, want)
        found[name] = {"max_error": max(jax.tree_util.tree_leaves(errors)),
                       "all_gathers": compiled.as_text().count("all-gather(")}
    # the control: traced without the mesh in context, the kernel is not split and XLA gathers
    fn, args, shardings = cases["cache_attention_sinks"]
    found["control_all_gathers"] = jax.jit(fn, in_shardings=shardings).lower(*args).compile().as_text().count(
        "all-gather(")
    found["generator"] = _generator_run(mesh)
    Path(out).write_text(json.dumps(found))


def _generator_run(mesh) -> dict:
    """Greedy tokens and all-gathers of the compiled programs: the kernel on one device, the
    kernel on `mesh`, the reference attention on `mesh`."""

    import numpy as np

    from dflash_jax.drafters.config import DrafterConfig
    from dflash_jax.drafters.drafter import Drafter, drafter_param_shapes
    from dflash_jax.engine.generator import Generator
    from dflash_jax.models.config import ModelConfig
    from dflash_jax.models.target import Target, target_param_shapes
    from support.families import drawn_params

    vocab = 64
    config = ModelConfig(arch="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, max_position_embeddings=128)
    drafter_config = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                                   head_dim=8, vocab_size=vocab, num_target_layers=1, target_layer_ids=(0,),
                                   block_size=4, mask_token_id=vocab - 1, max_position_embeddings=128)
    prompts = [[3, 9, 4], [7, 1, 2, 5, 8], [12], [5, 5, 20, 31]]
    # weights drawn with numpy (no initialiser to compile; placed on the mesh by slicing on the host): norms
    # near 1, the rest N(0, 0.3)
    rng = np.random.default_rng(0)
    target_params = drawn_params(target_param_shapes(config), rng, host=True)
    drafter_params = drawn_params(drafter_param_shapes(drafter_config), rng, host=True)
    found = {}
    for name, impl, on_mesh in (("kernel_one_device", "pallas_interpret", None),
                                ("kernel_mesh", "pallas_interpret", mesh), ("reference_mesh", "reference", mesh)):
        target = Target(config, target_params, attn_impl=impl)
        drafter = Drafter(drafter_config, drafter_params, attn_impl=impl)
        generator = (Generator(target, drafter, backend="xla") if on_mesh is None
                     else Generator(target, drafter, mesh=mesh))
        tokens = generator.generate(prompts, max_new_tokens=6, stop_token_ids=()).tokens
        found[name] = {"tokens": tokens,
                       "all_gathers": sum(e.as_text().count("all-gather(") for e in generator._compiled.values())}
    return found


@pytest.fixture(scope="module")
def findings():
    from support.devices import run_8_devices

    return run_8_devices("sharded_run({out})", module="test_sharded_kernel")


@pytest.mark.parametrize("case", ["cache_attention_sinks", "cache_attention", "attention_grads"])
def test_kernel_split_over_heads_equals_one_device(findings, case):
    assert findings[case]["max_error"] <= 1e-5, findings[case]


@pytest.mark.parametrize("case", ["cache_attention_sinks", "cache_attention", "attention_grads"])
def test_kernel_operands_are_not_gathered(findings, case):
    assert findings[case]["all_gathers"] == 0, findings[case]


def test_generator_on_a_mesh_splits_the_kernel_over_heads(findings):
    runs = findings["generator"]
    assert runs["kernel_mesh"]["tokens"] == runs["kernel_one_device"]["tokens"]
    assert runs["kernel_mesh"]["all_gathers"] <= runs["reference_mesh"]["all_gathers"], runs


def test_without_the_mesh_in_context_the_kernel_is_gathered(findings):
    assert findings["control_all_gathers"] > 0, findings
