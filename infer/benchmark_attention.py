"""Benchmark the Pallas block-attention kernel against XLA attention with a dense mask.

On a GPU: first checks the kernel against the reference (forward and gradients, bf16 and f32, on a
small drafter-training mask), then times forward and forward+backward at drafter-training shapes
(Qwen3-8B drafter: 32 heads, 8 kv heads, head_dim 128; 3k context + 512 blocks of 16, batch 1)
and forward at inference shapes (a block of 16 queries against a long context; target verify;
target decode). TFLOP/s are counted on the visible (unmasked) work only:
forward 4 * D * Hq * visible pairs, forward+backward 3.5x that. The same count is used for both
implementations, so the ratio is the speedup.

    python -m infer.benchmark_attention              # GPU, a few minutes
    python -m infer.benchmark_attention --cpu-smoke  # tiny shapes, interpret mode, seconds
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kernels import block_attention, BlockSizes, masks, reference_attention


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    q_len: int
    k_len: int
    ranges: masks.KeyRanges
    backward: bool  # time forward+backward too (training shapes)


def training_case(batch, context, blocks, block_size, pad_blocks, seed) -> Case:
    rng = np.random.default_rng(seed)
    anchors = np.stack(
        [np.sort(rng.choice(np.arange(1, context - 1), size=blocks, replace=False)) for _ in range(batch)]
    )
    valid = np.ones((batch, blocks), bool)
    if pad_blocks:
        valid[:, blocks - pad_blocks :] = False
    ranges = masks.drafter_training(jnp.array(anchors), jnp.array(valid), context, block_size)
    name = f"train ctx={context} blocks={blocks}x{block_size}" + (f" pad={pad_blocks}" if pad_blocks else "")
    return Case(name, batch, blocks * block_size, context + blocks * block_size, ranges, True)


def draft_case(batch, capacity, block_size, seed) -> Case:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(capacity // 2, capacity + 1, size=batch)
    lengths[0] = capacity
    ranges = masks.drafter_inference(jnp.array(lengths), capacity, block_size)
    return Case(f"draft ctx<={capacity} block={block_size} B={batch}", batch, block_size,
                capacity + block_size, ranges, False)


def target_case(batch, capacity, q_len, seed, label) -> Case:
    rng = np.random.default_rng(seed)
    starts = rng.integers((capacity - q_len) // 2, capacity - q_len + 1, size=batch)
    starts[0] = capacity - q_len
    positions = jnp.array(starts)[:, None] + jnp.arange(q_len)[None]
    ranges = masks.causal(positions)
    return Case(f"{label} cache={capacity} q={q_len} B={batch}", batch, q_len, capacity, ranges, False)


def _inputs(case: Case, heads, kv_heads, head_dim, dtype, seed=0):
    kq, kk, kv, kw = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (case.batch, case.q_len, heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (case.batch, case.k_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (case.batch, case.k_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, q.shape, jnp.float32).astype(dtype)
    return q, k, v, w


def _time(fn, args, reps):
    out = fn(*args)
    jax.block_until_ready(out)  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _impls(tiles: BlockSizes, interpret: bool):
    def kern(q, k, v, r):
        return block_attention(q, k, v, r, block_sizes=tiles, interpret=interpret)

    def ref(q, k, v, r):
        return reference_attention(q, k, v, r)

    return {"pallas": kern, "xla-dense": ref}


def _fwd_and_grad(fn):
    def fwd(q, k, v, start, end):
        return fn(q, k, v, masks.KeyRanges(start, end))

    def loss(q, k, v, w, start, end):
        return jnp.sum(fwd(q, k, v, start, end).astype(jnp.float32) * w.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    return jax.jit(fwd), jax.jit(grad)


def check(heads, kv_heads, head_dim, tiles, interpret) -> bool:
    """Kernel vs reference, forward and gradients, bf16 and f32, on a small training mask."""
    ok = True
    case = training_case(1, 48 if interpret else 512, 3 if interpret else 64, 16, 1, seed=1)
    dtypes = ((jnp.bfloat16, 2e-2),) if interpret else ((jnp.float32, 2e-3), (jnp.bfloat16, 2e-2))
    for dtype, tol in dtypes:
        q, k, v, w = _inputs(case, heads, kv_heads, head_dim, dtype, seed=1)
        results = {}
        with jax.default_matmul_precision("float32"):
            for name, fn in _impls(tiles, interpret).items():
                fwd, grad = _fwd_and_grad(fn)
                out = fwd(q, k, v, case.ranges.start, case.ranges.end)
                g = grad(q, k, v, w, case.ranges.start, case.ranges.end)
                results[name] = [np.asarray(x, np.float32) for x in (out, *g)]
        for i, part in enumerate(("out", "dq", "dk", "dv")):
            a, b = results["pallas"][i], results["xla-dense"][i]
            err = float(np.abs(a - b).max())
            scale = max(1.0, float(np.abs(b).max()))
            good = bool(np.isfinite(a).all()) and err <= tol * scale
            ok &= good
            print(f"  check {jnp.dtype(dtype).name:8s} {part:3s} max|err| {err:.2e} "
                  f"(|ref| {scale:.2f}) {'ok' if good else 'MISMATCH'}")
    return ok


def run_case(case: Case, heads, kv_heads, head_dim, dtype, tiles, interpret, reps, skip_reference):
    q, k, v, w = _inputs(case, heads, kv_heads, head_dim, dtype)
    visible = float(np.asarray(jnp.sum(case.ranges.dense(case.k_len), axis=-1)).astype(np.float64).sum())
    fwd_flops = 4.0 * head_dim * heads * visible
    density = visible / (case.batch * case.q_len * case.k_len)
    rows = []
    outs = {}
    for name, fn in _impls(tiles, interpret).items():
        if name == "xla-dense" and skip_reference:
            continue
        fwd, grad = _fwd_and_grad(fn)
        args = (q, k, v, case.ranges.start, case.ranges.end)
        t_fwd, outs[name] = _time(fwd, args, reps)
        t_bwd = None
        if case.backward:
            t_bwd, _ = _time(grad, (q, k, v, w, case.ranges.start, case.ranges.end), reps)
        rows.append((name, t_fwd, t_bwd))
    err = ""
    if len(outs) == 2:
        diff = np.abs(np.asarray(outs["pallas"], np.float32) - np.asarray(outs["xla-dense"], np.float32))
        err = f"  max|out diff| {float(diff.max()):.2e}"
    print(f"\n{case.name}  (Hq={heads} Hkv={kv_heads} D={head_dim} {jnp.dtype(dtype).name}, "
          f"Tq={case.q_len} Tk={case.k_len}, visible {100 * density:.1f}%){err}")
    print(f"  {'impl':10s} {'fwd ms':>9s} {'TFLOP/s':>8s} {'fwd+bwd ms':>11s} {'TFLOP/s':>8s}")
    for name, t_fwd, t_bwd in rows:
        line = f"  {name:10s} {1e3 * t_fwd:9.3f} {fwd_flops / t_fwd / 1e12:8.1f}"
        if t_bwd is not None:
            line += f" {1e3 * t_bwd:11.3f} {3.5 * fwd_flops / t_bwd / 1e12:8.1f}"
        print(line)
    if len(rows) == 2:
        (_, kf, kb), (_, rf, rb) = rows
        line = f"  speedup    {rf / kf:8.2f}x"
        if kb is not None:
            line += f" {'':8s} {rb / kb:10.2f}x"
        print(line)


def sweep(case, heads, kv_heads, head_dim, dtype, reps, interpret):
    """A few tile configurations at one shape (forward and forward+backward)."""
    q, k, v, w = _inputs(case, heads, kv_heads, head_dim, dtype)
    configs = [
        BlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=2),
        BlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=3),
        BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=3),
        BlockSizes(block_q=128, block_k=32, num_warps=4, num_stages=3),
        BlockSizes(block_q_bwd=32, block_k_bwd=64, num_stages=2),
        BlockSizes(block_q_bwd=64, block_k_bwd=32, num_stages=2),
        BlockSizes(block_q_bwd=32, block_k_bwd=32, num_stages=3),
    ]
    print(f"\nsweep: {case.name}")
    for tiles in configs:
        fwd, grad = _fwd_and_grad(_impls(tiles, interpret)["pallas"])
        try:
            t_fwd, _ = _time(fwd, (q, k, v, case.ranges.start, case.ranges.end), reps)
            t_bwd, _ = _time(grad, (q, k, v, w, case.ranges.start, case.ranges.end), reps)
            print(f"  {tiles}: fwd {1e3 * t_fwd:.3f} ms, fwd+bwd {1e3 * t_bwd:.3f} ms")
        except Exception as e:  # a config Triton cannot compile (e.g. out of shared memory)
            print(f"  {tiles}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes with interpret=True (runs anywhere, in seconds; timings meaningless)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--context", type=int, default=3072, help="training context length")
    p.add_argument("--blocks", type=int, default=512, help="training blocks per sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pad-blocks", type=int, default=0, help="fully masked (padding) training blocks")
    p.add_argument("--draft-context", type=int, default=8192, help="inference context capacity")
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=10)
    default_tiles = BlockSizes()
    for field in dataclasses.fields(BlockSizes):  # --block-q, ..., --num-stages
        default = getattr(default_tiles, field.name)
        p.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=default,
                       help=f"BlockSizes.{field.name} (default {default})")
    p.add_argument("--skip-reference-train", action="store_true",
                   help="do not run the dense reference at the training shape (needs ~50 GB)")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also try a few tile configurations")
    p.add_argument("--only", default="", help="comma list of case kinds: train,draft,verify,decode")
    args = p.parse_args(argv)

    interpret = args.cpu_smoke
    if interpret:
        heads, kv_heads, head_dim = 4, 2, 32
        context, blocks, block_size = 48, 2, 16
        draft_ctx, decode_batch, reps = 48, 2, 1
    else:
        if jax.default_backend() != "gpu":
            print(f"no GPU (backend {jax.default_backend()!r}); use --cpu-smoke here", file=sys.stderr)
            return 2
        heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
        context, blocks, block_size = args.context, args.blocks, args.block_size
        draft_ctx, decode_batch, reps = args.draft_context, args.decode_batch, args.reps
    dtype = jnp.dtype(args.dtype)
    tiles = BlockSizes(**{field.name: getattr(args, field.name) for field in dataclasses.fields(BlockSizes)})
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, device {jax.devices()[0].device_kind}")
    print(f"kernel tiles: {tiles}, interpret={interpret}")

    ok = True
    if not args.skip_check:
        print("\nkernel vs reference (forward and gradients):")
        ok = check(heads, kv_heads, head_dim, tiles, interpret)

    only = set(filter(None, args.only.split(",")))
    want = lambda kind: not only or kind in only  # noqa: E731
    cases = []
    if want("train"):
        cases.append((training_case(1, context, blocks, block_size, args.pad_blocks, seed=0),
                      args.skip_reference_train))
    batches = (decode_batch,) if interpret else (1, decode_batch)
    if want("draft"):
        cases += [(draft_case(b, draft_ctx, block_size, seed=0), False) for b in batches]
    if want("verify") and not interpret:
        cases.append((target_case(decode_batch, draft_ctx, block_size, seed=0, label="verify"), False))
    if want("decode"):
        cases += [(target_case(b, draft_ctx, 1, seed=0, label="decode"), False) for b in batches]
    for case, skip_ref in cases:
        run_case(case, heads, kv_heads, head_dim, dtype, tiles, interpret, reps, skip_ref)
    if args.sweep:
        sweep(training_case(1, context, blocks, block_size, args.pad_blocks, seed=0),
              heads, kv_heads, head_dim, dtype, reps, interpret)
    print("\nchecks:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
