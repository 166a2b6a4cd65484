"""DFlash drafters as the authors' current reference runs them (`dflash/model.py`, 2026): per-layer
windows measured from each query, sliding layers causal inside the block unless `is_causal` says
otherwise, `input_embedding_scale` on the block embeddings, `output_multiplier` then
`final_logit_softcapping` on the draft logits, YaRN in the drafter's rope, all read from
`dflash_config` first, then the top level.

The reference here is float64 numpy written from that description (not from our model code), on
tiny random weights, with the context longer than the window so that the block's queries see
different context positions."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.drafters.drafter import Drafter
from support.drafter_reference import random_drafter_params, rms, rope
from support.tolerance import assert_model_close

D, H, KV, HD, FF, V, G = 32, 4, 2, 8, 64, 50, 5
MASK = V - 1


def config(**kw):
    base = dict(hidden_size=D, intermediate_size=FF, num_layers=3, num_heads=H, num_kv_heads=KV, head_dim=HD,
                vocab_size=V, num_target_layers=3, target_layer_ids=(0, 2), block_size=G, mask_token_id=MASK,
                rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=3)
    return DrafterConfig(**{**base, **kw})


def random_params(cfg, seed=0):
    """Every weight random (norm scales near 1), drawn with numpy."""
    return random_drafter_params(cfg, seed)


# ---- the float64 reference, from the description -------------------------------------------------

def visible(cfg, layer, c, g, bound=0):
    """[g, c + g]: queries at positions c..c+g-1, keys at 0..c+g-1 (context, then the block); bound
    > 0: only the last `bound` context positions (a ring cache's)."""
    sliding = cfg.layer_types[layer] == "sliding_attention"
    causal = sliding if cfg.is_causal is None else cfg.is_causal
    q = np.arange(c, c + g)[:, None]
    k = np.arange(c + g)[None, :]
    vis = np.ones((g, c + g), bool)
    if bound:
        vis &= (k >= c - bound) | (k >= c)
    if causal:
        vis &= k <= q
    if sliding:
        vis &= q - k < cfg.sliding_window
        if not causal:
            vis &= k - q < cfg.sliding_window
    return vis


def reference_block(cfg, params, features, block_embeds, bound=0):
    """features [c, n*D] at positions 0..c-1, block token embeddings [g, D] (unscaled) at c..c+g-1
    (seeing only the last `bound` context positions where > 0) -> the final-normed hidden states
    [g, D], float64."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    c, g = features.shape[0], block_embeds.shape[0]
    ctx = rms(features @ p["fc"]["kernel"], p["hidden_norm"]["scale"])
    x = block_embeds * cfg.input_embedding_scale
    positions = np.arange(c + g, dtype=np.float64)
    for i in range(cfg.num_layers):
        lp = jax.tree_util.tree_map(lambda a: a[i], p["layers"])
        at = lp["self_attn"]
        h = rms(x, lp["input_layernorm"]["scale"])
        q = rms((h @ at["q_proj"]["kernel"]).reshape(g, H, HD), at["q_norm"]["scale"])
        both = np.concatenate([ctx, h])
        k = rms((both @ at["k_proj"]["kernel"]).reshape(c + g, KV, HD), at["k_norm"]["scale"])
        v = (both @ at["v_proj"]["kernel"]).reshape(c + g, KV, HD)
        q, k = rope(q, positions[c:]), rope(k, positions)
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HD)
        scores = np.where(visible(cfg, i, c, g, bound)[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(g, H * HD)
        x = x + out @ at["o_proj"]["kernel"]
        m = lp["mlp"]
        h = rms(x, lp["post_attention_layernorm"]["scale"])
        gate = h @ m["gate_proj"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]
    return rms(x, p["norm"]["scale"])


def reference_logits(cfg, hidden, head):
    logits = hidden @ head * cfg.output_multiplier
    if cfg.final_logit_softcapping > 0:
        logits = np.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


# ---- the checks ----------------------------------------------------------------------------------

CASES = {
    "default": {},  # sliding layers causal, the full one not
    "non-causal": dict(is_causal=False),
    "causal": dict(is_causal=True),
    "scaled-softcapped": dict(input_embedding_scale=2.5, output_multiplier=0.7, final_logit_softcapping=3.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_block_hidden_and_logits_equal_the_float64_reference(case):
    """Through the cached inference entry (context appended in two chunks) and the packed training
    entry at the same anchor: the block's hidden states and draft logits equal the reference's."""
    cfg = config(**CASES[case])
    params = random_params(cfg)
    drafter = Drafter(cfg, params)
    rng = np.random.default_rng(1)
    c = 9  # context longer than the window: each block query sees its own context positions
    features = rng.standard_normal((1, c, 2 * D)).astype(np.float32)
    tokens = np.array([[7] + [MASK] * (G - 1)])
    table = (0.5 * rng.standard_normal((V, D))).astype(np.float32)
    head = (0.5 * rng.standard_normal((D, V))).astype(np.float32)
    embeds = jnp.asarray(table[tokens])

    cache = drafter.init_cache(1, 32)
    cache = drafter.append_context(params, cache, jnp.asarray(features[:, :4]))
    cache = drafter.append_context(params, cache, jnp.asarray(features[:, 4:]))
    got = drafter.draft_hidden(params, cfg.block_embeddings(embeds), cache)[0]

    want = reference_block(cfg, params, features[0].astype(np.float64), table[tokens[0]].astype(np.float64))
    assert_model_close(got, want, cfg, err_msg=f"{case}: inference entry")

    anchors, valid = jnp.asarray([[c]]), jnp.asarray([[True]])
    padded = jnp.concatenate([jnp.asarray(features), jnp.zeros((1, 3, 2 * D))], axis=1)  # features past the anchor
    trained = drafter.train_hidden(params, padded, cfg.block_embeddings(embeds), anchors, valid)[0]
    assert_model_close(trained, want, cfg, err_msg=f"{case}: training entry")

    logits = cfg.draft_logits(jnp.asarray(got) @ head)
    assert_model_close(logits, reference_logits(cfg, want, head.astype(np.float64)), cfg,
                       err_msg=f"{case}: draft logits")


def test_a_window_measured_from_each_query_is_not_one_window_for_the_block():
    """The reference rule differs from a single window at the block's start: the check above
    would not notice a mask that ignores the query's own position unless the two differ here."""
    cfg = config(is_causal=False)
    c, g, w = 9, G, cfg.sliding_window
    per_query = visible(cfg, 0, c, g)[:, :c]
    block_start = np.zeros((g, c), bool)
    block_start[:, c - w:] = True
    assert (per_query != block_start).any()
    assert [np.flatnonzero(row).tolist() for row in per_query] == [
        [q - w + 1 + j for j in range(w) if q - w + 1 + j < c] for q in range(c, c + g)]


def test_config_reads_dflash_config_first_then_the_top_level_and_exports_them():
    hf = {"architectures": ["DFlashDraftModel"], "hidden_size": D, "intermediate_size": FF, "num_hidden_layers": 2,
          "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD, "vocab_size": V,
          "num_target_layers": 3, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
          "input_embedding_scale": 9.0, "output_multiplier": 0.5, "final_logit_softcapping": 30.0,
          "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": MASK, "input_embedding_scale": 2.0}}
    cfg = DrafterConfig.from_hf_config(hf)
    assert (cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping) == (2.0, 0.5, 30.0)
    assert cfg.is_causal is None and cfg.layer_causal == (True, False)
    out = cfg.to_hf_config(hf)
    assert "is_causal" not in out  # mixed layers: the readers' default is what runs here
    assert out["dflash_config"]["input_embedding_scale"] == 2.0 and "input_embedding_scale" not in out
    assert DrafterConfig.from_hf_config(out) == cfg

    explicit = DrafterConfig.from_hf_config({**hf, "is_causal": False})
    assert explicit.layer_causal == (False, False)
    assert json.loads(json.dumps(explicit.to_hf_config()))["is_causal"] is False
    # one kind of layer: its default written out, so that any reader runs it as we do
    sliding = DrafterConfig.from_hf_config({**hf, "layer_types": ["sliding_attention"] * 2})
    assert sliding.is_causal is True and sliding.to_hf_config()["is_causal"] is True


@pytest.mark.parametrize("field, value, message", [
    ("final_logit_softcapping", -1.0, "final_logit_softcapping"),
    ("output_multiplier", 0.0, "output_multiplier"),
    ("input_embedding_scale", float("inf"), "input_embedding_scale"),
])
def test_bad_scales_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        config(**{field: value})


def test_yarn_in_the_drafter_rope_is_transformers_qwen3_rope():
    """The reference builds the drafter's rope with transformers' Qwen3RotaryEmbedding from the
    drafter's config: with YaRN there, our cos/sin (and attention scale) are the same."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dflash_jax.layers.common import Rotary

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    hf = {"architectures": ["DFlashDraftModel"], "hidden_size": D, "intermediate_size": FF, "num_hidden_layers": 2,
          "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD, "vocab_size": V,
          "num_target_layers": 3, "max_position_embeddings": 256, "rope_parameters": rope,
          "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": MASK}}
    cfg = DrafterConfig.from_hf_config(hf)
    assert cfg.rope["rope_type"] == "yarn"
    positions = np.arange(0, 200, 7)[None]
    cos, sin = Rotary(cfg)(jnp.asarray(positions))
    theirs = Qwen3RotaryEmbedding(transformers.Qwen3Config(**{k: v for k, v in hf.items() if k != "dflash_config"}))
    with torch.no_grad():
        want_cos, want_sin = theirs(torch.zeros(1, 1, dtype=torch.float32), torch.tensor(positions))
    np.testing.assert_allclose(np.asarray(cos), want_cos.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), want_sin.numpy(), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def ruled_run(fitted):
    """One speculative run shared by the two tests below: the fitted drafter under every rule above
    at once (all layers causal, a window of 3, scaled embeddings, multiplied and softcapped logits)
    and, as its mask token, the token the target emits most often. -> (result, the target's own
    greedy decoding, that token)."""
    import collections
    import dataclasses

    from dflash_jax.engine.generator import Generator
    from support.speculative import plain_greedy, prompts_mix

    target, drafter = fitted
    prompts = prompts_mix()
    expect = [plain_greedy(target, p, 24) for p in prompts]
    common = collections.Counter(t for row in expect for t in row).most_common(1)[0][0]
    layers = ("sliding_attention",) * drafter.config.num_layers
    cfg = dataclasses.replace(drafter.config, is_causal=True, layer_types=layers, sliding_window=3,
                              input_embedding_scale=1.25, output_multiplier=0.8, final_logit_softcapping=4.0,
                              mask_token_id=common)
    ruled = dataclasses.replace(drafter, config=cfg)
    result = Generator(target, ruled).generate(prompts, max_new_tokens=24, stop_token_ids=())
    return result, expect, common


def test_greedy_speculative_with_the_current_rules_equals_plain_decoding(ruled_run):
    """The fitted drafter run under every rule above at once: its drafts change, the output stays
    the target's own greedy decoding, and drafts are still accepted."""
    result, expect, _ = ruled_run
    assert result.tokens == expect
    assert result.tau > 1.0


def test_a_generated_token_equal_to_the_mask_token_is_output(ruled_run):
    """The mask token id is only the drafter's input filler: where the target itself emits that id,
    it is output like any other token (the reference keeps it too)."""
    result, expect, common = ruled_run
    assert result.tokens == expect and any(common in row for row in result.tokens)


@pytest.mark.parametrize("chunks", [(9,), (2, 3, 4), (6, 1, 1, 1)],
                         ids=["longer-than-the-ring", "wrapping", "one-by-one"])
def test_a_ring_context_cache_sees_the_last_positions_only(chunks):
    """draft_context: the drafter's cache a ring of 5 slots, of which the last 4 positions are
    visible; appended in chunks longer than the ring, wrapping around its end, one by one: the block
    equals the reference that sees only the last 4 context positions."""
    cfg = config(is_causal=False, layer_types=("full_attention", "sliding_attention", "full_attention"))
    params = random_params(cfg, seed=2)
    drafter = Drafter(cfg, params)
    rng = np.random.default_rng(3)
    c = sum(chunks)
    features = rng.standard_normal((2, c, 2 * D)).astype(np.float32)
    table = (0.5 * rng.standard_normal((V, D))).astype(np.float32)
    tokens = np.array([[7] + [MASK] * (G - 1), [3] + [MASK] * (G - 1)])
    cache = drafter.init_cache(2, 5, window=4)
    # each compiled whole (one program per chunk length, not one per operation)
    append, draft = jax.jit(drafter.spec.append_context), jax.jit(drafter.spec.draft_hidden)
    start = 0
    for n in chunks:
        cache = append(params, cache, jnp.asarray(features[:, start:start + n]))
        start += n
    got = draft(params, jnp.asarray(table[tokens]), cache)
    for row in range(2):
        want = reference_block(cfg, params, features[row].astype(np.float64), table[tokens[row]].astype(np.float64),
                               bound=4)
        assert_model_close(got[row], want, cfg, err_msg=f"row {row}")


def test_a_ring_keeps_what_it_is_given_and_no_garbage():
    """Of a chunk's positions only each row's first num_new are written (the rest would overwrite
    slots still visible); of more than the ring holds, the last ones."""
    from dflash_jax.models.cache import RingKVCache

    cache = RingKVCache.for_window(config(), 2, 3, 4)
    k = jnp.arange(2 * 6, dtype=jnp.float32).reshape(1, 2, 6, 1, 1) * jnp.ones((3, 1, 1, KV, HD))
    cache = cache.append(k, k, jnp.asarray([6, 2]))
    assert cache.lengths.tolist() == [6, 2]
    slots = np.asarray(cache.k[0, :, :, 0, 0])
    assert slots[0].tolist() == [4, 5, 2, 3]  # positions 4, 5 in slots 0, 1; 2, 3 in 2, 3
    assert slots[1].tolist() == [6, 7, 0, 0]  # positions 0, 1; nothing written past num_new
    with pytest.raises(ValueError, match="window"):
        RingKVCache.for_window(config(), 1, 5, 4)


def test_greedy_with_a_bounded_draft_context_equals_plain_decoding(fitted):
    """generate(draft_context=n): lossless; with n at least the whole context the drafts (and so the
    acceptance) are those of the unbounded drafter."""
    from dflash_jax.engine.generator import Generator
    from support.speculative import plain_greedy, prompts_mix

    target, drafter = fitted
    prompts = prompts_mix()
    generator = Generator(target, drafter)
    expect = [plain_greedy(target, p, 24) for p in prompts]
    whole = generator.generate(prompts, max_new_tokens=24, stop_token_ids=())
    bounded = generator.generate(prompts, max_new_tokens=24, stop_token_ids=(), draft_context=5)
    wide = generator.generate(prompts, max_new_tokens=24, stop_token_ids=(), draft_context=40)
    assert whole.tokens == bounded.tokens == wide.tokens == expect
    assert wide.acceptance_lengths == whole.acceptance_lengths
    with pytest.raises(ValueError, match="draft_context"):
        generator.generate(prompts, max_new_tokens=4, draft_context=-1)
