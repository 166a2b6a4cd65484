"""Generation from Python: `Generator`, `generate`, `generate_stream` and their results (the host side).

The device side (decode state, prefill, the speculative cycle, the `lax.while_loop`) lives in
`dflash_jax.decode.loop`. Here: checking every argument (each error names it), padding prompts to a
few length buckets, compiling the executables ahead of time once per shape (compile time is reported
apart), timing, and turning the final state into a result.

A `Generator` holds a target and a drafter with the params its backend decodes with (derived once:
on a CPU the packed layout, `backends.cpu`) and the executables it compiled, the most recent
`max_compiled` of them. `generate` and `generate_stream` use one Generator per pair of specs
(`generator_for`): a model with the same spec and other weights reuses its executables, since
weights enter them as arguments. That registry keeps the two most recently used, with their decode
params (on a CPU a packed copy of the weights) and executables; `release_generators()` drops them.

The options of one call (every keyword of `generate` but the mesh) travel as one frozen value,
`SamplingOptions`, from the public functions through the checks (`_prepare`) to the compiled
`GenerationConfig` and the `SamplingParams` arrays.

Prompt buckets: prompts are right-padded to the next power of two from 16 up to 1024 tokens, and
beyond that to the next multiple of 1024 (`prompt_bucket`). A chat that grows to n tokens compiles
at most 7 + (n - 1024) / 1024 prompt shapes, and the padding beyond 1024 tokens stays under 1024.

On a mesh (`Generator(..., mesh=...)`, by default the target's `Target.mesh`): the XLA backend over
stacked params, each placed by `dflash_jax.sharding`'s rules; the prefill and the loop are compiled
with those in/out shardings (the prompts and the per-row state over `data` where the batch divides,
the caches over `data` and `tensor`), and XLA's partitioner adds the collectives. On a mesh over
several processes (`sharding.initialize_distributed`), every process calls `generate` alike;
process 0's prompts are broadcast to the others (which may pass None) and every process gets every
row back.
"""
from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import functools
import time
from typing import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import backends, sharding
from dflash_jax.decode.loop import cycle, decode, GenerationConfig, prefill, state_shardings
from dflash_jax.drafters.config import validate_pair
from dflash_jax.engine.text import IncrementalDetokenizer
from dflash_jax.engine.options import (  # noqa: F401 (prompt_bucket, _block_size, verify_widths_for: imported from here too)
    SamplingOptions,
    check_models,
    _as_options,
    _block_size,
    _cut,
    _fetch,
    _prepare,
    _prompt_rows,
    prompt_bucket,
    verify_widths_for,
)

MAX_COMPILED = 16  # compiled executables a Generator keeps by default (least recently used dropped first)
_DEFAULT_GENERATORS = 2  # the Generators `generate` keeps, one per pair of specs (least recently used dropped)


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per row, cut after the first stop token
    # Tokens emitted by each verify cycle (accepted + 1). As in the official code, the last cycle
    # of a row counts everything it accepted, even past a stop token or max_new_tokens.
    acceptance_lengths: list[list[int]]
    prefill_seconds: float  # the prompt pass, which also produces each row's first token
    decode_seconds: float  # the decode loop, which produces every token after the first
    compile_seconds: float  # 0.0 when the executables came from the cache
    block_size: int
    stop_token_ids: tuple[int, ...] = ()

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
        """All generated tokens, the prefill's first token of each row included."""
        return sum(len(t) for t in self.tokens)

    @property
    def num_decoded(self) -> int:
        """Tokens produced by the decode loop: every generated token but each row's first."""
        return sum(max(len(t) - 1, 0) for t in self.tokens)

    @property
    def decode_tokens_per_second(self) -> float:
        """Decode-loop tokens per second of decode: the speed to compare between decoders."""
        return self.num_decoded / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def tokens_per_second(self) -> float:
        """All generated tokens per second of prefill + decode (end to end, compile excluded)."""
        seconds = self.prefill_seconds + self.decode_seconds
        return self.num_generated / seconds if seconds > 0 else float("nan")

    def histogram(self) -> np.ndarray:
        """counts[k] = number of cycles that emitted k tokens (k = 1 .. block_size)."""
        flat = np.asarray([n for row in self.acceptance_lengths for n in row], np.int64)
        return np.bincount(flat, minlength=self.block_size + 1)

    def acceptance_counts(self) -> dict[int, int]:
        """{k: cycles that emitted k tokens} for k = 1 .. block_size, as the CLIs print it ("1:26 2:17")."""
        counts = self.histogram()
        return {k: int(counts[k]) for k in range(1, len(counts))}

    def __repr__(self) -> str:
        """The result in one line: rows, tokens per row, tau and its counts, decode speed (the tokens are
        `tokens`)."""
        lengths = [len(t) for t in self.tokens]
        shown = lengths if len(lengths) <= 8 else [*lengths[:8], "..."]
        return (f"GenerationResult({len(self.tokens)} rows, tokens {shown}, tau {self.tau:.2f}, acceptance "
                f"{self.acceptance_counts()}, decode {self.decode_tokens_per_second:.1f} tokens/s)")

    def text(self, tokenizer, row: int = 0) -> str:
        """The answer of `row` as text: without its closing stop token and special tokens."""
        ids = self.tokens[row]
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return tokenizer.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------
# generate and generate_stream


class GenerationStream:
    """What `generate_stream` returns: an iterator over each row's newly committed tokens
    (list[list[int]]), after prefill and after every cycle. `compile_seconds` is known at once
    (0.0 when the executables were held); prefill runs at the first `next()`. `tokens` holds each
    row's tokens streamed so far (a row's closing stop token included), and `text(tokenizer)`
    streams one row as the text a user prints.

        for piece in generator.stream([ids]).text(target.tokenizer):
            print(piece, end="", flush=True)
    """

    def __init__(self, chunks: Iterator[list[list[int]]], compile_seconds: float,
                 stop_token_ids: Sequence[int] = ()):
        self._chunks = chunks
        self.compile_seconds = compile_seconds
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.tokens: list[list[int]] = []

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> list[list[int]]:
        new = next(self._chunks)
        if not self.tokens:
            self.tokens = [[] for _ in new]
        for row, ids in zip(self.tokens, new):
            row.extend(ids)
        return new

    def text(self, tokenizer, row: int = 0) -> Iterator[str]:
        """Row `row`'s answer as text pieces, as the stream commits its tokens (consumes the stream):
        decoded incrementally, so a multi-byte character split over tokens comes whole; the stop
        token and special tokens left out (the ids stay in `tokens`)."""
        detok = IncrementalDetokenizer(tokenizer)
        stops = set(self.stop_token_ids)
        for new in self:
            piece = detok.push([t for t in new[row] if t not in stops])
            if piece:
                yield piece
        rest = detok.flush()
        if rest:
            yield rest


def _from_process_zero(prompts, vocab: int):
    """The prompts of process 0, on every process of a multi-process job: (tokens [B, P], lengths
    [B]) broadcast from process 0 (the other processes' `prompts` are not read: pass None there).
    Prompts that process 0 refuses raise on every process (its error there), so none is left
    waiting in the broadcast."""
    from jax.experimental import multihost_utils

    error, header = None, np.zeros(2, np.int32)
    if jax.process_index() == 0:
        try:
            rows = _prompt_rows(prompts, vocab)
            header = np.asarray([len(rows), max(len(r) for r in rows)], np.int32)
        except (TypeError, ValueError) as e:
            error, header = e, np.asarray([-1, 0], np.int32)
    header = np.asarray(multihost_utils.broadcast_one_to_all(header))
    if header[0] < 0:
        raise error if error is not None else ValueError("process 0's prompts were refused (its error says why)")
    tokens, lengths = np.zeros(tuple(int(n) for n in header), np.int32), np.zeros(int(header[0]), np.int32)
    if jax.process_index() == 0:
        for i, row in enumerate(rows):
            tokens[i, : len(row)], lengths[i] = row, len(row)
    tokens, lengths = multihost_utils.broadcast_one_to_all((tokens, lengths))
    return np.asarray(tokens), np.asarray(lengths)


def _stream_chunks(prefill_fn, cycle_fn, max_new_tokens: int, args, stops) -> Iterator[list[list[int]]]:
    state = prefill_fn(*args)
    sent = [0] * state.tokens.shape[0]
    while True:
        tokens, lengths, prompt_lengths, done = _fetch(
            (state.tokens, state.lengths, state.prompt_lengths, state.done))
        new = []
        for b in range(tokens.shape[0]):
            row = _cut(tokens[b], int(prompt_lengths[b]), int(lengths[b]), max_new_tokens, stops)
            new.append(row[sent[b]:])
            sent[b] = len(row)
        yield new
        if done.all():
            return
        state = cycle_fn(args[0], args[1], state, args[-1])


class Generator:
    """A target and a drafter (None: plain autoregressive decoding) ready to generate.

        generator = Generator(target, drafter)
        result = generator.generate([ids], max_new_tokens=256)
        for new_tokens in generator.stream([ids]): ...

    It owns what generation derives from the models: their params in the layout `backend` decodes
    with (`TargetSpec.decode_params`, `DrafterSpec.decode_params`; "auto": this process's,
    `backends.resolve`), made once here, and the executables it compiles, one prefill and one loop
    (or cycle) per argument shape, the `max_compiled` most recently used kept (None:
    `MAX_COMPILED`). Executables are keyed by the models' static specs, and params enter them as
    arguments: `bind` swaps in other models of the same specs without compiling again.

    mesh: a `jax.sharding.Mesh` (`dflash_jax.sharding.make_mesh`) to generate on; None: the
    target's (`Target.mesh`; None there too: one device). On a mesh the backend is "xla" (the CPU
    backend's packed kernels are custom calls XLA's partitioner cannot split), the params are
    placed by the rules (`sharding.place_params`: a no-op for models loaded with that mesh but for a
    hybrid's Gated DeltaNet channels, regrouped per tensor shard), the specs take the mesh's layout
    (`sharding.spec_for_mesh`: kv heads repeated where fewer than the tensor axis) and the
    executables are compiled with in/out shardings from the rules (`sharding`,
    `decode_loop.state_shardings`). Its `fsdp` axis must be 1: that axis shards training.
    """

    def __init__(self, target, drafter=None, *, backend: str = "auto", max_compiled: int | None = None,
                 mesh=None):
        check_models(target, drafter)
        mesh = target.mesh if mesh is None else mesh
        if mesh is not None:
            if backend not in ("auto", "xla"):
                raise ValueError(f"backend={backend!r} cannot run on a mesh: XLA's partitioner splits only "
                                 "the 'xla' backend's programs (use backend='auto' or 'xla')")
            if sharding.axis_size(mesh, "fsdp") > 1:
                raise ValueError(f"mesh: generation splits over 'data' and 'tensor'; its 'fsdp' axis (size "
                                 f"{sharding.axis_size(mesh, 'fsdp')}) shards training, make it 1")
            backend = "xla"
        self.mesh = mesh
        self.backend = backends.resolve(backend)
        self.max_compiled = max_compiled
        self._compiled: collections.OrderedDict = collections.OrderedDict()
        self.target = self.drafter = self._target_params = self._drafter_params = None
        self._target_shardings = self._drafter_shardings = None
        self.bind(target, drafter)

    def bind(self, target, drafter=None) -> "Generator":
        """Generate with these models from now on (of this Generator's specs once it has compiled
        anything); decode params are derived for params objects it does not hold already."""
        check_models(target, drafter)
        if drafter is not None:
            validate_pair(drafter.config, target)
        if self.target is not None and (target.spec, _spec(drafter)) != (self.target.spec, _spec(self.drafter)):
            raise ValueError("bind: these models' specs differ from the Generator's; make a new Generator")
        if self.target is None or target.params is not self.target.params:
            if self.mesh is not None and backends.of_target_params(target.params) != "xla":
                raise ValueError("target: its params are packed for a one-device CPU decode and cannot be "
                                 "sharded; load it with load_target(..., mesh=mesh) (or layout='stacked')")
            self._target_params, self._target_shardings = self._placed(
                target.spec.decode_params(target.params, self.backend), target.config)
        if drafter is None:
            self._drafter_params = self._drafter_shardings = None
        elif (self.drafter is None or drafter.params is not self.drafter.params
              or drafter.draft_head is not self.drafter.draft_head):
            self._drafter_params, self._drafter_shardings = self._placed(
                drafter.spec.decode_params(drafter.loop_params, self.backend), drafter.config)
        self.target, self.drafter = target, drafter
        return self

    def _placed(self, params, config):
        """(params on this Generator's mesh by the rules, their shardings); as they are, None, off
        a mesh."""
        if self.mesh is None:
            return params, None
        return sharding.place_params(self.mesh, params, config)

    def _input_shardings(self, inputs):
        """Shardings of (prompt tokens [B, P], prompt lengths [B], rng, sampling params) on the
        mesh: the prompts over `data` where it divides B, the rest replicated."""
        tokens, lengths, rng, params = inputs
        replicated = sharding.replicated(self.mesh)
        return (sharding.batch_sharding(self.mesh, tokens.shape), sharding.batch_sharding(self.mesh, lengths.shape),
                replicated, jax.tree_util.tree_map(lambda _: replicated, params))

    @property
    def specs(self):
        """(target spec, drafter spec or None): what the executables are compiled for (on a mesh,
        with the layout its tensor axis needs: `sharding.spec_for_mesh`)."""
        return sharding.spec_for_mesh(self.target.spec, self.mesh), sharding.spec_for_mesh(_spec(self.drafter),
                                                                                            self.mesh)

    @property
    def compile_cache_size(self) -> int:
        """Number of compiled executables held (at most `max_compiled`)."""
        return len(self._compiled)

    def generate(self, prompts, *, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, stop_token_ids: int | Sequence[int] | None = None,
                 block_size: int | None = None, seed: int = 0, acceptance: str = "exact", lookup: int = 0,
                 min_draft_probability: float = 0.0, draft_context: int = 0,
                 confidence_threshold: float = 0.0, verify_budget: int = 0,
                 verify_costs: Mapping[int, float] | None = None) -> GenerationResult:
        """Generate for `prompts` (see `generate` for every argument)."""
        return self._generate(prompts, SamplingOptions.of_call(locals()))

    def _generate(self, prompts, options: SamplingOptions) -> GenerationResult:
        cfg, args, stops = self._prepare(prompts, options)
        prefill_fn, decode_fn, compile_seconds = self._executables(cfg, args, "decode")
        start = time.perf_counter()
        state = jax.block_until_ready(prefill_fn(*args))
        prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        state = jax.block_until_ready(decode_fn(args[0], args[1], state, args[-1]))
        decode_seconds = time.perf_counter() - start
        tokens, lengths, prompt_lengths, cycles, emitted = _fetch(
            (state.tokens, state.lengths, state.prompt_lengths, state.cycles, state.emitted_per_cycle))
        rows = [_cut(tokens[b], int(prompt_lengths[b]), int(lengths[b]), options.max_new_tokens, stops)
                for b in range(tokens.shape[0])]
        acceptance_lengths = [[int(n) for n in emitted[b, : cycles[b]]] for b in range(tokens.shape[0])]
        return GenerationResult(rows, acceptance_lengths, prefill_seconds, decode_seconds, compile_seconds,
                                cfg.block_size, tuple(stops))

    def stream(self, prompts, *, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, stop_token_ids: int | Sequence[int] | None = None,
               block_size: int | None = None, seed: int = 0, acceptance: str = "exact", lookup: int = 0,
               min_draft_probability: float = 0.0, draft_context: int = 0,
               confidence_threshold: float = 0.0, verify_budget: int = 0,
               verify_costs: Mapping[int, float] | None = None) -> "GenerationStream":
        """Like `generate`, streaming (see `generate_stream`)."""
        return self._stream(prompts, SamplingOptions.of_call(locals()))

    def _stream(self, prompts, options: SamplingOptions) -> "GenerationStream":
        cfg, args, stops = self._prepare(prompts, options)
        prefill_fn, cycle_fn, compile_seconds = self._executables(cfg, args, "cycle")
        return GenerationStream(_stream_chunks(prefill_fn, cycle_fn, options.max_new_tokens, args, stops),
                                compile_seconds, stops)

    def engine(self, *, slots: int = 8, max_prompt_tokens: int = 1024, cycles_per_chunk: int = 1,
               max_cycles: int | None = None, **options):
        """A `BatchEngine` over this Generator's models: `slots` rows decoded together, refilled from a
        queue of prompts as rows finish (continuous batching; `dflash_jax.engine.batch`). options: the
        keywords of `generate` (max_new_tokens, temperature, ...), the same for every prompt it runs.
        max_prompt_tokens: the longest prompt a slot holds (longer ones are refused one by one)."""
        from dflash_jax.engine.batch import BatchEngine, DEFAULT_MAX_CYCLES

        return BatchEngine(self, slots=slots, max_prompt_tokens=max_prompt_tokens, options=SamplingOptions(**options),
                           cycles_per_chunk=cycles_per_chunk,
                           max_cycles=DEFAULT_MAX_CYCLES if max_cycles is None else max_cycles)

    def _prepare(self, prompts, options: SamplingOptions | None = None, **keywords):
        """Check every argument (`options`, or its fields as keywords) -> (GenerationConfig,
        executable args, stop ids); args = (target params, drafter params, prompt tokens, prompt
        lengths, rng, sampling params). On a mesh over several processes, process 0's prompts are
        the batch (`_from_process_zero`)."""
        options = _as_options(options, keywords)
        if self.mesh is not None and jax.process_count() > 1:
            prompts = _from_process_zero(prompts, self.target.config.vocab_size)
        cfg, inputs, stops = _prepare(self.target, self.drafter, prompts, options)
        if self.mesh is not None:  # the prompts scattered over `data`, the rest replicated
            inputs = jax.device_put(inputs, self._input_shardings(inputs))
        return cfg, (self._target_params, self._drafter_params, *inputs), stops

    def _compiled_executable(self, key, build):
        """(executable, seconds spent compiling it: 0.0 when it was held)."""
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key], 0.0
        start = time.perf_counter()
        # traced with the mesh in context: the attention seam splits the Pallas kernel over its heads
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            self._compiled[key] = build()
        while len(self._compiled) > (MAX_COMPILED if self.max_compiled is None else self.max_compiled):
            self._compiled.popitem(last=False)
        return self._compiled[key], time.perf_counter() - start

    def _executables(self, cfg: GenerationConfig, args, step: str):
        """(prefill, step, compile seconds) for these argument shapes; step "decode" is the whole
        loop (for `generate`), "cycle" one cycle (for `stream`)."""
        leaves, treedef = jax.tree_util.tree_flatten(args)
        signature = (treedef, tuple((x.shape, jnp.dtype(x.dtype).name) for x in leaves))
        static = (*self.specs, cfg)  # closed over by the traced functions
        key = (*static, signature)
        run_prefill = functools.partial(prefill, *static)
        run_step = functools.partial({"decode": decode, "cycle": cycle}[step], *static)
        mesh = self.mesh
        if mesh is None:
            prefill_jit = lambda: jax.jit(run_prefill)
        else:
            params_shardings = (self._target_shardings, self._drafter_shardings)
            input_shardings = (*params_shardings, *self._input_shardings(args[2:]))

            def run_prefill_on_mesh(*prefill_args):
                # the state's shardings from the rules, set where its shapes are known (this
                # trace), so the prefill is traced once
                state = run_prefill(*prefill_args)
                return jax.lax.with_sharding_constraint(state, state_shardings(mesh, state))

            prefill_jit = lambda: jax.jit(run_prefill_on_mesh, in_shardings=input_shardings)
        prefill_fn, prefill_seconds = self._compiled_executable(
            ("prefill", key), lambda: prefill_jit().lower(*args).compile())

        def build_step():
            # the prefill's output shapes from its executable: eval_shape would trace the whole
            # prefill a second time, a large part of this step's first compile
            state = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), prefill_fn.out_info)
            if mesh is None:
                step_jit = jax.jit(run_step, donate_argnums=2)
            else:
                state_sh = state_shardings(mesh, state)
                step_jit = jax.jit(run_step, donate_argnums=2, out_shardings=state_sh,
                                   in_shardings=(*params_shardings, state_sh, input_shardings[-1]))
            return step_jit.lower(args[0], args[1], state, args[-1]).compile()

        step_fn, step_seconds = self._compiled_executable((step, key), build_step)
        return prefill_fn, step_fn, prefill_seconds + step_seconds


def _spec(model):
    """The model's static, hashable description (None for no drafter)."""
    return None if model is None else model.spec


_GENERATORS: collections.OrderedDict = collections.OrderedDict()  # (specs, backend, mesh) -> Generator


def generator_for(target, drafter=None, mesh=None) -> Generator:
    """The Generator `generate` and `generate_stream` use for these models: one per pair of specs
    on this process's backend and a mesh (None: the target's; the `_DEFAULT_GENERATORS` most
    recently used kept, until `release_generators`), bound to them."""
    check_models(target, drafter)
    mesh = target.mesh if mesh is None else mesh
    key = (target.spec, _spec(drafter), backends.resolve() if mesh is None else "xla", mesh)
    if key in _GENERATORS:
        _GENERATORS.move_to_end(key)
        return _GENERATORS[key].bind(target, drafter)
    generator = Generator(target, drafter, mesh=mesh)
    _GENERATORS[key] = generator
    while len(_GENERATORS) > _DEFAULT_GENERATORS:
        _GENERATORS.popitem(last=False)
    return generator


def release_generators() -> int:
    """Drop the Generators `generate` and `generate_stream` keep (`generator_for`): their decode
    params (on a CPU a packed copy of the target's weights) and compiled executables are freed once
    nothing else holds them. The next call builds and compiles again. -> how many were dropped.
    A `Generator` you made yourself is yours: drop your reference to free it."""
    count = len(_GENERATORS)
    _GENERATORS.clear()
    return count


def generate(target, drafter, prompts, *, max_new_tokens: int = 256, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, stop_token_ids: int | Sequence[int] | None = None,
             block_size: int | None = None, seed: int = 0, acceptance: str = "exact",
             lookup: int = 0, min_draft_probability: float = 0.0, draft_context: int = 0,
             confidence_threshold: float = 0.0, verify_budget: int = 0,
             verify_costs: Mapping[int, float] | None = None, mesh=None) -> GenerationResult:
    """Generate from a target, speculatively with a DFlash drafter (or plainly with drafter=None).

    prompts: a list of prompts, each a list of token ids (ragged; one prompt is `[ids]`), or a
    tuple (tokens [B, P], lengths [B]); on a mesh over several processes, process 0's (the others
    may pass None). temperature 0 = greedy (bit-identical to plain greedy
    decoding); otherwise sampling with top-k (0 = off, at most the vocabulary size) and top-p
    (1 = off), lossless under `acceptance="exact"` (speculative sampling) or "match" (the official
    rule: the target's sample must equal the greedy draft). stop_token_ids: one id or a sequence;
    None = the target's EOS ids; () disables stopping. block_size defaults to the drafter's
    (larger than that warns). lookup (0 = off): n >= 2 drafts, where a row's last 2..n tokens
    occurred earlier in it, the tokens that followed them instead of the drafter's
    (`dflash_jax.decode.lookup`; still lossless). min_draft_probability (0 = off): a cycle verifies its
    drafts only where, for some live row, the drafter's first slot gives its most likely token at
    least this probability (a greedy first draft's own; 1 for a looked-up one), else it runs the
    anchor alone, an autoregressive step (still lossless: the choice looks neither at the target nor
    at a sampled draft). draft_context (0 = off): the drafter sees only each row's
    last draft_context positions (its context cache a ring buffer of that size: bounded memory and
    cost for long contexts; the authors' MLX backend offers the same; still lossless).
    confidence_threshold (0 = off; a DSpark drafter with a confidence head only): each row verifies
    its drafts up to the first whose confidence is below it (the rest of the static block is
    masked, never recompiled: the value is an argument; still lossless). verify_costs (None = off):
    {verify width: seconds of a cycle at that width} for this batch and device (`infer.benchmark
    --profile-verify` measures them): each cycle verifies the width (a prefix of the block, the same
    for every row: static shapes) with the most expected tokens per second, from the drafter's
    confidence in each slot. verify_budget (0 = off): the most tokens a cycle verifies over the batch
    (rows x width; with verify_costs, among the widths it allows; alone, the widest it allows of 1, 2,
    4, ..., G). Both lossless whatever they choose (`decode.loop._verify_plan`). A DSpark drafter's block
    of G slots proposes G tokens, so its default block_size (tokens verified per cycle) is G + 1. mesh: a
    `jax.sharding.Mesh` to generate on (None: the
    target's, `Target.mesh`; see `Generator`). Bad arguments raise TypeError/ValueError naming the
    argument. The Generator it uses is kept for the next call with models of the same specs (the two
    most recent pairs); `release_generators()` frees what they hold. Its programs are compiled per
    prompt bucket (`prompt_bucket`) and per 64 of max_new_tokens: calls asking for 1 to 64 new tokens
    share one.
    """
    return generator_for(target, drafter, mesh)._generate(prompts, SamplingOptions.of_call(locals()))


def generate_stream(target, drafter, prompts, *, max_new_tokens: int = 256, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0,
                    stop_token_ids: int | Sequence[int] | None = None, block_size: int | None = None,
                    seed: int = 0, acceptance: str = "exact", lookup: int = 0,
                    min_draft_probability: float = 0.0, draft_context: int = 0,
                    confidence_threshold: float = 0.0, verify_budget: int = 0,
                    verify_costs: Mapping[int, float] | None = None, mesh=None) -> GenerationStream:
    """Like `generate`, but yields each row's newly committed tokens after prefill and after every
    cycle (a host loop over the same cycle, compiled ahead of time). Tokens past a stop token are
    never yielded. Arguments are checked and the executables compiled at the call, not at the first
    `next()`; the returned stream carries `compile_seconds`."""
    return generator_for(target, drafter, mesh)._stream(prompts, SamplingOptions.of_call(locals()))


def generate_batch(target, drafter, prompts, *, slots: int = 8, seeds: Sequence[int] | None = None, mesh=None,
                   **options) -> list:
    """Generate for many prompts through a `BatchEngine` of `slots` rows (continuous batching,
    `dflash_jax.engine.batch`), each prompt's `PromptResult` as `generate` would give it alone, in
    submission order.
    options: the keywords of `generate` but mesh (max_new_tokens, temperature, ...). seeds: one per
    prompt (None: `seed` folded with the prompt's index). mesh: as `generate`'s (None: the target's).
    Uses `generate`'s Generator for the pair."""
    generator = generator_for(target, drafter, mesh)
    rows = _prompt_rows(prompts, target.config.vocab_size)
    engine = generator.engine(slots=slots, max_prompt_tokens=max(len(r) for r in rows), **options)
    return engine.generate(rows, seeds)
