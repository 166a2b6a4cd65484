"""A tiny target fitted to a simple pattern and a DFlash drafter fitted to that target, so that
speculative tests see long accepted runs (random drafters are almost never accepted).

Data: arithmetic progressions x_t = (start + step * t) mod 40 over a 48-token vocabulary
(id 47 is the mask token and never appears in data).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.drafters.drafter import Drafter, init_drafter_params
from dflash_jax.drafters.objective import dflash_loss, sample_anchors
from dflash_jax.models.config import ModelConfig, MoEConfig
from dflash_jax.models.target import init_target_params, Target

VOCAB, MODULUS, MASK = 48, 40, 47
STEPS = (1, 2, 3, 5)

TARGET_CONFIG = ModelConfig(arch="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                            num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                            max_position_embeddings=512)
# the same as a Qwen3-MoE target (test_moe_train, test_train_distributed)
MOE_TARGET_CONFIG = dataclasses.replace(TARGET_CONFIG, arch="qwen3_moe",
                                        moe=MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                                      norm_topk_prob=True))


def drafter_config(block_size: int = 8) -> DrafterConfig:
    return DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=16, vocab_size=VOCAB, num_target_layers=3, target_layer_ids=(0, 2),
                         block_size=block_size, mask_token_id=MASK, max_position_embeddings=512)


def pattern_batch(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    start = rng.integers(0, MODULUS, size=(batch, 1))
    step = rng.choice(STEPS, size=(batch, 1))
    return ((start + step * np.arange(length)[None]) % MODULUS).astype(np.int32)


def _fit(loss_fn, params, batches, lr):
    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch, key):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, key)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    key = jax.random.PRNGKey(0)
    for batch in batches:
        key, sub = jax.random.split(key)
        params, state, loss = step(params, state, batch, sub)
    return params, float(loss)


def fit_target(steps: int = 300, seed: int = 0) -> Target:
    target = Target(TARGET_CONFIG, init_target_params(TARGET_CONFIG, jax.random.PRNGKey(seed)))

    def loss_fn(params, tokens, key):
        hidden, _, _ = target.forward(params, tokens[:, :-1])
        logits = target.logits(params, hidden)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return ce.mean(), None

    rng = np.random.default_rng(seed)
    batches = (jnp.asarray(pattern_batch(rng, 32, 33)) for _ in range(steps))
    params, loss = _fit(loss_fn, target.params, batches, 3e-3)
    return dataclasses.replace(target, params=params)


def fit_drafter(target: Target, steps: int = 300, block_size: int = 8, seed: int = 0) -> Drafter:
    cfg = drafter_config(block_size)
    drafter = Drafter(cfg, init_drafter_params(cfg, jax.random.PRNGKey(seed + 1)))
    capture = cfg.target_layer_ids

    def loss_fn(params, tokens, key):
        _, features, _ = target.forward(target.params, tokens, capture=capture)
        mask = jnp.ones(tokens.shape, bool)
        anchors, valid = sample_anchors(key, mask, 8)
        return dflash_loss(drafter, target, params, target.params, jax.lax.stop_gradient(features), tokens,
                           mask, anchors, valid)

    rng = np.random.default_rng(seed + 7)
    batches = (jnp.asarray(pattern_batch(rng, 16, 40)) for _ in range(steps))
    params, loss = _fit(loss_fn, drafter.params, batches, 3e-3)
    return dataclasses.replace(drafter, params=params)


def write_self_continuations(target, path, prompts, train_rows: int, max_new_tokens: int) -> list:
    """A training JSONL at `path` of the target's own greedy continuations of the first `train_rows`
    prompts (the prompt tokens masked out of the loss) -> the held-out rest of `prompts`."""
    import json

    from dflash_jax import generate

    out = generate(target, None, prompts, max_new_tokens=max_new_tokens, stop_token_ids=())
    with open(path, "w") as f:
        for p, t in zip(prompts[:train_rows], out.tokens[:train_rows]):
            f.write(json.dumps({"tokens": p + t, "loss_mask": [0] * len(p) + [1] * len(t)}) + "\n")
    return prompts[train_rows:]
