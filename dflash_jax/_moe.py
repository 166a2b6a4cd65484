"""Mixture-of-experts MLPs (Qwen3-MoE, Qwen3.5-MoE): a router, top-k experts per token, and the
chosen experts run as grouped matmuls over the tokens sorted by expert (`jax.lax.ragged_dot`), not a
loop over experts and not a one-hot product with all of them; Qwen3.5-MoE adds a shared expert."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax._layers import MLP


def route(logits, top_k: int, normalize: bool):
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k]): the top k
    of softmax(logits) in float32, renormalised to sum to 1 where `normalize` (Qwen3-MoE's
    norm_topk_prob)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(logits.dtype), experts


def grouped_experts(x, experts, weights, gate, up, down):
    """sum_j weights[n, j] * expert_{experts[n, j]}(x[n]) for x [N, D], with SwiGLU experts
    gate / up [E, D, I] and down [E, I, D].

    With fewer (token, expert) pairs than experts (a decode step: k pairs), each pair's expert
    weights are gathered and multiplied: only the chosen experts' weights are read. Otherwise the
    N * k pairs are sorted by expert and each expert's run multiplies its own weights
    (`ragged_dot`, one group per expert). XLA's CPU backend lowers `ragged_dot` to a dense product
    over every expert (docs/architecture.md, "Mixture-of-experts targets")."""
    n, k = experts.shape
    num_experts = gate.shape[0]
    if n * k < num_experts:
        flat = experts.reshape(-1)
        xs = jnp.repeat(x, k, axis=0)  # pair p = (token p // k, its (p % k)-th expert)
        h = jax.nn.silu(jnp.einsum("pd,pdi->pi", xs, gate[flat].astype(x.dtype))) * \
            jnp.einsum("pd,pdi->pi", xs, up[flat].astype(x.dtype))
        out = jnp.einsum("pi,pid->pd", h, down[flat].astype(x.dtype)) * weights.reshape(-1)[:, None]
        return out.reshape(n, k, -1).sum(axis=1)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    tokens = order // k
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = x[tokens]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate.astype(x.dtype), sizes)) * jax.lax.ragged_dot(xs, up.astype(x.dtype), sizes)
    out = jax.lax.ragged_dot(h, down.astype(x.dtype), sizes)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[tokens].add(out)


class MoE(nn.Module):
    """Qwen3-MoE's sparse MLP: router kernel [D, E] ("router"), experts' gate_proj / up_proj
    [E, D, I] and down_proj [E, I, D]. With shared_intermediate_size > 0 (Qwen3.5-MoE's
    `Qwen3_5MoeSparseMoeBlock`), a SwiGLU shared expert of that width ("shared_expert") runs on every
    token, scaled by sigmoid(shared_expert_gate(x)) (a kernel [D, 1]), and is added to the experts'
    sum."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool = False
    dtype: Any = jnp.float32
    shared_intermediate_size: int = 0

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        e, i = self.num_experts, self.intermediate_size
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        router = nn.Dense(e, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name="router")
        gate = self.param("gate_proj", init, (e, d, i), self.dtype)
        up = self.param("up_proj", init, (e, d, i), self.dtype)
        down = self.param("down_proj", init, (e, i, d), self.dtype)
        flat = x.reshape(-1, d)
        weights, experts = route(router(flat), self.top_k, self.normalize)
        out = grouped_experts(flat, experts, weights, gate, up, down).reshape(x.shape)
        if self.shared_intermediate_size:
            shared = MLP(self.shared_intermediate_size, False, self.dtype, name="shared_expert")(x)
            shared_gate = nn.Dense(1, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                                   name="shared_expert_gate")(x)
            out = out + jax.nn.sigmoid(shared_gate) * shared
        return out
