"""References and checks of speculative decoding shared by the test modules: plain greedy decoding
token by token, tiny random drafters, greedy speculative decoding with rejections at every block
position, and sampling's chi-square."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from support import fitted_models


@functools.partial(jax.jit, static_argnums=0)
def _greedy_step(spec, params, tokens, cache):
    hidden, _, cache = spec.forward(params, tokens, cache)
    return jnp.argmax(spec.logits(params, hidden[:, -1]), -1), cache


def plain_greedy(target, prompt, max_new, stops=(), capacity=256):
    """Independent reference: the prompt through the cache, then one token at a time (one compiled
    step per target spec and token count, whatever the params)."""
    token, cache = _greedy_step(target.spec, target.params, jnp.asarray([prompt], jnp.int32),
                                target.init_cache(1, capacity))
    out = [int(token[0])]
    while len(out) < max_new and out[-1] not in stops:
        token, cache = _greedy_step(target.spec, target.params, jnp.asarray([[out[-1]]], jnp.int32), cache)
        out.append(int(token[0]))
    return out


@functools.partial(jax.jit, static_argnums=0)
def _greedy_prefill(spec, params, tokens, cache, lengths):
    hidden, _, cache = spec.prefill(params, tokens, cache, num_new=lengths)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return jnp.argmax(spec.logits(params, last), -1), cache


def plain_greedy_rows(target, prompts, max_new, capacity=256):
    """`plain_greedy` of each prompt, the prompts as one right-padded batch: each row's own length
    through the cached prefill (`num_new`), then one token per row at a time. Two compiled programs
    whatever the prompts' lengths (`plain_greedy` compiles one per prompt length)."""
    lengths = [len(p) for p in prompts]
    tokens = np.zeros((len(prompts), max(lengths)), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, :len(p)] = p
    token, cache = _greedy_prefill(target.spec, target.params, jnp.asarray(tokens),
                                   target.init_cache(len(prompts), capacity), jnp.asarray(lengths, jnp.int32))
    out = [token]
    for _ in range(max_new - 1):
        token, cache = _greedy_step(target.spec, target.params, token[:, None], cache)
        out.append(token)
    return np.stack(out, axis=1).tolist()


def prompts_mix(seed=0):
    """Three prompts of the fitted models' pattern (3, 7, 12 tokens) and three of noise (1, 5, 9)."""
    rng = np.random.default_rng(seed)
    pattern = [list(map(int, p[: n])) for p, n in zip(fitted_models.pattern_batch(rng, 3, 12), (3, 7, 12))]
    noise = [list(map(int, rng.integers(0, 40, size=n))) for n in (1, 5, 9)]
    return pattern + noise


def tiny_drafter(target, block_size=8, seed=1):
    """A random one-layer drafter of `target` (of its hidden size), reading its layers 1 and last."""
    from dflash_jax.drafters.config import DrafterConfig
    from dflash_jax.drafters.drafter import Drafter, init_drafter_params

    cfg = DrafterConfig(hidden_size=target.config.hidden_size, intermediate_size=64, num_layers=1, num_heads=4,
                        num_kv_heads=2, head_dim=8, vocab_size=target.config.vocab_size,
                        num_target_layers=target.config.num_layers, target_layer_ids=(1, target.config.num_layers - 1),
                        block_size=block_size, mask_token_id=target.config.vocab_size - 1)
    return Drafter(cfg, init_drafter_params(cfg, jax.random.PRNGKey(seed)))


def check_rejections_at_every_position(target, drafter, prompts, max_new, monkeypatch, expect=None, stride=1):
    """Generate with drafts that are the plain greedy continuation with one token wrong at a position
    that moves every cycle (cycle c of row b: position (c + stride * b) mod G, none wrong at G - 1), so
    every cycle rejects at a known place and the cache rolls back there: the output must stay plain
    greedy decoding (`expect`, by default `plain_greedy_rows` of the prompts) bit for bit, and every
    acceptance length 1..G must occur (rows' positions `stride` apart: fewer new tokens cover them)."""
    from dflash_jax.decode import loop as decode_loop
    from dflash_jax.drafters.generations import Proposal
    from dflash_jax.engine.generator import Generator

    g = drafter.config.block_size
    expect = plain_greedy_rows(target, prompts, max_new) if expect is None else expect
    reference = np.zeros((len(prompts), 128), np.int32)
    for row, (p, e) in enumerate(zip(prompts, expect)):
        reference[row, :len(p) + max_new] = p + e
    reference = jnp.asarray(reference)
    vocab = target.config.vocab_size

    def oracle(target_spec, drafter_spec, cfg, tp, dp, state, anchors, key, params):
        slots = jnp.arange(cfg.block_size - 1)
        want = jnp.take_along_axis(reference, jnp.minimum(state.lengths[:, None] + slots, reference.shape[1] - 1), 1)
        wrong = (state.cycles + stride * jnp.arange(state.lengths.shape[0])) % cfg.block_size
        return Proposal(jnp.where(slots[None] == wrong[:, None], (want + 1) % vocab, want))

    monkeypatch.setattr(decode_loop, "_draft", oracle)
    result = Generator(target, drafter).generate(prompts, max_new_tokens=max_new, stop_token_ids=())
    assert result.tokens == expect
    lengths = {n for row in result.acceptance_lengths for n in row}
    assert set(range(1, g + 1)) <= lengths, lengths


def check_sampling_lossless(target, drafter):
    """test_sampling's chi-square (`support.sampling`): the first 3 tokens sampled speculatively
    (6,000 samples, its prompt, seed and threshold) follow the target's exact distribution, with
    drafts accepted."""
    from dflash_jax.engine.generator import generate
    from support.sampling import PROMPT, SAMPLES, chi_square_pvalue, exact_joint

    result = generate(target, drafter, [PROMPT] * SAMPLES, max_new_tokens=3, stop_token_ids=(), temperature=1.0,
                      seed=11)
    assert chi_square_pvalue([tuple(t) for t in result.tokens], exact_joint(target)) > 1e-3
    assert result.tau > 1.05  # drafts were accepted: the rule and the rollback ran
