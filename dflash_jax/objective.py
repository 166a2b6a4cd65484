"""The DFlash training objective: anchor sampling, packed blocks, decayed block cross-entropy.

Recipe (DESIGN.md §2): a position p is an anchor candidate when p and p+1 are both in the loss
mask; up to N distinct candidates are drawn uniformly per sequence and sorted, padding with
invalid blocks. Block j = [token at anchor_j, MASK x (G-1)]; slot k = 1..G-1 predicts the token at
anchor_j + k with weight exp(-(k-1)/decay) times that label's loss mask; loss = sum(w*CE)/sum(w).
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


def block_targets(tokens, loss_mask, anchors, valid, block_size: int, decay: float):
    """labels [B, N, G] (slot k -> token at anchor + k) and weights [B, N, G] (slot 0 weight 0)."""
    t = tokens.shape[1]
    k = jnp.arange(block_size)
    where = anchors[..., None] + k  # [B, N, G]
    inside = where < t
    where = jnp.minimum(where, t - 1)
    labels = jnp.take_along_axis(tokens[:, None, :], where, axis=2)
    label_mask = jnp.take_along_axis(loss_mask[:, None, :], where, axis=2) & inside
    slot_weight = jnp.where(k >= 1, jnp.exp(-(k - 1) / decay), 0.0)
    weights = slot_weight * label_mask * valid[..., None]
    return labels, weights.astype(jnp.float32)


def dflash_loss(drafter, target, drafter_params, target_params, features, tokens, loss_mask, anchors,
                valid, decay: float | None = None):
    """Weighted block cross-entropy of the drafter for one packed batch.

    features [B, T, n*D] come from the (frozen) target over the same tokens [B, T].
    Returns (loss, metrics) with per-slot accuracy for monitoring.
    """
    g = drafter.config.block_size
    decay = default_decay(g) if decay is None else decay
    b, n = anchors.shape
    block = block_inputs(tokens, anchors, g, drafter.config.mask_token_id)
    embeds = jax.lax.stop_gradient(target.embed(target_params, block))
    hidden = drafter.train_hidden(drafter_params, features, embeds, anchors, valid)
    logits = target.logits(jax.lax.stop_gradient(target_params), hidden).reshape(b, n, g, -1)
    labels, weights = block_targets(tokens, loss_mask, anchors, valid, g, decay)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    total = jnp.maximum(jnp.sum(weights), 1e-9)
    loss = jnp.sum(weights * ce) / total
    correct = (jnp.argmax(logits, -1) == labels) & (weights > 0)
    accuracy = jnp.sum(correct) / jnp.maximum(jnp.sum(weights > 0), 1)
    return loss, {"loss": loss, "accuracy": accuracy}
