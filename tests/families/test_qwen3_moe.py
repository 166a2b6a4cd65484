"""Qwen3-MoE targets, what is theirs alone: the grouped expert matmul in every form against a loop
over experts, and the refusal of dense layers among MoE ones. Parity with transformers, cached ragged
prefill, speculative decoding with rejections and sampling are the conformance suite's
(test_family_conformance.py, the qwen3_moe row of support/families.py)."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from dflash_jax.layers import moe


@pytest.mark.parametrize("form", ["auto", *moe.FORMS])
@pytest.mark.parametrize("n", [2, 13])
def test_grouped_experts_equal_a_loop_over_experts(n, form):
    """Every form, for fewer (token, expert) pairs than experts and more: the chosen experts'
    weights gathered, `ragged_dot` over the pairs sorted by expert, and "auto"
    (this platform's choice)."""
    rng = np.random.default_rng(0)
    d, i, e, k = 8, 6, 5, 2
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(e, d, i)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(e, i, d)), jnp.float32)
    # jitted, as a model runs them: one program each, not one per eager op
    weights, experts = jax.jit(moe.route, static_argnums=(1, 2))(jnp.asarray(rng.normal(size=(n, e)), jnp.float32), k,
                                                                 True)
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
    got = jax.jit(moe.grouped_experts, static_argnames="form")(x, experts, weights, gate, up, down, form=form)
    # the loop in numpy, float32 (not one jax op per token and expert, each compiled)
    xs, gs, us, ds, ws, es = (np.asarray(a) for a in (x, gate, up, down, weights, experts))
    want = np.zeros((n, d), np.float32)
    for t in range(n):
        for j in range(k):
            ex = int(es[t, j])
            a = xs[t] @ gs[ex]
            h = a / (1 + np.exp(-a)) * (xs[t] @ us[ex])
            want[t] += float(ws[t, j]) * (h @ ds[ex])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
