"""The gated delta rule of Gated DeltaNet layers (Qwen3.5): the recurrence, its chunked form, the
causal depthwise conv in front of it, and the masks that make a suffix of positions leave the state
untouched (the exact rollback of a speculative block, the padding of a ragged prefill).

Per value head, with the state S [Dk, Dv] (float32), q and k L2-normalised (q also scaled by
Dk^-1/2), decay g <= 0 (log space) and write strength beta in (0, 1), position t does
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t.
A position with g = 0 and beta = 0 leaves S exactly as it was (S * 1 + k 0^T), so masking those two
for positions >= valid[b] gives the state after the first valid[b] positions of row b, with the
same static shapes whatever the count (`masked`).

`delta_rule` takes the recurrence for one position and the chunked form (Hugging Face's
`torch_chunk_gated_delta_rule`, chunks of CHUNK positions: a unit-lower-triangular solve per chunk
and a scan over chunks) for more; both return (outputs [B, T, Hv, Dv] float32, final state).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64  # positions per chunk of the chunked form (the reference implementations' size)


def l2_normalize(x, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (as FLA and transformers)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def masked(g, beta, valid):
    """g, beta [B, T, H] with positions t >= valid[b] (valid: [B] or a scalar; None: all valid) set
    to 0: those positions leave the state unchanged."""
    if valid is None:
        return g, beta
    t = jnp.arange(g.shape[1], dtype=jnp.int32)
    keep = t[None, :, None] < jnp.broadcast_to(jnp.asarray(valid, jnp.int32), (g.shape[0],))[:, None, None]
    return jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)


def _expand_heads(x, heads: int):
    """[B, T, Hk, D] -> [B, T, heads, D]: each key head serves heads // Hk consecutive value heads."""
    return x if x.shape[2] == heads else jnp.repeat(x, heads // x.shape[2], axis=2)


def recurrent(q, k, v, g, beta, state):
    """The recurrence position by position (a scan over T). q, k [B, T, Hv, Dk] (normalised, q
    scaled), v [B, T, Hv, Dv], g, beta [B, T, Hv], state [B, Hv, Dk, Dv]; all float32."""
    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        memory = jnp.sum(s * k_t[..., :, None], axis=-2)  # S^T k  [B, H, Dv]
        s = s + k_t[..., :, None] * ((v_t - memory) * b_t[..., None])[..., None, :]
        return s, jnp.sum(s * q_t[..., :, None], axis=-2)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def unit_lower_inverse(m):
    """The inverse of unit-lower-triangular matrices m [..., C, C], by doubling: the inverses of
    the diagonal blocks of size s give those of size 2s, [[A, 0], [B, D]]^-1 =
    [[A^-1, 0], [-D^-1 B A^-1, D^-1]], in log2(C) rounds of batched products. (Not
    `lax.linalg.triangular_solve`: on a CPU it is a LAPACK call, and concurrent calls inside one
    program can deadlock there; products also suit a GPU.)"""
    c = m.shape[-1]
    width = 1 << max(c - 1, 0).bit_length()  # the next power of two; padded with the identity
    if width != c:
        pad = [(0, 0)] * (m.ndim - 2) + [(0, width - c)] * 2
        m = jnp.pad(m, pad) + jnp.diag((jnp.arange(width) >= c).astype(m.dtype))
    batch = m.shape[:-2]
    inverse = jnp.ones((*batch, width, 1, 1), m.dtype)  # the 1x1 diagonal blocks
    size = 1
    while size < width:
        n = width // (2 * size)
        blocks = m.reshape(*batch, n, 2 * size, n, 2 * size)
        blocks = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., n, 2s, 2s]
        lower_left = blocks[..., size:, :size]
        inverse = inverse.reshape(*batch, n, 2, size, size)
        a_inv, d_inv = inverse[..., 0, :, :], inverse[..., 1, :, :]
        corner = -(d_inv @ lower_left @ a_inv)
        zeros = jnp.zeros_like(corner)
        inverse = jnp.concatenate([jnp.concatenate([a_inv, zeros], axis=-1),
                                   jnp.concatenate([corner, d_inv], axis=-1)], axis=-2)
        size *= 2
    return inverse.reshape(*batch, width, width)[..., :c, :c]


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The chunked form (same arguments as `recurrent`): T padded to chunks of min(chunk, T) with
    positions that leave the state unchanged, the in-chunk recurrence as one unit-lower-triangular
    solve per chunk, a scan over chunks for the state."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    size = min(chunk, t)
    pad = -t % size
    n = (t + pad) // size

    def blocks(x):  # [B, T, H, ...] -> [N, B, H, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, size, h, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

    q, k, v, g, beta = map(blocks, (q, k, v, g, beta))  # g, beta: [N, B, H, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((size, size), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    system = jnp.einsum("...id,...jd->...ij", k_beta, k) * decay
    inverse = unit_lower_inverse(jnp.where(jnp.tril(lower, -1), system, 0.0) + jnp.eye(size, dtype=system.dtype))
    new_values = inverse @ v_beta  # [N, B, H, C, Dv]
    k_cumdecay = inverse @ (k_beta * jnp.exp(cum)[..., None])  # [N, B, H, C, Dk]
    intra = jnp.einsum("...id,...jd->...ij", q, k) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    def step(s, xs):
        new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay = xs
        v_new = new_values - jnp.einsum("...ck,...kv->...cv", k_cumdecay, s)
        out = jnp.einsum("...ck,...kv->...cv", q_decayed, s) + jnp.einsum("...ij,...jv->...iv", intra, v_new)
        s = s * chunk_decay + jnp.einsum("...ck,...cv->...kv", k_decayed, v_new)
        return s, out

    state, out = jax.lax.scan(step, state, (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay))
    out = jnp.moveaxis(jnp.moveaxis(out, 0, 1), 3, 2).reshape(b, n * size, h, dv)[:, :t]
    return out, state


def delta_rule(q, k, v, g, beta, state, valid=None, *, form: str = "auto"):
    """The gated delta rule over T positions from `state`; positions >= valid[b] leave it unchanged.

    q, k [B, T, Hk, Dk] (L2-normalised; q not yet scaled), v [B, T, Hv, Dv], g, beta [B, T, Hv],
    state [B, Hv, Dk, Dv] -> (outputs [B, T, Hv, Dv], state), float32. form: "recurrent",
    "chunked", or "auto" (the recurrence for one position, chunks for more).
    """
    heads = v.shape[2]
    q = _expand_heads(q.astype(jnp.float32), heads) * (q.shape[-1] ** -0.5)
    k = _expand_heads(k.astype(jnp.float32), heads)
    g, beta = masked(g.astype(jnp.float32), beta.astype(jnp.float32), valid)
    v, state = v.astype(jnp.float32), state.astype(jnp.float32)
    if form == "auto":
        form = "recurrent" if q.shape[1] == 1 else "chunked"
    if form == "recurrent":
        return recurrent(q, k, v, g, beta, state)
    if form == "chunked":
        return chunked(q, k, v, g, beta, state)
    raise ValueError(f"form must be recurrent, chunked or auto, not {form!r}")


def causal_conv(x, tail, kernel):
    """Depthwise causal conv + SiLU: x [B, T, C] after the previous K-1 inputs tail [B, K-1, C],
    kernel [K, 1, C] -> [B, T, C] in x's dtype (computed in the kernel's)."""
    width = kernel.shape[0]
    window = jnp.concatenate([tail.astype(kernel.dtype), x.astype(kernel.dtype)], axis=1)
    t = x.shape[1]
    out = sum(window[:, i:i + t] * kernel[i, 0] for i in range(width))
    return jax.nn.silu(out).astype(x.dtype)


def conv_tail(tail, x, valid=None):
    """The last K-1 conv inputs after the first valid[b] of x [B, T, C] (None: all T) follow
    tail [B, K-1, C]."""
    window = jnp.concatenate([tail, x.astype(tail.dtype)], axis=1)
    width = tail.shape[1]
    if valid is None:
        return window[:, window.shape[1] - width:]
    valid = jnp.broadcast_to(jnp.asarray(valid, jnp.int32), (x.shape[0],))
    return jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, width, axis=0))(window, valid)
