"""Time the sampling filters on one cycle's worth of logits (not a test).

    python -m infer.benchmark_sampling                      # [16, 49152] f32: SmolLM2, block 16
    python -m infer.benchmark_sampling --vocab 151936       # Qwen3's vocabulary
    python -m infer.benchmark_sampling --module OLD/sampling.py   # another sampling.py, to compare

Each case is jitted, warmed up, and timed as the median of --repeats calls.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from typing import Sequence


def load_sampling(path: str | None):
    if path is None:
        from dflash_jax.decode import sampling

        return sampling
    spec = importlib.util.spec_from_file_location("sampling_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.benchmark_sampling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16, help="distributions per call (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per case (default: %(default)s)")
    p.add_argument("--module", metavar="PATH", help="a sampling.py file to time instead of dflash_jax's")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    s = load_sampling(args.module)
    logits = jax.random.normal(jax.random.PRNGKey(0), (args.rows, args.vocab), jnp.float32) * 4.0
    temperature, top_p, key = jnp.float32(0.7), jnp.float32(0.9), jax.random.PRNGKey(1)
    cases = {
        "argmax": lambda x: jnp.argmax(x, axis=-1),
        "temperature 0.7": lambda x: s.filtered_probs(x, temperature),
        "temperature 0.7 + sample": lambda x: s.sample(key, s.filtered_probs(x, temperature)),
        "top-p 0.9": lambda x: s.filtered_probs(x, temperature, 0, top_p),
        "top-k 50": lambda x: s.filtered_probs(x, temperature, 50),
    }
    if hasattr(s, "greedy"):
        cases["sampling.greedy"] = s.greedy
    print(f"logits [{args.rows}, {args.vocab}] float32, {jax.default_backend()}, median of {args.repeats}")
    for name, fn in cases.items():
        fn = jax.jit(fn)
        jax.block_until_ready(fn(logits))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(logits))
            times.append(time.perf_counter() - start)
        print(f"  {name:26s} {statistics.median(times) * 1e3:9.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
