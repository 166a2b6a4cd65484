"""Sampling's statistical check shared by the test modules: a target's exact joint distribution of
its first tokens, by enumeration, and the chi-square of samples against it (test_sampling's
prompt, sample count and vocabulary; test_sampling.py keeps its own copy of these until its owner
imports them from here)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

V = 6  # the vocabulary of the sampled targets is V + 1 (the last id: the drafter's mask token)
PROMPT = [1, 4, 2]
SAMPLES = 6000

_PROBS_FNS = {}


def _next_token_probs_fn(target, temperature, top_k, top_p):
    """Jitted next-token probabilities (eager dispatch would dominate the enumeration)."""
    from dflash_jax import _sampling as sampling

    key = (id(target), temperature, top_k, top_p)
    if key not in _PROBS_FNS:
        def probs(params, batch):
            hidden, _, _ = target.forward(params, batch)
            return sampling.filtered_probs(target.logits(params, hidden[:, -1]), temperature, top_k, top_p)
        _PROBS_FNS[key] = jax.jit(probs)
    return _PROBS_FNS[key]


def exact_joint(target, temperature=1.0, top_k=0, top_p=1.0, depth=3, prompt=PROMPT):
    """p(x1..x_depth | prompt) by enumeration, with the same filters applied to every step."""
    seqs = [tuple()]
    probs = {tuple(): 1.0}
    for _ in range(depth):
        batch = jnp.asarray([prompt + list(s) for s in seqs], jnp.int32)
        probs_fn = _next_token_probs_fn(target, temperature, top_k, top_p if top_p < 1 else None)
        p = np.asarray(probs_fn(target.params, batch))
        nxt = {}
        for s, row in zip(seqs, p):
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
