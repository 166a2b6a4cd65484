"""Checking what a generation call asks for (the host side of `generate`, `Generator` and the batch
engine): `SamplingOptions`, the prompts, every option, each error naming the argument at fault, and
what they become: the compiled `GenerationConfig` and the `SamplingParams` arrays (`_configure`), the
padded prompt batch (`_prepare`, `prompt_bucket`); and reading results back (`_fetch`, `_cut`).

Prompt buckets: prompts are right-padded to the next power of two from 16 up to 1024 tokens, and
beyond that to the next multiple of 1024 (`prompt_bucket`). A chat that grows to n tokens compiles
at most 7 + (n - 1024) / 1024 prompt shapes, and the padding beyond 1024 tokens stays under 1024.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers
import os
import sys
import warnings
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode.loop import ACCEPTANCE_RULES, GenerationConfig, new_tokens_bucket, round_up, SamplingParams
from dflash_jax.drafters import generations
from dflash_jax.models.config import default_stop_token_ids

_SMALLEST_BUCKET, _LARGEST_POWER_BUCKET = 16, 1024
_STOP_ID_SLOTS = 8  # stop ids are padded to a multiple of this: few shapes, no recompiles


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """What one `generate` / `generate_stream` call (or `Generator.generate` / `stream`) asks for,
    besides its prompts and mesh: the public functions' keywords, with the same defaults (a test
    holds them equal), as one frozen value. Checked against the models by `_prepare`, which turns
    it into the compiled `GenerationConfig` and the `SamplingParams` arrays."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    stop_token_ids: int | Sequence[int] | None = None  # None: the target's EOS ids; (): never stop
    block_size: int | None = None  # None: the drafter's
    seed: int = 0
    acceptance: str = "exact"  # or "match"
    lookup: int = 0  # 0 = off; n >= 2: look-up drafts of up to n matched tokens
    min_draft_probability: float = 0.0  # 0 = verify every draft
    draft_context: int = 0  # 0 = the drafter sees the whole context; n > 0: each row's last n positions
    confidence_threshold: float = 0.0  # 0 = verify every draft; a DSpark drafter's confidence policy
    verify_budget: int = 0  # 0 = off; tokens verified per cycle over the batch
    verify_costs: Mapping[int, float] | None = None  # None = off; seconds of a cycle per verify width

    @classmethod
    def of_call(cls, arguments: dict) -> "SamplingOptions":
        """The options among a public function's arguments (its `locals()`), each by its name."""
        return cls(**{field.name: arguments[field.name] for field in dataclasses.fields(cls)})


def _as_options(options: SamplingOptions | None, keywords: dict) -> SamplingOptions:
    """`options`, or the options of these keywords (what the tests that drive `_prepare` pass)."""
    if options is None:
        return SamplingOptions(**keywords)
    if keywords:
        raise TypeError(f"pass options or keywords, not both: {sorted(keywords)}")
    return options


def prompt_bucket(n: int) -> int:
    """Padded prompt length for a longest prompt of n tokens: the next power of two (at least 16)
    up to 1024, then the next multiple of 1024."""
    if n <= _LARGEST_POWER_BUCKET:
        return max(_SMALLEST_BUCKET, 1 << (n - 1).bit_length())
    return round_up(n, _LARGEST_POWER_BUCKET)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_int(name: str, value, low: int | None = None, high: int | None = None) -> None:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _check_number(name: str, value, rule: str, ok) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value}")


def check_models(target, drafter) -> None:
    """TypeError naming the argument and the fix where `target` is not a loaded target or `drafter`
    not a loaded drafter (None: plain decoding): a path given for either, the two swapped, a target
    where the drafter belongs. Models are told apart by their configs (`ModelConfig`,
    `DrafterConfig`), so specs and loaded models both pass."""
    from dflash_jax.drafters.config import DrafterConfig
    from dflash_jax.models.config import ModelConfig

    def kind(model) -> str | None:
        config = getattr(model, "config", None)
        return "target" if isinstance(config, ModelConfig) else "drafter" if isinstance(config, DrafterConfig) else None

    if kind(target) == "drafter" and (drafter is None or kind(drafter) == "target"):
        raise TypeError("target and drafter are swapped: the target comes first, generate(target, drafter, "
                        "prompts) (drafter=None decodes plainly)")
    if kind(target) != "target":
        if isinstance(target, (str, bytes, os.PathLike)):
            raise TypeError(f"target must be a loaded target, not a path ({target!r}): load it first, "
                            "target = dflash_jax.load_target(path)")
        raise TypeError(f"target must be a loaded target (dflash_jax.load_target), got {type(target).__name__}")
    if drafter is not None and kind(drafter) != "drafter":
        if isinstance(drafter, (str, bytes, os.PathLike)):
            raise TypeError(f"drafter must be a loaded drafter, not a path ({drafter!r}): load it first, "
                            "drafter = dflash_jax.load_drafter(path, target=target)")
        if kind(drafter) == "target":
            raise TypeError("drafter is a target: pass the DFlash drafter second (dflash_jax.load_drafter), or "
                            "drafter=None for plain decoding")
        raise TypeError(f"drafter must be a loaded drafter (dflash_jax.load_drafter) or None, got "
                        f"{type(drafter).__name__}")


def _prompt_rows(prompts, vocab: int) -> list[list[int]]:
    """prompts (a list of token-id lists, or (tokens [B, P], lengths [B])) -> ragged rows."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be token ids, not text: encode the text with the target's tokenizer "
                        "(ids = target.tokenizer.encode(text)) and pass [ids]")
    if isinstance(prompts, tuple) and len(prompts) == 2 and np.ndim(prompts[0]) == 2:
        array, lens = np.asarray(prompts[0]), np.asarray(prompts[1])
        if lens.shape != (array.shape[0],) or (lens > array.shape[1]).any():
            raise ValueError(f"prompts: lengths {lens.tolist()} do not fit the prompt array of shape "
                             f"{array.shape}")
        rows = [array[i, :n] for i, n in enumerate(lens)]
    else:
        if not isinstance(prompts, collections.abc.Iterable):
            raise TypeError(f"prompts must be a list of prompts, each a list of token ids; got "
                            f"{type(prompts).__name__}")
        rows = list(prompts)
        for i, row in enumerate(rows):
            if isinstance(row, (str, bytes)):
                raise TypeError(f"prompts[{i}] is text ({row!r:.40}): prompts are token ids; encode it with the "
                                "target's tokenizer (target.tokenizer.encode(text)) and pass the ids")
        if any(np.ndim(r) == 0 for r in rows):
            shown = ", ".join(str(r) for r in rows[:3]) + (", ..." if len(rows) > 3 else "")
            raise ValueError(f"prompts must be a list of prompts, each a list of token ids; got a flat "
                             f"list of {len(rows)} values. For one prompt pass [[{shown}]]")
        rows = [np.asarray(r) for r in rows]
    if not rows:
        raise ValueError("prompts: no prompts given")
    for i, row in enumerate(rows):
        if row.ndim != 1:
            raise ValueError(f"prompts[{i}] must be a flat list of token ids, got shape {row.shape}")
        if row.size == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        if row.dtype.kind not in "iu":
            raise TypeError(f"prompts[{i}] must hold integer token ids, got dtype {row.dtype}")
        outside = row[(row < 0) | (row >= vocab)]
        if outside.size:
            raise ValueError(f"prompts[{i}]: token ids must lie in [0, {vocab}) (the target vocabulary), "
                             f"got {int(outside[0])}")
    return [[int(t) for t in row] for row in rows]


def _stop_ids(target, stop_token_ids) -> list[int]:
    """None: the target's EOS ids (and the tokenizer's); an int: that one id; else a sequence."""
    if stop_token_ids is None:
        return default_stop_token_ids(target.config, target.tokenizer)
    if _is_int(stop_token_ids):
        stop_token_ids = [stop_token_ids]
    if isinstance(stop_token_ids, (str, bytes)) or not all(_is_int(s) for s in stop_token_ids):
        raise TypeError(f"stop_token_ids must be token ids (ints), got {stop_token_ids!r}")
    vocab = target.config.vocab_size
    outside = [int(s) for s in stop_token_ids if not 0 <= s < vocab]
    if outside:
        raise ValueError(f"stop_token_ids must lie in [0, {vocab}) (the target vocabulary), got {outside}")
    return [int(s) for s in stop_token_ids]


def _caller_level() -> int:
    """The `stacklevel` that makes a warning issued by this function's caller point at the first line
    outside this package (the user's call), however deep the package's own calls are."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _block_size(drafter, block_size) -> int:
    """The tokens one cycle verifies (the anchor and its drafts): the drafter's block size, or for a
    DSpark drafter (whose anchor slot proposes too) one more."""
    if drafter is None:
        return 1  # autoregressive: the block is the anchor alone
    trained = drafter.config.proposals + 1
    if block_size is None:
        return trained
    _check_int("block_size", block_size, 2)
    if block_size > trained:
        warnings.warn(f"block_size {block_size} is larger than the block size the drafter was trained "
                      f"for ({trained}): the extra slots are rarely accepted",
                      stacklevel=_caller_level())
    return block_size


def _prepare(target, drafter, prompts, options: SamplingOptions | None = None, **keywords):
    """Check the prompts and every option (a `SamplingOptions`, or its fields as keywords) but the
    pair itself (`Generator.bind` checks it) -> (GenerationConfig, the executables' inputs after the
    params: prompt tokens, prompt lengths, rng, sampling params; stop ids)."""
    o = _as_options(options, keywords)
    cfg, params, stops = _configure(target, drafter, o)
    rows = _prompt_rows(prompts, target.config.vocab_size)
    longest = max(len(r) for r in rows)
    limit = target.config.max_position_embeddings
    if longest + o.max_new_tokens > limit:
        raise ValueError(f"prompt too long: {longest} prompt tokens + max_new_tokens {o.max_new_tokens} "
                         f"exceed the target's max_position_embeddings ({limit})")
    tokens = np.zeros((len(rows), prompt_bucket(longest)), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    lengths = np.asarray([len(r) for r in rows], np.int32)
    inputs = (jnp.asarray(tokens), jnp.asarray(lengths), jax.random.PRNGKey(o.seed), params)
    return cfg, inputs, stops


def _configure(target, drafter, o: SamplingOptions):
    """Check every option but the prompts -> (GenerationConfig, SamplingParams, stop ids)."""
    vocab = target.config.vocab_size
    _check_int("max_new_tokens", o.max_new_tokens, 1)
    _check_number("temperature", o.temperature, "a finite number >= 0 (0 = greedy)", lambda t: t >= 0)
    _check_int("top_k", o.top_k, 0)
    if o.top_k > vocab:
        raise ValueError(f"top_k ({o.top_k}) is larger than the target vocabulary ({vocab} tokens); "
                         f"use 0 to turn top-k off")
    _check_number("top_p", o.top_p, "in (0, 1]", lambda p: 0 < p <= 1)
    _check_int("seed", o.seed)
    if o.acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {o.acceptance!r}")
    _check_int("lookup", o.lookup, 0)
    if o.lookup == 1:
        raise ValueError("lookup must be 0 (off) or >= 2 (the longest run of tokens to match), got 1")
    if o.lookup and drafter is None:
        raise ValueError("lookup fills a drafter's slots; it needs a drafter (got drafter=None)")
    _check_number("min_draft_probability", o.min_draft_probability, "in [0, 1] (0 = verify every draft)",
                  lambda p: 0 <= p <= 1)
    if o.min_draft_probability and drafter is None:
        raise ValueError("min_draft_probability gates a drafter's drafts; it needs a drafter (got drafter=None)")
    _check_int("draft_context", o.draft_context, 0)
    _check_number("confidence_threshold", o.confidence_threshold, "in [0, 1] (0 = verify every draft)",
                  lambda c: 0 <= c <= 1)
    confidence = drafter is not None and generations.of(drafter.config).accepts_confidence_threshold(drafter.config)
    if o.confidence_threshold and not confidence:
        raise ValueError("confidence_threshold needs a DSpark drafter with a confidence head (enable_confidence_head); "
                         f"this {'generation has no drafter' if drafter is None else 'drafter has none'}")
    block_size = _block_size(drafter, o.block_size)
    widths, policy, costs = _verify_options(drafter, o, block_size)
    stops = _stop_ids(target, o.stop_token_ids)
    sampled = o.temperature > 0
    cfg = GenerationConfig(max_new_tokens=new_tokens_bucket(o.max_new_tokens), block_size=block_size, sampling=sampled,
                           top_k=o.top_k if sampled else 0, use_top_p=sampled and o.top_p < 1.0,
                           acceptance=o.acceptance, lookup=o.lookup, gate_drafts=o.min_draft_probability > 0,
                           draft_context=o.draft_context if drafter is not None else 0, verify_widths=widths,
                           verify_policy=policy)
    padded_stops = np.full(max(_STOP_ID_SLOTS, round_up(len(stops), _STOP_ID_SLOTS)), -1, np.int32)
    padded_stops[: len(stops)] = stops
    params = SamplingParams(temperature=jnp.float32(max(o.temperature, 1e-6)), top_p=jnp.float32(o.top_p),
                            stop_token_ids=jnp.asarray(padded_stops),
                            min_draft_probability=jnp.float32(o.min_draft_probability),
                            confidence_threshold=jnp.float32(o.confidence_threshold) if confidence else None,
                            verify_budget=jnp.int32(o.verify_budget) if o.verify_budget else None,
                            verify_costs=None if costs is None else jnp.asarray(costs, jnp.float32),
                            max_new_tokens=jnp.int32(o.max_new_tokens))
    return cfg, params, stops


def verify_widths_for(block_size: int) -> tuple[int, ...]:
    """The widths a cycle under a verify budget chooses from: 1, 2, 4, ... below the block, and the block."""
    return tuple(sorted({1 << i for i in range(block_size.bit_length()) if 1 << i < block_size} | {block_size}))


def _verify_options(drafter, o: SamplingOptions, block_size: int):
    """verify_budget / verify_costs -> (GenerationConfig.verify_widths, verify_policy, the costs per width)."""
    _check_int("verify_budget", o.verify_budget, 0)
    if not o.verify_budget and o.verify_costs is None:
        return (), "", None
    if drafter is None:
        raise ValueError("verify_budget / verify_costs choose how many drafts a cycle verifies; they need a drafter "
                         "(got drafter=None)")
    if o.min_draft_probability:
        raise ValueError("min_draft_probability and verify_budget / verify_costs both choose what a cycle verifies: "
                         "pass one")
    if o.verify_costs is None:
        return verify_widths_for(block_size), "budget", None
    if not isinstance(o.verify_costs, Mapping) or not o.verify_costs:
        raise TypeError(f"verify_costs must be a non-empty mapping of verify width -> seconds per cycle, got "
                        f"{o.verify_costs!r}")
    for width, seconds in o.verify_costs.items():
        _check_int("verify_costs: a width", width, 1, block_size)
        _check_number(f"verify_costs[{width}]", seconds, "a number > 0 (seconds)", lambda c: c > 0)
    widths = tuple(sorted(o.verify_costs))
    return widths, "costs", [float(o.verify_costs[w]) for w in widths]


def _cut(tokens: np.ndarray, start: int, end: int, max_new: int, stops: Sequence[int]) -> list[int]:
    out = [int(t) for t in tokens[start:end][:max_new]]
    for i, t in enumerate(out):
        if t in stops:
            return out[: i + 1]
    return out


def _fetch(tree):
    """Device arrays -> numpy on this host; arrays spread over several processes are gathered
    from all of them first (every process of a multi-host mesh calls this alike)."""
    if any(not x.is_fully_addressable for x in jax.tree_util.tree_leaves(tree)):
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)
