"""How much KV cache a decoding slot holds, and whether a paged layout would fit more slots (not a test).

    python -m infer.kv_memory                                    # Qwen3-8B, 32 slots x 8k, 80 GB GPU
    python -m infer.kv_memory --max-tokens 8192 16384 32768 --slots 32 64
    python -m infer.kv_memory --random-target llama3-8b --kv-cache-dtype float16

Nothing is allocated: every byte count comes from the shapes of what generation allocates
(`jax.eval_shape`): the target's decode cache (`TargetSpec.init_cache`), the drafter's context
cache (`DrafterSpec.init_cache`, the same capacity), the weights of the target and of its random
DFlash drafter of the official shape (`dflash_jax.cli.bench_random`), and the capacity rule of the
decode loop (`decode.loop.prefill`: prompt + max_new_tokens + block, rounded up to the attention
kernel's key tile). A slot of our layout holds that capacity whatever its row's actual length.

The paged comparison holds each in-flight sequence's actual length rounded up to pages of
`--page` tokens (keys and values of the target and of the drafter alike). Lengths are drawn from a
distribution (`DISTRIBUTIONS`; prompt and output independent, each clipped so that they fit
--max-tokens); a sequence in flight is caught at a uniformly random point of its decoding and is
weighted by its output length (a long answer occupies its slot longer), so its cache then holds
prompt + u * output tokens (u uniform in [0, 1]) plus the block being verified. The slots that
fit are the largest N whose sum of N such sequences stays under the free memory in 99% of draws.
"""
from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.cli.bench_random import random_configs, RANDOM_TARGETS
from dflash_jax.decode.loop import cache_tile
from dflash_jax.drafters.drafter import drafter_param_shapes, DrafterSpec
from dflash_jax.kernels import round_up
from dflash_jax.models.target import target_param_shapes, TargetSpec

GIB = 2**30
# (prompt mean, output mean, lognormal sigma) in tokens. "sharegpt": the means the vLLM paper
# (Kwon et al., SOSP 2023) reports for its ShareGPT set (input 161.31, output 337.99 tokens), the
# spread a lognormal of sigma 1 (an assumption: ShareGPT's lengths are long-tailed); "long": long
# inputs and answers (retrieval, reasoning), 2,000 tokens each on average.
DISTRIBUTIONS = {"sharegpt": (161.31, 337.99, 1.0), "long": (2000.0, 2000.0, 0.8)}


def tree_bytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def per_token_bytes(init_cache) -> int:
    """Bytes one row's cache grows by per position (from the shapes of a 1- and a 2-position cache)."""
    size = lambda capacity: tree_bytes(jax.eval_shape(lambda: init_cache(1, capacity)))  # noqa: E731
    return size(2) - size(1)


def lognormal(rng, mean: float, sigma: float, n: int):
    return rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, n)


def in_flight_tokens(rng, distribution: str, max_tokens: int, block: int, page: int, n: int):
    """Tokens (rounded up to pages) that n sequences caught in flight hold."""
    prompt_mean, output_mean, sigma = DISTRIBUTIONS[distribution]
    draws = 4 * n
    prompt = np.clip(np.ceil(lognormal(rng, prompt_mean, sigma, draws)), 1, max_tokens - 1)
    output = np.clip(np.ceil(lognormal(rng, output_mean, sigma, draws)), 1, max_tokens - prompt)
    chosen = rng.choice(draws, size=n, p=output / output.sum())  # weighted by the time in flight
    held = prompt[chosen] + rng.uniform(0, 1, n) * output[chosen] + block
    return np.ceil(held / page) * page


def paged_slots(rng, distribution: str, max_tokens: int, block: int, page: int, token_bytes: int,
                free_bytes: float) -> tuple[int, float]:
    """(largest N whose N in-flight sequences fit free_bytes in 99% of 400 draws, mean tokens held)."""
    pool = in_flight_tokens(rng, distribution, max_tokens, block, page, 200_000)
    mean = float(pool.mean())
    n = int(free_bytes / (mean * token_bytes))
    while n > 0:
        sums = np.array([rng.choice(pool, n).sum() for _ in range(400)]) * token_bytes
        if np.quantile(sums, 0.99) <= free_bytes:
            return n, mean
        n = int(n * 0.98)
    return 0, mean


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--random-target", choices=sorted(RANDOM_TARGETS), default="qwen3-8b")
    p.add_argument("--dtype", default="bfloat16", help="weights and KV cache (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default=None, help="default: --dtype")
    p.add_argument("--slots", type=int, nargs="+", default=[32])
    p.add_argument("--max-tokens", type=int, nargs="+", default=[8192], help="prompt + output per slot")
    p.add_argument("--block", type=int, default=16, help="tokens verified per cycle (default: %(default)s)")
    p.add_argument("--gpu-gib", type=float, default=79.6,
                   help="device memory (default: an 80 GB H100's 81,559 MiB, %(default)s GiB)")
    p.add_argument("--reserve-gib", type=float, default=4.0,
                   help="kept free for activations, the verify's logits and XLA's workspace (default: %(default)s)")
    p.add_argument("--page", type=int, default=16, help="paged layout: tokens per page (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    config, drafter_config = random_configs(args.random_target, None, args.block)
    dtype = jnp.dtype(args.dtype)
    kv_dtype = jnp.dtype(args.kv_cache_dtype or args.dtype)
    target = TargetSpec(config, dtype, kv_cache_dtype=kv_dtype)
    drafter = DrafterSpec(drafter_config, kv_dtype)
    weights = tree_bytes(target_param_shapes(config, dtype))
    drafter_weights = tree_bytes(drafter_param_shapes(drafter_config, dtype))
    t_tok, d_tok = per_token_bytes(target.init_cache), per_token_bytes(drafter.init_cache)
    free = args.gpu_gib * GIB - weights - drafter_weights - args.reserve_gib * GIB
    print(f"# {args.random_target}: weights {weights / GIB:.2f} GiB + drafter ({drafter_config.num_layers} layers) "
          f"{drafter_weights / GIB:.2f} GiB ({args.dtype}); KV cache {kv_dtype.name}: target {t_tok:,} B per token "
          f"({config.num_layers} layers x {config.num_kv_heads} kv heads x {config.head_dim} x 2), drafter "
          f"{d_tok:,} B per token; {args.gpu_gib} GiB device, {args.reserve_gib} GiB reserved: "
          f"{free / GIB:.2f} GiB for caches")
    print("\n## our layout: every slot holds its full capacity")
    print("| max tokens | capacity | per slot (target + drafter) | slots | caches | total with weights | fits | "
          "most slots that fit |")
    print("|---|---|---|---|---|---|---|---|")
    for max_tokens in args.max_tokens:
        capacity = round_up(max_tokens + args.block, cache_tile())
        slot = capacity * (t_tok + d_tok) + capacity * 4  # + the slot's int32 token row
        for slots in args.slots:
            caches = slots * slot
            total = caches + weights + drafter_weights
            print(f"| {max_tokens:,} | {capacity:,} | {slot / GIB:.3f} GiB ({capacity * t_tok / GIB:.3f} + "
                  f"{capacity * d_tok / GIB:.3f}) | {slots} | {caches / GIB:.1f} GiB | {total / GIB:.1f} GiB | "
                  f"{'yes' if caches <= free else 'NO'} | {int(free // slot)} |")
    print(f"\n## paged layout: pages of {args.page} tokens, sequences of a length distribution in flight")
    print("| max tokens | distribution (prompt, output means) | mean tokens held | our layout's use of a slot | "
          "slots that fit, paged (99%) | slots that fit, ours |")
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(args.seed)
    for max_tokens in args.max_tokens:
        capacity = round_up(max_tokens + args.block, cache_tile())
        ours = int(free // (capacity * (t_tok + d_tok) + capacity * 4))
        for name, (prompt_mean, output_mean, _) in DISTRIBUTIONS.items():
            n, mean = paged_slots(rng, name, max_tokens, args.block, args.page, t_tok + d_tok, free)
            print(f"| {max_tokens:,} | {name} ({prompt_mean:,.0f}, {output_mean:,.0f}) | {mean:,.0f} | "
                  f"{100 * mean / capacity:.1f}% | {n:,} | {ours} |")


if __name__ == "__main__":
    main()
