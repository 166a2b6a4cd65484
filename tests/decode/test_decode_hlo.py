"""Structural checks on the optimised HLO of decode steps (`support.hlo.whole_buffer_ops`): nothing
but in-place row updates touches a whole cache buffer, so a step's cost does not grow with the cache
capacity. Here on a Qwen3 target with a sliding layer, both layouts, the drafter, the prefill and the
whole decode loop in every mode; the conformance suite (support/conformance.py) runs the decode step of every family."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dflash_jax.backends.cpu.layout import pack_layers
from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.drafters.drafter import Drafter, drafter_param_shapes
from dflash_jax.models.cache import UNROLLED_ROWS, write_rows
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.target import Target, target_param_shapes
from support.families import drawn_params
from support.hlo import CAPACITY, compiled_text, whole_buffer_ops

TARGET = ModelConfig(arch="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=4)
DRAFTER = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, vocab_size=97, num_target_layers=3, target_layer_ids=(0, 2),
                        block_size=4, mask_token_id=96)


@pytest.fixture(scope="module")
def target():
    return Target(TARGET, drawn_params(target_param_shapes(TARGET), 0, scale=0.2))


@pytest.fixture(scope="module")
def drafter():
    return Drafter(DRAFTER, drawn_params(drafter_param_shapes(DRAFTER), 1, scale=0.2))


# make test-all: the packed float32 steps alone; by default the loops of test_generate_loop_touches_only_new_rows
# below run them (on a CPU the packed layout: the plain loop's one-token step, the speculative loop's verify)
@pytest.mark.parametrize("num_tokens,layout,kv_cache_dtype", [
    pytest.param(n, layout, dtype, marks=[pytest.mark.slow] if (layout, dtype) == ("packed", None) else [])
    for n in (1, 4) for layout, dtype in (("stacked", None), ("packed", None), ("packed", "float16"))])
def test_target_decode_step_touches_only_new_rows(target, num_tokens, layout, kv_cache_dtype):
    """Both layouts: stacked layers (a scan) and the packed ones generate decodes with on a CPU
    (a loop whose products read the kernels in place); a float16 cache (new rows rounded, the
    cache read as it is)."""
    spec = dataclasses.replace(target.spec, kv_cache_dtype=kv_cache_dtype)

    def step(params, tokens, cache):
        hidden, features, cache = spec.forward(params, tokens, cache, capture=(0, 2))
        return spec.logits(params, hidden), features, cache

    params = target.params if layout == "stacked" else pack_layers(target.params)
    cache = spec.init_cache(2, CAPACITY)
    tokens = jnp.zeros((2, num_tokens), jnp.int32)
    assert whole_buffer_ops(compiled_text(step, params, tokens, cache, donate=(2,))) == []


@pytest.mark.parametrize("layout", ["stacked", "packed"])
def test_chunked_prefill_touches_only_new_rows(target, layout):
    """A prompt longer than one prefill chunk: a scan over chunks, each writing its rows."""
    from dflash_jax.models.target import PREFILL_CHUNK

    def prefill(params, tokens, cache):
        hidden, features, cache = target.prefill(params, tokens, cache, capture=(0, 2))
        return target.logits(params, hidden[:, -1]), features, cache

    params = target.params if layout == "stacked" else pack_layers(target.params)
    tokens = jnp.zeros((2, PREFILL_CHUNK + 44), jnp.int32)
    hlo = compiled_text(prefill, params, tokens, target.init_cache(2, CAPACITY), donate=(2,))
    assert whole_buffer_ops(hlo) == []


def test_drafter_block_and_append_touch_only_new_rows(drafter):
    def step(params, block, cache):
        hidden = drafter.draft_hidden(params, block, cache)
        # As in a cycle, the appended features depend on the draft (through the verify).
        features = jnp.concatenate([hidden, hidden], axis=-1)
        return hidden, drafter.append_context(params, cache, features, num_new=jnp.asarray([4, 2]))

    block = jnp.zeros((2, DRAFTER.block_size, DRAFTER.hidden_size))
    cache = drafter.init_cache(2, CAPACITY)
    hlo = compiled_text(step, drafter.params, block, cache, donate=(2,))
    assert whole_buffer_ops(hlo) == []


def _per_row_vmapped_write(buffer, new, offsets):
    """The writer this project had before: a vmapped dynamic_update_slice with per-row offsets."""
    write = lambda row, row_new, offset: jax.lax.dynamic_update_slice(row, row_new, (0, offset, 0, 0))
    return jax.vmap(write, in_axes=(1, 1, 0), out_axes=1)(buffer, new, offsets)


def _project_write(buffer, new, offsets):
    return write_rows(buffer, new, offsets, axis=1)


@pytest.mark.parametrize("writer,batch,flagged", [
    (_per_row_vmapped_write, 2, True),
    (_project_write, 2, False),
    (_project_write, UNROLLED_ROWS + 4, False),  # the fori_loop path for large batches
])
def test_check_flags_a_whole_buffer_writer(writer, batch, flagged):
    """The check can fail: a vmapped per-row update inside a scan lowers to a scatter over the
    whole buffer (and is flagged); the project's writer is not, unrolled or looped."""

    def step(buffer, new, offsets):  # buffer [1, B, S, H, D], new [steps, 1, B, T, H, D]
        return jax.lax.scan(lambda buf, rows: (writer(buf, rows, offsets), None), buffer, new)[0]

    buffer = jnp.zeros((1, batch, CAPACITY, 2, 8))
    new = jnp.ones((3, 1, batch, 4, 2, 8))
    offsets = jnp.arange(batch, dtype=jnp.int32) * 7 % (CAPACITY - 4)
    hlo = compiled_text(step, buffer, new, offsets, donate=(0,))
    assert bool(whole_buffer_ops(hlo)) == flagged


# make test-all: sampling alone and lookup alone; by default [True-1.0-3-0.0] compiles both into the same
# ungated verify (sampled drafts' acceptance and the lookup's shifted token buffer), [True-1.0-3-0.5] into the gated one
@pytest.mark.parametrize("draft,temperature,lookup,gate", [
    (False, 0.0, 0, 0.0), (True, 0.0, 0, 0.0), pytest.param(True, 1.0, 0, 0.0, marks=pytest.mark.slow),
    pytest.param(True, 0.0, 3, 0.0, marks=pytest.mark.slow), (True, 1.0, 3, 0.0),
    (True, 0.0, 0, 0.5), (True, 1.0, 3, 0.5)])
def test_generate_loop_touches_only_new_rows(target, drafter, draft, temperature, lookup, gate):
    """The whole compiled decode loop of `generate` (on a CPU: the packed target layout) copies
    no cache: its step cost does not follow the capacity (prompt bucket + 960 + block, rounded up
    to 1024). With gated drafts (min_draft_probability) the verify is a `lax.cond` whose branches
    only read the caches (a branch that returned the target cache made XLA copy it)."""
    from dflash_jax.engine import generator as speculative
    from dflash_jax.kernels import KEY_TILE, round_up

    model = drafter if draft else None
    generator = speculative.Generator(target, model)
    cfg, args, _ = generator._prepare([[1, 2, 3]], max_new_tokens=960,
                                        temperature=temperature, top_k=0, top_p=1.0, stop_token_ids=(),
                                        block_size=None, seed=0, acceptance="exact", lookup=lookup,
                                        min_draft_probability=gate)
    capacity = round_up(speculative.prompt_bucket(3) + cfg.max_new_tokens + cfg.block_size, KEY_TILE)
    assert capacity == 1024  # a number no other dimension of these models has
    _, loop, _ = generator._executables(cfg, args, "decode")
    assert whole_buffer_ops(loop.as_text(), capacity) == []
