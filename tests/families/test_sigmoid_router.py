"""The sigmoid router of DeepSeek-V3, GLM-4 MoE and MiniMax-M2 (`layers.moe.route_sigmoid_grouped`, MoE routing
"sigmoid_grouped") against a float64 numpy reference written from the math, the MoE block that uses it
(its correction bias and an ungated shared expert), and what `MoEConfig` refuses for it."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from dflash_jax.layers import moe
from dflash_jax.models.config import MoEConfig


def reference_route(logits, bias, top_k, n_group, topk_group, normalize, scaling, eps):
    """float64: experts chosen by sigmoid + bias among the best groups (a group's score: the sum of its two
    best biased scores), weighted by the unbiased sigmoid, renormalised (+ eps) where asked, scaled."""
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias.astype(np.float64)
    n, e = choice.shape
    size = e // n_group
    weights, experts = np.zeros((n, top_k)), np.zeros((n, top_k), np.int64)
    for t in range(n):
        groups = choice[t].reshape(n_group, size)
        group_scores = np.sort(groups, axis=-1)[:, -2:].sum(-1) if size >= 2 else groups[:, 0]
        kept = np.argsort(-group_scores)[:topk_group]
        allowed = np.full(e, -np.inf)
        for g in kept:
            allowed[g * size:(g + 1) * size] = choice[t, g * size:(g + 1) * size]
        chosen = np.argsort(-allowed)[:top_k]
        w = scores[t, chosen]
        if normalize:
            w = w / (w.sum() + eps)
        weights[t], experts[t] = w * scaling, chosen
    return weights, experts


CASES = {  # name: (experts, top_k, n_group, topk_group, normalize, scaling, eps)
    "deepseek-like groups": (32, 4, 8, 3, True, 2.5, 1e-20),
    "two groups, one kept": (16, 3, 2, 1, True, 1.0, 1e-20),
    "glm (one group)": (16, 4, 1, 1, True, 1.8, 1e-20),
    "minimax (no groups, no eps)": (12, 3, 1, 1, True, 1.0, 0.0),
    "not renormalised": (16, 2, 4, 2, False, 1.5, 0.0),
}


@pytest.mark.parametrize("case", CASES)
def test_route_sigmoid_grouped_equals_the_float64_reference(case):
    e, k, n_group, topk_group, normalize, scaling, eps = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    n = 64
    logits = rng.normal(size=(n, e)).astype(np.float32) * 2
    bias = (rng.normal(size=(e,)) * 0.5).astype(np.float32)
    want_w, want_e = reference_route(logits, bias, k, n_group, topk_group, normalize, scaling, eps)
    got_w, got_e = jax.jit(moe.route_sigmoid_grouped, static_argnums=2, static_argnames=(
        "n_group", "topk_group", "normalize", "scaling", "norm_eps"))(
        jnp.asarray(logits), jnp.asarray(bias), k, n_group=n_group, topk_group=topk_group, normalize=normalize,
        scaling=scaling, norm_eps=eps)
    assert got_w.dtype == jnp.float32 and got_e.shape == (n, k)
    # ties avoided: every row's k-th and (k+1)-th allowed choice apart by far more than float32 rounding
    scores = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias
    top = np.sort(scores, axis=-1)
    assert np.min(top[:, -k] - top[:, -k - 1]) > 1e-5 or n_group > 1
    order = np.argsort(want_e, axis=-1)  # the same experts, in any order
    got_order = np.argsort(np.asarray(got_e), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(got_e), got_order, -1),
                                  np.take_along_axis(want_e, order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(got_w), got_order, -1),
                               np.take_along_axis(want_w, order, -1), rtol=1e-6, atol=1e-7)


def test_groups_limit_the_choice():
    """With groups, an expert outside the kept groups is never chosen, however high its own score: a
    group holding one very strong expert loses to groups whose two best are better together."""
    logits = np.full((1, 8), -4.0, np.float32)
    logits[0, 0] = 6.0  # group 0: one strong expert, one weak
    logits[0, 2:4] = [3.0, 2.9]  # group 1: two good ones
    logits[0, 4:6] = [2.8, 2.7]  # group 2: two good ones
    bias = np.zeros(8, np.float32)
    route = jax.jit(moe.route_sigmoid_grouped, static_argnums=2, static_argnames=("n_group", "topk_group"))
    _, experts = route(jnp.asarray(logits), jnp.asarray(bias), 2, n_group=4, topk_group=2)
    assert sorted(np.asarray(experts)[0].tolist()) == [2, 3]
    # without groups the strong expert wins
    _, experts = route(jnp.asarray(logits), jnp.asarray(bias), 2)
    assert 0 in np.asarray(experts)[0].tolist()


def test_the_correction_bias_chooses_but_does_not_weigh():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]], jnp.float32)
    bias = jnp.asarray([0.0, 0.0, 5.0, 0.0], jnp.float32)
    weights, experts = moe.route_sigmoid_grouped(logits, bias, 2, normalize=False)
    assert sorted(np.asarray(experts)[0].tolist()) == [0, 2]
    by_expert = dict(zip(np.asarray(experts)[0].tolist(), np.asarray(weights)[0].tolist()))
    np.testing.assert_allclose(by_expert[2], 0.5, rtol=1e-6)  # sigmoid(0), not sigmoid(0) + 5
    np.testing.assert_allclose(by_expert[0], 1 / (1 + np.exp(-2.0)), rtol=1e-6)


def test_moe_block_with_the_sigmoid_router_and_an_ungated_shared_expert():
    """`moe_block` of a sigmoid_grouped MoEConfig: params router (no bias), e_score_correction_bias [E],
    the experts, shared_expert (no shared_expert_gate); its output is the routed experts' weighted sum plus
    the shared expert's, computed here by hand."""
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=6, norm_topk_prob=True,
                    shared_expert_intermediate_size=12, router="sigmoid_grouped", n_group=2, topk_group=1,
                    routed_scaling_factor=2.0, norm_topk_eps=1e-20, shared_expert_gate=False)
    block = moe.moe_block(cfg)
    draw = np.random.default_rng(0)  # numpy's draws: no sampling program to compile
    x = jnp.asarray(draw.normal(size=(2, 5, 16)), jnp.float32)
    # the block's params by name and shape (its init traced, not run: eager or jitted, its truncated normals
    # take seconds to compile), drawn here at its initializer's scale (lecun normal: std 1/sqrt(fan_in))
    shapes = jax.eval_shape(block.init, jax.random.PRNGKey(0), x)["params"]
    params = jax.tree_util.tree_map(
        lambda s: jnp.asarray(draw.normal(0, s.shape[-2] ** -0.5 if len(s.shape) > 1 else 0, s.shape), s.dtype), shapes)
    assert sorted(params) == ["down_proj", "e_score_correction_bias", "gate_proj", "router", "shared_expert",
                              "up_proj"]
    assert sorted(params["router"]) == ["kernel"] and params["e_score_correction_bias"].shape == (8,)
    bias = jnp.asarray(draw.normal(size=(8,)) * 0.3, jnp.float32)
    params = {**params, "e_score_correction_bias": bias}
    got = np.asarray(jax.jit(block.apply)({"params": params}, x))  # one program, not one per eager op
    flat = np.asarray(x, np.float64).reshape(-1, 16)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    weights, experts = reference_route(flat @ p["router"]["kernel"], np.asarray(bias), 2, 2, 1, True, 2.0, 1e-20)
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    want = np.zeros_like(flat)
    for t in range(flat.shape[0]):
        for w, ex in zip(weights[t], experts[t]):
            want[t] += w * (silu(flat[t] @ p["gate_proj"][ex]) * (flat[t] @ p["up_proj"][ex])) @ p["down_proj"][ex]
        s = p["shared_expert"]
        want[t] += (silu(flat[t] @ s["gate_proj"]["kernel"]) * (flat[t] @ s["up_proj"]["kernel"])) @ s["down_proj"][
            "kernel"]
    np.testing.assert_allclose(got.reshape(-1, 16), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fields, message", [
    (dict(n_group=3), "divide num_experts"),
    (dict(n_group=8), ">= 2 experts"),
    (dict(n_group=4, topk_group=5), "topk_group must be in"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "exceeds the experts"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor must be > 0"),
    (dict(router_bias=True), "correction bias"),
    (dict(router="softmax_topk", n_group=2), "belong to the sigmoid_grouped router"),
])
def test_moe_config_refuses_bad_sigmoid_router_settings(fields, message):
    base = dict(num_experts=8, num_experts_per_tok=2, intermediate_size=4, router="sigmoid_grouped")
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**base, **fields})
