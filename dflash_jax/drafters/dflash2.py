"""DFlash2's additions to the DFlash drafter (the authors' `DFlash2DraftModel`, `DrafterConfig.dflash2`).

Grouped dynamic causal convolution (`GroupedDynamicCausalConv`, one around each attention and each
MLP sublayer of every drafter layer). With x the sublayer's normed input [.., L, H], T the kernel
size and groups of `conv_group_size` channels (G = H / group_size of them):

    dyn = kernel_projection(x) -> [.., L, 2, T, G]       (Linear H -> 2*T*G, no bias)
    x'  = conv(x, base_kernel[0], dyn[.., 0])            the sublayer's input
    y'  = conv(sublayer(x'), base_kernel[1], dyn[.., 1]) added to the residual
    conv(u, base, d)[l, c] = sum_{o < T} (base[o, c] + d[l, o, c // group_size]) * u[l - o, c]

with u[l - o] = 0 before the block's first position: the convolution runs over one block's
positions only (inference: the G slots of the block; training: each block of the packed sequence on
its own), never over the context, whose keys and values are not convolved.

Candidate selector (`CandidateSelector`, `select`): over the block's proposal slots, the top K of
each slot's draft logits z (after the output multiplier and softcap) are the candidates, z their
unary scores; hp = hidden_projection(h) [r] for the slot's hidden state; codebooks P (predecessor)
and S (successor) [V, r]. A walk from prev = the anchor: score[k] = z[k] + sum_r P[prev, r] hp[r]
S[cand[k], r]; greedy: the argmax; at temperature T > 0: one of the K drawn from
q = softmax(score / T); prev = the chosen candidate. The draft distribution over the vocabulary
that the acceptance rule reads is q scattered on the candidate ids, zero elsewhere (`scatter_q`).

Training (`selector_cross_entropy`): the same scores with the gold previous token as predecessor,
over the top K with the gold put in place of the lowest when missing (`training_candidates`), and
the K-way cross-entropy of the gold.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax import sharding
from dflash_jax.decode import sampling
from dflash_jax.layers.common import make_dense

sharding.declare_param_axes({
    ("base_kernel",): ("conv", "conv", "embed"),  # [2, T, H]
    ("kernel_projection", "kernel"): ("embed", "conv_dynamic"),  # [H, 2*T*G]
    ("candidate_selector", "hidden_projection", "kernel"): ("embed", "selector_rank"),
    ("predecessor_codebook",): ("vocab", "selector_rank"),
    ("successor_codebook",): ("vocab", "selector_rank"),
})


def grouped_causal_conv(u, dyn, base, group_size: int, block: int):
    """conv(u, base, dyn) over consecutive blocks of `block` positions (module docstring).

    u [B, L, H] (L a multiple of `block`), dyn [B, L, T, H / group_size], base [T, H] -> [B, L, H]
    in u's dtype. A loop over the T taps only."""
    b, length, h = u.shape
    taps = base.shape[0]
    if length % block:
        raise ValueError(f"the convolution runs over blocks of {block} positions; got {length} positions")
    u = u.reshape(b, length // block, block, h)
    dyn = jnp.repeat(dyn.reshape(b, length // block, block, taps, -1), group_size, axis=-1).astype(u.dtype)
    out = jnp.zeros_like(u)
    for o in range(min(taps, block)):  # a tap at or past the block's length reads only zeros
        shifted = u if o == 0 else jnp.pad(u[:, :, :block - o], ((0, 0), (0, 0), (o, 0), (0, 0)))
        out = out + (base[o].astype(u.dtype) + dyn[:, :, :, o]) * shifted
    return out.reshape(b, length, h)


class GroupedDynamicCausalConv(nn.Module):
    """The pair of convolutions around one sublayer: `prepare` (before it) and `finish` (after it)."""

    hidden_size: int
    kernel_size: int
    group_size: int
    dtype: Any = jnp.float32
    backend: str = "xla"

    def setup(self):
        groups = self.hidden_size // self.group_size
        self.kernel_projection = make_dense(2 * self.kernel_size * groups, False, self.dtype, self.backend)
        # at initialisation: the identity (tap 0 one, the rest zero) plus the projected kernel
        self.base_kernel = self.param(
            "base_kernel", lambda _, shape, dtype: jnp.zeros(shape, dtype).at[:, 0].set(1.0),
            (2, self.kernel_size, self.hidden_size), self.dtype)

    def prepare(self, x, block: int):
        """The normed input x [B, L, H] (consecutive blocks of `block` positions; the convolution
        never crosses a block's start) -> (the sublayer's input, the second convolution's dynamic
        kernel [B, L, T, G])."""
        groups = self.hidden_size // self.group_size
        dyn = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, groups)
        first = grouped_causal_conv(x, dyn[..., 0, :, :], self.base_kernel[0], self.group_size, block)
        return first, dyn[..., 1, :, :]

    def finish(self, y, dyn, block: int):
        """The sublayer's output y [B, L, H] convolved with the kernel `prepare` made."""
        return grouped_causal_conv(y, dyn, self.base_kernel[1], self.group_size, block)


class CandidateSelector(nn.Module):
    """The selector's weights: codebooks [V, r] (stored without ".weight") and hidden_projection
    (Linear H -> r, no bias). The walk is `select`, a function of these params."""

    vocab_size: int
    rank: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, hidden):
        init = nn.initializers.normal(0.02)
        self.param("predecessor_codebook", init, (self.vocab_size, self.rank), self.dtype)
        self.param("successor_codebook", init, (self.vocab_size, self.rank), self.dtype)
        return nn.Dense(self.rank, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                        name="hidden_projection")(hidden)


def select(params, hidden, logits, anchors, top_k: int, temperature=None, key=None):
    """The selector's walk over the proposal slots.

    params: the selector's ({"predecessor_codebook", "successor_codebook", "hidden_projection"});
    hidden [B, S, D] the drafter's final-normed states of the S = G-1 proposal slots; logits [B, S, V]
    their draft logits; anchors [B] the block's first tokens. temperature None: greedy (the argmax of
    every slot's scores); else a [] array > 0 and a PRNG key: each slot's candidate drawn from
    softmax(score / temperature). -> (drafts [B, S] int32, candidates [B, S, K] int32, the chosen
    indices [B, S] into them, q [B, S, K] float32: softmax(score / temperature), or softmax(score)
    when greedy)."""
    f32 = jnp.float32
    unary, candidates = jax.lax.top_k(logits.astype(f32), top_k)  # [B, S, K]
    candidates = candidates.astype(jnp.int32)
    predecessor = params["predecessor_codebook"]
    successor = params["successor_codebook"][candidates].astype(f32)  # [B, S, K, r]
    projected = hidden.astype(f32) @ params["hidden_projection"]["kernel"].astype(f32)  # [B, S, r]
    slots = hidden.shape[1]
    keys = sampling.split(key, slots) if temperature is not None else jnp.zeros((slots,), jnp.uint32)
    scale = 1.0 if temperature is None else 1.0 / temperature

    def step(prev, xs):
        z, cand, hp, succ, slot_key = xs
        scores = z + jnp.einsum("br,bkr->bk", predecessor[prev].astype(f32) * hp, succ)
        q = jax.nn.softmax(scores * scale, axis=-1)
        index = sampling.greedy(scores) if temperature is None else sampling.sample(slot_key, q)
        chosen = jnp.take_along_axis(cand, index[:, None], axis=-1)[:, 0]
        return chosen, (chosen, index, q)

    leading = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731 (slots first, for the scan)
    _, (drafts, index, q) = jax.lax.scan(
        step, anchors.astype(jnp.int32),
        (leading(unary), leading(candidates), leading(projected), leading(successor), keys))
    back = lambda x: jnp.moveaxis(x, 0, 1)  # noqa: E731
    return back(drafts), candidates, back(index), back(q)


def scatter_q(q, candidates, vocab_size: int):
    """q [B, S, K] over candidates [B, S, K] (distinct ids per slot) -> [B, S, V], zero off them."""
    b, s, _ = q.shape
    out = jnp.zeros((b, s, vocab_size), q.dtype)
    rows = jnp.arange(b)[:, None, None]
    cols = jnp.arange(s)[None, :, None]
    return out.at[rows, cols, candidates].set(q)


def training_candidates(logits, labels, top_k: int):
    """The selector's K-way training set of each position: the top `top_k` of logits [..., V] (no
    gradient through the choice), with the gold label [...] put in place of the lowest candidate
    when it is missing. -> (candidate ids [..., K] int32, the gold's index among them [...] int32,
    whether the top K held the gold [...] bool)."""
    _, candidates = jax.lax.top_k(jax.lax.stop_gradient(logits), top_k)
    candidates = candidates.astype(jnp.int32)
    labels = labels.astype(jnp.int32)
    hit = candidates == labels[..., None]
    contains = jnp.any(hit, axis=-1)
    index = jnp.where(contains, jnp.argmax(hit, axis=-1), top_k - 1).astype(jnp.int32)
    last = jnp.where(contains, candidates[..., -1], labels)
    return candidates.at[..., -1].set(last), index, contains


def selector_cross_entropy(params, hidden, logits, predecessors, labels, top_k: int):
    """The selector's teacher-forced K-way cross-entropy at every position.

    params: the selector's (as `select`); hidden [..., D] final-normed states; logits [..., V]
    their draft logits (the unary scores; gradient flows into them); predecessors [...] the gold
    previous token of each position (the anchor for the first proposal); labels [...] the gold
    tokens. score[k] = z[cand_k] + sum_r P[prev, r] hp[r] S[cand_k, r] over `training_candidates`;
    -> (-log softmax(score)[gold] [...] float32, whether the top K held the gold [...] bool)."""
    f32 = jnp.float32
    candidates, index, contains = training_candidates(logits, labels, top_k)
    unary = jnp.take_along_axis(logits.astype(f32), candidates, axis=-1)
    projected = hidden.astype(f32) @ params["hidden_projection"]["kernel"].astype(f32)  # [..., r]
    gate = params["predecessor_codebook"][predecessors].astype(f32) * projected
    successor = params["successor_codebook"][candidates].astype(f32)  # [..., K, r]
    scores = unary + jnp.einsum("...r,...kr->...k", gate, successor)
    picked = jnp.take_along_axis(scores, index[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(scores, axis=-1) - picked, contains
