"""Draft tokens looked up in a row's own text (n-gram / prompt lookup), to stand in for the
drafter's where the text repeats itself.

Where the last n committed tokens of a row occurred earlier in it (prompt or answer), the tokens
that followed that earlier occurrence are proposed for the next slots: answers quote their prompt
and repeat their own phrases. The target verifies them like any draft, so the output stays the
target's (greedy: bit-identical; sampling: a looked-up token is a draft whose distribution is a
point mass, which the exact rule accepts with probability p_target(token)).

Matches are at least 2 tokens long: a match of 2 or more tokens names the target's next token
more often than the shipped SmolLM2 drafter does, a single matching token too seldom to be worth
a verified slot. The lookup only fills the block's own slots: verifying extra looked-up tokens
where a match exists would raise the tokens per cycle, but on a CPU every verified row costs a
fraction of a step, which takes the gain back. Where the lookup fills every slot of every live
row, the drafter does not run (`decode_loop._draft`), which saves its pass. The measurements
behind these choices are in docs/performance.md ("Why the code is shaped this way (measured)").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def lookup_drafts(tokens, lengths, longest: int, count: int):
    """Drafts for the `count` slots after each row's committed text.

    tokens [B, C] int32, lengths [B]: row b's committed tokens are tokens[b, :lengths[b]]. For
    n = longest, ..., 2 (the longest that occurs wins), find the latest j < L = lengths[b] with
    tokens[j - n:j] == tokens[L - n:L]; propose tokens[j + k] for slot k, where j + k < L.
    Returns (drafts [B, count] int32, found [B, count] bool: False where nothing matched or the
    earlier text runs out).
    """
    b, capacity = tokens.shape
    position = jnp.arange(capacity)[None, :]  # j: where an earlier occurrence ends (exclusive)
    lengths = lengths[:, None]
    # earlier[s][:, j] = tokens[:, j - s], one shifted copy per distance s = 1..longest
    earlier = {s: jnp.pad(tokens, ((0, 0), (s, 0)))[:, :capacity] for s in range(1, longest + 1)}
    best = jnp.full((b, 1), -1, jnp.int32)
    for n in range(2, longest + 1):  # a longer match overrides a shorter one
        match = (position >= n) & (position < lengths) & (lengths >= n)
        for k in range(n):  # tokens[j - n + k] == tokens[L - n + k]
            key = jnp.take_along_axis(tokens, jnp.maximum(lengths - n + k, 0), axis=1)
            match &= earlier[n - k] == key
        latest = jnp.max(jnp.where(match, position, -1), axis=1, keepdims=True).astype(jnp.int32)
        best = jnp.where(latest >= 0, latest, best)
    slots = best + jnp.arange(count)[None, :]  # [B, count]
    found = (best >= 0) & (slots < lengths)
    drafts = jnp.take_along_axis(tokens, jnp.clip(slots, 0, capacity - 1), axis=1)
    return jnp.where(found, drafts, 0).astype(jnp.int32), found


def merge_lookup(drafts, draft_probs, looked_up, found):
    """drafts [B, G-1] (and their distributions [B, G-1, V], or None) with `lookup_drafts`'s tokens
    in the slots it found; a looked-up slot's distribution is a point mass on its token."""
    drafts = jnp.where(found, looked_up, drafts)
    if draft_probs is not None:
        point = jax.nn.one_hot(looked_up, draft_probs.shape[-1], dtype=draft_probs.dtype)
        draft_probs = jnp.where(found[..., None], point, draft_probs)
    return drafts, draft_probs
