"""The attention seam: every attention in dflash_jax (target, drafter, training) calls `attention`.

q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D] with Hq % Hkv == 0 (GQA without repeating K/V);
ranges: `masks.KeyRanges` ([B, Tq, 2] bounds). Output [B, Tq, Hq, D] in q's dtype. Scores,
softmax and accumulation are float32. A query that sees no key yields zeros (never NaN).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.masks import KeyRanges

IMPLS = ("auto", "reference", "pallas", "pallas_interpret")


def reference_attention(q, k, v, ranges: KeyRanges, *, scale: float | None = None):
    """Plain-jnp attention with a materialised mask: the ground truth and the CPU path."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, tq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    visible = ranges.dense(tk)[:, None, None]  # [B, 1, 1, Tq, Tk]
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, tq, hq, d).astype(q.dtype)


def attention(q, k, v, ranges: KeyRanges, *, scale: float | None = None, impl: str = "auto"):
    """Dispatch to the best implementation available for this backend and shape."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS}")
    return reference_attention(q, k, v, ranges, scale=scale)
