"""Qwen3.5 hybrid targets (Gated DeltaNet + gated attention): parity with transformers' own classes,
the delta rule's forms, exact rollback of the recurrent state, lossless speculative decoding with
rejections at every block position, sampling, loading and bad input."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import _decode_loop as decode_loop, _gated_delta as gd
from dflash_jax._config import LinearAttentionConfig, ModelConfig
from dflash_jax._drafter import Drafter, init_drafter_params
from dflash_jax._drafter_config import DrafterConfig
from dflash_jax._errors import CheckpointError
from dflash_jax._speculative import Generator, generate
from dflash_jax._target import Target, init_target_params
from support.tolerance import assert_model_close



def _hf():
    """(torch, transformers) for the parity tests, which skip without them (the jax-latest leg has
    no torch); the rest of this file needs neither."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("this transformers has no Qwen3_5")
    return torch, transformers

TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=512)
VARIANTS = {
    # Qwen3.5's default pattern (3 linear, 1 full) twice; GQA 2:1 in both kinds of layer
    "causal-lm": dict(kind="causal", text={}),
    # every other layer full, GQA 4:1, one linear key head per 4 value heads, tied head
    "interval2-tied": dict(kind="causal", text=dict(num_hidden_layers=6, num_key_value_heads=1,
                                                    full_attention_interval=2, linear_num_key_heads=1,
                                                    tie_word_embeddings=True)),
    # the text model of a multimodal checkpoint (its vision tower is not read)
    "conditional-generation": dict(kind="conditional", text=dict(num_hidden_layers=4)),
}


def make_hf(kind, text, out_dir, seed=0):
    torch, transformers = _hf()
    torch.manual_seed(seed)
    text = {**TEXT, **text}
    if kind == "conditional":
        config = transformers.Qwen3_5Config(
            text_config=text, tie_word_embeddings=text.get("tie_word_embeddings", False),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32))
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    with torch.no_grad():  # every weight random, the centred norms and the decay's A_log too
        for name, p in model.named_parameters():
            p.copy_((0.1 if "norm" in name else 0.08) * torch.randn_like(p))
            if "A_log" in name:
                p.uniform_(-2.0, 1.0)
    model.eval()
    model.save_pretrained(out_dir)
    return model


SLOW_VARIANTS = ("interval2-tied",)  # make test-all: its parity tests repeat the others' on another pattern


@pytest.fixture(scope="module", params=[pytest.param(v, marks=pytest.mark.slow) if v in SLOW_VARIANTS else v
                                        for v in sorted(VARIANTS)])
def hf_pair(request, tmp_path_factory):
    from dflash_jax import load_target

    variant = VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    model = make_hf(variant["kind"], variant["text"], directory)
    return model, load_target(directory, tokenizer=False), directory


def hf_outputs(model, ids, mask=None):
    torch, _ = _hf()
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), attention_mask=None if mask is None else torch.as_tensor(mask),
                    output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def test_logits_and_captured_layers_equal_transformers(hf_pair):
    model, target, _ = hf_pair
    cfg = target.config
    assert cfg.arch == "qwen3_5" and "linear_attention" in cfg.layer_types
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(2, 77))  # two chunks of the chunked delta rule
    logits, hidden_states = hf_outputs(model, ids)
    capture = (0, 1, cfg.num_layers // 2, cfg.num_layers - 1)  # both kinds of layer, and the last
    hidden, features, _ = target.forward(target.params, jnp.asarray(ids, jnp.int32), capture=capture)
    assert_model_close(np.asarray(target.logits(target.params, hidden)), logits, target.config, tokens=ids.shape[1])
    d = cfg.hidden_size
    for j, layer in enumerate(capture):
        assert_model_close(np.asarray(features[..., j * d:(j + 1) * d]), hidden_states[layer + 1],
                           target.config, tokens=ids.shape[1], err_msg=f"layer {layer}")


def test_padded_batch_and_cached_prefill_equal_transformers(hf_pair):
    """Right-padded rows through the cached, chunked prefill (300 tokens: a 256-token chunk and a
    remainder, each row stopping its recurrent state at its own length) give each row's logits
    alone; the next cached step continues them."""
    model, target, _ = hf_pair
    cfg = target.config
    rng = np.random.default_rng(1)
    lengths = [300, 131, 5]
    ids = rng.integers(0, cfg.vocab_size, size=(3, 301))
    cache = target.init_cache(3, 512)
    hidden, _, cache = target.prefill(target.params, jnp.asarray(ids[:, :300], jnp.int32), cache,
                                      num_new=jnp.asarray(lengths))
    assert list(np.asarray(cache.lengths)) == lengths
    nxt = ids[np.arange(3), lengths]
    step, _, _ = target.forward(target.params, jnp.asarray(nxt[:, None], jnp.int32), cache)
    for row, n in enumerate(lengths):
        row_ids = np.concatenate([ids[row, :n], nxt[row:row + 1]])[None]
        logits, _ = hf_outputs(model, row_ids)
        assert_model_close(np.asarray(target.logits(target.params, hidden[row, :n])), logits[0, :n],
                           target.config, tokens=ids.shape[1])
        assert_model_close(np.asarray(target.logits(target.params, step[row, 0])), logits[0, n],
                           target.config, tokens=ids.shape[1])


def test_greedy_tokens_equal_transformers_generate(hf_pair):
    model, target, _ = hf_pair
    torch, _ = _hf()
    prompt = [5, 17, 33, 2, 9, 41]
    with torch.no_grad():
        expect = model.generate(torch.as_tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(target, None, [prompt], max_new_tokens=24, stop_token_ids=()).tokens[0] == expect


# ---------------------------------------------------------------------------------------------
# The delta rule and its rollback

def _delta_inputs(rng, b=2, t=37, hk=2, hv=4, dk=8, dv=8):
    q = gd.l2_normalize(jnp.asarray(rng.normal(size=(b, t, hk, dk)), jnp.float32))
    k = gd.l2_normalize(jnp.asarray(rng.normal(size=(b, t, hk, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(b, t, hv, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 2.0, size=(b, t, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, size=(b, t, hv)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(b, hv, dk, dv)), jnp.float32)
    return q, k, v, g, beta, state


def test_delta_rule_forms_agree_with_transformers_reference():
    torch, _ = _hf()
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    q, k, v, g, beta, state = _delta_inputs(np.random.default_rng(2), t=150)
    t = lambda x: torch.as_tensor(np.array(x))
    for form in ("recurrent", "chunked"):
        out, final = gd.delta_rule(q, k, v, g, beta, state, form=form)
        fn = ref.torch_recurrent_gated_delta_rule if form == "recurrent" else ref.torch_chunk_gated_delta_rule
        want, want_final = fn(t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=t(state), output_final_state=True)
        np.testing.assert_allclose(np.asarray(out), want.numpy(), atol=2e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(final), want_final.numpy(), atol=2e-5, rtol=0)


def test_unit_lower_inverse_by_doubling():
    rng = np.random.default_rng(7)
    for c in (1, 3, 16, 37, 64):
        m = np.tril(rng.uniform(-1, 1, size=(3, c, c)), -1) + np.eye(c)
        want = np.linalg.inv(m)
        got = np.asarray(gd.unit_lower_inverse(jnp.asarray(m, jnp.float32)))
        np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_masked_positions_leave_the_state_exactly_unchanged(form):
    """valid[b] = n gives the state after the first n positions alone, for every n of a block."""
    q, k, v, g, beta, state = _delta_inputs(np.random.default_rng(3), t=16)
    rule = jax.jit(lambda *args: gd.delta_rule(*args, form=form)[1])
    for n in range(17):
        masked = rule(q, k, v, g, beta, state, jnp.asarray([n, 16 - n]))
        for row, m in enumerate((n, 16 - n)):
            cut = lambda x: x[row:row + 1, :m]
            if m == 0:
                np.testing.assert_array_equal(np.asarray(masked[row]), np.asarray(state[row]))
                continue
            alone = rule(*map(cut, (q, k, v, g, beta)), state[row:row + 1], None)
            tol = 0 if form == "recurrent" else 1e-6  # the chunk's inverse over 16 vs m positions
            np.testing.assert_allclose(np.asarray(masked[row]), np.asarray(alone[0]), atol=tol, rtol=0)


def tiny_hybrid(seed=0, vocab=48, scale=4.0, layer_types=("linear_attention",) * 3 + ("full_attention",)):
    cfg = ModelConfig(arch="qwen3_5", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_layers=len(layer_types), num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                      partial_rotary_factor=0.25, layer_types=layer_types,
                      linear=LinearAttentionConfig(conv_kernel_dim=4, num_key_heads=2, num_value_heads=4,
                                                   key_head_dim=8, value_head_dim=8))
    params = init_target_params(cfg, jax.random.PRNGKey(seed))
    params = jax.tree_util.tree_map(lambda x: x * scale if x.ndim >= 2 else x, params)  # sharper logits
    return Target(cfg, params)


# make test-all: the masked-state test and the rejections test (every acceptance length) check rollback by default
@pytest.mark.slow
def test_state_after_rollback_equals_plain_decoding_of_the_accepted_tokens():
    """A verify of 8 tokens committed for n = 0..8 (two rows, n and 8 - n) holds what a forward of
    the first n tokens alone writes: the first layer's conv tail bit for bit (its inputs are the
    embeddings), the rest to the float32 rounding of an 8-position chunk against an n-position one
    (a later layer's inputs went through an earlier layer's delta rule)."""
    target = tiny_hybrid()
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, 40, size=(2, 11)), jnp.int32)
    block = jnp.asarray(rng.integers(0, 40, size=(2, 8)), jnp.int32)
    forward = jax.jit(lambda p, t, c: target.forward(p, t, c))
    _, _, cache = forward(target.params, prompt, target.init_cache(2, 64))
    _, _, pending = jax.jit(lambda p, t, c: target.forward(p, t, c, write_cache=False))(target.params, block, cache)
    commit = jax.jit(lambda c, pd, n: c.commit(pd, n))
    for n in range(9):
        counts = jnp.asarray([n, 8 - n])
        rolled = commit(cache, pending, counts)
        for row, m in enumerate((n, 8 - n)):
            one = cache.replace(kv=cache.kv.replace(k=cache.kv.k[:, row:row + 1], v=cache.kv.v[:, row:row + 1],
                                                    lengths=cache.kv.lengths[row:row + 1]),
                                conv=cache.conv[:, row:row + 1], state=cache.state[:, row:row + 1])
            if m:
                _, _, one = forward(target.params, block[row:row + 1, :m], one)
            assert int(rolled.lengths[row]) == 11 + m
            np.testing.assert_array_equal(np.asarray(rolled.conv[0, row]), np.asarray(one.conv[0, 0]))
            close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)
            close(rolled.conv[:, row], one.conv[:, 0])
            close(rolled.state[:, row], one.state[:, 0])
            used = slice(0, 11 + m)
            close(rolled.kv.k[:, row, used], one.kv.k[:, 0, used])
            close(rolled.kv.v[:, row, used], one.kv.v[:, 0, used])


# ---------------------------------------------------------------------------------------------
# Speculative decoding

@functools.partial(jax.jit, static_argnums=0)
def _forward(spec, params, tokens, cache):
    return spec.forward(params, tokens, cache)


def plain_greedy(target, prompt, max_new):
    """Independent reference: the prompt, then one token at a time through the cache (one compiled
    step per target spec, whatever the prompt)."""
    fwd = functools.partial(_forward, target.spec)
    hidden, _, cache = fwd(target.params, jnp.asarray([prompt], jnp.int32), target.init_cache(1, 256))
    out = [int(jnp.argmax(target.logits(target.params, hidden[0, -1])))]
    while len(out) < max_new:
        hidden, _, cache = fwd(target.params, jnp.asarray([[out[-1]]], jnp.int32), cache)
        out.append(int(jnp.argmax(target.logits(target.params, hidden[0, -1]))))
    return out


def tiny_drafter(target, block_size=8, seed=1):
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                        vocab_size=target.config.vocab_size, num_target_layers=target.config.num_layers,
                        target_layer_ids=(1, target.config.num_layers - 1), block_size=block_size,
                        mask_token_id=target.config.vocab_size - 1)
    return Drafter(cfg, init_drafter_params(cfg, jax.random.PRNGKey(seed)))


def check_rejections_at_every_position(target, drafter, prompts, max_new, monkeypatch):
    """Generate with drafts that are the plain greedy continuation with one token wrong at a position
    that moves every cycle (cycle c of row b: position (c + b) mod G, none wrong at G - 1), so every
    cycle rejects at a known place and the cache rolls back there: the output must stay plain
    greedy decoding bit for bit, and every acceptance length 1..G must occur."""
    g = drafter.config.block_size
    expect = [plain_greedy(target, p, max_new) for p in prompts]
    reference = np.zeros((len(prompts), 128), np.int32)
    for row, (p, e) in enumerate(zip(prompts, expect)):
        reference[row, :len(p) + max_new] = p + e
    reference = jnp.asarray(reference)
    vocab = target.config.vocab_size

    def oracle(target_spec, drafter_spec, cfg, tp, dp, state, anchors, key, params):
        slots = jnp.arange(cfg.block_size - 1)
        want = jnp.take_along_axis(reference, jnp.minimum(state.lengths[:, None] + slots, reference.shape[1] - 1), 1)
        wrong = (state.cycles + jnp.arange(state.lengths.shape[0])) % cfg.block_size
        return jnp.where(slots[None] == wrong[:, None], (want + 1) % vocab, want), None, None

    monkeypatch.setattr(decode_loop, "_draft", oracle)
    result = Generator(target, drafter).generate(prompts, max_new_tokens=max_new, stop_token_ids=())
    assert result.tokens == expect
    lengths = {n for row in result.acceptance_lengths for n in row}
    assert set(range(1, g + 1)) <= lengths, lengths


def test_speculative_greedy_with_rejections_at_every_position(monkeypatch):
    """A hybrid's recurrent state rolled back at every position of an 8-token block, three ragged
    rows (`check_rejections_at_every_position`)."""
    target = tiny_hybrid()
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, 40, size=n))) for n in (3, 9, 20)]
    check_rejections_at_every_position(target, tiny_drafter(target), prompts, 50, monkeypatch)


@pytest.mark.slow  # make test-all: the rejections test covers every acceptance length, 1 included
def test_speculative_greedy_with_a_random_drafter_equals_plain_decoding():
    target = tiny_hybrid(seed=2, layer_types=("linear_attention", "full_attention") * 2)
    drafter = tiny_drafter(target, block_size=4, seed=3)
    rng = np.random.default_rng(6)
    prompts = [list(map(int, rng.integers(0, 40, size=n))) for n in (1, 12, 30)]
    result = generate(target, drafter, prompts, max_new_tokens=33, stop_token_ids=())
    assert result.tokens == [plain_greedy(target, p, 33) for p in prompts]


def check_sampling_lossless(target, drafter):
    """test_sampling's chi-square: the first 3 tokens sampled speculatively (6,000 samples, its
    prompt, seed and threshold) follow the target's exact distribution, with drafts accepted."""
    from test_sampling import PROMPT, SAMPLES, chi_square_pvalue, exact_joint

    result = generate(target, drafter, [PROMPT] * SAMPLES, max_new_tokens=3, stop_token_ids=(), temperature=1.0,
                      seed=11)
    assert chi_square_pvalue([tuple(t) for t in result.tokens], exact_joint(target)) > 1e-3
    assert result.tau > 1.05  # drafts were accepted: the rule and the rollback ran


def test_speculative_sampling_keeps_the_hybrid_targets_distribution():
    from test_sampling import V

    target = tiny_hybrid(seed=3, vocab=V + 1, scale=3.0)
    check_sampling_lossless(target, tiny_drafter(target, block_size=4, seed=5))


# ---------------------------------------------------------------------------------------------
# Loading and bad input

def test_vision_tower_is_not_read_and_packed_layout_is_refused(hf_pair):
    from dflash_jax import load_target

    _, target, directory = hf_pair
    hf = json.loads((directory / "config.json").read_text())
    assert target.config.num_layers == (hf.get("text_config") or hf)["num_hidden_layers"]
    with pytest.raises(ValueError, match="no packed layout"):
        load_target(directory, tokenizer=False, layout="packed")


def test_missing_linear_attention_tensor_is_one_clear_error(tmp_path):
    from safetensors.numpy import load_file, save_file

    from dflash_jax import load_target

    make_hf("causal", dict(num_hidden_layers=4), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.linear_attn.in_proj_b.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.2\.linear_attn\.in_proj_b"):
        load_target(tmp_path, tokenizer=False)


def test_drafter_reading_layers_the_target_lacks_is_refused():
    from dflash_jax.loading.drafter_io import DrafterMismatchError

    target = tiny_hybrid()
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                        vocab_size=48, num_target_layers=8, target_layer_ids=(1, 6), block_size=4, mask_token_id=47)
    drafter = Drafter(cfg, init_drafter_params(cfg, jax.random.PRNGKey(0)))
    with pytest.raises(DrafterMismatchError, match="layers"):
        generate(target, drafter, [[1, 2, 3]], max_new_tokens=4)
