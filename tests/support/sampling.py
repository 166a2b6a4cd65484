"""Sampling's statistical check shared by the test modules: a sampled pair (a target with a sharpened
LM head and a drafter that differs from it), the target's exact joint distribution of its first
tokens, by enumeration, and the chi-square of samples against it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.models.config import ModelConfig

V = 6  # the vocabulary of the sampled targets is V + 1 (the last id: the drafter's mask token)
TARGET = ModelConfig(arch="llama", vocab_size=V + 1, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
DRAFTER = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                        head_dim=8, vocab_size=V + 1, num_target_layers=2, target_layer_ids=(0, 1),
                        block_size=4, mask_token_id=V)
PROMPT = [1, 4, 2]
SAMPLES = 6000


def sampling_pair():
    """TARGET with its LM head sharpened (the distribution far from uniform, the mask token never
    emitted) and DRAFTER, from fixed seeds -> (Target, Drafter)."""
    from dflash_jax.drafters.drafter import Drafter, init_drafter_params
    from dflash_jax.models.target import init_target_params, Target

    params = init_target_params(TARGET, jax.random.PRNGKey(3))
    params = {**params, "embed_tokens": {"embedding": params["embed_tokens"]["embedding"] * 4.0}}
    drafter = Drafter(DRAFTER, init_drafter_params(DRAFTER, jax.random.PRNGKey(5)))
    return Target(TARGET, params), drafter

_PROBS_FNS = {}
_ROWS = 64  # rows of every enumeration batch: the (V + 1) ** (depth - 1) sequences of depth <= 3 fit one


def _next_token_probs_fn(target, temperature, top_k, top_p):
    """Jitted next-token probabilities at a position (eager dispatch would dominate the enumeration), one
    per target spec (hashable, static; the params are an argument) and filters."""
    from dflash_jax.decode import sampling

    spec = target.spec
    key = (spec, temperature, top_k, top_p)
    if key not in _PROBS_FNS:
        def probs(params, batch, position):
            hidden, _, _ = spec.forward(params, batch)
            return sampling.filtered_probs(spec.logits(params, hidden[:, position]), temperature, top_k, top_p)
        _PROBS_FNS[key] = jax.jit(probs)
    return _PROBS_FNS[key]


def exact_joint(target, temperature=1.0, top_k=0, top_p=1.0, depth=3, prompt=PROMPT):
    """p(x1..x_depth | prompt) by enumeration, with the same filters applied to every step.

    Every step's batch has one shape, [_ROWS rows, len(prompt) + depth - 1 tokens] (the sequences
    right-padded: a causal target's probabilities at a position do not read the tokens after it),
    so one compiled program serves the whole enumeration."""
    seqs = [tuple()]
    probs = {tuple(): 1.0}
    width = len(prompt) + depth - 1
    probs_fn = _next_token_probs_fn(target, temperature, top_k, top_p if top_p < 1 else None)
    for step in range(depth):
        rows = []
        for start in range(0, len(seqs), _ROWS):
            batch = np.zeros((_ROWS, width), np.int32)
            for i, s in enumerate(seqs[start:start + _ROWS]):
                batch[i, : len(prompt) + step] = prompt + list(s)
            rows.extend(np.asarray(probs_fn(target.params, jnp.asarray(batch), len(prompt) + step - 1)))
        nxt = {}
        for s, row in zip(seqs, rows):
            for tok in range(V + 1):
                if row[tok] > 0:
                    nxt[s + (tok,)] = probs[s] * float(row[tok])
        probs, seqs = nxt, list(nxt)
    return probs


def chi_square_pvalue(samples, probs, min_expected=5.0):
    """Pool rare outcomes so every cell expects >= min_expected counts."""
    from scipy import stats

    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    unseen = sum(c for s, c in counts.items() if s not in probs)
    assert unseen == 0, "generated a sequence the target gives probability 0"
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for s, p in sorted(probs.items(), key=lambda kv: -kv[1]):
        if p * n >= min_expected:
            observed.append(counts.get(s, 0))
            expected.append(p * n)
        else:
            pool_o += counts.get(s, 0)
            pool_e += p * n
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    expected = np.asarray(expected) * (n / np.sum(expected))
    return stats.chisquare(observed, expected).pvalue
