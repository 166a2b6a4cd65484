"""The DFlash training objective: anchor sampling, packed blocks, decayed block cross-entropy.

Recipe (docs/training.md): a position p is an anchor candidate when p and p+1 are both in the loss
mask; up to N distinct candidates are drawn uniformly per sequence and sorted, padding with
invalid blocks. Block j = [token at anchor_j, MASK x (G-1)]; slot k = 1..G-1 predicts the token at
anchor_j + k with weight exp(-(k-1)/decay) times that label's loss mask; loss = sum(w*CE)/sum(w).
Beyond the recipe: labels may be the target's greedy choices (`block_targets` with next tokens),
and the cross-entropy may be taken against the target's distribution over its top-k next tokens
(`block_distributions`: distillation's soft labels, more signal per cached token).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_DECAY = {16: 7.0, 10: 5.0, 8: 4.0}


def default_decay(block_size: int) -> float:
    return DEFAULT_DECAY.get(block_size, max(1.0, 0.45 * block_size))


def sample_anchors(rng, loss_mask, num_anchors: int):
    """loss_mask [B, T] bool -> anchors [B, N] (sorted; invalid ones at the end) and valid [B, N]."""
    b, t = loss_mask.shape
    candidate = loss_mask[:, :-1] & loss_mask[:, 1:]  # p and p+1 in the mask, p < T-1
    candidate = jnp.pad(candidate, ((0, 0), (0, 1)))
    scores = jnp.where(candidate, jax.random.uniform(rng, (b, t)), -1.0)
    n = min(num_anchors, t)
    top_scores, positions = jax.lax.top_k(scores, n)
    valid = top_scores >= 0
    order_key = jnp.where(valid, positions, t + positions)  # valid first, each group by position
    order = jnp.argsort(order_key, axis=1)
    anchors = jnp.take_along_axis(positions, order, axis=1).astype(jnp.int32)
    valid = jnp.take_along_axis(valid, order, axis=1)
    if n < num_anchors:
        anchors = jnp.pad(anchors, ((0, 0), (0, num_anchors - n)))
        valid = jnp.pad(valid, ((0, 0), (0, num_anchors - n)))
    return jnp.where(valid, anchors, 0), valid


def block_inputs(tokens, anchors, block_size: int, mask_token_id: int):
    """[B, N*G] block tokens: [tokens[anchor_j], MASK x (G-1)] for each block."""
    b, n = anchors.shape
    first = jnp.take_along_axis(tokens, anchors, axis=1)[..., None]
    mask = jnp.full((b, n, block_size - 1), mask_token_id, tokens.dtype)
    return jnp.concatenate([first, mask], axis=-1).reshape(b, n * block_size)


def block_targets(tokens, loss_mask, anchors, valid, block_size: int, decay: float, next_tokens=None):
    """labels [B, N, G] and weights [B, N, G] (slot 0 weight 0).

    Without next_tokens, slot k's label is the token at anchor + k. With next_tokens [B, T] (the
    target's greedy next token after each position, `train.cache_features`), slot k's label is
    what the target itself would emit there: next_tokens[anchor + k - 1], counted only while the
    text followed the target's greedy choice at the block's earlier slots (tokens[anchor + j] ==
    next_tokens[anchor + j - 1] for 1 <= j < k), so that the label is the target's greedy
    continuation of the anchor and any text (not only the target's own answers) teaches the
    drafter what verification accepts.
    """
    t = tokens.shape[1]
    k = jnp.arange(block_size)
    where = anchors[..., None] + k  # [B, N, G]
    inside = where < t
    where = jnp.minimum(where, t - 1)
    text = jnp.take_along_axis(tokens[:, None, :], where, axis=2)
    label_mask = jnp.take_along_axis(loss_mask[:, None, :], where, axis=2) & inside
    if next_tokens is None:
        labels = text
    else:
        before = jnp.maximum(where - 1, 0)  # slot k's label sits at position anchor + k - 1
        labels = jnp.take_along_axis(next_tokens[:, None, :], before, axis=2)
        followed = (text == labels) | (k == 0)  # slot j's text token is the target's choice
        earlier = jnp.cumprod(followed, axis=2)  # all of slots 0..k agree
        label_mask &= jnp.concatenate([jnp.ones_like(earlier[..., :1]), earlier[..., :-1]], axis=2).astype(bool)
    slot_weight = jnp.where(k >= 1, jnp.exp(-(k - 1) / decay), 0.0)
    weights = slot_weight * label_mask * valid[..., None]
    return labels, weights.astype(jnp.float32)


def chunked_cross_entropy(head, hidden, labels, chunk: int = 1024, soft=None, extra=None):
    """Cross-entropy and argmax-correctness through an LM head, `chunk` positions at a time.

    head: hidden [..., D] -> float32 logits [..., V]; hidden [B, M, D]; labels [B, M].
    soft: None (the cross-entropy of `labels`) or (ids [B, M, K], probs [B, M, K]): the
    cross-entropy of that distribution, -sum_k probs_k log p(ids_k) (probs summing to 1, or 0 on
    positions that do not count); correctness still compares the argmax with `labels`.
    Each chunk's logits are recomputed in the backward pass (jax.checkpoint), so peak memory holds
    B x chunk x V logits instead of B x M x V (M = N blocks x G slots, V ~ 150k for Qwen3).
    extra: None, or (fn, arrays): fn(hidden [B, c, D], logits [B, c, V], *the arrays' chunks) ->
    [B, c] float32, another per-position term from the same logits (arrays: a tuple of [B, M, ...]).
    Returns (ce [B, M], correct [B, M]), and that term [B, M] with `extra`.
    """
    b, m, d = hidden.shape
    chunk = max(1, min(chunk, m))
    pad = -m % chunk
    to_chunks = lambda x: jnp.moveaxis(jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
                                       .reshape(b, -1, chunk, *x.shape[2:]), 1, 0)
    if soft is None:
        soft = (labels[..., None], jnp.ones(labels.shape + (1,), jnp.float32))
    extra_fn, extra_inputs = (None, ()) if extra is None else extra

    @jax.checkpoint
    def one(h, y, ids, probs, *more):  # [B, chunk, D], [B, chunk], [B, chunk, K] x 2, extra's
        logits = head(h)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.sum(probs * jnp.take_along_axis(logits, ids, axis=-1), axis=-1)
        out = (jnp.sum(probs, axis=-1) * log_z - picked, jnp.argmax(logits, axis=-1) == y)
        return out if extra_fn is None else (*out, extra_fn(h, logits, *more))

    out = jax.lax.map(lambda args: one(*args), tuple(map(to_chunks, (hidden, labels, *soft, *extra_inputs))))
    return tuple(jnp.moveaxis(x, 0, 1).reshape(b, -1)[:, :m] for x in out)


def _over_position_chunks(fn, hidden, chunk: int):
    """fn(hidden [B, chunk, D]) -> a pytree of [B, chunk, ...], applied `chunk` positions at a time
    over hidden [B, T, D]; the results joined back to [B, T, ...]."""
    b, t, d = hidden.shape
    chunk = max(1, min(chunk, t))
    pad = -t % chunk
    parts = jnp.moveaxis(jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, chunk, d), 1, 0)
    out = jax.lax.map(fn, parts)
    return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1).reshape(b, -1, *x.shape[3:])[:, :t], out)


def greedy_tokens(head, hidden, chunk: int = 1024):
    """argmax of head(hidden) [B, T, V] -> int32 [B, T], `chunk` positions at a time (peak memory
    B x chunk x V logits)."""
    return _over_position_chunks(lambda h: jnp.argmax(head(h), axis=-1).astype(jnp.int32), hidden, chunk)


def greedy_and_top_tokens(head, hidden, top_k: int, chunk: int = 1024):
    """One pass of head(hidden) [B, T, V], `chunk` positions at a time -> (argmax int32 [B, T],
    the top_k largest logits' ids int32 [B, T, top_k] and values float32 [B, T, top_k], largest
    first): what `train.cache_features` stores for target labels and their distribution."""
    def one(h):
        logits = head(h).astype(jnp.float32)
        values, ids = jax.lax.top_k(logits, top_k)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), ids.astype(jnp.int32), values
    return _over_position_chunks(one, hidden, chunk)


def block_distributions(top_ids, top_logits, anchors, block_size: int, top_k: int | None = None):
    """The target's distribution over its top-k next tokens for every slot of every block.

    top_ids, top_logits [B, T, K'] (`greedy_and_top_tokens`); slot k of block j takes position
    anchors[j] + k - 1, as `block_targets` does with next tokens (slot 0's entry is never weighed).
    top_k (<= K', default K') keeps the largest k. Returns (ids [B, N, G, k] int32, probs
    [B, N, G, k] float32: the softmax of those logits, renormalised over the k kept).
    """
    b, t, _ = top_ids.shape
    n = anchors.shape[1]
    k = top_ids.shape[2] if top_k is None else top_k
    where = jnp.clip(anchors[..., None] + jnp.arange(block_size) - 1, 0, t - 1).reshape(b, n * block_size, 1)
    gather = lambda x: jnp.take_along_axis(x[..., :k], where, axis=1).reshape(b, n, block_size, k)
    return gather(top_ids), jax.nn.softmax(gather(top_logits).astype(jnp.float32), axis=-1)


def draft_labels(labels, weights, target_to_draft):
    """Map target-id labels [B, N, G] into a reduced draft vocabulary.

    target_to_draft: int32 [V], -1 for target ids outside the draft vocabulary. Returns
    (draft labels [B, N, G], weights [B, N, G] with 0 where the label has no draft id).
    """
    mapped = jnp.take(target_to_draft, labels, axis=0)
    return jnp.maximum(mapped, 0), jnp.where(mapped >= 0, weights, 0.0)


def draft_distributions(ids, probs, weights, target_to_draft):
    """Map the target's top-k distributions (`block_distributions`) into a reduced draft vocabulary.

    ids, probs [B, N, G, K]; weights [B, N, G]. Candidates without a draft id are dropped and the
    rest renormalised; a slot none of whose candidates has one weighs 0. Returns (draft ids, probs
    [B, N, G, K], weights [B, N, G]).
    """
    mapped = jnp.take(target_to_draft, ids, axis=0)
    probs = jnp.where(mapped >= 0, probs, 0.0)
    total = jnp.sum(probs, axis=-1)
    kept = total > 0
    return jnp.maximum(mapped, 0), probs / jnp.where(kept, total, 1.0)[..., None], jnp.where(kept, weights, 0.0)


def slot_accuracy(correct, counted):
    """correct, counted [B, N, G] bool -> accuracy of each slot [G] (0 where nothing counted)."""
    hits = jnp.sum(correct & counted, axis=(0, 1))
    return hits / jnp.maximum(jnp.sum(counted, axis=(0, 1)), 1)


def tau_estimate(accuracy):
    """Expected tokens per cycle from per-slot accuracies [G-1] (slots 1..G-1), treating slots as
    independent: 1 + sum_k prod_{j<=k} acc_j."""
    return 1.0 + jnp.sum(jnp.cumprod(accuracy))


def drafter_block_hidden(drafter, target, drafter_params, target_params, features, tokens, anchors, valid,
                         anchor_chunk: int = 0, embed=None):
    """Drafter output [B, N*G, D] for the packed blocks at `anchors` (frozen target embedding, or
    `embed`: block token ids [B, c*G] -> embeddings, e.g. a DSpark drafter's own table).

    anchor_chunk > 0 runs the blocks `anchor_chunk` anchors at a time against the whole context
    (same result: blocks never see each other), so attention costs N/c x (C + c*G) x c*G instead
    of N*G x (C + N*G). N must be a multiple of anchor_chunk.
    """
    b, n = anchors.shape
    g = drafter.config.block_size
    frozen = jax.lax.stop_gradient(target_params)
    if embed is None:
        embed = lambda block: drafter.config.block_embeddings(target.embed(frozen, block))  # noqa: E731

    def run(anchors, valid):  # [B, c] -> [B, c*G, D]
        block = block_inputs(tokens, anchors, g, drafter.config.mask_token_id)
        embeds = embed(block)
        return drafter.train_hidden(drafter_params, features, embeds, anchors, valid)

    if not anchor_chunk or anchor_chunk >= n:
        return run(anchors, valid)
    if n % anchor_chunk:
        raise ValueError(f"num_anchors {n} is not a multiple of anchor_chunk {anchor_chunk}")
    split = lambda x: jnp.moveaxis(x.reshape(b, n // anchor_chunk, anchor_chunk), 1, 0)
    hidden = jax.lax.map(lambda av: run(*av), (split(anchors), split(valid)))  # [N/c, B, c*G, D]
    return jnp.moveaxis(hidden, 0, 1).reshape(b, n * g, hidden.shape[-1])


def weighted_block_loss(head, hidden, labels, weights, counted, logits_chunk: int = 1024, soft=None,
                        scorable=None, extra=None):
    """Decayed block cross-entropy through `head` and per-slot accuracy.

    hidden [B, N*G, D]; labels, weights [B, N, G] (labels in head's vocabulary); counted [B, N, G]
    marks the slots that count for accuracy; scorable [B, N, G] (default weights > 0) those whose
    label the head can produce (the others count as wrong). soft: None, or (ids, probs)
    [B, N, G, K] (`block_distributions`): the loss learns that distribution instead of `labels`.
    extra: None, or (fn, arrays [B, N*G, ...]): another per-position term from the same logits
    (`chunked_cross_entropy`), returned [B, N*G] after the accuracy.
    Returns (loss, per-slot accuracy [G]) (and the extra term).
    """
    b, n, g = labels.shape
    flat = lambda x: x.reshape(b, n * g, *x.shape[3:])
    ce, correct, *more = chunked_cross_entropy(head, hidden, flat(labels), logits_chunk,
                                               None if soft is None else tuple(map(flat, soft)), extra)
    weights = flat(weights)
    loss = jnp.sum(weights * ce) / jnp.maximum(jnp.sum(weights), 1e-9)
    scorable = weights > 0 if scorable is None else flat(scorable)
    correct = (correct & scorable).reshape(b, n, g)
    return (loss, slot_accuracy(correct, counted), *more)


def dflash_loss(drafter, target, drafter_params, target_params, features, tokens, loss_mask, anchors,
                valid, decay: float | None = None, logits_chunk: int = 1024):
    """Weighted block cross-entropy of the drafter for one packed batch.

    features [B, T, n*D] come from the (frozen) target over the same tokens [B, T]. The target's
    embedding table and LM head are used frozen (no gradient reaches them).
    Returns (loss, metrics) with the accuracy of the weighted slots for monitoring.
    """
    g = drafter.config.block_size
    decay = default_decay(g) if decay is None else decay
    frozen = jax.lax.stop_gradient(target_params)
    hidden = drafter_block_hidden(drafter, target, drafter_params, frozen, features, tokens, anchors, valid)
    labels, weights = block_targets(tokens, loss_mask, anchors, valid, g, decay)
    counted = weights > 0
    head = lambda h: drafter.config.draft_logits(target.logits(frozen, h))
    loss, per_slot = weighted_block_loss(head, hidden, labels, weights, counted, logits_chunk)
    slot_counts = jnp.sum(counted, axis=(0, 1))
    accuracy = jnp.sum(per_slot * slot_counts) / jnp.maximum(jnp.sum(slot_counts), 1)
    return loss, {"loss": loss, "accuracy": accuracy}


def map_position_chunks(fn, arrays, chunk: int = 1024):
    """fn(*chunks) -> a pytree of [B, c, ...], applied `chunk` positions at a time over arrays, a
    tuple of [B, M, ...] (padded at the end to a multiple of the chunk), each chunk recomputed in
    the backward pass (jax.checkpoint), so that peak memory holds the logits of one chunk; the
    results joined back to [B, M, ...]."""
    b, m = arrays[0].shape[:2]
    chunk = max(1, min(chunk, m))
    pad = -m % chunk
    to_chunks = lambda x: jnp.moveaxis(jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
                                       .reshape(b, -1, chunk, *x.shape[2:]), 1, 0)
    out = jax.lax.map(lambda args: jax.checkpoint(fn)(*args), tuple(map(to_chunks, arrays)))
    return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1).reshape(b, -1, *x.shape[3:])[:, :m], out)


def block_predecessors(tokens, anchors, block_size: int):
    """[B, N, G] the text token before each slot's label: slot k of block j (label at anchor_j + k)
    gets tokens[anchor_j + k - 1], slot 0 the anchor (a DFlash2 selector's teacher-forced
    predecessor; slot 0 is never weighed)."""
    t = tokens.shape[1]
    where = jnp.clip(anchors[..., None] + jnp.arange(block_size) - 1, 0, t - 1)
    where = jnp.maximum(where, anchors[..., None])
    return jnp.take_along_axis(tokens[:, None, :], where, axis=2)


def proposal_targets(tokens, loss_mask, anchors, valid, proposals: int, decay: float):
    """DSpark's targets (DeepSpec): proposal s = 0..P-1 of block j predicts the token at
    anchor_j + s + 1 from the gold previous token at anchor_j + s, where the target's own
    distribution is read too. A slot counts while every label up to it lies inside the text and
    the loss mask (a contiguous prefix), its block is valid; weight exp(-s / decay).
    -> (labels, previous, positions of the target's distribution, weights float32), each [B, N, P]."""
    t = tokens.shape[1]
    s = jnp.arange(proposals)
    where = anchors[..., None] + s + 1  # [B, N, P]
    inside = where < t
    where = jnp.minimum(where, t - 1)
    gather = lambda x, w: jnp.take_along_axis(x[:, None, :], w, axis=2)  # noqa: E731
    labels = gather(tokens, where)
    before = jnp.minimum(anchors[..., None] + s, t - 1)
    counted = gather(loss_mask, where) & inside & valid[..., None]
    counted = jnp.cumprod(counted.astype(jnp.int32), axis=2).astype(bool)
    weights = counted * jnp.exp(-s / decay)
    return labels, gather(tokens, before), before, weights.astype(jnp.float32)
