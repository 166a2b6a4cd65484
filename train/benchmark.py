"""Train-step speed of the drafter: online vs offline features, full vs reduced vocabulary, few vs
many anchors. Prints a table of step time and drafter tokens/s (blocks x block size per second).

    python -m train.benchmark                          # SmolLM2-135M target on this machine
    python -m train.benchmark --random-target qwen3-8b # Qwen3-8B-shaped random weights (GPU), with MFU

Each setting is compiled and run once untimed, then timed over --steps steps (median).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafters.objective import default_decay
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.target import init_target_params, Target
from train import drafter_init, step as step_lib

QWEN3_8B = ModelConfig(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                       num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6,
                       max_position_embeddings=40960)
RANDOM_TARGETS = {"qwen3-8b": QWEN3_8B}
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    offline: bool
    num_anchors: int
    draft_vocab: int  # 0 = full
    anchor_chunk: int = 0


def settings(few: int, many: int, vocab: int, chunk: int) -> list[Setting]:
    return [Setting("online, full vocab", False, few, 0),
            Setting("online, full vocab", False, many, 0),
            Setting("online, full vocab", False, many, 0, chunk),
            Setting("offline, full vocab", True, many, 0, chunk),
            Setting("offline, reduced vocab", True, few, vocab),
            Setting("offline, reduced vocab", True, many, vocab),
            Setting("offline, reduced vocab", True, many, vocab, chunk)]


def time_setting(target, config, setting: Setting, batch: dict, steps: int, dtype: str):
    """(median step seconds, FLOPs per step or None) of one setting."""
    params = drafter_init.initial_params(
        config, target, target.params, jax.random.PRNGKey(0),
        draft_to_target=np.arange(setting.draft_vocab) if setting.draft_vocab else None)
    schedule = step_lib.learning_rate_schedule(6e-4, 1000, 0.04)
    optimizer = step_lib.make_optimizer(schedule)
    state = step_lib.init_state(params, optimizer, 0)
    spec = step_lib.StepSpec(num_anchors=setting.num_anchors, decay=default_decay(config.block_size),
                             compute_dtype=dtype, anchor_chunk=setting.anchor_chunk)
    frozen = {"target": target.params}
    if setting.draft_vocab:
        t2d = np.full(config.vocab_size, -1, np.int32)
        t2d[: setting.draft_vocab] = np.arange(setting.draft_vocab)
        frozen["target_to_draft"] = jnp.asarray(t2d)
    if not setting.offline:
        batch = {k: v for k, v in batch.items() if k != "features"}
    step = jax.jit(step_lib.make_train_step(target, config, spec, optimizer, schedule), donate_argnums=(0,))
    compiled = step.lower(state, frozen, batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = (cost or {}).get("flops")
    state, _ = jax.block_until_ready(compiled(state, frozen, batch))  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = jax.block_until_ready(compiled(state, frozen, batch))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), flops


def make_batch(target, config, batch_size: int, seq_len: int, seed: int = 0) -> dict:
    """Random tokens (prompt = first eighth unmasked) and their bf16 target features."""
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size - 1, (batch_size, seq_len)), jnp.int32)
    loss_mask = jnp.asarray(np.arange(seq_len)[None].repeat(batch_size, 0) >= seq_len // 8)
    capture = jax.jit(lambda params, ids: step_lib.target_features(target, params, ids, config.target_layer_ids))
    features = capture(target.params, tokens)
    return {"tokens": tokens, "loss_mask": loss_mask, "lengths": jnp.full((batch_size,), seq_len, jnp.int32),
            "features": features.astype(jnp.bfloat16)}


def load_benchmark_target(name: str | None, dtype: str):
    if name is None:
        from dflash_jax._resources import smollm2_gguf_path
        from dflash_jax.loading.target_loader import load_target

        return load_target(smollm2_gguf_path(), dtype=dtype, tokenizer=False, layout="stacked")
    config = RANDOM_TARGETS[name]
    jdtype = step_lib.DTYPES[dtype]
    params = jax.jit(lambda key: init_target_params(config, key, jdtype))(jax.random.PRNGKey(0))
    return Target(config, params, None, jdtype)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("--random-target", choices=sorted(RANDOM_TARGETS),
                   help="random weights of this shape instead of SmolLM2 (for a GPU)")
    p.add_argument("--dtype", default=None, help="target and compute dtype (default float32 on CPU, bfloat16 else)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--layers", type=int, default=1, help="drafter layers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--few-anchors", type=int, default=24)
    p.add_argument("--many-anchors", type=int, default=128)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--anchor-chunk", type=int, default=16, help="anchors per attention group (0 = all at once)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--only", help="comma-separated row numbers of the table to run (default: all)")
    args = p.parse_args(argv)
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    target = load_benchmark_target(args.random_target, dtype)
    config = drafter_init.build_drafter_config(target, num_layers=args.layers, block_size=args.block_size,
                                               mask_token_id=target.config.vocab_size - 1)
    batch = make_batch(target, config, args.batch, args.seq_len)
    device = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_FLOPS.items() if k in device), None)
    print(f"target: {args.random_target or 'SmolLM2-135M'} ({target.config.num_layers} layers, vocab "
          f"{target.config.vocab_size}), {dtype}, device {device} x{jax.device_count()}; drafter {args.layers} "
          f"layer(s), block {args.block_size}; batch {args.batch} x {args.seq_len} tokens; median of {args.steps}")
    header = f"| {'setting':<28} | anchors | chunk | step (s) | drafter tok/s | vs first |" + (" MFU |" if peak else "")
    print(header + "\n|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    base = None
    rows = settings(args.few_anchors, args.many_anchors, args.draft_vocab, args.anchor_chunk)
    if args.only:
        rows = [rows[int(i)] for i in args.only.split(",")]
    for s in rows:
        seconds, flops = time_setting(target, config, s, batch, args.steps, dtype)
        rate = args.batch * s.num_anchors * args.block_size / seconds
        base = base or rate
        name = s.name + (f" {s.draft_vocab}" if s.draft_vocab else "")
        row = (f"| {name:<28} | {s.num_anchors:>7} | {s.anchor_chunk or '-':>5} | {seconds:>8.3f} | {rate:>13,.0f} "
               f"| {rate / base:>7.1f}x |")
        if peak:
            row += f" {flops / seconds / peak:.1%} |" if flops else "  n/a |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
