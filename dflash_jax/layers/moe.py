"""Mixture-of-experts MLPs (Qwen3-MoE, Qwen3.5-MoE, gpt-oss, and the sigmoid router of DeepSeek-V3,
GLM-4 MoE and MiniMax-M2): a router, top-k experts per token, and
the chosen experts run as grouped matmuls over the tokens sorted by expert (`jax.lax.ragged_dot`), not
a loop over experts and not a one-hot product with all of them; Qwen3.5-MoE adds a shared expert,
gpt-oss its own router order, expert biases and a clamped SwiGLU. Which grouped form multiplies the
pairs is the backend's static choice (`backends.base.Backend.expert_form`), made from the shapes at
trace time."""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax import backends
from dflash_jax.layers.common import MLP


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


def route_sigmoid_grouped(logits, correction_bias, top_k: int, *, n_group: int = 1, topk_group: int = 1,
                          normalize: bool = True, scaling: float = 1.0, norm_eps: float = 0.0):
    """The DeepSeek-V3 router (also GLM-4 MoE's and MiniMax-M2's): logits [N, E] and the correction
    bias [E] -> (weights [N, k] float32, expert ids [N, k]). In float32: scores = sigmoid(logits);
    the experts are chosen by scores + correction_bias, among the `topk_group` best of `n_group`
    equal groups of consecutive experts (a group scored by the sum of its 2 best biased scores;
    n_group 1: all experts); the weights are the chosen experts' unbiased scores, divided by their
    sum (+ norm_eps: DeepSeek's and GLM's 1e-20, MiniMax's 0) where `normalize`, times `scaling`
    (routed_scaling_factor)."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction_bias.astype(jnp.float32)
    if n_group > 1:
        n, e = choice.shape
        grouped = choice.reshape(n, n_group, e // n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
        _, groups = jax.lax.top_k(group_scores, topk_group)
        kept = jnp.any(groups[:, :, None] == jnp.arange(n_group)[None, None, :], axis=1)  # [N, G]
        choice = jnp.where(jnp.repeat(kept, e // n_group, axis=-1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + norm_eps)
    return weights * scaling, experts


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def clamped_swiglu(gate, up, *, limit: float, alpha: float):
    """gpt-oss's expert activation: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def grouped_experts(x, experts, weights, gate, up, down, *, biases=None, activation: Callable = swiglu,
                    form: str = "auto", backend: str = "xla"):
    """sum_j weights[n, j] * expert_{experts[n, j]}(x[n]) for x [N, D], with SwiGLU experts
    gate / up [E, D, I] and down [E, I, D]: down(activation(x gate, x up)). biases: None or
    (gate [E, I], up [E, I], down [E, D]), added after each product (gpt-oss).

    Two forms (`FORMS`) read the chosen experts' weights:
    - "gathered": each (token, expert) pair's expert weights are gathered and multiplied
      (`_gathered_pairs`): only the chosen experts' weights are read;
    - "sorted": the N * k pairs are sorted by expert and each expert's run multiplies its own
      weights (`_sorted_groups`: `ragged_dot`, one group per expert, each expert's weights read once).
    form: "auto" asks `backend` (`Backend.expert_form`: a static choice from the shapes; XLA's
    gathers fewer pairs than experts everywhere, and on a CPU while the gathered weights stay under
    `backends.base.CPU_GATHER_BYTES`, since XLA's CPU backend lowers `ragged_dot` to a dense product
    with every expert), or one of `FORMS` (tests).
    """
    n, k = experts.shape
    if form == "auto":
        expert_bytes = sum(w[0].size * jnp.dtype(x.dtype).itemsize for w in (gate, up, down))
        form = backends.get(backend).expert_form(n * k, gate.shape[0], expert_bytes)
    if form not in FORMS:
        raise ValueError(f"form must be 'auto' or one of {sorted(FORMS)}, got {form!r}")
    return FORMS[form](x, experts, weights, gate, up, down, biases, activation)


def _plus(biases):
    """y + the bias rows of each pair's expert (`pair_experts`), or y where there are no biases."""
    if biases is None:
        return lambda y, which, pair_experts: y
    return lambda y, which, pair_experts: y + biases[which][pair_experts].astype(y.dtype)


def _gathered_pairs(x, experts, weights, gate, up, down, biases, activation):
    """Each pair's expert weights gathered, then the pairs' products at once."""
    n, k = experts.shape
    plus = _plus(biases)
    flat = experts.reshape(-1)
    xs = jnp.repeat(x, k, axis=0)  # pair p = (token p // k, its (p % k)-th expert)
    h = activation(plus(jnp.einsum("pd,pdi->pi", xs, gate[flat].astype(x.dtype)), 0, flat),
                   plus(jnp.einsum("pd,pdi->pi", xs, up[flat].astype(x.dtype)), 1, flat))
    out = plus(jnp.einsum("pi,pid->pd", h, down[flat].astype(x.dtype)), 2, flat)
    out = out * weights.reshape(-1)[:, None]
    return out.reshape(n, k, -1).sum(axis=1)


def _sorted_groups(x, experts, weights, gate, up, down, biases, activation):
    """The pairs sorted by expert, each expert's run through its own weights (`ragged_dot`)."""
    n, k = experts.shape
    plus = _plus(biases)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    tokens = order // k
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    xs = x[tokens]
    sorted_experts = flat[order]
    h = activation(plus(jax.lax.ragged_dot(xs, gate.astype(x.dtype), sizes), 0, sorted_experts),
                   plus(jax.lax.ragged_dot(xs, up.astype(x.dtype), sizes), 1, sorted_experts))
    out = plus(jax.lax.ragged_dot(h, down.astype(x.dtype), sizes), 2, sorted_experts)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[tokens].add(out)


FORMS = {"gathered": _gathered_pairs, "sorted": _sorted_groups}


class MoE(nn.Module):
    """Qwen3-MoE's sparse MLP: router kernel [D, E] ("router"), experts' gate_proj / up_proj
    [E, D, I] and down_proj [E, I, D]. With shared_intermediate_size > 0 (Qwen3.5-MoE's
    `Qwen3_5MoeSparseMoeBlock`), a SwiGLU shared expert of that width ("shared_expert") runs on every
    token, scaled by sigmoid(shared_expert_gate(x)) (a kernel [D, 1]), and is added to the experts'
    sum. gpt-oss's sets the other fields: routing "topk_softmax" (`route_top_k_softmax`) with a
    router bias, expert biases gate_bias / up_bias [E, I] and down_bias [E, D], and swiglu_limit > 0:
    the clamped SwiGLU (`clamped_swiglu`; 0: plain SwiGLU). DeepSeek-V3's, GLM-4 MoE's and MiniMax-M2's:
    routing "sigmoid_grouped" (`route_sigmoid_grouped`: the router's logits in float32, its correction
    bias "e_score_correction_bias" [E], n_group / topk_group, routed_scaling_factor, norm_eps), and
    with shared_expert_gate False the shared expert added ungated (no "shared_expert_gate"). backend: the
    backend whose expert form the products take (`grouped_experts`). `moe_block` builds one from a
    `MoEConfig`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool = False
    dtype: Any = jnp.float32
    shared_intermediate_size: int = 0
    routing: str = "softmax_topk"  # or "topk_softmax", "sigmoid_grouped" (`models.config.MOE_ROUTERS`)
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    backend: str = "xla"
    n_group: int = 1  # "sigmoid_grouped": expert groups, the best topk_group of them searched
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_eps: float = 0.0
    shared_expert_gate: bool = True  # the shared expert scaled by sigmoid(shared_expert_gate(x)); False: ungated

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        e, i = self.num_experts, self.intermediate_size
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        sigmoid = self.routing == "sigmoid_grouped"
        router = nn.Dense(e, use_bias=self.router_bias, dtype=jnp.float32 if sigmoid else self.dtype,
                          param_dtype=self.dtype, name="router")
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
        if sigmoid:
            # float32 whatever the model's dtype (transformers keeps it so): it decides between close scores
            correction = self.param("e_score_correction_bias", nn.initializers.zeros, (e,), jnp.float32)
            weights, experts = route_sigmoid_grouped(
                logits, correction, self.top_k, n_group=self.n_group, topk_group=self.topk_group,
                normalize=self.normalize, scaling=self.routed_scaling_factor, norm_eps=self.norm_eps)
            weights = weights.astype(x.dtype)
        elif self.routing == "topk_softmax":
            weights, experts = route_top_k_softmax(logits, self.top_k)
        else:
            weights, experts = route(logits, self.top_k, self.normalize)
        out = grouped_experts(flat, experts, weights, gate, up, down, biases=biases, activation=activation,
                              backend=self.backend).reshape(x.shape)
        if self.shared_intermediate_size:
            shared = MLP(self.shared_intermediate_size, False, self.dtype, name="shared_expert")(x)
            if not self.shared_expert_gate:
                return out + shared
            shared_gate = nn.Dense(1, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                                   name="shared_expert_gate")(x)
            out = out + jax.nn.sigmoid(shared_gate) * shared
        return out


def moe_block(moe, dtype=jnp.float32, backend: str = "xla", name: str = "mlp") -> MoE:
    """The `MoE` module of a `models.config.MoEConfig` (every field of it passed on)."""
    return MoE(moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.norm_topk_prob, dtype,
               moe.shared_expert_intermediate_size, routing=moe.router, router_bias=moe.router_bias,
               expert_bias=moe.expert_bias, swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha,
               backend=backend, n_group=moe.n_group, topk_group=moe.topk_group,
               routed_scaling_factor=moe.routed_scaling_factor, norm_eps=moe.norm_topk_eps,
               shared_expert_gate=moe.shared_expert_gate, name=name)
