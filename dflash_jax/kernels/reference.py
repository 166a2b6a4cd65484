"""Plain-jnp attention over `KeyRanges`: the ground truth for the kernels (and the backward of
``block_attention(..., backward="reference")``) and the path wherever a kernel cannot run.

q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D] with Hq % Hkv == 0: the G = Hq / Hkv query heads of a
group share their kv head (q is grouped, K/V are never repeated). Scores, softmax and
accumulation are float32; a query that sees no key yields zeros (never NaN). K/V narrower than q
(a float16 cache under float32 queries) are widened to q's dtype as they are read.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.kernels.masks import KeyRanges

CACHE_CHUNK = 256  # keys per step of `chunked_cache_attention_with_lse`'s loop over a cache



def check_gqa(num_heads: int, num_kv_heads: int) -> int:
    """The query heads per kv head; ValueError unless num_heads is a multiple of num_kv_heads."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    return num_heads // num_kv_heads

def _grouped(q, num_kv_heads: int):
    """q [B, Tq, Hq, D] -> [B, Tq, Hkv, Hq / Hkv, D]."""
    b, tq, hq, d = q.shape
    return q.reshape(b, tq, num_kv_heads, check_gqa(hq, num_kv_heads), d)


def _scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


def _ungrouped(out, lse):
    """out [B, Hkv, G, Tq, D], lse [B, Hkv, G, Tq] -> [B, Tq, Hq, D], [B, Tq, Hq]."""
    b, hkv, g, tq, d = out.shape
    return (out.transpose(0, 3, 1, 2, 4).reshape(b, tq, hkv * g, d),
            lse.transpose(0, 3, 1, 2).reshape(b, tq, hkv * g))


def _widened(q, *xs):
    """K/V in the wider of their dtype and q's (a float16 cache read by float32 queries: float32)."""
    return [x.astype(jnp.promote_types(x.dtype, q.dtype)) for x in xs]


def with_sinks(out, lse, sinks):
    """Attention sinks (gpt-oss): one learned logit per query head [Hq] that joins every query's
    softmax denominator and carries no value. From the attention over the keys alone (out
    [B, Tq, Hq, D], lse [B, Tq, Hq]) -> (out float32, lse), both as if the sink had been one more
    key: out scaled by exp(lse - lse'), lse' = logaddexp(lse, sink). A query that sees no key
    keeps zeros (its whole weight is on the sink). sinks None: unchanged."""
    if sinks is None:
        return out.astype(jnp.float32), lse
    with_sink = jnp.logaddexp(lse, sinks.astype(jnp.float32))
    return out.astype(jnp.float32) * jnp.exp(lse - with_sink)[..., None], with_sink


def reference_attention_with_lse(q, k, v, ranges: KeyRanges, *, scale: float | None = None, sinks=None):
    """Plain-jnp attention with a materialised mask -> (out [B, Tq, Hq, D] float32,
    lse [B, Tq, Hq] float32 natural log-sum-exp of the visible scores, -inf where none is visible).
    sinks [Hq]: attention sinks (`with_sinks`), one more logit per head in each softmax; the lse
    then includes it."""
    k, v = _widened(q, k, v)
    qg = _grouped(q, k.shape[2])
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * _scale(q, scale)
    visible = ranges.dense(k.shape[1])[:, None, None]  # [B, 1, 1, Tq, Tk]
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bhgqd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    lse = jnp.where(denom > 0, row_max + jnp.log(denom), -jnp.inf)[..., 0]
    return with_sinks(*_ungrouped(out, lse), sinks)


def reference_attention(q, k, v, ranges: KeyRanges, *, scale: float | None = None, sinks=None):
    """Plain-jnp attention with a materialised mask -> [B, Tq, Hq, D] in q's dtype (sinks: as in
    `reference_attention_with_lse`)."""
    return reference_attention_with_lse(q, k, v, ranges, scale=scale, sinks=sinks)[0].astype(q.dtype)


def chunked_cache_attention_with_lse(q, cache_k, cache_v, layer, ranges: KeyRanges, *,
                                     scale: float | None = None, chunk_size: int = CACHE_CHUNK):
    """Attention of q over the slots of layer `layer` of cache_k/v [L, B, S, Hkv, D], reading only
    the key chunks that hold visible slots (a loop with an online softmax; its trip count follows
    `ranges.bounds()`, so the cost follows the filled length, not the capacity S).
    -> (out [B, Tq, Hq, D] float32, lse [B, Tq, Hq] float32) as `reference_attention_with_lse`."""
    _, b, s, hkv, d = cache_k.shape
    qg = _grouped(q, hkv)
    scale = _scale(q, scale)
    chunk = min(chunk_size, s)
    lo, hi = ranges.bounds()

    def step(i, carry):  # m, l: [B, Hkv, G, Tq, 1]; acc: [B, Hkv, G, Tq, D]
        row_max, denom, acc = carry
        nominal = i * chunk
        start = jnp.minimum(nominal, s - chunk)  # the last chunk may overlap the one before it
        keys = start + jnp.arange(chunk, dtype=jnp.int32)
        k = jax.lax.dynamic_slice(cache_k, (layer, 0, start, 0, 0), (1, b, chunk, hkv, d))[0]
        v = jax.lax.dynamic_slice(cache_v, (layer, 0, start, 0, 0), (1, b, chunk, hkv, d))[0]
        k, v = _widened(q, k, v)
        visible = ranges.visible(keys) & (keys >= nominal)[None, None, :]  # [B, Tq, chunk]
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1, keepdims=True))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        rescale = jnp.exp(row_max - safe_max)
        probs = jnp.exp(scores - safe_max)
        denom = denom * rescale + jnp.sum(probs, axis=-1, keepdims=True)
        acc = acc * rescale + jnp.einsum("bhgqk,bkhd->bhgqd", probs.astype(v.dtype), v,
                                         preferred_element_type=jnp.float32)
        return new_max, denom, acc

    stats = qg.shape[:1] + (hkv, qg.shape[3], q.shape[1], 1)  # [B, Hkv, G, Tq, 1]
    init = (jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros(stats[:-1] + (d,), jnp.float32))
    row_max, denom, acc = jax.lax.fori_loop(lo // chunk, -(-hi // chunk), step, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom > 0, row_max + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)[..., 0]
    return _ungrouped(out, lse)
