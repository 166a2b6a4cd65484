"""Train state, optimizer, loss and the jitted train step of the DFlash drafter.

Trainable params are {"drafter": drafter params} plus {"draft_head": kernel [D, Vd]} with a
reduced draft vocabulary; the target (embedding, LM head, and in online mode its layers) is frozen.
Master params are float32; `compute_dtype` casts them for the forward pass only.

batch (the dict train.data.make_iterator yields, as global arrays):
    tokens [B, T] int32, loss_mask [B, T] bool, lengths [B] int32, features [B, T, n*D] and
    next_tokens [B, T] int32 (offline only; the target's greedy next token after each position),
    top_ids [B, T, K] int32 and top_logits [B, T, K] float32 (offline, soft labels only)

Labels: the text's own next tokens (`StepSpec.target_labels=False`), or the target's greedy
choices (`target_labels=True`, `objective.block_targets`): what verification accepts, from any
text, without regenerating answers. With `label_top_k=k` the cross-entropy is taken against the
target's distribution over its k likeliest next tokens instead (`objective.block_distributions`:
soft labels, a distillation loss); the greedy labels still decide which slots count and what
accuracy compares with.

The drafter's generation (`dflash_jax.drafters.generations`) picks the objective:
* DFlash: the decayed block cross-entropy above.
* DFlash2: the same backbone loss (its convolutions run per block, as in inference) plus
  `selector_alpha` times the candidate selector's teacher-forced K-way cross-entropy
  (`drafters.dflash2.selector_cross_entropy`), weighed slot by slot as the backbone's.
* DSpark (DeepSpec's loss): proposal s of a block predicts the token at anchor + s + 1 (the
  anchor slot too, `sample_from_anchor`), its logits biased by the Markov head of the gold
  previous token; `ce_alpha` x cross-entropy + `l1_alpha` x |p_d - p_t|_1 (the target's
  distribution at the same position, read online) + `confidence_alpha` x the confidence head's
  BCE against clip(1 - |p_d - p_t|_1 / 2, 0, 1), each a weighted mean with weights
  exp(-s / decay) over the contiguous prefix of labels inside the loss mask (`DSpark.batch_loss`).
  The drafter's own embedding table and LM head (copies of the target's) stay frozen
  (`frozen_paths`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from dflash_jax.drafters import generations, objective
from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.drafters.drafter import DrafterSpec

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static settings of one train step (hashable)."""

    num_anchors: int
    decay: float
    logits_chunk: int = 1024
    compute_dtype: str = "float32"
    grad_accum: int = 1
    anchor_chunk: int = 0  # > 0: blocks attend in groups of this many anchors (objective.drafter_block_hidden)
    target_labels: bool = False  # label slots with the target's greedy next tokens, not the text's
    label_top_k: int = 0  # > 0 (needs target_labels): learn the target's top-k distribution
    selector_alpha: float = 1.0  # DFlash2: weight of the selector's K-way cross-entropy
    ce_alpha: float = 0.1  # DSpark: weights of the cross-entropy, the L1 distance to the target's
    l1_alpha: float = 0.9  # distribution and the confidence head's BCE (DeepSpec's defaults)
    confidence_alpha: float = 1.0

    def __post_init__(self):
        if self.label_top_k < 0 or (self.label_top_k and not self.target_labels):
            raise ValueError("label_top_k must be 0, or > 0 with target_labels")
        for name in ("selector_alpha", "ce_alpha", "l1_alpha", "confidence_alpha"):
            value = getattr(self, name)
            if not (value >= 0 and value < float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array  # int32 []: optimizer steps done
    params: Any  # {"drafter": ..., "draft_head": [D, Vd] (reduced vocabulary only)}, float32
    opt_state: Any
    rng: jax.Array  # uint32 [2]; step s draws its anchors from fold_in(rng, s)


def learning_rate_schedule(learning_rate: float, total_steps: int, warmup_ratio: float,
                           final_lr_ratio: float = 0.0) -> optax.Schedule:
    """Linear warmup from 0 over warmup_ratio * total_steps, then cosine decay."""
    warmup = max(1, round(warmup_ratio * total_steps))
    return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(total_steps, warmup + 1),
                                              learning_rate * final_lr_ratio)


def make_optimizer(schedule: optax.Schedule, *, clip_norm: float = 1.0, weight_decay: float = 0.0,
                   b1: float = 0.9, b2: float = 0.95, frozen: tuple = ()) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (the paper: lr 6e-4, warmup 4%, clip 1.0, wd 0).

    frozen: key paths (tuples of dict keys, e.g. ("drafter", "lm_head")) of params that never
    change: no update and no optimizer state for them (`frozen_paths`)."""
    tx = optax.chain(optax.clip_by_global_norm(clip_norm),
                     optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))
    if not frozen:
        return tx

    def labels(params):
        def label(path, _):
            keys = tuple(getattr(p, "key", None) for p in path)
            return "frozen" if any(keys[:len(f)] == tuple(f) for f in frozen) else "train"
        return jax.tree_util.tree_map_with_path(label, params)

    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)


def frozen_paths(config: DrafterConfig) -> tuple:
    """The trainable params' key paths that training keeps as they start: a DSpark drafter's own
    embedding table and LM head (DeepSpec freezes its copies of the target's)."""
    return tuple(("drafter", name) for name in generations.of(config).own_tables)


def init_state(params, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                      rng=jax.random.PRNGKey(seed))


def target_features(target, target_params, tokens, layer_ids, *, next_tokens: bool = False,
                    top_k: int = 0, logits_chunk: int = 1024):
    """Online mode: the frozen target's captured features [B, T, n*D] (no gradient); with
    next_tokens, also its greedy next token after each position [B, T] int32, and with top_k > 0
    its top_k likeliest next tokens' ids [B, T, top_k] int32 and logits float32 after those."""
    target_params = jax.lax.stop_gradient(target_params)
    hidden, features, _ = target.forward(target_params, tokens, capture=layer_ids)
    features = jax.lax.stop_gradient(features)
    if not next_tokens:
        return features
    head, hidden = (lambda h: target.logits(target_params, h)), jax.lax.stop_gradient(hidden)
    if top_k:
        return (features, *objective.greedy_and_top_tokens(head, hidden, top_k, logits_chunk))
    return features, objective.greedy_tokens(head, hidden, logits_chunk)


def batch_loss(target, config: DrafterConfig, spec: StepSpec, params, frozen, batch, *, with_terms: bool = False):
    """Loss and per-slot accuracy [G] of one (micro-)batch that carries its anchors [B, N] and
    their validity [B, N] (objective.sample_anchors). with_terms: (loss, (accuracy, terms)), terms
    a dict of the loss's parts before their weights ({} for DFlash; "selector_loss" for DFlash2;
    "ce_loss", "l1_loss" and "confidence_loss" for DSpark).

    frozen: {"target": target params, "target_to_draft": int32 [V] (reduced vocabulary only)}.
    Labels outside a reduced draft vocabulary weigh 0 and count as wrong for accuracy.
    A generation with a loss of its own (DSpark's) computes it (`Generation.batch_loss`); one with
    terms beside the block loss (DFlash2's selector) adds them (`Generation.block_loss_term`).
    """
    generation = generations.of(config)
    if generation.trains_own_loss:
        loss, slots, terms = generation.batch_loss(target, DrafterSpec(config, DTYPES[spec.compute_dtype]), spec,
                                                   params, frozen, batch)
        return (loss, (slots, terms)) if with_terms else (loss, slots)
    dtype = DTYPES[spec.compute_dtype]
    target_params = jax.lax.stop_gradient(frozen["target"])
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    next_tokens = batch.get("next_tokens") if spec.target_labels else None
    top = (batch.get("top_ids"), batch.get("top_logits")) if spec.label_top_k else None
    if "features" in batch:
        features = batch["features"]
        if spec.target_labels and next_tokens is None:
            raise ValueError("target labels need the feature cache's next_tokens (rerun train.cache_features)")
        if top is not None and (top[0] is None or top[0].shape[-1] < spec.label_top_k):
            have = 0 if top[0] is None else top[0].shape[-1]
            raise ValueError(f"soft labels of the top {spec.label_top_k} tokens need a feature cache written "
                             f"with train.cache_features --top-k {spec.label_top_k} or more (it has {have})")
    elif spec.target_labels:
        features, next_tokens, *top = target_features(target, target_params, tokens, config.target_layer_ids,
                                                      next_tokens=True, top_k=spec.label_top_k,
                                                      logits_chunk=spec.logits_chunk)
        top = tuple(top) or None
    else:
        features = target_features(target, target_params, tokens, config.target_layer_ids)
    anchors, valid = batch["anchors"], batch["valid"]
    drafter = DrafterSpec(config, dtype)
    drafter_params = jax.tree.map(lambda p: p.astype(dtype), params["drafter"])
    hidden = objective.drafter_block_hidden(drafter, target, drafter_params, target_params,
                                            features.astype(dtype), tokens, anchors, valid, spec.anchor_chunk)
    labels, weights = objective.block_targets(tokens, loss_mask, anchors, valid, config.block_size, spec.decay,
                                              next_tokens)
    counted = weights > 0
    soft = None if top is None else objective.block_distributions(*top, anchors, config.block_size,
                                                                    spec.label_top_k)
    soft_weights = weights  # a soft label keeps its slot while any of its candidates has a draft id
    if "draft_head" in params:
        to_draft = frozen["target_to_draft"]
        labels, weights = objective.draft_labels(labels, weights, to_draft)
        if soft is not None:
            *soft, soft_weights = objective.draft_distributions(*soft, soft_weights, to_draft)
        kernel = params["draft_head"].astype(dtype)
        head = lambda h: config.draft_logits(jnp.einsum("bmd,dv->bmv", h, kernel).astype(jnp.float32))
    else:
        head = lambda h: config.draft_logits(target.logits(target_params, h))
    loss_weights = weights if soft is None else soft_weights
    extra = generation.block_loss_term(config, drafter_params, tokens, anchors, labels)
    loss, slots, *extra_values = objective.weighted_block_loss(
        head, hidden, labels, loss_weights, counted, spec.logits_chunk, soft=None if soft is None else tuple(soft),
        scorable=weights > 0, extra=extra)
    loss, terms = generation.add_block_loss_terms(spec, loss, extra_values, weights)
    return (loss, (slots, terms)) if with_terms else (loss, slots)


def _micro_batches(batch: dict, count: int) -> dict:
    """[B, ...] -> [count, B // count, ...]; micro-batch a holds rows a, a + count, ... so that
    each device's contiguous rows stay on it."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1),
                        batch)


def make_train_step(target, config: DrafterConfig, spec: StepSpec, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule) -> Callable:
    """(state, frozen, batch) -> (new state, metrics).

    Anchors are drawn for the whole batch from fold_in(state.rng, state.step), then gradients are
    averaged over spec.grad_accum micro-batches. metrics: loss, slot_accuracy [G-1] (slots 1..G-1), tau_estimate,
    grad_norm, learning_rate, and the loss's terms (`batch_loss`). A DSpark drafter's slot_accuracy
    has one entry per proposal (`DrafterConfig.proposals`)."""
    first_proposal = generations.of(config).first_accuracy_slot  # the accuracy vector's first proposing slot

    def step(state: TrainState, frozen, batch):
        anchors, valid = objective.sample_anchors(jax.random.fold_in(state.rng, state.step),
                                                  batch["loss_mask"], spec.num_anchors)
        batch = {**batch, "anchors": anchors, "valid": valid}
        grad_fn = jax.value_and_grad(lambda p, mb: batch_loss(target, config, spec, p, frozen, mb, with_terms=True),
                                     has_aux=True)

        def accumulate(total, micro):
            (loss, (slots, terms)), grads = grad_fn(state.params, micro)
            return jax.tree.map(jnp.add, total, grads), (loss, slots, terms)

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, (losses, slots, terms) = jax.lax.scan(accumulate, zeros, _micro_batches(batch, spec.grad_accum))
        grads = jax.tree.map(lambda g: g / spec.grad_accum, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        slot_accuracy = jnp.mean(slots, axis=0)[first_proposal:]
        metrics = {"loss": jnp.mean(losses), "slot_accuracy": slot_accuracy,
                   "tau_estimate": objective.tau_estimate(slot_accuracy),
                   "grad_norm": optax.global_norm(grads), "learning_rate": schedule(state.step),
                   **{name: jnp.mean(value) for name, value in terms.items()}}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step
