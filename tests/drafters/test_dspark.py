"""DSpark drafters (DeepSeek's DeepSpec, `Qwen3DSparkModel`): the anchor slot proposing too, the Markov
head's chain, the confidence head and the verify-length policy, in the jitted loop, loaded and
exported in DeepSpec's own layout.

The reference here is float64 numpy written from the description of DeepSpec's model (not from our
model code), on tiny random weights: the block's hidden states, the base and Markov-biased logits
along the drafted chain, its choices and its draft distributions, and the confidences."""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax._errors import ConfigError
from dflash_jax.decode import loop as decode_loop
from dflash_jax.drafters import dspark
from dflash_jax.drafters.config import DrafterConfig, DSparkConfig
from dflash_jax.drafters.drafter import Drafter, init_drafter_params
from dflash_jax.engine.generator import generate, Generator
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.target import init_target_params, Target
from support.drafter_reference import random_drafter_params, rms, rope
from support.tolerance import assert_model_close

D, H, KV, HD, FF, V, G, R = 32, 4, 2, 8, 64, 50, 4, 6  # G: the drafter's block; R: the Markov rank
MASK = V - 1


def config(dspark_config=DSparkConfig(R, True, True), **kw):
    base = dict(hidden_size=D, intermediate_size=FF, num_layers=2, num_heads=H, num_kv_heads=KV, head_dim=HD,
                vocab_size=V, num_target_layers=3, target_layer_ids=(0, 2), block_size=G, mask_token_id=MASK,
                rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, dspark=dspark_config)
    return DrafterConfig(**{**base, **kw})


def random_params(cfg, seed=0, markov_scale=1.0):
    """Every weight random (norm scales near 1), drawn with numpy; the Markov head times markov_scale."""
    return random_drafter_params(cfg, seed, lambda names: markov_scale if "markov_head" in names
                                 else 0.5 if names[0] in ("embed_tokens", "lm_head") else 0.2)


# ---- the float64 reference, from the description -------------------------------------------------

def reference_block(cfg, p, features, block):
    """features [c, n*D] at positions 0..c-1, block token ids [g] at c..c+g-1, embedded with the
    drafter's own table -> final-normed hidden states [g, D] (full, non-causal attention over the
    context and the whole block, as DeepSpec's Qwen3DSparkAttention)."""
    c, g = features.shape[0], len(block)
    ctx = rms(features @ p["fc"]["kernel"], p["hidden_norm"]["scale"])
    x = p["embed_tokens"]["embedding"][block]
    positions = np.arange(c + g, dtype=np.float64)
    for i in range(cfg.num_layers):
        lp = jax.tree_util.tree_map(lambda a: a[i], p["layers"])
        at, m = lp["self_attn"], lp["mlp"]
        h = rms(x, lp["input_layernorm"]["scale"])
        q = rms((h @ at["q_proj"]["kernel"]).reshape(g, H, HD), at["q_norm"]["scale"])
        both = np.concatenate([ctx, h])
        k = rms((both @ at["k_proj"]["kernel"]).reshape(c + g, KV, HD), at["k_norm"]["scale"])
        v = (both @ at["v_proj"]["kernel"]).reshape(c + g, KV, HD)
        q, k = rope(q, positions[c:]), rope(k, positions)
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HD)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(g, H * HD) @ at["o_proj"]["kernel"]
        h = rms(x, lp["post_attention_layernorm"]["scale"])
        gate = h @ m["gate_proj"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]
    return rms(x, p["norm"]["scale"])


def reference_chain(cfg, p, hidden, anchor, temperature=0.0, chosen=None):
    """hidden [g, D] -> (biased logits [g, V] along the chain, choices [g], q [g, V] =
    softmax(logits / T) (softmax(logits) when greedy), confidences [g]). logits_k = lm_head(h_k) +
    W2 W1[x_{k-1}], x_{-1} = the anchor; c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b). At T > 0 the
    chain follows `chosen` (the draws being random)."""
    w1 = p["markov_head"]["markov_w1"]["embedding"]  # [V, r]
    w2 = p["markov_head"]["markov_w2"]["kernel"].T  # Linear r -> V: weight [V, r]
    proj = p["confidence_head"]["proj"]
    prev, logits, path, qs, conf = anchor, [], [], [], []
    for k in range(hidden.shape[0]):
        e = w1[prev]
        z = hidden[k] @ p["lm_head"]["kernel"] + w2 @ e
        t = z / (temperature if temperature > 0 else 1.0)
        q = np.exp(t - t.max())
        features = np.concatenate([hidden[k], e]) if cfg.dspark.confidence_head_with_markov else hidden[k]
        conf.append(1 / (1 + np.exp(-(features @ proj["kernel"][:, 0] + proj["bias"][0]))))
        prev = int(np.argmax(z)) if temperature == 0 else int(chosen[k])
        logits.append(z)
        path.append(prev)
        qs.append(q / q.sum())
    return np.array(logits), np.array(path), np.array(qs), np.array(conf)


def as64(params):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)


# ---- the checks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("with_markov", [True, False], ids=["confidence-with-markov", "confidence-of-h"])
def test_block_chain_and_confidences_equal_the_float64_reference(with_markov):
    """Through the cached inference entry: every slot's hidden state (the anchor's too), the Markov
    chain's biased logits, choices and q, greedy and sampled, and the confidences."""
    cfg = config(DSparkConfig(R, True, with_markov))
    params = random_params(cfg, markov_scale=1.5)
    p64 = as64(params)
    drafter = Drafter(cfg, params)
    rng = np.random.default_rng(1)
    b, c = 3, 7
    features = rng.standard_normal((b, c, 2 * D)).astype(np.float32)
    anchors = np.array([7, 21, 40])
    block = np.concatenate([anchors[:, None], np.full((b, G - 1), MASK)], axis=1)
    cache = drafter.append_context(params, drafter.init_cache(b, 32), jnp.asarray(features))
    hidden = drafter.draft_hidden(params, dspark.block_embeddings(params, jnp.asarray(block)), cache)
    base = dspark.base_logits(params, hidden)
    greedy = dspark.draft(cfg.dspark, params, hidden, base, jnp.asarray(anchors))
    probs_fn = lambda z: jax.nn.softmax(z / 0.8, axis=-1)  # noqa: E731
    sampled = dspark.draft(cfg.dspark, params, hidden, base, jnp.asarray(anchors), probs_fn, jax.random.PRNGKey(4))
    assert greedy[2] is None and sampled[2].shape == (b, G, V)
    departs = False
    for row in range(b):
        want = reference_block(cfg, p64, features[row].astype(np.float64), block[row])
        assert_model_close(hidden[row], want, cfg, err_msg=f"hidden states, row {row}")
        assert_model_close(base[row], want @ p64["lm_head"]["kernel"], cfg, err_msg=f"base logits, row {row}")
        for temperature, (drafts, biased, q, conf) in ((0.0, greedy), (0.8, sampled)):
            logits, path, want_q, want_conf = reference_chain(cfg, p64, want, int(anchors[row]), temperature,
                                                              chosen=np.asarray(drafts[row]))
            np.testing.assert_array_equal(np.asarray(drafts[row]), path, err_msg=f"chain at T={temperature}")
            assert_model_close(biased[row], logits, cfg, err_msg=f"biased logits at T={temperature}, row {row}")
            np.testing.assert_allclose(np.asarray(conf[row]), want_conf, atol=1e-5, err_msg=f"confidence, row {row}")
            if q is not None:
                np.testing.assert_allclose(np.asarray(q[row]), want_q, atol=1e-5, err_msg=f"q, row {row}")
        departs |= bool((np.asarray(greedy[0][row]) != np.argmax(want @ p64["lm_head"]["kernel"], -1)).any())
    assert departs, "the Markov term never changed a choice: the chain would not be tested"


@pytest.mark.parametrize("from_anchor", [True, False], ids=["sample-from-anchor", "older-1+N-block"])
def test_the_loops_proposal_equals_the_reference(from_anchor):
    """`DSpark.propose` as the loop runs it (`decode.loop._propose`): with sample_from_anchor, a block of
    G slots gives G drafts (G + 1 verified); without it, DFlash's block of G slots gives G - 1 (the
    chain starting at slot 1 from the anchor). Its drafts and its per-row proposal limit equal the reference's."""
    cfg = config(DSparkConfig(R, True, True, sample_from_anchor=from_anchor))
    assert cfg.proposals == (G if from_anchor else G - 1)
    params = random_params(cfg, seed=7, markov_scale=1.5)
    spec = Drafter(cfg, params).spec
    rng = np.random.default_rng(3)
    features = rng.standard_normal((3, 6, 2 * D)).astype(np.float32)
    anchors = np.array([3, 17, 44])
    cache = spec.append_context(params, spec.init_cache(3, 32), jnp.asarray(features))
    threshold = 0.5
    sampling_params = decode_loop.SamplingParams(jnp.float32(1.0), jnp.float32(1.0), jnp.full((8,), -1, jnp.int32),
                                                 confidence_threshold=jnp.float32(threshold))
    gen_cfg = decode_loop.GenerationConfig(block_size=cfg.proposals + 1)
    drafts, probs, first, limit = decode_loop._propose(None, spec, gen_cfg, None, params, jnp.asarray(anchors), cache,
                                                       jax.random.PRNGKey(0), sampling_params)
    assert drafts.shape == (3, cfg.proposals) and probs is None and first is None
    p64 = as64(params)
    for row in range(3):
        block = np.concatenate([[anchors[row]], np.full(G - 1, MASK)])
        hidden = reference_block(cfg, p64, features[row].astype(np.float64), block)
        _, path, _, conf = reference_chain(cfg, p64, hidden if from_anchor else hidden[1:], int(anchors[row]))
        np.testing.assert_array_equal(np.asarray(drafts[row]), path, err_msg=f"row {row}")
        assert int(limit[row]) == int(np.cumprod(conf >= threshold).sum()), (row, conf)


def test_proposal_limit_stops_before_the_first_low_confidence():
    c = jnp.asarray([[0.9, 0.8, 0.2, 0.9], [0.1, 0.9, 0.9, 0.9], [0.6, 0.6, 0.6, 0.6]])
    np.testing.assert_array_equal(np.asarray(dspark.proposal_limit(c, jnp.float32(0.5))), [2, 0, 4])
    np.testing.assert_array_equal(np.asarray(dspark.proposal_limit(c, jnp.float32(0.0))), [4, 4, 4])


TARGET = ModelConfig(arch="llama", vocab_size=V, hidden_size=D, intermediate_size=FF, num_layers=3, num_heads=H,
                     num_kv_heads=KV, head_dim=HD, max_position_embeddings=2048)


def bigram_drafter(sequences):
    """A random DSpark drafter whose Markov head (rank V) adds a large bias toward the most frequent
    successor of the previous token in `sequences` (the target's own greedy outputs): drafts that the
    target often accepts, so whole blocks, partial blocks and rejections all occur."""
    counts = np.zeros((V, V))
    for seq in sequences:
        for a, b in zip(seq[:-1], seq[1:]):
            counts[a, b] += 1
    cfg = config(DSparkConfig(V, True, True))
    params = random_params(cfg, seed=3)
    params["markov_head"] = {"markov_w1": {"embedding": jnp.eye(V, dtype=jnp.float32) * 20.0},
                             "markov_w2": {"kernel": jnp.asarray(np.eye(V, dtype=np.float32)[counts.argmax(1)])}}
    return Drafter(cfg, params)


def test_greedy_speculative_equals_plain_decoding_with_a_ragged_batch_and_the_threshold():
    """A DSpark drafter (G slots, G proposals: G + 1 tokens verified) against a random target: the
    output is the target's own greedy decoding, bit for bit, for prompts of different lengths, with
    the confidence threshold off, in between and at 1 (no draft ever verified: every cycle emits one
    token), the threshold an argument of one compiled loop."""
    from support.speculative import plain_greedy_rows

    target = Target(TARGET, init_target_params(TARGET, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(0, V - 1, size=n))) for n in (1, 4, 9, 2)]
    # plain decoding of the prompts as one ragged batch (2 programs, not one prefill per prompt length;
    # rows of a ragged prefill equal each row alone: test_family_conformance's cached ragged prefill, qwen3's
    # row by default for the KV cache a llama target has too)
    expect = plain_greedy_rows(target, prompts, 16)
    drafter = bigram_drafter([p + e for p, e in zip(prompts, expect)])
    generator = Generator(target, drafter)
    taus = {}
    for threshold in (0.0, 0.5, 1.0):
        result = generator.generate(prompts, max_new_tokens=16, stop_token_ids=(), confidence_threshold=threshold)
        assert result.tokens == expect, f"threshold {threshold}"
        assert result.block_size == G + 1
        taus[threshold] = result.tau
    assert generator.compile_cache_size == 2  # one prefill, one loop for every threshold
    lengths = {n for row in generator.generate(prompts, max_new_tokens=16, stop_token_ids=()).acceptance_lengths
               for n in row}
    assert {1, G + 1} <= lengths and len(lengths) >= 3, lengths
    assert taus[1.0] == 1.0 and taus[0.0] > taus[1.0]


@pytest.mark.slow
def test_greedy_speculative_with_the_older_block_equals_plain_decoding():
    """sample_from_anchor false: G verified per cycle, the output the target's own."""
    from support.speculative import plain_greedy

    target = Target(TARGET, init_target_params(TARGET, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(0, V - 1, size=n))) for n in (1, 4, 9, 2)]
    expect = [plain_greedy(target, p, 16) for p in prompts]
    drafter = bigram_drafter([p + e for p, e in zip(prompts, expect)])
    drafter = dataclasses.replace(drafter, config=dataclasses.replace(
        drafter.config, dspark=dataclasses.replace(drafter.config.dspark, sample_from_anchor=False)))
    result = Generator(target, drafter).generate(prompts, max_new_tokens=16, stop_token_ids=(),
                                                 confidence_threshold=0.3)
    assert result.tokens == expect and result.block_size == G
    assert max(n for row in result.acceptance_lengths for n in row) > 1


@pytest.mark.slow
def test_looked_up_drafts_count_as_confident():
    """With lookup, a looked-up slot is inside the proposal limit: at threshold 1 (no drafter slot
    ever passes) the looked-up tokens are still verified, and the output is the target's own."""
    from support.speculative import plain_greedy

    target = Target(TARGET, init_target_params(TARGET, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(0, V - 1, size=n))) for n in (1, 4, 9, 2)]
    expect = [plain_greedy(target, p, 16) for p in prompts]
    drafter = bigram_drafter([p + e for p, e in zip(prompts, expect)])
    result = Generator(target, drafter).generate(prompts, max_new_tokens=16, stop_token_ids=(), lookup=3,
                                                 confidence_threshold=1.0)
    assert result.tokens == expect and result.tau > 1.0


@pytest.mark.slow
def test_rejections_at_every_block_position(monkeypatch):
    """The loop's geometry with a DSpark drafter (G + 1 tokens verified): drafts wrong at a position
    that moves every cycle keep the output plain greedy decoding, every acceptance length occurring."""
    from support.speculative import check_rejections_at_every_position

    target = Target(TARGET, init_target_params(TARGET, jax.random.PRNGKey(0)))
    cfg = config()
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, V - 1, size=n))) for n in (3, 6)]
    check_rejections_at_every_position(target, Drafter(cfg, random_params(cfg)), prompts, 20, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("temperature, lookup, gate", [(0.0, 0, 0.0), (1.0, 3, 0.5)], ids=["greedy", "sampled"])
def test_the_decode_loop_copies_no_cache(temperature, lookup, gate):
    """The compiled decode loop with a DSpark drafter (the Markov chain's scan and the proposal limit
    inside, with lookup and gated drafts where sampled) copies no whole cache buffer (`support.hlo`).
    960 new tokens: the token buffer (16 + 960 + G + 1) and the lookup's shifted copies of it stay
    shorter than the caches (1024), which the check tells apart by length."""
    from dflash_jax.engine import generator as speculative
    from dflash_jax.kernels import KEY_TILE, round_up
    from support.hlo import whole_buffer_ops

    target = Target(TARGET, init_target_params(TARGET, jax.random.PRNGKey(0)))
    cfg = config()
    generator = speculative.Generator(target, Drafter(cfg, random_params(cfg)))
    gen_cfg, args, _ = generator._prepare([[1, 2, 3]], max_new_tokens=960, temperature=temperature, top_k=0,
                                          top_p=1.0, stop_token_ids=(), block_size=None, seed=0, acceptance="exact",
                                          lookup=lookup, min_draft_probability=gate, confidence_threshold=0.5)
    capacity = round_up(speculative.prompt_bucket(3) + gen_cfg.max_new_tokens + gen_cfg.block_size, KEY_TILE)
    assert capacity == 1024 and gen_cfg.block_size == G + 1
    _, loop, _ = generator._executables(gen_cfg, args, "decode")
    assert whole_buffer_ops(loop.as_text(), capacity) == []


def test_the_cli_flag_reaches_generate():
    import argparse

    from dflash_jax.cli import common

    parser = argparse.ArgumentParser()
    common.add_drafting_flags(parser)
    args = parser.parse_args(["--confidence-threshold", "0.4", "--lookup", "0", "--min-draft-probability", "0"])
    common.check_drafting_flags(parser, args)
    assert common.drafting_kwargs(args, object())["confidence_threshold"] == 0.4
    assert "confidence_threshold" not in common.drafting_kwargs(parser.parse_args([]), object())
    with pytest.raises(SystemExit):
        common.check_drafting_flags(parser, parser.parse_args(["--confidence-threshold", "1.5"]))


# ---- sampling ------------------------------------------------------------------------------------

@functools.cache  # one (target, drafter) for the module: exact_joint compiles its steps once
def sampling_setup():
    from support.sampling import DRAFTER, sampling_pair

    target, _ = sampling_pair()
    cfg = dataclasses.replace(DRAFTER, dspark=DSparkConfig(4, True, True))
    params = random_params(cfg, seed=5, markov_scale=1.5)
    return target, Drafter(cfg, params)


# newer-jax leg only (`one_leg`), with its power check below; both legs run the chain against float64 and
# its greedy decoding (above) and the sampling rule's chi-squares (test_sampling.py)
@pytest.mark.one_leg
def test_speculative_sampling_with_a_dspark_drafter_matches_the_target_distribution():
    """6,000 rows at temperature 1 (the Markov chain's q over the vocabulary in the exact rule), with
    the threshold off and at 0.5 (one compiled loop): the chi-square against the target's exact
    joint distribution of its first 3 tokens passes."""
    from support.sampling import PROMPT, SAMPLES, chi_square_pvalue, exact_joint

    target, drafter = sampling_setup()
    generator = Generator(target, drafter)
    taus = []
    for threshold in (0.0, 0.5):
        result = generator.generate([PROMPT] * SAMPLES, max_new_tokens=3, stop_token_ids=(), seed=21,
                                    temperature=1.0, confidence_threshold=threshold)
        assert chi_square_pvalue([tuple(t) for t in result.tokens], exact_joint(target)) > 1e-3, threshold
        taus.append(result.tau)
    assert taus[0] > 1.05 and 1.0 < taus[1] < taus[0]  # drafts accepted; the threshold cut some short


# covered by default: test_sampling.py::test_sampling_under_a_verify_cost_table_matches_target_distribution (the
# exact rule on the prefix a cost table chooses, its chi-square) and the test above (a DSpark chain's q, with the
# threshold cutting the proposal short, its chi-square); here the two at once, a loop of its own to compile
@pytest.mark.slow
def test_speculative_sampling_with_a_dspark_drafter_under_a_verify_cost_table_matches_the_target_distribution():
    """Verify widths chosen by a cost table, with the confidence threshold: still the target's
    distribution (6,000 rows at temperature 1, the chi-square of the first 3 tokens)."""
    from support.sampling import PROMPT, SAMPLES, chi_square_pvalue, exact_joint

    target, drafter = sampling_setup()
    result = Generator(target, drafter).generate(
        [PROMPT] * SAMPLES, max_new_tokens=3, stop_token_ids=(), seed=22, temperature=1.0,
        confidence_threshold=0.5, verify_costs={1: 1.0, 2: 1.05, 4: 1.1, 5: 1.2})
    assert chi_square_pvalue([tuple(t) for t in result.tokens], exact_joint(target)) > 1e-3
    assert 1.0 < result.tau


@pytest.mark.one_leg  # with the chi-square above
def test_the_chi_square_sees_a_q_without_the_markov_bias(monkeypatch):
    """Power: the same run with the chain's drafts verified against the base logits' distribution
    (the Markov bias left out of q) is detected."""
    from support.sampling import PROMPT, SAMPLES, chi_square_pvalue, exact_joint

    real = dspark.draft

    def unbiased_q(config, params, hidden, logits, anchors, probs_fn=None, key=None):
        drafts, biased, probs, conf = real(config, params, hidden, logits, anchors, probs_fn, key)
        return drafts, biased, probs if probs_fn is None else probs_fn(logits), conf

    target, drafter = sampling_setup()
    monkeypatch.setattr(dspark, "draft", unbiased_q)
    result = Generator(target, drafter).generate([PROMPT] * SAMPLES, max_new_tokens=3, stop_token_ids=(), seed=21,
                                                 temperature=1.0)
    assert chi_square_pvalue([tuple(t) for t in result.tokens], exact_joint(target)) < 1e-6


# ---- arguments -----------------------------------------------------------------------------------

def test_the_threshold_needs_a_dspark_drafter_with_a_confidence_head():
    target = Target(TARGET, init_target_params(TARGET, jax.random.PRNGKey(0)))
    cfg = config(DSparkConfig(R, False))
    with pytest.raises(ValueError, match="confidence_threshold needs a DSpark drafter with a confidence head"):
        generate(target, Drafter(cfg, random_params(cfg)), [[1, 2]], max_new_tokens=2, confidence_threshold=0.5)
    with pytest.raises(ValueError, match="confidence_threshold needs"):
        generate(target, None, [[1, 2]], max_new_tokens=2, confidence_threshold=0.5)
    with pytest.raises(ValueError, match=r"confidence_threshold must be in \[0, 1\]"):
        generate(target, None, [[1, 2]], max_new_tokens=2, confidence_threshold=1.5)


def test_every_dspark_weight_has_declared_sharding_axes():
    from dflash_jax import sharding

    shapes = jax.eval_shape(lambda: init_drafter_params(config(), jax.random.PRNGKey(0)))
    axes = {jax.tree_util.keystr(path): sharding.param_axes(tuple(k.key for k in path), s.shape)
            for path, s in jax.tree_util.tree_leaves_with_path(shapes)}
    assert axes["['markov_head']['markov_w1']['embedding']"] == ("vocab", "markov_rank")
    assert axes["['markov_head']['markov_w2']['kernel']"] == ("markov_rank", "vocab")
    assert axes["['lm_head']['kernel']"] == ("embed", "vocab")


# ---- config and checkpoints ----------------------------------------------------------------------

def hf_config(**kw):
    """DeepSpec's own config.json of a tiny Qwen3DSparkModel."""
    return {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": D, "intermediate_size": FF,
            "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD,
            "vocab_size": V, "num_target_layers": 3, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "block_size": G, "layer_types": ["full_attention"] * 2,
            "tie_word_embeddings": False, "target_layer_ids": [0, 2], "mask_token_id": MASK, "num_anchors": 512,
            "markov_rank": R, "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": True, **kw}


def test_config_reads_deepspec_fields_and_refuses_what_it_does_not_implement():
    cfg = DrafterConfig.from_hf_config(hf_config())
    assert cfg.dspark == DSparkConfig(R, True, True) and cfg.block_size == G and cfg.target_layer_ids == (0, 2)
    assert cfg.mask_token_id == MASK and cfg.is_causal is False and cfg.proposals == G
    out = cfg.to_hf_config(hf_config())
    assert out["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in out
    assert {k: out[k] for k in ("target_layer_ids", "mask_token_id", "markov_rank", "num_anchors")} == {
        "target_layer_ids": [0, 2], "mask_token_id": MASK, "markov_rank": R, "num_anchors": 512}
    assert DrafterConfig.from_hf_config(out) == cfg
    plain = DrafterConfig.from_hf_config(hf_config(markov_rank=0, enable_confidence_head=False,
                                                   markov_head_type=None, confidence_head_with_markov=None))
    assert plain.dspark == DSparkConfig(0, False)
    older = DrafterConfig.from_hf_config(hf_config(sample_from_anchor=False))
    assert older.proposals == G - 1 and older.to_hf_config()["sample_from_anchor"] is False
    assert "sample_from_anchor" not in out
    bad = [(dict(target_layer_ids=[-1, 2]), "an id of -1"),
           (dict(markov_head_type="gated"), "markov_head_type 'gated' is not supported"),
           (dict(markov_rank=None), "markov_rank"),
           (dict(confidence_head_with_markov=None), "confidence_head_with_markov"),
           (dict(target_layer_ids=None), "target_layer_ids"),
           (dict(tie_word_embeddings=True), "tie_word_embeddings"),
           (dict(architectures=["DSparkSpeculator"], transformer_layer_config={}), "speculators layout")]
    for kw, match in bad:
        with pytest.raises(ConfigError, match=match):
            DrafterConfig.from_hf_config(hf_config(**kw))


def deepspec_tensors(seed=0, dtype=np.float32):
    """A Qwen3DSparkModel checkpoint's tensors under DeepSpec's names, random."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    t = {"fc.weight": draw(D, 2 * D), "hidden_norm.weight": draw(D), "norm.weight": draw(D),
         "embed_tokens.weight": draw(V, D), "lm_head.weight": draw(V, D),
         "markov_head.markov_w1.weight": draw(V, R), "markov_head.markov_w2.weight": draw(V, R),
         "confidence_head.proj.weight": draw(1, D + R), "confidence_head.proj.bias": draw(1)}
    for i in range(2):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": draw(D), p + "post_attention_layernorm.weight": draw(D),
                  p + "self_attn.q_proj.weight": draw(H * HD, D), p + "self_attn.k_proj.weight": draw(KV * HD, D),
                  p + "self_attn.v_proj.weight": draw(KV * HD, D), p + "self_attn.o_proj.weight": draw(D, H * HD),
                  p + "self_attn.q_norm.weight": draw(HD), p + "self_attn.k_norm.weight": draw(HD),
                  p + "mlp.gate_proj.weight": draw(FF, D), p + "mlp.up_proj.weight": draw(FF, D),
                  p + "mlp.down_proj.weight": draw(D, FF)})
    return t


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_and_export_are_bit_exact_both_ways(tmp_path, dtype):
    import ml_dtypes
    from safetensors.numpy import load_file

    from dflash_jax.formats.safetensors_io import save_safetensors
    from dflash_jax.loading.drafter_io import load_drafter, save_drafter

    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    tensors = deepspec_tensors(dtype=np_dtype)
    save_safetensors(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(hf_config()))
    drafter = load_drafter(src, dtype=dtype)
    p = drafter.params
    np.testing.assert_array_equal(np.asarray(p["embed_tokens"]["embedding"]), tensors["embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(p["lm_head"]["kernel"]), tensors["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(p["markov_head"]["markov_w1"]["embedding"]),
                                  tensors["markov_head.markov_w1.weight"])
    np.testing.assert_array_equal(np.asarray(p["markov_head"]["markov_w2"]["kernel"]),
                                  tensors["markov_head.markov_w2.weight"].T)
    np.testing.assert_array_equal(np.asarray(p["confidence_head"]["proj"]["kernel"]),
                                  tensors["confidence_head.proj.weight"].T)
    save_drafter(drafter, out)
    saved = load_file(str(out / "model.safetensors")) if dtype == "float32" else None
    if saved is not None:
        assert set(saved) == set(tensors)
        for name, value in tensors.items():
            np.testing.assert_array_equal(saved[name], value, err_msg=name)
    again = load_drafter(out, dtype=dtype)
    assert again.config == drafter.config
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                           drafter.params, again.params)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Qwen3DSparkModel"] and written["num_anchors"] == 512
    # a tensor of the wrong shape (a table that is not the vocabulary's) is refused by name
    bad = dict(tensors, **{"embed_tokens.weight": tensors["embed_tokens.weight"][:-1]})
    save_safetensors(bad, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="embed_tokens.weight"):
        load_drafter(src, dtype=dtype)
