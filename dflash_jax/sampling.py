"""Token distributions and the lossless acceptance rules of speculative decoding.

Shapes: draft tokens [B, G-1] (slots 1..G-1 of the block); target distributions [B, G, V] where
slot i is the target's distribution for the token after block slot i; draft distributions
[B, G-1, V] for the draft tokens. All rules return (num_accepted [B], next_token [B]): the row
emits draft[:num_accepted] and then next_token (a correction, or the bonus when all survive).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def filtered_probs(logits, temperature, top_k: int = 0, top_p=None):
    """softmax(logits / temperature) restricted to the top-k tokens and the top-p nucleus.

    top_k is static (0 = off); top_p is a traced scalar, or None to skip the nucleus filter.
    """
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if top_p is not None:
        ordered = -jnp.sort(-probs, axis=-1)
        mass_before = jnp.cumsum(ordered, axis=-1) - ordered
        kept = mass_before < top_p
        cutoff = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
        probs = jnp.where(probs >= cutoff, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def sample(key, probs):
    """One token per distribution: probs [..., V] -> [...] int32."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def _leading_true(matches):
    """Number of leading True values along the last axis."""
    return jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _at(x, index):
    """x [B, G, ...], index [B] -> x[b, index[b]]."""
    return jnp.take_along_axis(x, index.reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]


def accept_greedy(draft_tokens, target_logits):
    """Accept while the draft equals the target argmax; next = argmax after the accepted prefix."""
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, G]
    accepted = _leading_true(draft_tokens == best[:, :-1])
    return accepted, _at(best, accepted)


def accept_match(key, draft_tokens, target_probs):
    """The official rule: the target samples every slot; accept while its sample equals the draft."""
    posterior = sample(key, target_probs)  # [B, G]
    accepted = _leading_true(draft_tokens == posterior[:, :-1])
    return accepted, _at(posterior, accepted)


def accept_exact(key, draft_tokens, draft_probs, target_probs):
    """Speculative sampling: accept draft x with probability min(1, p_t(x) / p_d(x)); at the first
    rejection sample from normalize(max(0, p_t - p_d)); if every draft survives sample the bonus
    from p_t. The emitted tokens are distributed exactly as the target's own samples."""
    gamma = target_probs.shape[1]
    accept_key, next_key = jax.random.split(key)
    p_target = jnp.take_along_axis(target_probs[:, :-1], draft_tokens[..., None], axis=-1)[..., 0]
    p_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(accept_key, p_target.shape)
    accepted = _leading_true(u * p_draft < p_target)
    # Distribution of the next token: the residual at the rejected slot, or p_t at the last slot.
    padded_draft = jnp.concatenate([draft_probs, jnp.zeros_like(target_probs[:, :1])], axis=1)
    residual = jnp.maximum(_at(target_probs, accepted) - _at(padded_draft, accepted), 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    bonus = (accepted == gamma - 1)[:, None]
    dist = jnp.where(bonus | (total <= 0), _at(target_probs, accepted), residual / jnp.where(total > 0, total, 1))
    return accepted, sample(next_key, dist)
