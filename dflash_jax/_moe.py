"""Mixture-of-experts MLPs (Qwen3-MoE, Qwen3.5-MoE, gpt-oss): a router, top-k experts per token, and
the chosen experts run as grouped matmuls over the tokens sorted by expert (`jax.lax.ragged_dot`), not
a loop over experts and not a one-hot product with all of them; Qwen3.5-MoE adds a shared expert,
gpt-oss its own router order, expert biases and a clamped SwiGLU."""
from __future__ import annotations

import functools
from typing import Any, Callable

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


def route_top_k_softmax(logits, top_k: int):
    """gpt-oss's router: logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k]):
    the top k of the raw logits, then a softmax over those k (float32)."""
    values, experts = jax.lax.top_k(logits.astype(jnp.float32), top_k)
    return jax.nn.softmax(values, axis=-1).astype(logits.dtype), experts


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def clamped_swiglu(gate, up, *, limit: float, alpha: float):
    """gpt-oss's expert activation: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def grouped_experts(x, experts, weights, gate, up, down, *, biases=None, activation: Callable = swiglu):
    """sum_j weights[n, j] * expert_{experts[n, j]}(x[n]) for x [N, D], with SwiGLU experts
    gate / up [E, D, I] and down [E, I, D]: down(activation(x gate, x up)). biases: None or
    (gate [E, I], up [E, I], down [E, D]), added after each product (gpt-oss).

    With fewer (token, expert) pairs than experts (a decode step: k pairs), each pair's expert
    weights are gathered and multiplied: only the chosen experts' weights are read. Otherwise the
    N * k pairs are sorted by expert and each expert's run multiplies its own weights
    (`ragged_dot`, one group per expert). XLA's CPU backend lowers `ragged_dot` to a dense product
    over every expert (docs/architecture.md, "Mixture-of-experts targets")."""
    n, k = experts.shape
    num_experts = gate.shape[0]
    # each (token, expert) pair's bias rows: `pair_experts` are the pairs' expert ids in product order
    plus = (lambda y, b, pair_experts: y) if biases is None else \
        (lambda y, b, pair_experts: y + b[pair_experts].astype(y.dtype))
    gate_bias, up_bias, down_bias = biases if biases is not None else (None,) * 3
    if n * k < num_experts:
        flat = experts.reshape(-1)
        xs = jnp.repeat(x, k, axis=0)  # pair p = (token p // k, its (p % k)-th expert)
        h = activation(plus(jnp.einsum("pd,pdi->pi", xs, gate[flat].astype(x.dtype)), gate_bias, flat),
                       plus(jnp.einsum("pd,pdi->pi", xs, up[flat].astype(x.dtype)), up_bias, flat))
        out = plus(jnp.einsum("pi,pid->pd", h, down[flat].astype(x.dtype)), down_bias, flat)
        out = out * weights.reshape(-1)[:, None]
        return out.reshape(n, k, -1).sum(axis=1)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    tokens = order // k
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = x[tokens]
    sorted_experts = flat[order]
    h = activation(plus(jax.lax.ragged_dot(xs, gate.astype(x.dtype), sizes), gate_bias, sorted_experts),
                   plus(jax.lax.ragged_dot(xs, up.astype(x.dtype), sizes), up_bias, sorted_experts))
    out = plus(jax.lax.ragged_dot(h, down.astype(x.dtype), sizes), down_bias, sorted_experts)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[tokens].add(out)


class MoE(nn.Module):
    """Qwen3-MoE's sparse MLP: router kernel [D, E] ("router"), experts' gate_proj / up_proj
    [E, D, I] and down_proj [E, I, D]. With shared_intermediate_size > 0 (Qwen3.5-MoE's
    `Qwen3_5MoeSparseMoeBlock`), a SwiGLU shared expert of that width ("shared_expert") runs on every
    token, scaled by sigmoid(shared_expert_gate(x)) (a kernel [D, 1]), and is added to the experts'
    sum. gpt-oss's sets the other fields: routing "topk_softmax" (`route_top_k_softmax`) with a
    router bias, expert biases gate_bias / up_bias [E, I] and down_bias [E, D], and swiglu_limit > 0:
    the clamped SwiGLU (`clamped_swiglu`; 0: plain SwiGLU)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool = False
    dtype: Any = jnp.float32
    shared_intermediate_size: int = 0
    routing: str = "softmax_topk"  # or "topk_softmax" (`_config.MOE_ROUTERS`)
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        e, i = self.num_experts, self.intermediate_size
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        router = nn.Dense(e, use_bias=self.router_bias, dtype=self.dtype, param_dtype=self.dtype, name="router")
        gate = self.param("gate_proj", init, (e, d, i), self.dtype)
        up = self.param("up_proj", init, (e, d, i), self.dtype)
        down = self.param("down_proj", init, (e, i, d), self.dtype)
        biases = None
        if self.expert_bias:
            biases = tuple(self.param(name, nn.initializers.zeros, shape, self.dtype)
                           for name, shape in (("gate_bias", (e, i)), ("up_bias", (e, i)), ("down_bias", (e, d))))
        activation = swiglu if not self.swiglu_limit else \
            functools.partial(clamped_swiglu, limit=self.swiglu_limit, alpha=self.swiglu_alpha)
        flat = x.reshape(-1, d)
        logits = router(flat)
        weights, experts = route_top_k_softmax(logits, self.top_k) if self.routing == "topk_softmax" else \
            route(logits, self.top_k, self.normalize)
        out = grouped_experts(flat, experts, weights, gate, up, down, biases=biases,
                              activation=activation).reshape(x.shape)
        if self.shared_intermediate_size:
            shared = MLP(self.shared_intermediate_size, False, self.dtype, name="shared_expert")(x)
            shared_gate = nn.Dense(1, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                                   name="shared_expert_gate")(x)
            out = out + jax.nn.sigmoid(shared_gate) * shared
        return out
