"""Token distributions and the lossless acceptance rules of speculative decoding.

Shapes: draft tokens [B, G-1] (slots 1..G-1 of the block); target distributions [B, G, V] where
slot i is the target's distribution for the token after block slot i; draft distributions
[B, G-1, V] for the draft tokens. All rules return (num_accepted [B], next_token [B]): the row
emits draft[:num_accepted] and then next_token (a correction, or the bonus when all survive).

Nothing here sorts the vocabulary. The top-k cutoff comes from `lax.top_k`; the top-p cutoff from a
bisection over the bit patterns of the probabilities (exact: one masked sum per step, 30 steps);
sampling draws a chunk of the vocabulary and then a token inside it (exact, with ~2*sqrt(V) random
numbers instead of V). XLA:CPU sorts a row of logits slowly, so a filter that sorts the vocabulary
costs a cycle far more than its arithmetic; these cost a few passes over the row (the figures:
docs/performance.md, "Why the code is shaped this way (measured)").
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Non-negative float32 values are ordered like their bit patterns read as int32; every probability
# in [0, 1] has a pattern below 2**30, so 30 halvings pin any threshold between them exactly.
_PROBABILITY_BISECTION_STEPS = 30


def per_row_keys(key) -> bool:
    """Whether `key` holds one PRNG key per batch row ([B, 2] raw keys, or [B] typed keys: the batch
    engine's, so that a row's draws depend on its own key alone) rather than one key for the batch."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.ndim == 1
    return key.ndim == 2


def split(key, num: int = 2):
    """`jax.random.split` of one key, or of a key per row: [num, B, ...] (entry i holds every row's
    i-th subkey, so `a, b = split(keys)` unpacks alike)."""
    if per_row_keys(key):
        return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, num))(key), 0, 1)
    return jax.random.split(key, num)


def _each_row(rule, key, *rows):
    """`rule(key, *rows)` (arrays with the batch first) run row by row with each row's own key."""
    one = lambda k, *r: jax.tree_util.tree_map(lambda y: y[0], rule(k, *(x[None] for x in r)))  # noqa: E731
    return jax.vmap(one)(key, *rows)


def gather_rows(x, index):
    """x [B, T, ...], index [B] -> x[b, index[b]] [B, ...]."""
    return jnp.take_along_axis(x, index.reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]


def greedy(logits):
    """First index of the largest logit, like `jnp.argmax` (cheaper on XLA:CPU): [..., V] -> [...]."""
    v = logits.shape[-1]
    best = jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(logits == best, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    return jnp.minimum(first, v - 1)  # NaN rows (no element equals the max) give the last id


def _nucleus_cutoff(probs, top_p):
    """The smallest probability c with mass(probs > c) < top_p: probs [..., V] -> [..., 1].

    This is the sort-based definition written without sorting. Walking the tokens in descending
    order, a token is kept while the mass before it is < top_p; ties with the last kept value are
    kept too. The first token of value v has mass(probs > v) before it, so the kept set is
    {probs >= c}. mass(probs > t) falls as t rises, so c is found by bisection over the bit
    patterns of t (int32 order = float order for t >= 0); c is always a value that occurs.
    """
    lo = jnp.zeros(probs.shape[:-1] + (1,), jnp.int32)  # invariant: the answer lies in [lo, hi]
    hi = jax.lax.bitcast_convert_type(jnp.max(probs, axis=-1, keepdims=True), jnp.int32)  # mass above: 0

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        above = probs > jax.lax.bitcast_convert_type(mid, jnp.float32)
        light = jnp.sum(jnp.where(above, probs, 0.0), axis=-1, keepdims=True) < top_p
        return jnp.where(light, lo, mid + 1), jnp.where(light, mid, hi)

    _, hi = jax.lax.fori_loop(0, _PROBABILITY_BISECTION_STEPS, halve, (lo, hi))
    return jax.lax.bitcast_convert_type(hi, jnp.float32)


def filtered_probs(logits, temperature, top_k: int = 0, top_p=None):
    """softmax(logits / temperature) restricted to the top-k tokens and the top-p nucleus.

    logits [..., V] -> probs [..., V] float32. top_k is static (0 = off; every token tied with the
    k-th largest logit is kept); top_p is a traced scalar, or None to skip the nucleus filter (the
    nucleus: the fewest most likely tokens whose mass reaches top_p, always the top token, and every
    token tied with the last one kept; see `_nucleus_cutoff`).
    """
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        # min over the values, not [..., -1]: a slice of lax.top_k makes XLA:CPU sort the whole row.
        kth = jnp.min(jax.lax.top_k(logits, top_k)[0], axis=-1, keepdims=True)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if top_p is not None:
        probs = jnp.where(probs >= _nucleus_cutoff(probs, top_p), probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def sample(key, probs):
    """One token per distribution: probs [..., V] (need not be normalised) -> [...] int32.

    Draws a chunk of C ~ sqrt(V) consecutive ids with probability proportional to its mass, then an
    id inside it: p(id) = mass(chunk)/total * p(id)/mass(chunk), exactly the categorical draw, with
    V/C + C Gumbel numbers instead of V. Zero-probability ids are never drawn. key: one key, or a
    key per row of probs [B, ..., V] (`per_row_keys`).
    """
    if per_row_keys(key):
        return jax.vmap(sample)(key, probs)
    v = probs.shape[-1]
    chunk = 1 << math.ceil(math.log2(math.sqrt(v))) if v > 1 else 1
    num_chunks = -(-v // chunk)
    padded = jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, num_chunks * chunk - v)])
    chunks = padded.reshape(*probs.shape[:-1], num_chunks, chunk)  # [..., V/C, C]
    chunk_key, token_key = jax.random.split(key)
    which = jax.random.categorical(chunk_key, jnp.log(jnp.sum(chunks, axis=-1)), axis=-1)  # [...]
    inside = jnp.take_along_axis(chunks, which[..., None, None], axis=-2)[..., 0, :]  # [..., C]
    offset = jax.random.categorical(token_key, jnp.log(inside), axis=-1)
    return (which * chunk + offset).astype(jnp.int32)


def leading_true(matches):
    """Number of leading True values along the last axis."""
    return jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def accept_greedy(draft_tokens, target_logits):
    """Accept while the draft equals the target argmax; next = argmax after the accepted prefix."""
    best = greedy(target_logits)  # [B, G]
    accepted = leading_true(draft_tokens == best[:, :-1])
    return accepted, gather_rows(best, accepted)


def accept_match(key, draft_tokens, target_probs):
    """The official rule: the target samples every slot; accept while its sample equals the draft."""
    if per_row_keys(key):
        return _each_row(accept_match, key, draft_tokens, target_probs)
    posterior = sample(key, target_probs)  # [B, G]
    accepted = leading_true(draft_tokens == posterior[:, :-1])
    return accepted, gather_rows(posterior, accepted)


def accept_exact(key, draft_tokens, draft_probs, target_probs):
    """Speculative sampling: accept draft x with probability min(1, p_t(x) / p_d(x)); at the first
    rejection sample from normalize(max(0, p_t - p_d)); if every draft survives sample the bonus
    from p_t. The emitted tokens are distributed exactly as the target's own samples. key: one key,
    or a key per row (`per_row_keys`)."""
    if per_row_keys(key):
        return _each_row(accept_exact, key, draft_tokens, draft_probs, target_probs)
    gamma = target_probs.shape[1]
    accept_key, next_key = jax.random.split(key)
    p_target = jnp.take_along_axis(target_probs[:, :-1], draft_tokens[..., None], axis=-1)[..., 0]
    p_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(accept_key, p_target.shape)
    accepted = leading_true(u * p_draft < p_target)
    # Distribution of the next token: the residual at the rejected slot, or p_t at the last slot.
    padded_draft = jnp.concatenate([draft_probs, jnp.zeros_like(target_probs[:, :1])], axis=1)
    target_next = gather_rows(target_probs, accepted)
    residual = jnp.maximum(target_next - gather_rows(padded_draft, accepted), 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    bonus = (accepted == gamma - 1)[:, None]
    # `sample` normalises: the residual needs no division.
    return accepted, sample(next_key, jnp.where(bonus | (total <= 0), target_next, residual))
