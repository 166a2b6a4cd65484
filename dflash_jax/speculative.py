"""Jitted speculative generation: the lossless DFlash loop, batched, greedy or sampling.

One cycle per row (DESIGN.md §2): draft a block [anchor, MASK x (G-1)] against the row's draft
context cache, verify it in one target pass, accept a prefix, emit the correction/bonus token,
roll the target cache back by length and append the accepted tokens' features to the draft cache.
`drafter=None` runs plain autoregressive decoding through the same cycle with a block of 1.

Invariants at the start of every cycle, for row b with L = lengths[b] committed tokens:
tokens[b, :L] are committed; the target cache and the draft context cache hold positions
0 .. L-2; the anchor is tokens[b, L-1] at position L-1.

The whole decode is one `lax.while_loop` over `DecodeState` (no host round trip). Executables are
compiled ahead of time once per shape bucket and cached; compile time is reported separately.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax import sampling
from dflash_jax.cache import KVCache

ACCEPTANCE_RULES = ("exact", "match")
KEY_TILE = 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Everything that fixes the compiled program (values that don't are passed as arrays)."""

    max_new_tokens: int = 256
    block_size: int = 1  # 1 = autoregressive
    sampling: bool = False  # False = greedy
    top_k: int = 0
    use_top_p: bool = False
    acceptance: str = "exact"  # sampling rule: "exact" (speculative sampling) or "match" (official)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {self.acceptance!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@struct.dataclass
class SamplingParams:
    temperature: jax.Array  # [] float32 (unused when greedy)
    top_p: jax.Array  # [] float32
    stop_token_ids: jax.Array  # [S] int32, padded with -1


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
    accepted: jax.Array  # [B, max_new_tokens] tokens emitted per cycle (tau samples), 0 = unused


def _gather_rows(x, index):
    """x [B, T, ...], index [B] -> [B, ...]."""
    return jnp.take_along_axis(x, index.reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]


def _write_rows(buffer, values, offsets):
    """buffer [B, S], values [B, T] written at offsets[b]."""
    return jax.vmap(lambda row, v, o: jax.lax.dynamic_update_slice(row, v, (o,)))(buffer, values, offsets)


def _target_probs(cfg: GenerationConfig, params: SamplingParams, logits):
    return sampling.filtered_probs(logits, params.temperature, cfg.top_k,
                                   params.top_p if cfg.use_top_p else None)


def _finished(cfg: GenerationConfig, params: SamplingParams, emitted, num_emitted, lengths, prompt_lengths):
    """A row is done when it emitted a stop token or reached max_new_tokens."""
    valid = jnp.arange(emitted.shape[1])[None, :] < num_emitted[:, None]
    is_stop = (emitted[..., None] == params.stop_token_ids[None, None, :]).any(-1)
    return (is_stop & valid).any(-1) | (lengths - prompt_lengths >= cfg.max_new_tokens)


def prefill(target, drafter, cfg: GenerationConfig, target_params, drafter_params, prompt_tokens,
            prompt_lengths, rng, params: SamplingParams) -> DecodeState:
    """Run the prompts [B, P] (right-padded) through the target; the first token becomes the anchor."""
    b, p = prompt_tokens.shape
    capacity = p + cfg.max_new_tokens + cfg.block_size
    # Key lengths that are multiples of the kernel's key tile spare it a padding copy per call: the
    # target attends over its cache, the drafter over [context cache ; block].
    target_capacity = _round_up(capacity, KEY_TILE)
    draft_capacity = _round_up(capacity + cfg.block_size, KEY_TILE) - cfg.block_size
    capture = drafter.config.target_layer_ids if drafter is not None else ()
    cache = target.init_cache(b, target_capacity)
    hidden, features, cache = target.forward(target_params, prompt_tokens, cache, capture=capture,
                                             num_new=prompt_lengths)
    last = _gather_rows(hidden, prompt_lengths - 1)
    logits = target.logits(target_params, last)
    rng, key = jax.random.split(rng)
    if cfg.sampling:
        first = sampling.sample(key, _target_probs(cfg, params, logits))
    else:
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(prompt_tokens)
    tokens = _write_rows(tokens, first[:, None], prompt_lengths)
    draft_cache = None
    if drafter is not None:
        draft_cache = drafter.init_cache(b, draft_capacity)
        draft_cache = drafter.append_context(drafter_params, draft_cache, features, num_new=prompt_lengths)
    lengths = prompt_lengths + 1
    done = _finished(cfg, params, first[:, None], jnp.ones_like(lengths), lengths, prompt_lengths)
    return DecodeState(tokens=tokens, lengths=lengths, prompt_lengths=prompt_lengths, done=done,
                       target_cache=cache, draft_cache=draft_cache, rng=rng,
                       cycles=jnp.zeros((b,), jnp.int32),
                       accepted=jnp.zeros((b, cfg.max_new_tokens), jnp.int32))


def _propose(target, drafter, cfg, target_params, drafter_params, anchors, draft_cache, key, params):
    """Draft tokens [B, G-1] and their distributions [B, G-1, V] (None when greedy)."""
    mask = jnp.full((anchors.shape[0], cfg.block_size - 1), drafter.config.mask_token_id, jnp.int32)
    block = jnp.concatenate([anchors[:, None], mask], axis=1)
    hidden = drafter.draft_hidden(drafter_params, target.embed(target_params, block), draft_cache)
    logits = target.logits(target_params, hidden[:, 1:])
    if cfg.sampling and cfg.acceptance == "exact":
        probs = _target_probs(cfg, params, logits)
        return sampling.sample(key, probs), probs
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), None


def cycle(target, drafter, cfg: GenerationConfig, target_params, drafter_params, state: DecodeState,
          params: SamplingParams) -> DecodeState:
    """One draft-verify-accept cycle for every row; finished rows do not change."""
    g = cfg.block_size
    rng, draft_key, accept_key = jax.random.split(state.rng, 3)
    anchors = _gather_rows(state.tokens, state.lengths - 1)
    if drafter is not None:
        drafts, draft_probs = _propose(target, drafter, cfg, target_params, drafter_params, anchors,
                                       state.draft_cache, draft_key, params)
    else:
        drafts, draft_probs = jnp.zeros((anchors.shape[0], 0), jnp.int32), None
    block = jnp.concatenate([anchors[:, None], drafts], axis=1)  # [B, G]
    capture = drafter.config.target_layer_ids if drafter is not None else ()
    hidden, features, target_cache = target.forward(target_params, block, state.target_cache,
                                                    capture=capture)
    logits = target.logits(target_params, hidden)  # [B, G, V]
    if not cfg.sampling:
        num_accepted, next_token = sampling.accept_greedy(drafts, logits)
    elif cfg.acceptance == "match" or drafter is None:
        num_accepted, next_token = sampling.accept_match(accept_key, drafts, _target_probs(cfg, params, logits))
    else:
        num_accepted, next_token = sampling.accept_exact(accept_key, drafts, draft_probs,
                                                         _target_probs(cfg, params, logits))
    live = ~state.done
    num_emitted = jnp.where(live, num_accepted + 1, 0)
    slot = jnp.arange(g)[None, :]
    shifted = jnp.concatenate([drafts, jnp.zeros_like(anchors[:, None])], axis=1)  # drafts[i] at slot i
    emitted = jnp.where(slot < num_accepted[:, None], shifted, next_token[:, None])
    tokens = _write_rows(state.tokens, emitted, state.lengths)
    tokens = jnp.where(live[:, None], tokens, state.tokens)
    lengths = state.lengths + num_emitted
    # The target cache keeps anchor + accepted drafts; the draft cache gains their features.
    target_cache = target_cache.with_lengths(state.target_cache.lengths + num_emitted)
    draft_cache = state.draft_cache
    if drafter is not None:
        draft_cache = drafter.append_context(drafter_params, draft_cache, features, num_new=num_emitted)
    done = state.done | _finished(cfg, params, emitted, num_emitted, lengths, state.prompt_lengths)
    index = jnp.minimum(state.cycles, cfg.max_new_tokens - 1)
    accepted = state.accepted.at[jnp.arange(anchors.shape[0]), index].set(
        jnp.where(live, num_emitted, state.accepted[jnp.arange(anchors.shape[0]), index]))
    return state.replace(tokens=tokens, lengths=lengths, done=done, target_cache=target_cache,
                         draft_cache=draft_cache, rng=rng, cycles=state.cycles + live, accepted=accepted)


def decode(target, drafter, cfg, target_params, drafter_params, state, params) -> DecodeState:
    """Cycles until every row is done, in one while_loop."""
    return jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        lambda s: cycle(target, drafter, cfg, target_params, drafter_params, s, params),
        state)


# ----------------------------------------------------------------------------------------------
# Host side: validation, bucketing, ahead-of-time compilation, timing, results.


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per row, cut after the first stop token
    # Tokens emitted by each verify cycle (accepted + 1). As in the official code, the last cycle
    # of a row counts everything it accepted, even past a stop token or max_new_tokens.
    acceptance_lengths: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float  # 0.0 when the executables came from the cache
    block_size: int

    @property
    def num_cycles(self) -> list[int]:
        return [len(a) for a in self.acceptance_lengths]

    @property
    def tau(self) -> float:
        """Mean tokens per verify cycle over all rows (1.0 for autoregressive decoding)."""
        flat = [n for row in self.acceptance_lengths for n in row]
        return float(np.mean(flat)) if flat else 0.0

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of decode (prefill and compile excluded)."""
        return self.num_generated / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def histogram(self) -> np.ndarray:
        """counts[k] = number of cycles that emitted k tokens (k = 1 .. block_size)."""
        flat = np.asarray([n for row in self.acceptance_lengths for n in row], np.int64)
        return np.bincount(flat, minlength=self.block_size + 1)


_EXECUTABLES: dict = {}


def compile_cache_size() -> int:
    return len(_EXECUTABLES)


def _strip(model):
    """The model without its params: the traced functions take params as arguments and must not
    close over them (that would embed them as constants in the program)."""
    return None if model is None else dataclasses.replace(model, params=None)


def _model_key(model):
    return None if model is None else (model.config, jnp.dtype(model.dtype).name, model.attn_impl)


def _executables(target, drafter, cfg, args):
    """(prefill, decode, cycle) executables for this shape bucket, compiled once and cached."""
    target_params, drafter_params = args[0], args[1]
    leaves, treedef = jax.tree_util.tree_flatten(args)
    signature = (treedef, tuple((x.shape, jnp.dtype(x.dtype).name) for x in leaves))
    key = (_model_key(target), _model_key(drafter), cfg, signature)
    if key in _EXECUTABLES:
        return _EXECUTABLES[key], 0.0
    t, d = _strip(target), _strip(drafter)
    start = time.perf_counter()
    prefill_fn = jax.jit(lambda *a: prefill(t, d, cfg, *a)).lower(*args).compile()
    state = jax.eval_shape(lambda *a: prefill(t, d, cfg, *a), *args)
    params = args[-1]
    decode_fn = jax.jit(lambda tp, dp, s, p: decode(t, d, cfg, tp, dp, s, p), donate_argnums=2).lower(
        target_params, drafter_params, state, params).compile()
    cycle_fn = jax.jit(lambda tp, dp, s, p: cycle(t, d, cfg, tp, dp, s, p), donate_argnums=2)
    _EXECUTABLES[key] = (prefill_fn, decode_fn, cycle_fn)
    return _EXECUTABLES[key], time.perf_counter() - start


def _bucket(n: int) -> int:
    """Prompt-length bucket: the next power of two, at least 16."""
    return max(16, 1 << (n - 1).bit_length())


def _prepare(target, drafter, prompts, max_new_tokens, temperature, top_k, top_p, stop_token_ids,
             block_size, seed, acceptance):
    if drafter is not None:
        from dflash_jax.loading.drafter_io import validate_pair
        validate_pair(drafter.config, target)
    if isinstance(prompts, tuple) and len(prompts) == 2 and np.ndim(prompts[0]) == 2:
        array, lens = np.asarray(prompts[0]), np.asarray(prompts[1])
        if lens.shape != (array.shape[0],) or (lens > array.shape[1]).any():
            raise ValueError(f"lengths {lens.tolist()} do not fit prompt array of shape {array.shape}")
        rows = [list(array[i, :n]) for i, n in enumerate(lens)]
    else:
        rows = [list(np.asarray(p).reshape(-1)) for p in prompts]
    if not rows:
        raise ValueError("no prompts given")
    if any(len(r) == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    vocab = target.config.vocab_size
    if any(not 0 <= int(t) < vocab for r in rows for t in r):
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    longest = max(len(r) for r in rows)
    limit = target.config.max_position_embeddings
    if longest + max_new_tokens > limit:
        raise ValueError(f"prompt too long: {longest} prompt tokens + {max_new_tokens} new tokens exceed "
                         f"the target's max_position_embeddings ({limit})")
    if drafter is None:
        block_size = 1
    elif block_size is None:
        block_size = drafter.config.block_size
    elif block_size < 2:
        raise ValueError(f"block_size must be >= 2 with a drafter, got {block_size}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, block_size=block_size, sampling=temperature > 0,
                           top_k=top_k if temperature > 0 else 0,
                           use_top_p=temperature > 0 and top_p < 1.0, acceptance=acceptance)
    if stop_token_ids is None:
        stop_token_ids = list(target.config.eos_token_ids)
        eos = getattr(target.tokenizer, "eos_token_id", None)
        if eos is not None and eos not in stop_token_ids:
            stop_token_ids.append(eos)
    p = _bucket(longest)
    tokens = np.zeros((len(rows), p), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    lengths = np.asarray([len(r) for r in rows], np.int32)
    stops = [int(s) for s in stop_token_ids]
    padded_stops = np.full(max(8, -(-len(stops) // 8) * 8), -1, np.int32)  # fixed shape: no recompiles
    padded_stops[: len(stops)] = stops
    params = SamplingParams(temperature=jnp.float32(max(temperature, 1e-6)), top_p=jnp.float32(top_p),
                            stop_token_ids=jnp.asarray(padded_stops))
    drafter_params = drafter.params if drafter is not None else None
    args = (target.params, drafter_params, jnp.asarray(tokens), jnp.asarray(lengths),
            jax.random.PRNGKey(seed), params)
    return cfg, args, stops


def _cut(tokens: np.ndarray, start: int, end: int, max_new: int, stops: Sequence[int]) -> list[int]:
    out = [int(t) for t in tokens[start:end][:max_new]]
    for i, t in enumerate(out):
        if t in stops:
            return out[: i + 1]
    return out


def generate(target, drafter, prompts, *, max_new_tokens: int = 256, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, stop_token_ids: Sequence[int] | None = None,
             block_size: int | None = None, seed: int = 0, acceptance: str = "exact") -> GenerationResult:
    """Generate from a target, speculatively with a DFlash drafter (or plainly with drafter=None).

    prompts: a list of token-id lists (ragged), or a tuple (tokens [B, P], lengths [B]).
    temperature 0 = greedy (bit-identical to plain greedy decoding); otherwise sampling with
    top-k/top-p, lossless under `acceptance="exact"` (speculative sampling) or "match" (the
    official rule: the target's sample must equal the greedy draft). stop_token_ids defaults to
    the target's EOS ids; pass () to disable.
    """
    cfg, args, stops = _prepare(target, drafter, prompts, max_new_tokens, temperature, top_k, top_p,
                                stop_token_ids, block_size, seed, acceptance)
    (prefill_fn, decode_fn, _), compile_seconds = _executables(target, drafter, cfg, args)
    start = time.perf_counter()
    state = jax.block_until_ready(prefill_fn(*args))
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    state = jax.block_until_ready(decode_fn(args[0], args[1], state, args[-1]))
    decode_seconds = time.perf_counter() - start
    return _result(cfg, state, stops, prefill_seconds, decode_seconds, compile_seconds)


def _result(cfg, state, stops, prefill_seconds, decode_seconds, compile_seconds) -> GenerationResult:
    tokens, lengths, prompt_lengths, cycles, accepted = jax.device_get(
        (state.tokens, state.lengths, state.prompt_lengths, state.cycles, state.accepted))
    rows = [_cut(tokens[b], int(prompt_lengths[b]), int(lengths[b]), cfg.max_new_tokens, stops)
            for b in range(tokens.shape[0])]
    acceptance = [[int(n) for n in accepted[b, : cycles[b]]] for b in range(tokens.shape[0])]
    return GenerationResult(rows, acceptance, prefill_seconds, decode_seconds, compile_seconds,
                            cfg.block_size)


def generate_stream(target, drafter, prompts, *, max_new_tokens: int = 256, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, stop_token_ids: Sequence[int] | None = None,
                    block_size: int | None = None, seed: int = 0,
                    acceptance: str = "exact") -> Iterator[list[list[int]]]:
    """Like `generate`, but yields each row's newly committed tokens after prefill and after every
    cycle (a host loop over the same jitted cycle). Tokens past a stop token are never yielded."""
    cfg, args, stops = _prepare(target, drafter, prompts, max_new_tokens, temperature, top_k, top_p,
                                stop_token_ids, block_size, seed, acceptance)
    (prefill_fn, _, cycle_fn), _ = _executables(target, drafter, cfg, args)
    state = prefill_fn(*args)
    sent = [0] * state.tokens.shape[0]
    while True:
        tokens, lengths, prompt_lengths, done = jax.device_get(
            (state.tokens, state.lengths, state.prompt_lengths, state.done))
        new = []
        for b in range(tokens.shape[0]):
            row = _cut(tokens[b], int(prompt_lengths[b]), int(lengths[b]), cfg.max_new_tokens, stops)
            new.append(row[sent[b]:])
            sent[b] = len(row)
        yield new
        if done.all():
            return
        state = cycle_fn(args[0], args[1], state, args[-1])
