"""DFlash2 drafters (`DFlash2DraftModel`): the grouped dynamic causal convolutions around every
sublayer and the candidate selector, in the jitted loop, loaded and exported in the official layout.

The reference here is float64 numpy written from the description of the authors' model (not from
our model code), on tiny random weights: the block's hidden states, the draft logits, the selector's
walk (its choices and its q over the candidates)."""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax._errors import ConfigError
from dflash_jax.decode import loop as decode_loop
from dflash_jax.drafters import dflash2, generations
from dflash_jax.drafters.config import DFlash2Config, DrafterConfig
from dflash_jax.drafters.drafter import Drafter, init_drafter_params
from dflash_jax.engine.generator import generate
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.target import init_target_params, Target
from support.drafter_reference import random_drafter_params, rms, rope
from support.tolerance import assert_float32_close, assert_model_close

D, H, KV, HD, FF, V, G = 32, 4, 2, 8, 64, 50, 5
T, GROUP, RANK, TOP_K = 3, 8, 6, 4  # conv taps, channels per group, selector rank, candidates
MASK = V - 1


def config(**kw):
    base = dict(hidden_size=D, intermediate_size=FF, num_layers=2, num_heads=H, num_kv_heads=KV, head_dim=HD,
                vocab_size=V, num_target_layers=3, target_layer_ids=(0, 2), block_size=G, mask_token_id=MASK,
                rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                dflash2=DFlash2Config(T, GROUP, RANK, TOP_K))
    return DrafterConfig(**{**base, **kw})


def random_params(cfg, seed=0, codebook_scale=1.0):
    """Every weight random (norm scales near 1), drawn with numpy; the codebooks times codebook_scale."""
    return random_drafter_params(cfg, seed, lambda names: codebook_scale if names[-1].endswith("codebook")
                                 else 0.5 if names[-1] == "base_kernel" else 0.2)


# ---- the float64 reference, from the description -------------------------------------------------

def conv(u, dyn, base):
    """u [g, H]; dyn [g, T, H / GROUP]; base [T, H]: out[l, c] = sum over o <= l of
    (base[o, c] + dyn[l, o, c // GROUP]) * u[l - o, c] (nothing before the block's first position)."""
    out = np.zeros_like(u)
    for pos in range(u.shape[0]):
        for o in range(min(base.shape[0], pos + 1)):
            out[pos] += (base[o] + np.repeat(dyn[pos, o], GROUP)) * u[pos - o]
    return out


def convolved(x, lp, sublayer, name):
    """The sublayer run between its two convolutions, both kernels projected from x (normed input)."""
    taps = lp[name]["base_kernel"].shape[1]
    dyn = (x @ lp[name]["kernel_projection"]["kernel"]).reshape(x.shape[0], 2, taps, -1)
    y = sublayer(conv(x, dyn[:, 0], lp[name]["base_kernel"][0]))
    return conv(y, dyn[:, 1], lp[name]["base_kernel"][1])


def reference_block(cfg, params, features, block_embeds):
    """features [c, n*D] at positions 0..c-1, block embeddings [g, D] at c..c+g-1 -> final-normed
    hidden states [g, D] (every layer full attention, causal inside the block where cfg.is_causal)."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    c, g = features.shape[0], block_embeds.shape[0]
    ctx = rms(features @ p["fc"]["kernel"], p["hidden_norm"]["scale"])
    x = block_embeds
    positions = np.arange(c + g, dtype=np.float64)
    vis = np.ones((g, c + g), bool)
    if cfg.is_causal:
        vis &= np.arange(c + g)[None] <= np.arange(c, c + g)[:, None]
    for i in range(cfg.num_layers):
        lp = jax.tree_util.tree_map(lambda a: a[i], p["layers"])
        at = lp["self_attn"]

        def attend(h):
            q = rms((h @ at["q_proj"]["kernel"]).reshape(g, H, HD), at["q_norm"]["scale"])
            both = np.concatenate([ctx, h])  # the context is not convolved
            k = rms((both @ at["k_proj"]["kernel"]).reshape(c + g, KV, HD), at["k_norm"]["scale"])
            v = (both @ at["v_proj"]["kernel"]).reshape(c + g, KV, HD)
            q, k = rope(q, positions[c:]), rope(k, positions)
            k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
            scores = np.where(vis[None], np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HD), -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            return np.einsum("hqk,khd->qhd", probs, v).reshape(g, H * HD) @ at["o_proj"]["kernel"]

        def mlp(h):
            m = lp["mlp"]
            gate = h @ m["gate_proj"]["kernel"]
            return (gate / (1 + np.exp(-gate)) * (h @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]

        x = x + convolved(rms(x, lp["input_layernorm"]["scale"]), lp, attend, "attention_conv")
        x = x + convolved(rms(x, lp["post_attention_layernorm"]["scale"]), lp, mlp, "mlp_conv")
    return rms(x, p["norm"]["scale"])


def reference_walk(params, hidden, logits, anchor, top_k, temperature=0.0, chosen=None):
    """hidden [S, D], logits [S, V] of the proposal slots -> (candidates [S, K] by descending logit,
    path [S], q [S, K]: softmax(score / temperature), or softmax(score) when greedy). At temperature
    > 0 the walk follows `chosen` (indices into the candidates, the draws being random)."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    pred, succ = p["predecessor_codebook"], p["successor_codebook"]
    hp = hidden @ p["hidden_projection"]["kernel"]
    candidates = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    prev, path, qs = anchor, [], []
    for s in range(hidden.shape[0]):
        cand = candidates[s]
        scores = logits[s, cand] + np.array([np.sum(pred[prev] * hp[s] * succ[k]) for k in cand])
        z = scores / (temperature if temperature > 0 else 1.0)
        q = np.exp(z - z.max())
        qs.append(q / q.sum())
        k = int(np.argmax(scores)) if temperature == 0 else int(chosen[s])
        prev = int(cand[k])
        path.append(prev)
    return candidates, np.array(path), np.array(qs)


# ---- the checks ----------------------------------------------------------------------------------

def test_conv_is_causal_per_block_and_loops_over_the_taps_only():
    """The convolution over packed blocks equals it over each block alone (nothing crosses a
    block's start), and the reference's formula."""
    rng = np.random.default_rng(0)
    u = rng.standard_normal((2, 3 * G, D)).astype(np.float32)
    dyn = rng.standard_normal((2, 3 * G, T, D // GROUP)).astype(np.float32)
    base = rng.standard_normal((T, D)).astype(np.float32)
    packed = np.asarray(dflash2.grouped_causal_conv(jnp.asarray(u), jnp.asarray(dyn), jnp.asarray(base), GROUP, G))
    for j in range(3):
        block = slice(j * G, (j + 1) * G)
        want = conv(u[1, block].astype(np.float64), dyn[1, block].astype(np.float64), base.astype(np.float64))
        assert_float32_close(packed[1, block], want, summation_length=T, err_msg=f"block {j}")
    # a kernel longer than the block reads only zeros past its start
    long_base = rng.standard_normal((G + 2, D)).astype(np.float32)
    long_dyn = rng.standard_normal((2, G, G + 2, D // GROUP)).astype(np.float32)
    got = dflash2.grouped_causal_conv(jnp.asarray(u[:, :G]), jnp.asarray(long_dyn), jnp.asarray(long_base), GROUP, G)
    want = conv(u[0, :G].astype(np.float64), long_dyn[0].astype(np.float64), long_base.astype(np.float64))
    assert_float32_close(got[0], want, summation_length=G, err_msg="long kernel")


@pytest.mark.parametrize("case", ["non-causal", "causal", "scaled-softcapped"])
def test_block_logits_and_walk_equal_the_float64_reference(case):
    """Through the cached inference entry and the packed training entry: hidden states, draft logits,
    and the selector's walk (its candidates, path and q), greedy and sampled."""
    kw = {"non-causal": dict(is_causal=False), "causal": dict(is_causal=True),
          "scaled-softcapped": dict(is_causal=False, input_embedding_scale=2.5, output_multiplier=0.7,
                                    final_logit_softcapping=3.0)}[case]
    cfg = config(**kw)
    params = random_params(cfg, codebook_scale=1.5)
    drafter = Drafter(cfg, params)
    rng = np.random.default_rng(1)
    b, c = 3, 7
    features = rng.standard_normal((b, c, 2 * D)).astype(np.float32)
    anchors = np.array([7, 21, 40])
    tokens = np.concatenate([anchors[:, None], np.full((b, G - 1), MASK)], axis=1)
    table = (0.5 * rng.standard_normal((V, D))).astype(np.float32)
    head = (0.5 * rng.standard_normal((D, V))).astype(np.float32)
    embeds = cfg.block_embeddings(jnp.asarray(table[tokens]))

    cache = drafter.append_context(params, drafter.init_cache(b, 32), jnp.asarray(features))
    got = drafter.draft_hidden(params, embeds, cache)
    valid = jnp.ones((b, 1), bool)
    padded = jnp.concatenate([jnp.asarray(features), jnp.zeros((b, G, 2 * D))], axis=1)
    trained = drafter.train_hidden(params, padded, embeds, jnp.full((b, 1), c), valid)
    logits = cfg.draft_logits(got[:, 1:] @ head)
    greedy = drafter.select(params, got[:, 1:], logits, jnp.asarray(anchors))
    sampled = drafter.select(params, got[:, 1:], logits, jnp.asarray(anchors), jnp.float32(0.8),
                             jax.random.PRNGKey(4))
    departs = False
    for row in range(b):
        want = reference_block(cfg, params, features[row].astype(np.float64),
                               np.asarray(embeds[row], np.float64))
        assert_model_close(got[row], want, cfg, err_msg=f"{case}: inference entry, row {row}")
        assert_model_close(trained[row], want, cfg, err_msg=f"{case}: training entry, row {row}")
        want_logits = want[1:] @ head.astype(np.float64) * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            want_logits = np.tanh(want_logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        assert_model_close(logits[row], want_logits, cfg, err_msg=f"{case}: draft logits, row {row}")
        sel = jax.tree_util.tree_map(np.asarray, params["candidate_selector"])
        for temperature, (drafts, candidates, index, q) in ((0.0, greedy), (0.8, sampled)):
            cand, path, want_q = reference_walk(sel, want[1:], want_logits, int(anchors[row]), TOP_K, temperature,
                                                chosen=np.asarray(index[row]))
            np.testing.assert_array_equal(np.asarray(candidates[row]), cand)
            np.testing.assert_array_equal(np.asarray(drafts[row]), path, err_msg=f"{case}: walk at T={temperature}")
            np.testing.assert_allclose(np.asarray(q[row]), want_q, atol=1e-5, err_msg=f"{case}: q at T={temperature}")
        departs |= bool((np.asarray(greedy[0][row]) != cand[:, 0]).any())
    assert departs, "the pairwise term never changed a choice: the walk would not be tested"


def test_the_selector_q_on_the_vocabulary_is_zero_off_the_candidates():
    q = jnp.asarray([[[0.5, 0.3, 0.2]]])
    cand = jnp.asarray([[[4, 0, 2]]])
    np.testing.assert_array_equal(np.asarray(dflash2.scatter_q(q, cand, 6))[0, 0], np.float32([0.3, 0, 0.2, 0, 0.5, 0]))


TARGET = ModelConfig(arch="llama", vocab_size=V, hidden_size=D, intermediate_size=FF, num_layers=3, num_heads=H,
                     num_kv_heads=KV, head_dim=HD, max_position_embeddings=2048)


def test_greedy_speculative_equals_plain_decoding_with_a_ragged_batch():
    """A random DFlash2 drafter (sharp selector) against a random target: the output is the target's
    own greedy decoding, bit for bit, for prompts of different lengths in one batch."""
    from support.speculative import plain_greedy_rows

    target = Target(TARGET, init_target_params(TARGET, jax.random.PRNGKey(0)))
    cfg = config(block_size=4)
    drafter = Drafter(cfg, random_params(cfg, seed=3, codebook_scale=1.5))
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(0, V - 1, size=n))) for n in (1, 4, 9, 2)]
    result = generate(target, drafter, prompts, max_new_tokens=12, stop_token_ids=())
    # plain decoding of the prompts as one ragged batch (2 programs, not one prefill per prompt length;
    # rows of a ragged prefill equal each row alone: test_family_conformance's cached ragged prefill, qwen3's
    # row by default for the KV cache a llama target has too)
    assert result.tokens == plain_greedy_rows(target, prompts, 12)


@pytest.mark.slow
@pytest.mark.parametrize("temperature, lookup, gate", [(0.0, 0, 0.0), (1.0, 3, 0.5)], ids=["greedy", "sampled"])
def test_the_decode_loop_copies_no_cache(temperature, lookup, gate):
    """The compiled decode loop with a DFlash2 drafter (its selector's scan inside, with lookup and
    gated drafts where sampled) copies no whole cache buffer (`support.hlo`)."""
    from dflash_jax.engine import generator as speculative
    from dflash_jax.kernels import KEY_TILE, round_up
    from support.hlo import whole_buffer_ops

    target = Target(TARGET, init_target_params(TARGET, jax.random.PRNGKey(0)))
    cfg = config(block_size=4)
    generator = speculative.Generator(target, Drafter(cfg, random_params(cfg)))
    gen_cfg, args, _ = generator._prepare([[1, 2, 3]], max_new_tokens=960, temperature=temperature, top_k=0,
                                          top_p=1.0, stop_token_ids=(), block_size=None, seed=0, acceptance="exact",
                                          lookup=lookup, min_draft_probability=gate)
    capacity = round_up(speculative.prompt_bucket(3) + gen_cfg.max_new_tokens + gen_cfg.block_size, KEY_TILE)
    assert capacity == 1024
    _, loop, _ = generator._executables(gen_cfg, args, "decode")
    assert whole_buffer_ops(loop.as_text(), capacity) == []


def test_every_dflash2_weight_has_declared_sharding_axes():
    from dflash_jax import sharding

    shapes = jax.eval_shape(lambda: init_drafter_params(config(), jax.random.PRNGKey(0)))
    axes = {jax.tree_util.keystr(path): sharding.param_axes(tuple(k.key for k in path), s.shape)
            for path, s in jax.tree_util.tree_leaves_with_path(shapes)}
    assert axes["['candidate_selector']['predecessor_codebook']"] == ("vocab", "selector_rank")
    assert axes["['layers']['mlp_conv']['base_kernel']"] == (None, "conv", "conv", "embed")


# ---- sampling ------------------------------------------------------------------------------------

@functools.cache  # one (target, drafter) for the module: exact_joint compiles its steps once
def sampling_setup():
    from support.sampling import DRAFTER, sampling_pair

    target, _ = sampling_pair()
    cfg = dataclasses.replace(DRAFTER, dflash2=DFlash2Config(2, 16, 4, 3))
    return target, Drafter(cfg, random_params(cfg, seed=5, codebook_scale=3.0))


SELECT = generations.DFLASH2.select


def plain_softmax_select(drafter, cfg, drafter_params, hidden, logits, anchors, key, params):
    """The selector's drafts with the wrong q: the drafter's plain softmax over the vocabulary."""
    drafts, _ = SELECT(drafter, cfg, drafter_params, hidden, logits, anchors, key, params)
    return drafts, decode_loop.target_probs(cfg, params, logits)


# newer-jax leg only (`one_leg`), with its power check below; both legs run the block and walk against
# float64 and greedy decoding (above) and the sampling rule's chi-squares (test_sampling.py)
@pytest.mark.one_leg
def test_speculative_sampling_with_a_dflash2_drafter_matches_the_target_distribution():
    """6,000 rows at temperature 1 with a sharp selector (3 candidates of 7 ids): the chi-square
    against the target's exact joint distribution of its first 3 tokens passes."""
    from support.sampling import PROMPT, SAMPLES, chi_square_pvalue, exact_joint

    target, drafter = sampling_setup()
    result = generate(target, drafter, [PROMPT] * SAMPLES, max_new_tokens=3, stop_token_ids=(), seed=21,
                      temperature=1.0)
    assert chi_square_pvalue([tuple(t) for t in result.tokens], exact_joint(target)) > 1e-3
    assert result.tau > 1.05


@pytest.mark.one_leg  # with the chi-square above
def test_the_chi_square_sees_a_plain_softmax_q(monkeypatch):
    """Power: the same run with the selector's drafts verified against the plain softmax instead of
    the selector's own q is detected (a Generator of its own: `generate`'s would reuse the loop the
    test above compiled)."""
    from support.sampling import PROMPT, SAMPLES, chi_square_pvalue, exact_joint

    from dflash_jax.engine.generator import Generator

    target, drafter = sampling_setup()
    monkeypatch.setattr(generations.DFLASH2, "select", plain_softmax_select)
    result = Generator(target, drafter).generate([PROMPT] * SAMPLES, max_new_tokens=3, stop_token_ids=(), seed=21,
                      temperature=1.0)
    assert chi_square_pvalue([tuple(t) for t in result.tokens], exact_joint(target)) < 1e-6


# ---- config and checkpoints ----------------------------------------------------------------------

def hf_config(**dflash):
    return {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": D, "intermediate_size": FF,
            "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD,
            "vocab_size": V, "num_target_layers": 3, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "block_size": G,
            "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": MASK, **dflash}}


def test_config_reads_dflash_config_first_then_the_top_level_and_names_a_missing_field():
    fields = dict(conv_kernel_size=T, conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOP_K)
    cfg = DrafterConfig.from_hf_config({**hf_config(**fields), "selector_top_k": 9})
    assert cfg.dflash2 == DFlash2Config(T, GROUP, RANK, TOP_K)
    top = DrafterConfig.from_hf_config({**hf_config(conv_kernel_size=T), "conv_group_size": GROUP,
                                        "selector_rank": RANK, "selector_top_k": TOP_K})
    assert top == cfg
    out = cfg.to_hf_config(hf_config())
    assert out["architectures"] == ["DFlash2DraftModel"] and out["dflash_config"]["selector_top_k"] == TOP_K
    assert DrafterConfig.from_hf_config(out) == cfg
    for missing in fields:
        with pytest.raises(ConfigError, match=f"dflash_config.{missing}"):
            DrafterConfig.from_hf_config(hf_config(**{k: v for k, v in fields.items() if k != missing}))
    with pytest.raises(ConfigError, match="conv_group_size"):
        DrafterConfig.from_hf_config(hf_config(**{**fields, "conv_group_size": 5}))
    with pytest.raises(ConfigError, match="selector_top_k"):
        DrafterConfig.from_hf_config(hf_config(**{**fields, "selector_top_k": V + 1}))
    plain = DrafterConfig.from_hf_config({**hf_config(**fields), "architectures": ["DFlashDraftModel"]})
    assert plain.dflash2 is None and "selector_top_k" not in plain.to_hf_config(hf_config(**fields))["dflash_config"]


def official_tensors(seed=0, dtype=np.float32):
    """A DFlash2 checkpoint's tensors under the official names, random."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    t = {"fc.weight": draw(D, 2 * D), "hidden_norm.weight": draw(D), "norm.weight": draw(D),
         "candidate_selector.predecessor_codebook": draw(V, RANK),
         "candidate_selector.successor_codebook": draw(V, RANK),
         "candidate_selector.hidden_projection.weight": draw(RANK, D)}
    for i in range(2):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": draw(D), p + "post_attention_layernorm.weight": draw(D),
                  p + "self_attn.q_proj.weight": draw(H * HD, D), p + "self_attn.k_proj.weight": draw(KV * HD, D),
                  p + "self_attn.v_proj.weight": draw(KV * HD, D), p + "self_attn.o_proj.weight": draw(D, H * HD),
                  p + "self_attn.q_norm.weight": draw(HD), p + "self_attn.k_norm.weight": draw(HD),
                  p + "mlp.gate_proj.weight": draw(FF, D), p + "mlp.up_proj.weight": draw(FF, D),
                  p + "mlp.down_proj.weight": draw(D, FF)})
        for conv_name in ("attention_conv", "mlp_conv"):
            t[p + f"{conv_name}.base_kernel"] = draw(2, T, D)
            t[p + f"{conv_name}.kernel_projection.weight"] = draw(2 * T * (D // GROUP), D)
    return t


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_and_export_are_bit_exact_both_ways(tmp_path, dtype):
    import ml_dtypes

    from dflash_jax.formats.safetensors_io import save_safetensors
    from dflash_jax.loading.drafter_io import load_drafter, save_drafter
    from safetensors.numpy import load_file

    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    tensors = official_tensors(dtype=np_dtype)
    save_safetensors(tensors, src / "model.safetensors", metadata={"format": "pt"})
    hf = hf_config(conv_kernel_size=T, conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOP_K)
    (src / "config.json").write_text(json.dumps(hf))
    drafter = load_drafter(src, dtype=dtype)
    layers, sel = drafter.params["layers"], drafter.params["candidate_selector"]
    np.testing.assert_array_equal(np.asarray(layers["mlp_conv"]["base_kernel"][1]),
                                  tensors["layers.1.mlp_conv.base_kernel"])
    np.testing.assert_array_equal(np.asarray(layers["attention_conv"]["kernel_projection"]["kernel"][0]),
                                  tensors["layers.0.attention_conv.kernel_projection.weight"].T)
    np.testing.assert_array_equal(np.asarray(sel["successor_codebook"]),
                                  tensors["candidate_selector.successor_codebook"])
    np.testing.assert_array_equal(np.asarray(sel["hidden_projection"]["kernel"]),
                                  tensors["candidate_selector.hidden_projection.weight"].T)
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
    assert written["architectures"] == ["DFlash2DraftModel"]
    assert {k: written["dflash_config"][k] for k in DFlash2Config.FIELDS} == {
        "conv_kernel_size": T, "conv_group_size": GROUP, "selector_rank": RANK, "selector_top_k": TOP_K}


# ---- on a mesh -----------------------------------------------------------------------------------

def sharded_findings(out):
    """In a process with 8 CPU devices: greedy and sampled output of a DFlash2 drafter on a mesh
    (tensor 2, data 4: codebooks split over the vocabulary, heads and the fc output over tensor) and
    on one device, and the compiled drafter params' shardings against the rules."""
    from dflash_jax import sharding
    from dflash_jax.engine.generator import Generator

    target = Target(TARGET, init_target_params(TARGET, jax.random.PRNGKey(0)))
    cfg = config(block_size=4)
    drafter = Drafter(cfg, random_params(cfg, seed=3, codebook_scale=1.5))
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(0, V - 1, size=n))) for n in (1, 4, 9, 2)]
    mesh = sharding.make_mesh(data=4, tensor=2)
    found = {}
    for name, kw in (("greedy", {}), ("sampled", dict(temperature=0.9, seed=3))):
        one = Generator(target, drafter).generate(prompts, max_new_tokens=10, stop_token_ids=(), **kw).tokens
        generator = Generator(target, drafter, mesh=mesh)
        found[name] = [one, generator.generate(prompts, max_new_tokens=10, stop_token_ids=(), **kw).tokens]
    rules = sharding.param_shardings(mesh, generator._drafter_params, cfg)
    placed = jax.tree_util.tree_map(lambda a, r: a.sharding.is_equivalent_to(r, a.ndim),
                                    generator._drafter_params, rules)
    found["placed"] = all(jax.tree_util.tree_leaves(placed))
    found["codebook"] = str(rules["candidate_selector"]["successor_codebook"].spec)
    with open(out, "w") as f:
        json.dump(found, f)


@pytest.mark.slow
def test_on_a_mesh_the_output_equals_one_device():
    from support.devices import run_8_devices

    found = run_8_devices("sharded_findings({out})", "test_dflash2")
    assert found["greedy"][0] == found["greedy"][1]
    assert found["sampled"][0] == found["sampled"][1]
    assert found["placed"] and "tensor" in found["codebook"]
