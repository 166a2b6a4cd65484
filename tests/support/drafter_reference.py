"""Pieces of the float64 drafter references the drafter-generation tests write from the math
(test_drafter_reference, test_dflash2, test_dspark): RMSNorm, half-split RoPE, and random drafter
params drawn with numpy."""
from __future__ import annotations

from typing import Callable

import numpy as np


def rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta=10000.0):
    """x [T, heads, d] rotated half by half at positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def random_drafter_params(cfg, seed: int = 0, scale_of: Callable[[list[str]], float] = lambda names: 0.2):
    """Every weight of a drafter of `cfg` random, drawn with numpy from `seed`: norm scales near 1, the
    rest N(0, scale_of(the param's path names))."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.drafters.drafter import init_drafter_params

    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_drafter_params(cfg, jax.random.PRNGKey(0)))

    def draw(path, s):
        names = [p.key for p in path]
        if names[-1] == "scale":
            return (1 + 0.1 * rng.standard_normal(s.shape)).astype(np.float32)
        return (scale_of(names) * rng.standard_normal(s.shape)).astype(np.float32)
    return jax.tree_util.tree_map_with_path(lambda p, s: jnp.asarray(draw(p, s)), shapes)
