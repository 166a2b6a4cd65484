"""Time one jitted matrix product x [M, D] @ W [D, V] for a few row counts M (not a test).

    python -m infer.benchmark_matmul                         # SmolLM2's LM head: 576 x 49152, f32
    python -m infer.benchmark_matmul --shape 576 1536 --rows 1 4 16

A decode step multiplies one row per weight matrix, a verify of G tokens G rows. When the weights
stream from memory, G rows should cost about what one row costs; the printed bandwidth (bytes of W
over the median time) shows how far from that the compiled product is on this machine. The last
column is the same product through `backends.cpu.matmul.rows_matmul` with W packed in panels of 16
columns (`pack_kernel`, what the unrolled CPU decode multiplies with; "-" where it does not run:
not float32, no kernel on this machine).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.benchmark_matmul", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=2, default=(576, 49152), metavar=("D", "V"),
                   help="weight shape (default: %(default)s, SmolLM2's LM head)")
    p.add_argument("--rows", type=int, nargs="+", default=(1, 2, 4, 8, 16), help="row counts M")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=15, help="timed calls per case (default: %(default)s)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    d, v = args.shape
    dtype = jnp.dtype(args.dtype)
    w = jax.random.normal(jax.random.PRNGKey(0), (d, v), dtype)
    from dflash_jax.backends.cpu.matmul import available, pack_kernel, rows_matmul

    product = jax.jit(lambda x, w: x @ w)
    packed_product = jax.jit(lambda x, w: rows_matmul(x, w, v))
    packed = pack_kernel(w)
    kernel = available() and dtype == jnp.float32 and jax.default_backend() == "cpu"
    print(f"W [{d}, {v}] {dtype.name} ({w.nbytes / 1e6:.0f} MB), device {jax.devices()[0].platform}, "
          f"median of {args.repeats}")
    print(f"| rows M | ms | x M={args.rows[0]} | GB/s of W | rows kernel ms |\n|---|---|---|---|---|")
    one = None
    for m in args.rows:
        x = jax.random.normal(jax.random.PRNGKey(m), (m, d), dtype)
        ms = _median_ms(product, x, w, args.repeats)
        one = ms if one is None else one
        rows_ms = f"{_median_ms(packed_product, x, packed, args.repeats):.2f}" if kernel else "-"
        print(f"| {m} | {ms:.2f} | {ms / one:.2f} | {w.nbytes / ms / 1e6:.1f} | {rows_ms} |")
    return 0


def _median_ms(fn, x, w, repeats: int) -> float:
    fn(x, w).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x, w).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    raise SystemExit(main())
