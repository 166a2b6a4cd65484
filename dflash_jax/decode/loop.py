"""The device side of generation: decode state, prefill, one speculative cycle, the decode loop.

Pure functions of (model specs, static config, params, state): `target` is a `TargetSpec`, `drafter`
a `DrafterSpec` or None (static and hashable; the weights come in as `target_params` and
`drafter_params`, never closed over). The host side (prompt checks, buckets, compiled executables,
timing, results, streaming) is `dflash_jax.engine.generator`.

One cycle per row (docs/architecture.md, "One speculative cycle"): draft a block [anchor, MASK x (G-1)] against the
row's draft context cache (with `lookup`, tokens that followed an earlier occurrence of the row's last few take
the slots they fill: `dflash_jax.decode.lookup`; where they fill every slot of every live row the drafter
does not run), verify it in one target pass, accept a prefix, emit the correction/bonus token,
write the anchor's and accepted tokens' keys to the target cache and append their features to the
draft cache. With `gate_drafts`, a cycle in which no live row's first draft reached
`min_draft_probability` verifies the anchor alone (`_verify_anchor`): an autoregressive step,
cheaper than verifying a draft that would most likely be rejected.
`drafter=None` runs plain autoregressive decoding through the same cycle with a block of 1.

Invariants at the start of every cycle, for row b with L = lengths[b] committed tokens:
tokens[b, :L] are committed; the target cache and the draft context cache hold positions
0 .. L-2; the anchor is tokens[b, L-1] at position L-1.

The whole decode is one `lax.while_loop` over `DecodeState` (no host round trip).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax import backends, sharding
from dflash_jax.decode import sampling
from dflash_jax.decode.lookup import lookup_drafts, merge_lookup
from dflash_jax.kernels import registry as kernel_registry, round_up
from dflash_jax.models.cache import KVCache, put_row, take_row, write_rows

ACCEPTANCE_RULES = ("exact", "match")
NEW_TOKENS_BUCKET = 64  # GenerationConfig.max_new_tokens: a multiple of this


def cache_tile() -> int:
    """Cache capacities are multiples of this: the key tile of the attention kernel this process's
    platform runs (`kernels.registry.key_tile`)."""
    return kernel_registry.key_tile(backends.platform())


def new_tokens_bucket(max_new_tokens: int) -> int:
    """The room a program compiled for `max_new_tokens` new tokens holds (GenerationConfig.max_new_tokens)."""
    return round_up(max_new_tokens, NEW_TOKENS_BUCKET)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Everything that fixes the compiled program (values that don't are passed as arrays)."""

    # the most new tokens the program has room for: a call's own max_new_tokens rounded up to a
    # multiple of NEW_TOKENS_BUCKET (`new_tokens_bucket`), so that calls differing only in it share
    # one program; each call's own limit is SamplingParams.max_new_tokens
    max_new_tokens: int = 256
    block_size: int = 1  # 1 = autoregressive
    sampling: bool = False  # False = greedy
    top_k: int = 0
    use_top_p: bool = False
    acceptance: str = "exact"  # sampling rule: "exact" (speculative sampling) or "match" (official)
    lookup: int = 0  # 0: the drafter's drafts; n >= 2: looked-up tokens where a 2..n-token match exists
    # True: a cycle verifies its drafts only where some live row's first draft is likely enough
    # (SamplingParams.min_draft_probability), else the anchor alone (`_verify_anchor`)
    gate_drafts: bool = False
    # > 0: the drafter's context cache keeps (and the drafter sees) only each row's last draft_context
    # positions, a ring buffer (`RingKVCache`); 0: the whole context
    draft_context: int = 0
    # the verify widths (block prefixes: the anchor and its first w-1 drafts) a cycle may verify,
    # ascending, each <= block_size; (): always the whole block. A cycle picks the narrowest that
    # holds what `verify_policy` asks for (`_verify_plan`).
    verify_widths: tuple[int, ...] = ()
    # "costs": the width with the most expected tokens per second (SamplingParams.verify_costs, within
    # SamplingParams.verify_budget where given); "budget": the widest the budget allows; "": the one
    # width (verify_widths is then one width)
    verify_policy: str = ""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {self.acceptance!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.lookup == 1 or self.lookup < 0:
            raise ValueError(f"lookup must be 0 (off) or >= 2 (the longest match), got {self.lookup}")
        if self.draft_context < 0:
            raise ValueError(f"draft_context must be >= 0 (0: the whole context), got {self.draft_context}")
        if self.verify_widths:
            widths = self.verify_widths
            if list(widths) != sorted(set(widths)) or widths[0] < 1 or widths[-1] > self.block_size:
                raise ValueError(f"verify_widths must ascend within [1, block_size={self.block_size}], got {widths}")
            if self.gate_drafts:
                raise ValueError("gate_drafts and verify_widths both choose what a cycle verifies: use one")
        if self.verify_policy not in ("", "budget", "costs") or (self.verify_policy and not self.verify_widths):
            raise ValueError(f"verify_policy must be '', 'budget' or 'costs' (with verify_widths), got "
                             f"{self.verify_policy!r}")


@struct.dataclass
class SamplingParams:
    temperature: jax.Array  # [] float32 (unused when greedy)
    top_p: jax.Array  # [] float32
    stop_token_ids: jax.Array  # [S] int32, padded with -1
    # [] float32: with GenerationConfig.gate_drafts, the least probability (the drafter's own, 1 for a
    # looked-up token) of a row's first draft for the cycle to verify it
    min_draft_probability: jax.Array | None = None
    # [] float32, a DSpark drafter with a confidence head only: each row verifies its drafts up to
    # the first whose confidence is below this (0: all of them; `drafters.dspark.proposal_limit`)
    confidence_threshold: jax.Array | None = None
    # [] int32: the most tokens a cycle verifies over the batch (rows x the verify width; None: no bound)
    verify_budget: jax.Array | None = None
    # [len(verify_widths)] float32, verify_policy "costs": seconds of a cycle verifying each width
    verify_costs: jax.Array | None = None
    # [] int32: the new tokens after which a row is done, at most GenerationConfig.max_new_tokens
    # (None: GenerationConfig.max_new_tokens)
    max_new_tokens: jax.Array | None = None


@struct.dataclass
class DecodeState:
    tokens: jax.Array  # [B, capacity] int32: prompt then generated tokens
    lengths: jax.Array  # [B] committed tokens (prompt + generated)
    prompt_lengths: jax.Array  # [B]
    done: jax.Array  # [B] bool
    target_cache: KVCache
    draft_cache: KVCache | None
    rng: jax.Array
    cycles: jax.Array  # [B] verify cycles run by each row
    # [B, max_new_tokens]: tokens emitted by each cycle (accepted drafts + 1, the tau samples);
    # entries at and past cycles[b] are 0.
    emitted_per_cycle: jax.Array
    # [] int32: tokens the target verified, summed over cycles (rows x the verified width: every row is
    # computed, live or not); the batch engine's (`empty_state`), None in `generate`'s state
    verified: jax.Array | None = None


def state_shardings(mesh, state: DecodeState) -> DecodeState:
    """NamedShardings of a decode state (of arrays or ShapeDtypeStructs) on `mesh`: the per-row
    arrays over `data` where it divides the batch (`sharding.batch_spec`), both caches by
    `sharding.cache_shardings`, the rng replicated."""
    rows = lambda x: sharding.batch_sharding(mesh, x.shape)
    draft = None if state.draft_cache is None else sharding.cache_shardings(mesh, state.draft_cache)
    return DecodeState(tokens=rows(state.tokens), lengths=rows(state.lengths),
                       prompt_lengths=rows(state.prompt_lengths), done=rows(state.done),
                       target_cache=sharding.cache_shardings(mesh, state.target_cache), draft_cache=draft,
                       rng=sharding.replicated(mesh), cycles=rows(state.cycles),
                       emitted_per_cycle=rows(state.emitted_per_cycle),
                       verified=None if state.verified is None else sharding.replicated(mesh))


def target_probs(cfg: GenerationConfig, params: SamplingParams, logits):
    """The filtered distribution [..., V] of logits [..., V] (the target's, or the drafter's over its
    own vocabulary: top_k beyond a reduced draft vocabulary keeps all of it)."""
    return sampling.filtered_probs(logits, params.temperature, min(cfg.top_k, logits.shape[-1]),
                                   params.top_p if cfg.use_top_p else None)


def _finished(cfg: GenerationConfig, params: SamplingParams, emitted, num_emitted, lengths, prompt_lengths):
    """A row is done when it emitted a stop token or reached max_new_tokens."""
    valid = jnp.arange(emitted.shape[1])[None, :] < num_emitted[:, None]
    is_stop = (emitted[..., None] == params.stop_token_ids[None, None, :]).any(-1)
    limit = cfg.max_new_tokens if params.max_new_tokens is None else params.max_new_tokens
    return (is_stop & valid).any(-1) | (lengths - prompt_lengths >= limit)


def _empty_draft_cache(drafter, cfg: GenerationConfig, batch: int, capacity: int):
    """The drafter's empty context cache (None without a drafter): the target cache's capacity, or with
    cfg.draft_context below it a ring of that window (`RingKVCache`)."""
    if drafter is None:
        return None
    if cfg.draft_context and cfg.draft_context < capacity:
        return drafter.init_cache(batch, round_up(cfg.draft_context, cache_tile()), window=cfg.draft_context)
    return drafter.init_cache(batch, capacity)


def prefill(target, drafter, cfg: GenerationConfig, target_params, drafter_params, prompt_tokens,
            prompt_lengths, rng, params: SamplingParams) -> DecodeState:
    """Run the prompts [B, P] (right-padded) through the target; the first token becomes the anchor."""
    b, p = prompt_tokens.shape
    capacity = p + cfg.max_new_tokens + cfg.block_size
    # Cache lengths that are multiples of the kernel's key tile spare it a padding copy per call
    # (the XLA path reads only the filled slots and needs no rounding). The drafter's block
    # attends to its context cache and its own keys separately, so both caches have one size.
    cache_capacity = round_up(capacity, cache_tile())
    capture = drafter.config.target_layer_ids if drafter is not None else ()
    # Chunked prefill (Target.prefill): attention cost follows the filled length, memory one chunk.
    hidden, features, cache = target.prefill(target_params, prompt_tokens, target.init_cache(b, cache_capacity),
                                             capture=capture, num_new=prompt_lengths)
    logits = target.logits(target_params, sampling.gather_rows(hidden, prompt_lengths - 1))
    rng, key = jax.random.split(rng)
    if cfg.sampling:
        first = sampling.sample(key, target_probs(cfg, params, logits))
    else:
        first = sampling.greedy(logits)
    tokens = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(prompt_tokens)
    tokens = write_rows(tokens, first[:, None], prompt_lengths)
    draft_cache = _empty_draft_cache(drafter, cfg, b, cache_capacity)
    if drafter is not None:
        draft_cache = drafter.append_context(drafter_params, draft_cache, features, num_new=prompt_lengths)
    lengths = prompt_lengths + 1
    done = _finished(cfg, params, first[:, None], jnp.ones_like(lengths), lengths, prompt_lengths)
    return DecodeState(tokens=tokens, lengths=lengths, prompt_lengths=prompt_lengths, done=done,
                       target_cache=cache, draft_cache=draft_cache, rng=rng,
                       cycles=jnp.zeros((b,), jnp.int32),
                       emitted_per_cycle=jnp.zeros((b, cfg.max_new_tokens), jnp.int32))


def _top_probability(logits):
    """The largest probability of softmax(logits [..., V]) -> [...] float32 (a greedy draft's own)."""
    logits = logits.astype(jnp.float32)
    return 1.0 / jnp.sum(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), axis=-1)


def slot_confidence(cfg, logits):
    """How likely the drafter is to be right, per slot, from its base logits [B, G-1, V] (before a
    DFlash2 selector or a DSpark Markov head): the top probability of each slot's distribution (of
    every slot [B, G-1] with cfg.verify_widths; of the first [B] with cfg.gate_drafts; else None).
    It depends on the context and the anchor, never on a drafted token: a choice of what to verify
    made from it is independent of the drafts, which keeps the acceptance rule exact when sampling
    (a choice that looked at a sampled draft's own probability would bias the output)."""
    if cfg.verify_widths:
        return _top_probability(logits)
    return _top_probability(logits[:, 0]) if cfg.gate_drafts else None


def _propose(target, drafter, cfg, target_params, drafter_params, anchors, draft_cache, key, params):
    """The drafter's proposal for every row: its generation's (`drafters.generations.Generation.propose`),
    a `Proposal` of the drafts [B, G-1] (target ids), their distributions over the target vocabulary
    [B, G-1, V] (None unless exact sampling), the drafter's confidence in its slots
    (`slot_confidence`) and how many leading drafts each row verifies [B] (None: all; a DSpark
    drafter's confidence policy)."""
    return drafter.generation.propose(target, drafter, cfg, target_params, drafter_params, anchors, draft_cache, key,
                                      params)


def _draft(target, drafter, cfg, target_params, drafter_params, state, anchors, key, params):
    """`_propose`'s `Proposal`, with `lookup`'s tokens in the slots it fills (their probability 1,
    inside the limit). Where the lookup fills every slot of every live row the drafter does not run
    (its drafts would all be replaced)."""
    propose = lambda: _propose(target, drafter, cfg, target_params, drafter_params, anchors,
                               state.draft_cache, key, params)
    if not cfg.lookup:
        return propose()
    looked_up, found = lookup_drafts(state.tokens, state.lengths, cfg.lookup, cfg.block_size - 1)
    shapes = jax.eval_shape(propose)
    unused = lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    everywhere = jnp.all(found | state.done[:, None])
    proposal = jax.lax.cond(everywhere, unused, propose)
    drafts, probs = merge_lookup(proposal.drafts, proposal.probs, looked_up, found)
    first, limit = proposal.confidence, proposal.limit
    if first is not None:  # a looked-up token counts as certain
        first = jnp.where(found if first.ndim == 2 else found[:, 0], 1.0, first)
    if limit is not None:  # a looked-up slot counts as confident (as its probability counts as 1)
        slot = jnp.arange(found.shape[1])[None, :]
        limit = jnp.sum(jnp.cumprod((slot < limit[:, None]) | found, axis=-1), axis=-1).astype(jnp.int32)
    return proposal._replace(drafts=drafts, probs=probs, confidence=first, limit=limit)


def _verify(target, drafter, cfg, target_params, state, block, drafts, draft_probs, key, params, limit=None):
    """The target on the whole block and the acceptance rule -> (num_accepted [B], next_token [B],
    the captured features [B, G, ...] or None, what the target cache commits of the block: its keys
    and values [L, B, G, Hkv, Dh] each, and a hybrid target's per-position linear-layer inputs).

    limit [B] (None: every draft): a row verifies only its first limit[b] drafts. Where the rule
    reaches that far (num_accepted >= limit), the row accepts limit drafts and its next token is the
    target's own at that slot (argmax, or a fresh sample from p with a key of its own): the drafts
    past the limit and the rule's verdict on them are never looked at, so the output is the
    target's whatever chose the limit (as long as that choice did not look at the target)."""
    capture = drafter.config.target_layer_ids if drafter is not None else ()
    hidden, features, new_kv = target.forward(target_params, block, state.target_cache, capture=capture,
                                              write_cache=False)
    logits = target.logits(target_params, hidden)  # [B, G, V]
    if limit is not None:
        key, limit_key = sampling.split(key)
    if not cfg.sampling:
        num_accepted, next_token = sampling.accept_greedy(drafts, logits)
    elif cfg.acceptance == "match" or drafter is None:
        num_accepted, next_token = sampling.accept_match(key, drafts, target_probs(cfg, params, logits))
    else:
        num_accepted, next_token = sampling.accept_exact(key, drafts, draft_probs,
                                                         target_probs(cfg, params, logits))
    if limit is not None:
        at_limit = sampling.gather_rows(logits, limit)  # [B, V]: the target at the first unverified slot
        own = (sampling.greedy(at_limit) if not cfg.sampling
               else sampling.sample(limit_key, target_probs(cfg, params, at_limit)))
        reached = num_accepted >= limit
        num_accepted = jnp.where(reached, limit, num_accepted)
        next_token = jnp.where(reached, own, next_token)
    return num_accepted, next_token, features, new_kv


def _verify_anchor(target, drafter, cfg, target_params, state, block, drafts, draft_probs, key, params, limit=None):
    """`_verify` of the anchor alone (an autoregressive step): no draft is accepted and the next
    token is the target's own, greedy or sampled. Lossless whatever made the choice, as long as the
    choice does not look at the target's outputs. Features, keys and values padded to the block's G
    slots (past the one token the row commits, the caches' slots are overwritten later)."""
    del draft_probs, limit  # nothing is verified
    outputs = _verify(target, drafter, dataclasses.replace(cfg, acceptance="match"), target_params, state, block[:, :1],
                      drafts[:, :0], None, key, params)
    return _padded(outputs, block.shape[1] - 1)


def _verify_prefix(width: int, target, drafter, cfg, target_params, state, block, drafts, draft_probs, key, params,
                   limit=None):
    """`_verify` of the block's first `width` slots (the anchor and its first width - 1 drafts; the
    target's own token follows the last of them when all are accepted): what a cycle verifies when
    `_verify_plan` chose that width. Outputs padded to the block's G slots, as `_verify_anchor`'s."""
    g = block.shape[1]
    if width == g:
        return _verify(target, drafter, cfg, target_params, state, block, drafts, draft_probs, key, params, limit)
    if width == 1:
        return _verify_anchor(target, drafter, cfg, target_params, state, block, drafts, draft_probs, key, params)
    outputs = _verify(target, drafter, cfg, target_params, state, block[:, :width], drafts[:, :width - 1],
                      None if draft_probs is None else draft_probs[:, :width - 1], key, params,
                      None if limit is None else jnp.minimum(limit, width - 1))
    return _padded(outputs, g - width)


def _padded(outputs, pad: int):
    """`_verify`'s outputs of a narrower verify with their features, keys and values padded by `pad`
    slots (every per-position array of a cache's pending is [layers, B, T, ...])."""
    num_accepted, next_token, features, new_kv = outputs
    if features is not None:
        features = jnp.pad(features, ((0, 0), (0, pad), (0, 0)))
    new_kv = jax.tree_util.tree_map(lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3)),
                                    new_kv)
    return num_accepted, next_token, features, new_kv


def _verify_plan(cfg: GenerationConfig, params: SamplingParams, draft_p, done, limit):
    """How much a cycle verifies (`GenerationConfig.verify_policy`) -> (limit [B], the index of the
    width in cfg.verify_widths every row verifies).

    The target computes every row at the chosen width (static shapes), so the choice is one width w
    for the batch, every row verifying up to w - 1 drafts (a proposer's own limit, DSpark's
    confidence threshold, still holds). "costs": the width with the most expected tokens per second
    of a cycle of that width (params.verify_costs): the live rows, plus each live row's chance of
    getting past draft k, about the product of the drafter's confidences in slots 0..k (draft_p
    [B, G-1], `_confidence`; a looked-up draft counts 1), summed over the drafts the width holds.
    "budget": the widest width with rows x w <= params.verify_budget (the narrowest if none fits).
    Both: the cost table's choice among the widths the budget allows. "": the one width.

    The choice reads draft_p, which depends on the context, never on a drafted token, so whether a
    draft is verified is independent of it: lossless at any temperature (`_verify`'s limit rule)."""
    widths = jnp.asarray(cfg.verify_widths, jnp.int32)
    allowed = jnp.ones(widths.shape, bool)
    if params.verify_budget is not None:
        allowed = (widths * done.shape[0] <= params.verify_budget) | (widths == widths[0])
    if cfg.verify_policy == "costs":
        live = ~done
        survival = jnp.where(live[:, None], jnp.cumprod(draft_p.astype(jnp.float32), axis=-1), 0.0)  # [B, G-1]
        gains = jnp.sum(live) + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(jnp.sum(survival, axis=0))])  # [G]
        index = jnp.argmax(jnp.where(allowed, gains[widths - 1] / params.verify_costs, -jnp.inf))
    else:
        index = jnp.sum(allowed) - 1  # the widest allowed (allowed is a prefix of the ascending widths)
    plan = jnp.full(done.shape, widths[index] - 1, jnp.int32)
    return (plan if limit is None else jnp.minimum(plan, limit)), index


def cycle(target, drafter, cfg: GenerationConfig, target_params, drafter_params, state: DecodeState,
          params: SamplingParams) -> DecodeState:
    """One draft-verify-accept cycle for every row; finished rows do not change."""
    rows = jnp.arange(state.tokens.shape[0])
    rng, draft_key, accept_key = sampling.split(state.rng, 3)
    anchors = sampling.gather_rows(state.tokens, state.lengths - 1)
    if drafter is not None:
        proposal = _draft(target, drafter, cfg, target_params, drafter_params, state, anchors, draft_key, params)
        drafts, draft_probs, first, limit = proposal.drafts, proposal.probs, proposal.confidence, proposal.limit
    else:
        drafts, draft_probs, first, limit = jnp.zeros((anchors.shape[0], 0), jnp.int32), None, None, None
    block = jnp.concatenate([anchors[:, None], drafts], axis=1)  # [B, G]
    verify_args = (target, drafter, cfg, target_params, state, block, drafts, draft_probs, accept_key, params,
                   limit)
    width = cfg.block_size
    if cfg.verify_widths:
        limit, index = _verify_plan(cfg, params, first, state.done, limit)
        width = jnp.asarray(cfg.verify_widths, jnp.int32)[index]
        verify_args = verify_args[:-1] + (limit,)
        num_accepted, next_token, features, new_kv = jax.lax.switch(
            index, [functools.partial(_verify_prefix, w, *verify_args) for w in cfg.verify_widths])
    elif first is not None:  # cfg.gate_drafts: the anchor alone where no live row's first draft is likely enough
        likely = jnp.any(~state.done & (first >= params.min_draft_probability))
        width = jnp.where(likely, cfg.block_size, 1)
        num_accepted, next_token, features, new_kv = jax.lax.cond(
            likely, lambda: _verify(*verify_args), lambda: _verify_anchor(*verify_args))
    else:
        num_accepted, next_token, features, new_kv = _verify(*verify_args)
    live = ~state.done
    num_emitted = jnp.where(live, num_accepted + 1, 0)
    slot = jnp.arange(cfg.block_size)[None, :]
    shifted = jnp.concatenate([drafts, jnp.zeros_like(anchors[:, None])], axis=1)  # drafts[i] at slot i
    emitted = jnp.where(slot < num_accepted[:, None], shifted, next_token[:, None])
    tokens = write_rows(state.tokens, emitted, state.lengths)
    tokens = jnp.where(live[:, None], tokens, state.tokens)
    lengths = state.lengths + num_emitted
    # The target cache keeps anchor + accepted drafts; the draft cache gains their features.
    target_cache = state.target_cache.commit(new_kv, num_emitted)
    draft_cache = state.draft_cache
    if drafter is not None:
        draft_cache = drafter.append_context(drafter_params, draft_cache, features, num_new=num_emitted)
    done = state.done | _finished(cfg, params, emitted, num_emitted, lengths, state.prompt_lengths)
    index = jnp.minimum(state.cycles, cfg.max_new_tokens - 1)
    emitted_per_cycle = state.emitted_per_cycle.at[rows, index].set(
        jnp.where(live, num_emitted, state.emitted_per_cycle[rows, index]))
    verified = state.verified
    if verified is not None:  # every row is computed at the width, live or not
        verified = verified + width * state.done.shape[0]
    return state.replace(tokens=tokens, lengths=lengths, done=done, target_cache=target_cache,
                         draft_cache=draft_cache, rng=rng, cycles=state.cycles + live,
                         emitted_per_cycle=emitted_per_cycle, verified=verified)


def decode(target, drafter, cfg, target_params, drafter_params, state, params) -> DecodeState:
    """Cycles until every row is done, in one while_loop."""
    return jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        lambda s: cycle(target, drafter, cfg, target_params, drafter_params, s, params),
        state)


# ----------------------------------------------------------------------------------------------
# The batch engine's device side (`dflash_jax.engine.batch`): a fixed number of rows ("slots"), each
# holding one prompt at a time. An idle or prefilling slot is `done` (no cycle changes it); `admit`
# prefills a prompt into a slot one chunk at a time, and `decode_until` runs cycles until a row
# finishes while prompts wait, or a number of cycles. Every row draws with its own key (`rng` is
# [B, 2]: `decode.sampling.per_row_keys`), so a prompt's samples depend on its own seed alone.


def empty_state(target, drafter, cfg: GenerationConfig, batch: int, capacity: int) -> DecodeState:
    """A decode state of `batch` idle slots of `capacity` tokens (prompt, generated tokens and one
    block; a multiple of the kernel's key tile), every row done."""
    draft_cache = _empty_draft_cache(drafter, cfg, batch, capacity)
    zeros = jnp.zeros((batch,), jnp.int32)
    return DecodeState(tokens=jnp.zeros((batch, capacity), jnp.int32), lengths=zeros, prompt_lengths=zeros,
                       done=jnp.ones((batch,), bool), target_cache=target.init_cache(batch, capacity),
                       draft_cache=draft_cache, rng=jnp.zeros((batch, 2), jnp.uint32), cycles=zeros,
                       emitted_per_cycle=jnp.zeros((batch, cfg.max_new_tokens), jnp.int32),
                       verified=jnp.zeros((), jnp.int32))


def _cleared_if(cache, flag):
    """`cache.cleared()` where flag (a traced bool) holds, else `cache`."""
    return jax.tree_util.tree_map(lambda c, x: jnp.where(flag, c, x), cache.cleared(), cache)


def admit(target, drafter, cfg: GenerationConfig, target_params, drafter_params, state: DecodeState, slot, chunk,
          start, count, prompt_length, key, params: SamplingParams) -> DecodeState:
    """Prefill the prompt tokens chunk [C] (its first `count` real, the rest padding) at positions
    start .. start + C - 1 into row `slot` (start 0: the row starts empty). The chunk that completes
    the prompt (start + count == prompt_length) also draws the first token, with `key` (the
    prompt's own; what the row's later cycles draw with follows from it), as `prefill` does; until
    then the row stays done. The row's caches are copied out, prefilled as a batch of one (the same
    computation as `prefill` of that prompt alone in chunks of C) and written back."""
    capture = drafter.config.target_layer_ids if drafter is not None else ()
    fresh = start == 0
    row = _cleared_if(take_row(state.target_cache, slot), fresh)
    hidden, features, row = target.prefill(target_params, chunk[None], row, capture=capture, num_new=count[None])
    target_cache = put_row(state.target_cache, row, slot)
    draft_cache = state.draft_cache
    if drafter is not None:
        draft_row = _cleared_if(take_row(draft_cache, slot), fresh)
        draft_row = drafter.append_context(drafter_params, draft_row, features, num_new=count[None])
        draft_cache = put_row(draft_cache, draft_row, slot)
    filled = start + count
    last = filled >= prompt_length
    logits = target.logits(target_params, sampling.gather_rows(hidden, (count - 1)[None]))  # [1, V]
    rng, first_key = jax.random.split(key)
    first = (sampling.sample(first_key, target_probs(cfg, params, logits)) if cfg.sampling
             else sampling.greedy(logits))[0]
    tokens = jax.lax.dynamic_update_slice(state.tokens, chunk[None].astype(jnp.int32), (slot, start))
    tokens = tokens.at[slot, filled].set(jnp.where(last, first, tokens[slot, filled]))
    finished = _finished(cfg, params, first[None, None], jnp.ones((1,), jnp.int32), (filled + 1)[None],
                         prompt_length[None])[0]
    return state.replace(
        tokens=tokens, lengths=state.lengths.at[slot].set(jnp.where(last, filled + 1, filled)),
        prompt_lengths=state.prompt_lengths.at[slot].set(prompt_length),
        done=state.done.at[slot].set(jnp.where(last, finished, True)), target_cache=target_cache,
        draft_cache=draft_cache, rng=state.rng.at[slot].set(jnp.where(last, rng, state.rng[slot])),
        cycles=state.cycles.at[slot].set(0), emitted_per_cycle=state.emitted_per_cycle.at[slot].set(0))


def decode_until(target, drafter, cfg: GenerationConfig, target_params, drafter_params, state: DecodeState,
                 params: SamplingParams, max_cycles, refill):
    """Cycles (one `lax.while_loop`) until no row is live, or `max_cycles` ran, or (refill: prompts
    wait for a slot) a row that was live finished. -> (state, cycles run)."""
    was_live = ~state.done

    def more(carry):
        s, n = carry
        freed = jnp.any(s.done & was_live)
        return jnp.any(~s.done) & (n < max_cycles) & ~(refill & freed)

    def step(carry):
        s, n = carry
        return cycle(target, drafter, cfg, target_params, drafter_params, s, params), n + 1

    return jax.lax.while_loop(more, step, (state, jnp.zeros((), jnp.int32)))
