"""KV-cache behaviour: incremental decode == full forward; ragged rows == rows run alone."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models.cache import UNROLLED_ROWS, write_rows
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.target import Target, target_param_shapes
from support.families import drawn_params

CFG = ModelConfig(arch="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                  layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=4)


def _params(config, seed):
    """Random params of `config` drawn with numpy (no initialiser to compile): N(0, 0.2), norms near 1."""
    return drawn_params(target_param_shapes(config), seed, scale=0.2)


@pytest.fixture(scope="module")
def target():
    return Target(CFG, _params(CFG, 0))


@functools.partial(jax.jit, static_argnames=("spec", "capture"))
def run(spec, params, tokens, cache=None, num_new=None, capture=(0, 2)):
    """(logits, captured layers, cache) of `spec.forward`, compiled whole: one program per shape (run
    eagerly, the forward compiles each of its dozens of operations for every new shape)."""
    hidden, feats, cache = spec.forward(params, tokens, cache, capture=capture, num_new=num_new)
    return spec.logits(params, hidden), feats, cache


def full_logits(target, tokens):
    logits, feats, _ = run(target.spec, target.params, jnp.asarray(tokens)[None])
    return np.asarray(logits)[0], np.asarray(feats)[0]


def test_prefill_then_decode_equals_full_forward(target):
    tokens = np.random.default_rng(0).integers(0, 97, size=14)
    want_logits, want_feats = full_logits(target, tokens)
    cache = target.init_cache(1, 32)
    logits, feats, cache = run(target.spec, target.params, jnp.asarray(tokens[None, :6]), cache)
    got_logits, got_feats = [logits[0]], [feats[0]]
    for t in range(6, 14, 2):  # two tokens at a time
        logits, feats, cache = run(target.spec, target.params, jnp.asarray(tokens[None, t:t + 2]), cache)
        got_logits.append(logits[0])
        got_feats.append(feats[0])
    assert int(cache.lengths[0]) == 14
    np.testing.assert_allclose(np.concatenate(got_logits), want_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(got_feats), want_feats, rtol=1e-5, atol=1e-5)


def test_rollback_is_setting_lengths(target):
    tokens = np.random.default_rng(1).integers(0, 97, size=10)
    want, _ = full_logits(target, tokens)
    cache = target.init_cache(1, 32)
    _, _, cache = run(target.spec, target.params, jnp.asarray(tokens[None, :6]), cache)
    # Feed 3 wrong tokens, roll back, then feed the right ones.
    _, _, cache = run(target.spec, target.params, jnp.asarray([[1, 2, 3]]), cache)
    cache = cache.with_lengths(cache.lengths - 3)
    logits, _, cache = run(target.spec, target.params, jnp.asarray(tokens[None, 6:]), cache)
    np.testing.assert_allclose(logits[0], want[6:], rtol=1e-5, atol=1e-5)


def test_ragged_batch_rows_match_rows_alone(target):
    rng = np.random.default_rng(2)
    lengths = [3, 9, 6]
    prompts = [rng.integers(0, 97, size=n) for n in lengths]
    batch = np.zeros((3, 9), np.int32)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
    cache = target.init_cache(3, 24)
    logits, _, cache = run(target.spec, target.params, jnp.asarray(batch), cache, num_new=jnp.asarray(lengths))
    np.testing.assert_array_equal(cache.lengths, lengths)
    nxt = rng.integers(0, 97, size=(3, 2))
    logits2, _, cache = run(target.spec, target.params, jnp.asarray(nxt), cache)
    for i, p in enumerate(prompts):
        want, _ = full_logits(target, np.concatenate([p, nxt[i]]))
        np.testing.assert_allclose(logits[i, : len(p)], want[: len(p)], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(logits2[i], want[len(p):], rtol=1e-5, atol=1e-5)


def test_capture_layer_out_of_range(target):
    with pytest.raises(ValueError, match="out of range"):
        target.forward(target.params, jnp.zeros((1, 2), jnp.int32), capture=(5,))


def test_prompt_longer_than_cache_raises(target):
    cache = target.init_cache(1, 8)
    with pytest.raises(ValueError, match="longer than the cache"):
        target.forward(target.params, jnp.zeros((1, 9), jnp.int32), cache)
    _, _, cache = target.forward(target.params, jnp.zeros((1, 6), jnp.int32), cache)
    with pytest.raises(ValueError, match="prompt too long"):
        target.forward(target.params, jnp.zeros((1, 3), jnp.int32), cache)


def test_prefill_in_chunks_equals_one_pass(target):
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, 97, size=(2, 11)))
    lengths = jnp.asarray([11, 7])
    # each compiled whole (one program, not one per operation)
    want = jax.jit(lambda p, t, c, n: target.forward(p, t, c, capture=(0, 2), num_new=n))(
        target.params, tokens, target.init_cache(2, 32), lengths)
    got = jax.jit(lambda p, t, c, n: target.prefill(p, t, c, capture=(0, 2), num_new=n, chunk_size=4))(
        target.params, tokens, target.init_cache(2, 32), lengths)  # two chunks of 4 in the scan, then a remainder of 3
    np.testing.assert_array_equal(got[2].lengths, lengths)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 5])
def test_chunked_cache_attention_equals_dense(window):
    """Key chunks of 4 over 10 slots (the last chunk overlaps the one before), ragged rows, one
    row with nothing visible: the same as dense attention over the layer."""
    from dflash_jax.kernels import masks
    from dflash_jax.layers.attention import chunked_cache_attention_with_lse, reference_attention_with_lse

    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(3, 2, 4, 8)), jnp.float32)
    cache_k, cache_v = (jnp.asarray(rng.normal(size=(2, 3, 10, 2, 8)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([10, 6, 0])
    ranges = masks.causal(lengths[:, None] - 1 + jnp.arange(2)[None, :], window).segment(0, lengths)
    # each compiled whole: one program for both windows (the ranges are its arguments)
    got = jax.jit(functools.partial(chunked_cache_attention_with_lse, layer=1, chunk_size=4))(q, cache_k, cache_v,
                                                                                           ranges=ranges)
    want = jax.jit(reference_attention_with_lse)(q, cache_k[1], cache_v[1], ranges)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", [3, UNROLLED_ROWS + 5])
def test_write_rows_writes_each_row_at_its_offset(batch):
    """Both paths of the cache writer (unrolled, and a loop for large batches) equal numpy."""
    rng = np.random.default_rng(0)
    buffer = rng.normal(size=(2, batch, 12, 3)).astype(np.float32)  # [L, B, S, H]
    new = rng.normal(size=(2, batch, 4, 3)).astype(np.float32)
    offsets = rng.integers(0, 9, size=batch).astype(np.int32)
    expected = buffer.copy()
    for b, o in enumerate(offsets):
        expected[:, b, o:o + 4] = new[:, b]
    got = jax.jit(lambda *a: write_rows(*a, axis=1))(buffer, new, offsets)
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_packed_layers_equal_the_scan_and_copy_no_weights(target):
    """`pack_layers` on the CPU backend (what generate decodes with on a CPU) give the scanned
    model's results, and the compiled one-token step produces no layer-weight-shaped value (the
    scan slices every layer's weights out of the stack with a copy: checked as the counter-case;
    the packed model's products read each layer's kernel inside its stack)."""
    import re

    from dflash_jax.backends.cpu.layout import is_packed_layout, pack_layers

    packed = pack_layers(target.params)
    assert is_packed_layout(packed) and not is_packed_layout(target.params)
    assert target.module_for(packed).backend == "cpu" and target.module_for(target.params).backend == "xla"
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 97, size=(2, 9)), jnp.int32)
    forward = jax.jit(lambda p, t, c: target.forward(p, t, c, capture=(0, 2)))  # one program per layout
    want = forward(target.params, tokens, None)
    got = forward(packed, tokens, None)
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    caches = [forward(p, tokens, target.init_cache(2, 16))[2] for p in (target.params, packed)]
    np.testing.assert_allclose(np.asarray(caches[1].k), np.asarray(caches[0].k), rtol=1e-5, atol=1e-5)

    def shape_text(shape):
        return "f32[" + ",".join(map(str, shape)) + "]"

    # one layer's weights, stacked layout and packed layout, and any 2-D+ slice of the stacks
    weight_shapes = {shape_text(x.shape[1:]) for x in jax.tree_util.tree_leaves(target.params["layers"])
                     if x.ndim == 3}
    weight_shapes |= {shape_text(x.shape[1:]) for x in jax.tree_util.tree_leaves(packed["layers"]) if x.ndim >= 3}

    def weight_copies(params):
        step = jax.jit(lambda p, tok, c: target.forward(p, tok, c)[0])
        text = step.lower(params, tokens[:, :1], target.init_cache(2, 16)).compile().as_text()
        # values the step computes: not parameters or aliases of them (a loop body reads its
        # invariants through get-tuple-element)
        made = [m.group(1) for m in re.finditer(
            r"= (f32\[[0-9,]*\])\{[0-9,]*\} (?!parameter|get-tuple-element|bitcast)\S+\(", text)]
        return [shape for shape in made if shape in weight_shapes]

    scanned = weight_copies(target.params)
    print("weight-shaped values made by the scanned step:", scanned)
    assert scanned, "the counter-case: the scan copies layer weights"
    assert weight_copies(packed) == []


# newer-jax leg only (`one_leg`): two programs (the layers inlined in one, one layer per call) agree to the bit
# at XLA's default codegen level, which that leg compiles with; at LLVM level 0 (the default leg) they round
# differently in the last bit. Both legs run the packed layers against the scan (test_packed_layers_equal_the_scan_
# and_copy_no_weights) and packed decoding (test_smollm2.py::test_a_cpu_decode_reads_the_files_quantized_blocks)
@pytest.mark.one_leg
def test_packed_layers_equal_a_loop_over_single_kernels():
    """The packed model's products read kernel `layer` of a stack in place; the same layers run one
    by one over their own packed kernels give bit-identical results (a loop over layers used to
    decode this way)."""
    import dataclasses

    from dflash_jax.backends.cpu.layout import pack_layers
    from dflash_jax.layers.common import RMSNorm, Rotary
    from dflash_jax.models.target import TargetLayer

    config = dataclasses.replace(CFG, hidden_size=64, intermediate_size=96)  # several panels
    model = Target(config, _params(config, 7))
    packed = pack_layers(model.params)
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, 97, size=(2, 5)), jnp.int32)
    got = model.forward(packed, tokens, capture=(0, 1))

    layer = TargetLayer(config, backend="cpu", parent=None)
    hidden = model.embed(packed, tokens)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    cos, sin = Rotary(config)(positions)
    one = lambda i: jax.tree.map(lambda x: x[i], packed["layers"])
    outputs = []
    apply = jax.jit(layer.apply)  # one program for every layer
    for i in range(config.num_layers):
        xs = (jnp.int32(i), jnp.int32(config.layer_windows[i]), jnp.int32(-1))
        (hidden, _), _ = apply({"params": one(i)}, (hidden, None), xs, positions, cos, sin, None)
        outputs.append(hidden)
    final = RMSNorm(config.rms_norm_eps).apply({"params": packed["norm"]}, hidden)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(final))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(jnp.concatenate(outputs[:2], -1)))


@pytest.mark.parametrize("widths", ["fused", "unfusable"])
def test_packed_layers_fuse_qkv_and_gate_up_where_the_widths_allow(widths):
    """`pack_layers` makes q/k/v one product ("qkv_proj", biases concatenated) and gate/up another
    ("gate_up_proj") when every part but the last is whole 16-column panels, and leaves them
    apart otherwise (`TargetLayer` follows the same rule); either way the packed model gives the
    scanned model's results and the stacked params it was given stay whole."""
    import dataclasses

    from dflash_jax.backends.cpu.layout import pack_layers

    if widths == "fused":  # q 4 x 8 = 32, k and v 2 x 8 = 16 columns, gate and up 48
        config = dataclasses.replace(CFG, head_dim=8, intermediate_size=48, attention_bias=True, mlp_bias=True)
    else:  # q 4 x 6 = 24 and gate 40 columns: not whole panels
        config = dataclasses.replace(CFG, head_dim=6, intermediate_size=40)
    model = Target(config, _params(config, 4))  # biases drawn like the weights (nonzero: they count)
    before = jax.tree.map(np.asarray, model.params)
    packed = pack_layers(model.params)
    attn, mlp = packed["layers"]["self_attn"], packed["layers"]["mlp"]
    fused = widths == "fused"
    assert ("qkv_proj" in attn, "q_proj" in attn, "k_proj" in attn) == (fused, not fused, not fused)
    assert ("gate_up_proj" in mlp, "gate_proj" in mlp) == (fused, not fused)
    if fused:
        layers = model.params["layers"]
        np.testing.assert_array_equal(attn["qkv_proj"]["bias"], np.concatenate(
            [layers["self_attn"][n]["bias"] for n in ("q_proj", "k_proj", "v_proj")], -1))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, model.params), before)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 97, size=(2, 6)), jnp.int32)
    forward = jax.jit(lambda p, t: model.forward(p, t, capture=(0, 2)))  # one program per layout
    want = forward(model.params, tokens)
    got = forward(packed, tokens)
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_packed_lm_head_equals_the_scanned_one(rows, tied):
    """The packed params carry the LM head packed for the rows kernel ("head", from the tied
    embedding or the moved lm_head; the CPU backend's `logits`): any number of rows read it and
    give the scanned model's logits."""
    import dataclasses

    from dflash_jax.backends.cpu.layout import pack_layers
    from dflash_jax.backends.cpu.matmul import pack_kernel

    config = dataclasses.replace(CFG, tie_word_embeddings=tied)
    model = Target(config, _params(config, 4))
    packed = pack_layers(model.params)
    head = model.params["embed_tokens"]["embedding"].T if tied else model.params["lm_head"]["kernel"]
    np.testing.assert_array_equal(np.asarray(packed["head"]), np.asarray(pack_kernel(head)))
    assert "lm_head" not in packed
    hidden = jax.random.normal(jax.random.PRNGKey(5), (1, rows, config.hidden_size))
    want = np.asarray(model.logits(model.params, hidden))
    got = np.asarray(jax.jit(model.logits)(packed, hidden))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("tied", [True, False])
def test_packed_params_keep_one_copy_of_a_tied_embedding(tied, kernels, monkeypatch):
    """A tied embedding moves into the packed head (no second copy of it in the packed params) and
    the CPU backend's `embed` reads the token rows back out of it: the same floats, with the head
    packed into panels or left [D, V] (no CPU kernel: then the layers' kernels stay [L, K, N] too,
    and the same model multiplies them with XLA)."""
    import dataclasses

    from dflash_jax.backends.cpu import matmul as cpu_matmul
    from dflash_jax.backends.cpu.layout import pack_layers

    if not kernels:
        monkeypatch.setattr(cpu_matmul, "available", lambda: False)
    config = dataclasses.replace(CFG, tie_word_embeddings=tied)
    model = Target(config, _params(config, 6))
    packed = pack_layers(model.params)
    assert ("embed_tokens" in packed) == (not tied)
    assert cpu_matmul.is_packed(packed["head"]) == (kernels and cpu_matmul.available())
    tokens = jnp.asarray([np.arange(config.vocab_size), np.arange(config.vocab_size)[::-1]], jnp.int32)
    want = np.asarray(model.params["embed_tokens"]["embedding"])[np.asarray(tokens)]
    np.testing.assert_array_equal(np.asarray(jax.jit(model.embed)(packed, tokens)), want)
    hidden = model.forward(model.params, tokens[:, :7])[0]
    np.testing.assert_allclose(np.asarray(model.forward(packed, tokens[:, :7])[0]), np.asarray(hidden),
                               rtol=1e-5, atol=1e-5)


def test_released_params_are_given_up_and_pack_the_same(target):
    """`pack_layers(..., release=True)` (how `load_target` lays out its own params) empties the
    stacked dict weight by weight and returns what the copying call returns."""
    from dflash_jax.backends import params_in_layout
    from dflash_jax.backends.cpu.layout import pack_layers

    kept = pack_layers(target.params)
    whole = jax.tree.structure(target.params)
    params = jax.tree.map(lambda x: x, target.params)  # new dicts, the same arrays: the fixture stays whole
    released = params_in_layout(params, "packed", release=True)
    assert "layers" not in params and jax.tree.structure(target.params) == whole
    assert jax.tree.structure(released) == jax.tree.structure(kept)
    jax.tree.map(np.testing.assert_array_equal, released, kept)
    assert params_in_layout(target.params, "stacked") is target.params
    assert pack_layers(kept) is kept
    with pytest.raises(ValueError, match="layout"):
        params_in_layout(kept, "stacked")
    with pytest.raises(ValueError, match="layout must be one of"):
        params_in_layout(target.params, "rolled")


def test_a_targets_forward_called_eagerly_is_one_compiled_program(target):
    """`Target.forward` / `prefill` / `logits` outside a trace run the spec's function jitted: one new
    program for a new shape, none for a second call of it, none for a call inside a trace (the spec's
    function there), the values of a jitted call, and a cache's room still checked first (under jit its
    lengths are traced)."""
    from dflash_jax.models import target as _target

    tokens = np.random.default_rng(3).integers(0, 97, size=(3, 11))  # a shape no other test here runs
    programs = _target._COMPILED["forward"]._cache_size()
    hidden, feats, _ = target.forward(target.params, tokens, capture=[0, 2])
    assert _target._COMPILED["forward"]._cache_size() == programs + 1
    target.forward(target.params, tokens + 1, capture=(0, 2))
    want_hidden, want_feats, _ = jax.jit(lambda p, t: target.forward(p, t, capture=(0, 2)))(
        target.params, jnp.asarray(tokens))
    assert _target._COMPILED["forward"]._cache_size() == programs + 1
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(want_hidden))
    np.testing.assert_array_equal(np.asarray(feats), np.asarray(want_feats))
    np.testing.assert_array_equal(np.asarray(target.logits(target.params, hidden)),
                                  np.asarray(jax.jit(target.spec.logits)(target.params, hidden)))
    cache = target.init_cache(3, 16)
    _, _, cache = target.prefill(target.params, tokens, cache)
    assert np.asarray(cache.lengths).tolist() == [11, 11, 11]
    with pytest.raises(ValueError, match="prompt too long for the cache"):
        target.forward(target.params, tokens, cache)
