"""Lossless sampling: the empirical distribution of the first generated tokens matches the target's
exact distribution (chi-square, fixed seeds and threshold), with a drafter that differs from it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dflash_jax.decode import sampling
from dflash_jax.engine.generator import generate
from support.sampling import PROMPT, SAMPLES, chi_square_pvalue, exact_joint, sampling_pair



@pytest.fixture(scope="module")
def pair():
    return sampling_pair()


def sample_sequences(target, drafter, depth=3, prompt=PROMPT, **kw):
    result = generate(target, drafter, [prompt] * SAMPLES, max_new_tokens=depth, stop_token_ids=(), **kw)
    assert all(len(t) == depth for t in result.tokens)
    return [tuple(t) for t in result.tokens], result


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=1.3, top_k=4, top_p=0.8),  # both filters in one compiled loop
    dict(temperature=0.7, acceptance="match"),
], ids=["t1", "t1.3-topk4-topp0.8", "match-rule-t0.7"])
def test_speculative_sampling_matches_target_distribution(pair, kw):
    target, drafter = pair
    samples, result = sample_sequences(target, drafter, seed=11, **kw)
    exact = exact_joint(target, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0))
    assert chi_square_pvalue(samples, exact) > 1e-3
    # The drafter really drafted and was sometimes accepted (the rule was exercised).
    assert result.tau > 1.05


# newer-jax leg only (`one_leg`); both legs: lookup's greedy checks (test_lookup.py)
@pytest.mark.one_leg
def test_sampling_with_looked_up_drafts_matches_target_distribution(pair):
    """A prompt that repeats itself: its last two tokens occurred before, so the first cycle's
    slots hold looked-up tokens (point-mass drafts) and later cycles often do too."""
    target, drafter = pair
    prompt = [1, 4, 2, 1, 4, 2, 1, 4]
    samples, result = sample_sequences(target, drafter, prompt=prompt, seed=14, temperature=1.0, lookup=2)
    assert chi_square_pvalue(samples, exact_joint(target, prompt=prompt)) > 1e-3
    assert result.tau > 1.05
    # the first cycle drafted the looked-up 2, 1, 4: its acceptance differs from the drafter's (the
    # same keys without lookup: the shapes and options of the [t1] run, whose programs it reuses)
    _, plain = sample_sequences(target, drafter, prompt=prompt, seed=14, temperature=1.0)
    assert [a[0] for a in plain.acceptance_lengths] != [a[0] for a in result.acceptance_lengths]


# newer-jax leg only (`one_leg`); both legs: the gate's greedy check (test_draft_gate.py)
@pytest.mark.one_leg
def test_sampling_with_gated_drafts_matches_target_distribution(pair):
    """min_draft_probability: a cycle whose first draft the drafter gave less than the threshold
    runs the anchor alone. Which cycles verify depends only on the drafter, never on the target, so
    the samples keep the target's distribution; the gate changed which cycles verified drafts."""
    target, drafter = pair
    # The gate is batch-wide (a cycle verifies drafts where any live row's first draft passes) and
    # these 6,000 rows share the prompt: at 0.42 no row's first cycle passes and the second cycle's
    # drafts do (the threshold where the first cycles of the rows stop passing is 0.38-0.40; the
    # second cycles' 0.44-0.45)
    samples, result = sample_sequences(target, drafter, seed=15, temperature=1.0, min_draft_probability=0.42)
    assert chi_square_pvalue(samples, exact_joint(target)) > 1e-3
    _, ungated = sample_sequences(target, drafter, seed=15, temperature=1.0)
    assert all(a[0] == 1 for a in result.acceptance_lengths)  # every first cycle was gated ...
    assert sum(result.num_cycles) > sum(ungated.num_cycles)
    assert result.tau > 1.02  # ... and second cycles still accepted drafts


def test_baseline_sampling_matches_and_test_has_power(pair):
    target, drafter = pair
    samples, _ = sample_sequences(target, None, seed=12, temperature=1.0)
    exact = exact_joint(target)
    assert chi_square_pvalue(samples, exact) > 1e-3
    # Power check: the same statistic rejects a wrong distribution (temperature 1.5 samples).
    wrong, _ = sample_sequences(target, None, seed=13, temperature=1.5)
    assert chi_square_pvalue(wrong, exact) < 1e-6


def test_exact_rule_unit_distribution():
    """accept_exact on fixed distributions: the emitted first token follows p_t exactly."""
    p_t = jnp.asarray([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])[None]  # [1, G=2, V=3]
    p_d = jnp.asarray([[0.1, 0.1, 0.8]])[None]  # [1, G-1=1, V]
    n = 20000
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    draft_keys = jax.random.split(jax.random.PRNGKey(1), n)

    def one(key, dkey):
        draft = sampling.sample(dkey, p_d)
        accepted, nxt = sampling.accept_exact(key, draft, p_d, p_t)
        return jnp.where(accepted[0] > 0, draft[0, 0], nxt[0])

    first = np.asarray(jax.vmap(one)(keys, draft_keys))
    counts = np.bincount(first, minlength=3)
    assert stats.chisquare(counts, np.asarray([0.5, 0.3, 0.2]) * n).pvalue > 1e-3


def sorted_nucleus(probs, top_p):
    """The definition top-p implements, by sorting: walking the tokens in descending order, keep a
    token while the mass before it is < top_p, and keep every token tied with the last kept one."""
    ordered = -np.sort(-probs, axis=-1)
    mass_before = np.cumsum(ordered, axis=-1) - ordered
    cutoff = np.min(np.where(mass_before < top_p, ordered, np.inf), axis=-1, keepdims=True)
    return probs >= cutoff


@pytest.mark.parametrize("top_k", [0, 3])
def test_top_p_without_sorting_equals_the_sorted_definition(top_k):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 97)).astype(np.float32) * rng.uniform(0.2, 6.0, size=(64, 1))
    logits[::2] = np.round(logits[::2])  # many exact ties, also at the cutoff
    logits[1::4, :40] = -np.inf  # tokens that are already out
    checked = 0
    for top_p in (0.05, 0.3, 0.5, 0.9, 0.99):
        got = np.asarray(sampling.filtered_probs(jnp.asarray(logits), 1.0, top_k, jnp.float32(top_p)))
        base = np.asarray(sampling.filtered_probs(jnp.asarray(logits), 1.0, top_k))
        # Float sums in another order differ by rounding: skip rows whose boundary sits within it.
        ordered = -np.sort(-base, axis=-1)
        boundary = np.min(np.abs(np.cumsum(ordered, axis=-1) - top_p), axis=-1) < 1e-5
        want = sorted_nucleus(base, top_p)
        np.testing.assert_array_equal((got > 0)[~boundary], want[~boundary])
        np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)
        checked += int((~boundary).sum())
    assert checked > 300
    # The top token is always kept, even when it alone carries more than top_p.
    peaked = sampling.filtered_probs(jnp.asarray([[9.0, 0.0, 0.0, 0.0]]), 1.0, 0, jnp.float32(0.1))
    np.testing.assert_array_equal(np.asarray(peaked) > 0, [[True, False, False, False]])


def test_top_k_keeps_ties_and_greedy_matches_argmax():
    logits = jnp.asarray([[1.0, 3.0, 2.0, 2.0, 0.5], [0.0, 0.0, 0.0, 0.0, -1.0]])
    kept = np.asarray(sampling.filtered_probs(logits, 1.0, 2)) > 0
    np.testing.assert_array_equal(kept, [[False, True, True, True, False], [True, True, True, True, False]])
    rng = np.random.default_rng(1)
    ties = jnp.asarray(np.round(rng.normal(size=(32, 50)) * 2), jnp.float32)
    np.testing.assert_array_equal(sampling.greedy(ties), jnp.argmax(ties, axis=-1))


def test_chunked_sample_follows_the_distribution():
    """`sample` draws a chunk and then an id inside it: the draws follow probs exactly, zero-probability
    ids (the padded tail of the last chunk included) never come out."""
    probs = np.zeros(11, np.float32)  # chunks of 4: the last chunk has one padded slot
    probs[[0, 3, 4, 9, 10]] = [0.1, 0.25, 0.05, 0.35, 0.25]
    n = 20000
    draws = np.asarray(sampling.sample(jax.random.PRNGKey(2), jnp.broadcast_to(jnp.asarray(probs), (n, 11))))
    counts = np.bincount(draws, minlength=12)
    assert counts[11] == 0 and counts[:11][probs == 0].sum() == 0
    support = probs > 0
    assert stats.chisquare(counts[:11][support], probs[support] * n).pvalue > 1e-3


# newer-jax leg only (`one_leg`); both legs run the rule's chi-squares (above) and the engine's verify budget
# and cost table (test_engine.py::test_a_verify_budget_or_cost_table_changes_what_is_verified_not_the_tokens)
@pytest.mark.one_leg
def test_sampling_under_a_verify_cost_table_matches_target_distribution(pair):
    """Each cycle verifies the prefix of the block a cost table chooses from the drafter's confidence
    (its top probabilities): the exact rule on each prefix keeps the target's distribution."""
    target, drafter = pair
    costs = {1: 1.0, 2: 1.05, 4: 1.1}
    samples, result = sample_sequences(target, drafter, seed=17, temperature=1.0, verify_costs=costs)
    assert chi_square_pvalue(samples, exact_joint(target)) > 1e-3
    assert result.tau > 1.05
