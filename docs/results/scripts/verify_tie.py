"""The first verify against the autoregressive step on a random target of real shapes: the anchor
position's hidden state and logits both ways, from one prefilled cache (docs/results/families-cpu.md).

    PYTHONPATH=. python docs/results/scripts/verify_tie.py qwen3-coder-next bfloat16 1
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.cli.bench_prompts import random_prompts
from dflash_jax.cli.bench_random import random_models

name, dtype, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
target, _ = random_models(name, layers, None, dtype, 0)
prompt = random_prompts(target.config.vocab_size, 1, 64, 0)[0]["ids"]  # the benchmark's prompt
forward = jax.jit(lambda params, tokens, cache: target.spec.forward(params, tokens, cache))
logits_of = jax.jit(lambda params, hidden: target.spec.logits(params, hidden))
hidden, _, cache = forward(target.params, jnp.asarray([prompt], jnp.int32), target.init_cache(1, 128))
anchor = int(np.asarray(logits_of(target.params, hidden[:, -1:]), np.float32)[0, 0].argmax())
step_hidden, _, _ = forward(target.params, jnp.asarray([[anchor]], jnp.int32), cache)
step = np.asarray(logits_of(target.params, step_hidden), np.float32)[0, 0]
top = np.sort(step)[::-1]
rng = np.random.default_rng(1)
for width in (2, 4, 16):
    block = [anchor] + [int(t) for t in rng.integers(0, target.config.vocab_size, width - 1)]
    block_hidden, _, _ = forward(target.params, jnp.asarray([block], jnp.int32), cache)
    verify = np.asarray(logits_of(target.params, block_hidden[:, :1]), np.float32)[0, 0]
    apart = np.abs(np.asarray(block_hidden[:, 0], np.float32) - np.asarray(step_hidden[:, 0], np.float32)).max()
    print(f"width {width}: step argmax {int(step.argmax())}, verify argmax {int(verify.argmax())}; step's top two "
          f"{top[0] - top[1]:.4f} apart; the step's winner in the verify {verify[step.argmax()] - verify.max():.4f} "
          f"from its max; logits at most {np.abs(step - verify).max():.4f} apart, hidden {apart:.4f} "
          f"(largest logit {np.abs(step).max():.3f}, largest hidden {np.abs(np.asarray(step_hidden)).max():.3f})")
