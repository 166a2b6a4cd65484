"""DSpark's additions to the DFlash drafter (DeepSeek's DeepSpec, `Qwen3DSparkModel`, `DrafterConfig.dspark`).

The backbone is DFlash's (context projection, K/V-injected layers, final norm). A DSpark drafter
keeps its own copies of the target's tables: `embed_tokens` [V, D] embeds the block and `lm_head`
(Linear D -> V) gives each slot's base logits. The block [x0, MASK x (G-1)] at positions
L-1 .. L+G-2 gives G proposals: slot k predicts the token at position L+k (the anchor slot
predicts too, `sample_from_anchor`), so a cycle verifies G + 1 tokens.

Markov head of rank r (`markov_head.markov_w1`: an embedding [V, r]; `markov_head.markov_w2`: a
Linear r -> V): with x_{-1} = the anchor and e_k = W1[x_{k-1}],

    logits_k = base_k + W2 e_k                          (base_k = lm_head(h_k), float32)

drafted left to right (`draft`, a `lax.scan` over the slots): greedy x_k = argmax logits_k; at
temperature T > 0, x_k is drawn from the filtered distribution of logits_k (temperature, top-k,
top-p), which is the draft distribution q_k over the whole vocabulary that the exact acceptance
rule reads.

A reduced draft vocabulary (`DSparkConfig.draft_vocab_size`, the speculators layout's d2t/t2d):
the LM head and W2 hold zero columns off the kept ids and `draft_vocab.bias` [V] is 0 at them,
-inf elsewhere, added to the base logits: the draft distribution is the reduced one's, zero off
its ids, so the chain, the sampled q and the exact rule run over target ids unchanged.

Confidence head (`confidence_head.proj`, Linear D + r -> 1 with a bias, or D -> 1 without the
Markov features): c_k = sigmoid(w . [h_k ; e_k] + b), an estimate of the chance that x_k is
accepted. A verify-length policy (`proposal_limit`) stops the proposal before the first slot whose
confidence is below a threshold; the loop verifies only that prefix (`decode.loop._verify`), so the
output is the target's whatever the policy.

Training (DeepSpec's loss; `drafters.generations.DSpark.batch_loss`): every slot teacher-forced on the gold
previous token (`teacher_forced`), its terms against the target's distribution (`loss_terms`).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax import sharding
from dflash_jax.decode import sampling
from dflash_jax.drafters.config import DSparkConfig

sharding.declare_param_axes({
    ("markov_head", "markov_w1", "embedding"): ("vocab", "markov_rank"),  # [V, r]
    ("markov_head", "markov_w2", "kernel"): ("markov_rank", "vocab"),  # [r, V]
    ("confidence_head", "proj", "kernel"): ("confidence", "confidence"),  # [D + r, 1]
})


def heads(config: DSparkConfig, vocab_size: int, hidden_size: int, dtype=jnp.float32) -> dict:
    """The modules DSpark adds at the drafter's top level, by their param names: `embed_tokens`,
    `lm_head`, `markov_head` (rank > 0) and `confidence_head` (when enabled). Their params are
    created by `init_heads`; drafting reads them as arrays (`draft`)."""
    out = {"embed_tokens": nn.Embed(vocab_size, hidden_size, param_dtype=dtype),
           "lm_head": nn.Dense(vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype)}
    if config.markov_rank:
        out["markov_head"] = MarkovHead(vocab_size, config.markov_rank, dtype)
    if config.enable_confidence_head:
        out["confidence_head"] = ConfidenceHead(dtype)
    if config.draft_vocab_size is not None:
        out["draft_vocab"] = DraftVocabBias(vocab_size, dtype)
    return out


def init_heads(config: DSparkConfig, modules: dict, hidden):
    """Call every module of `heads` once (at initialisation) on hidden states [..., D]."""
    prev = jnp.zeros(hidden.shape[:-1], jnp.int32)
    modules["embed_tokens"](prev)
    modules["lm_head"](hidden)
    if "markov_head" in modules:
        modules["markov_head"](prev)
    if "draft_vocab" in modules:
        modules["draft_vocab"]()
    if "confidence_head" in modules:
        extra = jnp.zeros((*hidden.shape[:-1], config.confidence_inputs), hidden.dtype)
        modules["confidence_head"](jnp.concatenate([hidden, extra], axis=-1))


class MarkovHead(nn.Module):
    vocab_size: int
    rank: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, prev):
        e = nn.Embed(self.vocab_size, self.rank, param_dtype=self.dtype, name="markov_w1")(prev)
        return nn.Dense(self.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                        name="markov_w2")(e)


class DraftVocabBias(nn.Module):
    """`bias` [V]: 0 at the target ids a reduced draft vocabulary holds, -inf elsewhere (set at load;
    initialised to zeros, the whole vocabulary)."""

    vocab_size: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self):
        return self.param("bias", nn.initializers.zeros, (self.vocab_size,), self.dtype)


class ConfidenceHead(nn.Module):
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, features):
        return nn.Dense(1, dtype=self.dtype, param_dtype=self.dtype, name="proj")(features)[..., 0]


def block_embeddings(params, block):
    """The drafter's own embeddings [B, G, D] of block token ids [B, G]."""
    return params["embed_tokens"]["embedding"][block]


def base_logits(params, hidden):
    """float32 base logits [..., V] of hidden [..., D] through the drafter's own LM head (-inf off a
    reduced draft vocabulary's ids)."""
    logits = hidden.astype(jnp.float32) @ params["lm_head"]["kernel"].astype(jnp.float32)
    if "draft_vocab" in params:
        logits = logits + params["draft_vocab"]["bias"].astype(jnp.float32)
    return logits


def draft(config: DSparkConfig, params, hidden, logits, anchors, probs_fn=None, key=None):
    """The Markov chain over the G proposal slots, left to right.

    params: the drafter's module params; hidden [B, G, D] its final-normed block states; logits
    [B, G, V] float32 their base logits (after the config's output transforms); anchors [B].
    probs_fn None: greedy; else a function of logits [B, V] -> the filtered distribution to draw
    from, with a PRNG key. -> (drafts [B, G] int32, the biased logits [B, G, V] float32, the draft
    distributions [B, G, V] (None when greedy), confidences c_k [B, G] float32 (None without a
    confidence head))."""
    f32 = jnp.float32
    slots = hidden.shape[1]
    markov = params.get("markov_head") if config.markov_rank else None
    confidence = params.get("confidence_head") if config.enable_confidence_head else None
    keys = sampling.split(key, slots) if probs_fn is not None else jnp.zeros((slots,), jnp.uint32)

    def step(prev, xs):
        z, h, slot_key = xs
        e = None
        if markov is not None:
            e = markov["markov_w1"]["embedding"][prev].astype(f32)  # [B, r]
            z = z + e @ markov["markov_w2"]["kernel"].astype(f32)
        probs = None if probs_fn is None else probs_fn(z)
        chosen = sampling.greedy(z) if probs_fn is None else sampling.sample(slot_key, probs)
        c = None
        if confidence is not None:
            features = h.astype(f32) if not config.confidence_head_with_markov else jnp.concatenate(
                [h.astype(f32), e], axis=-1)
            proj = confidence["proj"]
            c = jax.nn.sigmoid(features @ proj["kernel"].astype(f32)[:, 0] + proj["bias"].astype(f32)[0])
        return chosen, (chosen, z, probs, c)

    leading = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731 (slots first, for the scan)
    _, outs = jax.lax.scan(step, anchors.astype(jnp.int32), (leading(logits.astype(f32)), leading(hidden), keys))
    drafts, biased, probs, c = (None if x is None else jnp.moveaxis(x, 0, 1) for x in outs)
    return drafts, biased, probs, c


def proposal_limit(confidences, threshold):
    """How many leading slots a row verifies: those before its first confidence below `threshold`
    (confidences [B, G], threshold [] float32) -> [B] int32 in [0, G]."""
    keep = (confidences >= threshold).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(keep, axis=-1), axis=-1).astype(jnp.int32)


def teacher_forced(config: DSparkConfig, params, hidden, base, previous):
    """Each proposal slot's biased logits and confidence logit with the gold previous token.

    hidden [..., D] final-normed states; base [..., V] float32 their base logits (`base_logits`);
    previous [...] the gold token before each slot's label (the anchor for the first proposal).
    -> (logits [..., V] float32: base + W2 W1[previous]; the confidence head's logit w . [h ;
    W1[previous]] + b [...] float32, before the sigmoid, or None without a confidence head)."""
    f32 = jnp.float32
    e = None
    if config.markov_rank:
        markov = params["markov_head"]
        e = markov["markov_w1"]["embedding"][previous].astype(f32)
        base = base + e @ markov["markov_w2"]["kernel"].astype(f32)
    if not config.enable_confidence_head:
        return base, None
    features = hidden.astype(f32)
    if config.confidence_head_with_markov:
        features = jnp.concatenate([features, e], axis=-1)
    proj = params["confidence_head"]["proj"]
    return base, features @ proj["kernel"].astype(f32)[:, 0] + proj["bias"].astype(f32)[0]


def loss_terms(logits, target_logits, labels, confidence_logit=None):
    """DeepSpec's per-slot terms: the cross-entropy of the label, the L1 distance |p_d - p_t|_1
    between the drafter's and the target's distributions (twice their total variation), and, with
    a confidence logit, its binary cross-entropy against c* = clip(1 - |p_d - p_t|_1 / 2, 0, 1)
    (no gradient through c*). logits, target_logits [..., V] float32; labels [...].
    -> (ce, l1, bce or None, correct: argmax == label), each [...]."""
    log_p = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(log_p, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(jnp.exp(log_p) - jax.nn.softmax(target_logits, axis=-1)), axis=-1)
    correct = jnp.argmax(logits, axis=-1) == labels
    if confidence_logit is None:
        return ce, l1, None, correct
    accept = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    x = confidence_logit
    bce = jnp.maximum(x, 0.0) - x * accept + jnp.log1p(jnp.exp(-jnp.abs(x)))
    return ce, l1, bce, correct
