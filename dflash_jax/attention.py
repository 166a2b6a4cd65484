"""The attention seam: every attention in dflash_jax (target, drafter, training) calls `attention`.

q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D] with Hq % Hkv == 0 (GQA without repeating K/V);
ranges: `masks.KeyRanges` ([B, Tq, 2] bounds). Output [B, Tq, Hq, D] in q's dtype. Scores,
softmax and accumulation are float32. A query that sees no key yields zeros (never NaN).
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from dflash_jax.masks import KeyRanges

IMPLS = ("auto", "reference", "pallas", "pallas_interpret")

logger = logging.getLogger("dflash_jax.attention")
_logged_reasons: set[str] = set()


def _log_once(level: int, reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.log(level, "attention: using the reference implementation: %s", reason)


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
    """Dispatch to the best implementation available for this backend and shape.

    impl: "auto" takes the Pallas kernel on GPU when it supports the shape and the reference
    otherwise (logging the reason once); "pallas" forces the kernel (ValueError if unsupported);
    "pallas_interpret" runs the kernel in Pallas interpret mode (CPU tests); "reference" the
    reference.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS}")
    if impl == "reference":
        return reference_attention(q, k, v, ranges, scale=scale)

    # Lazy: the kernel module imports this one (for the reference backward).
    from dflash_jax.kernels import block_attention, unsupported_reason

    if impl == "auto":
        backend = jax.default_backend()
        if backend != "gpu":
            _log_once(logging.DEBUG, f"backend is {backend!r}, the kernel needs a GPU")
            return reference_attention(q, k, v, ranges, scale=scale)
        reason = unsupported_reason(q, k, v, ranges, scale)
        if reason is not None:
            _log_once(logging.WARNING, reason)
            return reference_attention(q, k, v, ranges, scale=scale)
    # "pallas" / "pallas_interpret" raise on unsupported inputs.
    return block_attention(q, k, v, ranges, scale=scale, interpret=impl == "pallas_interpret")
