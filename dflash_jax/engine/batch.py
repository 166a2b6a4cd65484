"""The batch engine: many prompts through a fixed number of slots, with continuous batching.

    engine = Generator(target, drafter).engine(slots=8, max_prompt_tokens=1024, max_new_tokens=256)
    for index, result in engine.run(prompts):  # as each prompt completes
        ...
    results = engine.generate(prompts)  # in submission order

The decode state holds `slots` rows of one static capacity (the longest admissible prompt, the
generated tokens and one block), so one set of programs serves every prompt: the empty state, one
prefill program per chunk size (`admit`: the chunk sizes `generate`'s own prefill would use for the
prompt, at most five), and the decode loop (`decode_until`). Nothing recompiles for a new prompt length.

The host loop (`BatchEngine.run`): free slots take the next queued prompts; every prompt being
prefilled advances by one chunk (a long prompt costs the others at most a chunk between their
cycles); then the decode loop runs on the device until a row finishes while prompts wait (its slot
is refilled at once), or `cycles_per_chunk` cycles while a prompt is half prefilled, or
`max_cycles`. Finished rows are read back and their slots freed.

Each prompt's output is what `generate` gives it alone: greedy, the same tokens (a row is prefilled
as a batch of one in `generate`'s chunks, and decoded by the same cycle in a batch, as `generate`'s
own rows are: bit-identical in the tests, float32 on a CPU); sampling, the same distribution, drawn
with the prompt's own key (`seeds`, or the engine's seed folded with the prompt's index), so a
prompt's sample does not depend on its neighbours or its slot, unless `min_draft_probability`,
`verify_budget` or `verify_costs` is set: those decide what a cycle verifies for the whole batch
(the distribution stays exact; the sample then depends on the batch).

On a mesh (the Generator's) the programs are compiled with the params placed by the rules and the
state by `decode_loop.state_shardings` (rows over `data`, caches over `data` and `tensor`); the host
loop runs in one process (a multi-process mesh is `generate`'s).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import sharding
from dflash_jax.decode.loop import admit, cache_tile, decode_until, empty_state, round_up, state_shardings
from dflash_jax.engine.options import _configure, _cut, _fetch, _is_int, _prompt_rows, prompt_bucket, SamplingOptions
from dflash_jax.models.target import PREFILL_CHUNK

DEFAULT_MAX_CYCLES = 64  # cycles the decode loop may run before it returns to the host when nothing waits


@dataclasses.dataclass
class PromptResult:
    """One prompt's output from the batch engine."""

    index: int  # the prompt's position in the submitted list
    tokens: list[int]  # generated tokens, cut after the first stop token
    acceptance_lengths: list[int]  # tokens emitted by each verify cycle (accepted + 1)
    block_size: int
    error: str | None = None  # why the prompt was refused (too long for a slot); tokens are then empty

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tau(self) -> float:
        """Mean tokens per verify cycle (1.0 for autoregressive decoding; 0.0 without cycles)."""
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0


@dataclasses.dataclass
class EngineStats:
    """What the last `run` did: host round trips (`returns`: decode-loop calls), cycles (of the whole
    batch), tokens the target verified in them (slots x the verify width: every row is computed, live
    or not), prefill chunks, and where the time went: `prefill_seconds` and `decode_seconds` in those
    programs (including the reads that wait for them), `host_seconds` between device calls
    (bookkeeping, reading rows back), `compile_seconds` compiling; each apart from the others, and none
    counting the caller's time between the results `run` yields."""

    returns: int = 0
    cycles: int = 0
    verified_tokens: int = 0
    prefill_chunks: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    host_seconds: float = 0.0
    compile_seconds: float = 0.0
    generated_tokens: int = 0

    @property
    def device_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def verified_per_cycle(self) -> float:
        """Tokens the target verified per cycle, over the batch (slots x the verify width)."""
        return self.verified_tokens / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_second(self) -> float:
        seconds = self.device_seconds + self.host_seconds
        return self.generated_tokens / seconds if seconds > 0 else float("nan")

    @property
    def seconds_per_return(self) -> float:
        """Host time per round trip: what a return to the host costs beyond the device's work."""
        return self.host_seconds / self.returns if self.returns else 0.0


@dataclasses.dataclass
class _Slot:
    index: int  # the prompt's index
    tokens: list[int]
    key: jax.Array
    filled: int = 0  # prompt tokens prefilled so far
    chunk: int = 0  # chunk size of its prefill

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.tokens)


class BatchEngine:
    """A fixed number of decode slots fed from a queue of prompts (module docstring). Made by
    `Generator.engine`; holds the sampling options of every prompt it runs, and compiles through
    its Generator (whose executable cache keeps the programs)."""

    def __init__(self, generator, *, slots: int = 8, max_prompt_tokens: int = 1024,
                 options: SamplingOptions | None = None, cycles_per_chunk: int = 1,
                 max_cycles: int = DEFAULT_MAX_CYCLES):
        if not _is_int(slots) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        if not _is_int(max_prompt_tokens) or max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be an int >= 1, got {max_prompt_tokens!r}")
        for name, value in (("cycles_per_chunk", cycles_per_chunk), ("max_cycles", max_cycles)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.generator = generator
        self.options = SamplingOptions() if options is None else options
        target, drafter = generator.target, generator.drafter
        self.config, self._params, self.stop_token_ids = _configure(target, drafter, self.options)
        limit = target.config.max_position_embeddings
        self.max_prompt_tokens = min(max_prompt_tokens, limit - self.options.max_new_tokens)
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_new_tokens {self.options.max_new_tokens} leaves no room for a prompt in the "
                             f"target's max_position_embeddings ({limit})")
        self.slots = slots
        self.capacity = round_up(prompt_bucket(self.max_prompt_tokens) + self.config.max_new_tokens
                                 + self.config.block_size, cache_tile())
        self.cycles_per_chunk, self.max_cycles = cycles_per_chunk, max_cycles
        self.stats = EngineStats()
        self._state_sharding = None

    # programs ---------------------------------------------------------------------------------

    def _program(self, name: str, fn, *args, donate: int | None = None, state_out: bool = True):
        """The compiled `fn` for these argument shapes (held by the Generator), and the seconds spent
        compiling it (0.0 when it was held). On the Generator's mesh: the params placed by the rules,
        the state by `state_shardings` (in and out), every other argument replicated."""
        leaves, treedef = jax.tree_util.tree_flatten(args)
        signature = (treedef, tuple((x.shape, jnp.dtype(x.dtype).name) for x in leaves))
        key = ("engine", name, *self.generator.specs, self.config, self.slots, self.capacity, signature)
        mesh = self.generator.mesh
        if mesh is None:
            jitted = jax.jit(fn) if donate is None else jax.jit(fn, donate_argnums=donate)
        else:
            g, replicated = self.generator, sharding.replicated(mesh)
            state = self._state_shardings()
            inputs = [jax.tree_util.tree_map(lambda _: replicated, a) for a in args]
            if args:  # (target params, drafter params, state, ...)
                inputs[:3] = [g._target_shardings, g._drafter_shardings, state]
            out = state if state_out else (state, replicated)
            jitted = jax.jit(fn, in_shardings=tuple(inputs), out_shardings=out,
                             **({} if donate is None else {"donate_argnums": donate}))
        return self.generator._compiled_executable(key, lambda: jitted.lower(*args).compile())

    def _state_shardings(self):
        """The decode state's shardings on the Generator's mesh (`state_shardings`)."""
        if self._state_sharding is None:
            shapes = jax.eval_shape(lambda: empty_state(*self._static(), self.slots, self.capacity))
            self._state_sharding = state_shardings(self.generator.mesh, shapes)
        return self._state_sharding

    def _static(self):
        return (*self.generator.specs, self.config)

    def _empty(self):
        fn = lambda: empty_state(*self._static(), self.slots, self.capacity)  # noqa: E731
        program, seconds = self._program("empty", fn)
        self.stats.compile_seconds += seconds
        return program()

    def _admit(self, state, slot: int, chunk: np.ndarray, start: int, count: int, length: int, key):
        g = self.generator
        args = (g._target_params, g._drafter_params, state, jnp.int32(slot), jnp.asarray(chunk, jnp.int32),
                jnp.int32(start), jnp.int32(count), jnp.int32(length), key, self._params)
        program, seconds = self._program(f"admit{chunk.shape[0]}", functools.partial(admit, *self._static()), *args,
                                         donate=2)
        self.stats.compile_seconds += seconds
        self.stats.prefill_chunks += 1
        return program(*args)

    def _decode(self, state, max_cycles: int, refill: bool):
        g = self.generator
        args = (g._target_params, g._drafter_params, state, self._params, jnp.int32(max_cycles), jnp.bool_(refill))
        program, seconds = self._program("decode", functools.partial(decode_until, *self._static()), *args,
                                         donate=2, state_out=False)
        self.stats.compile_seconds += seconds
        return program(*args)

    @property
    def compiled_programs(self) -> int:
        """Programs of this engine's shapes the Generator holds (the empty state, one prefill per
        chunk size used, the decode loop)."""
        prefix = ("engine",)
        tail = (*self.generator.specs, self.config, self.slots, self.capacity)
        return sum(1 for key in self.generator._compiled
                   if key[:1] == prefix and key[2:2 + len(tail)] == tail)

    # the host loop ----------------------------------------------------------------------------

    def _keys(self, count: int, seeds):
        if seeds is None:
            base = jax.random.PRNGKey(self.options.seed)
            return [jax.random.fold_in(base, i) for i in range(count)]
        seeds = list(seeds)
        if len(seeds) != count:
            raise ValueError(f"seeds: {len(seeds)} seeds for {count} prompts")
        for i, seed in enumerate(seeds):
            if not _is_int(seed):
                raise TypeError(f"seeds[{i}] must be an int, got {seed!r}")
        return [jax.random.PRNGKey(seed) for seed in seeds]

    def _refusal(self, tokens: list[int]) -> str | None:
        if len(tokens) > self.max_prompt_tokens:
            return (f"prompt too long: {len(tokens)} tokens, a slot holds at most {self.max_prompt_tokens} "
                    f"(max_prompt_tokens, and the target's max_position_embeddings less max_new_tokens)")
        return None

    def generate(self, prompts, seeds: Sequence[int] | None = None) -> list[PromptResult]:
        """Every prompt's result, in submission order (see `run`)."""
        results = dict(self.run(prompts, seeds))
        return [results[i] for i in range(len(results))]

    def run(self, prompts, seeds: Sequence[int] | None = None) -> Iterator[tuple[int, PromptResult]]:
        """Generate for every prompt (a list of token-id lists), yielding (index, PromptResult) as
        each completes. seeds: one int per prompt (its sample depends on its own seed alone); None:
        the options' seed folded with the prompt's index. A prompt longer than a slot holds is
        refused alone (its result carries `error`); bad prompts (empty, ids outside the vocabulary)
        raise before anything runs."""
        target = self.generator.target
        rows = _prompt_rows(prompts, target.config.vocab_size)
        keys = self._keys(len(rows), seeds)
        self.stats = EngineStats()
        queue = collections.deque()
        for i, tokens in enumerate(rows):
            refusal = self._refusal(tokens)
            if refusal is not None:
                yield i, PromptResult(i, [], [], self.config.block_size, refusal)
            else:
                queue.append(i)
        if not queue:
            return
        clock = time.perf_counter()
        compiled = self.stats.compile_seconds
        state = self._empty()
        slots: list[_Slot | None] = [None] * self.slots
        while queue or any(s is not None for s in slots):
            for b in range(self.slots):
                if slots[b] is None and queue:
                    i = queue.popleft()
                    chunk = min(prompt_bucket(len(rows[i])), PREFILL_CHUNK)
                    slots[b] = _Slot(i, rows[i], keys[i], chunk=chunk)
            clock, compiled = self._account("host_seconds", clock, compiled)
            prefilling = [b for b, slot in enumerate(slots) if slot is not None and slot.prefilling]
            for b in prefilling:
                state = self._prefill_chunk(state, b, slots[b])
            if prefilling:
                jax.block_until_ready(state.lengths)
                clock, compiled = self._account("prefill_seconds", clock, compiled)
            decoding = [b for b, s in enumerate(slots) if s is not None and not s.prefilling]
            ran = jnp.zeros((), jnp.int32)
            if decoding:
                waiting = any(s is not None and s.prefilling for s in slots)
                state, ran = self._decode(state, self.cycles_per_chunk if waiting else self.max_cycles, bool(queue))
                self.stats.returns += 1
            done, ran, verified = _fetch((state.done, ran, state.verified))
            self.stats.cycles += int(ran)
            self.stats.verified_tokens = int(verified)
            clock, compiled = self._account("decode_seconds", clock, compiled)
            finished = [b for b in decoding if done[b]]
            for b, result in self._read(state, finished, slots):
                slots[b] = None
                self.stats.generated_tokens += len(result.tokens)
                clock, compiled = self._account("host_seconds", clock, compiled)
                yield result.index, result
                clock = time.perf_counter()  # the caller's time between results is not the engine's
        self._account("host_seconds", clock, compiled)

    def _account(self, field: str, since: float, compiled: float) -> tuple[float, float]:
        """Add the time since `since`, less what was spent compiling since then, to stats.<field>; ->
        (now, the compile seconds so far)."""
        now = time.perf_counter()
        spent = now - since - (self.stats.compile_seconds - compiled)
        setattr(self.stats, field, getattr(self.stats, field) + max(spent, 0.0))
        return now, self.stats.compile_seconds

    def _prefill_chunk(self, state, b: int, slot: _Slot):
        start = slot.filled
        count = min(slot.chunk, len(slot.tokens) - start)
        chunk = np.zeros(slot.chunk, np.int32)
        chunk[:count] = slot.tokens[start:start + count]
        state = self._admit(state, b, chunk, start, count, len(slot.tokens), slot.key)
        slot.filled += count
        return state

    def _read(self, state, finished: list[int], slots):
        if not finished:
            return
        # whole arrays (slots x capacity int32: small beside a cache), not rows gathered on the device: an
        # eager gather compiles once per count of finished rows
        tokens, lengths, prompt_lengths, cycles, emitted = (x[finished] for x in _fetch(
            (state.tokens, state.lengths, state.prompt_lengths, state.cycles, state.emitted_per_cycle)))
        for j, b in enumerate(finished):
            generated = _cut(tokens[j], int(prompt_lengths[j]), int(lengths[j]), self.options.max_new_tokens,
                             self.stop_token_ids)
            accepted = [int(n) for n in emitted[j, : cycles[j]]]
            yield b, PromptResult(slots[b].index, generated, accepted, self.config.block_size)
