"""The batch engine (`dflash_jax.engine.batch`): many prompts through a few slots, each prompt's output what
`generate` gives it alone, its programs compiled once; sampling with a key per prompt; bad input."""
from __future__ import annotations

import numpy as np
import pytest
from support import fitted_models
from support.sampling import PROMPT, chi_square_pvalue, exact_joint, sampling_pair

from dflash_jax import generate, generate_batch
from dflash_jax.engine.generator import Generator, generator_for

# The engine tests on the fitted pair that do not count programs share one set of shapes (2 slots,
# prompts of <= 16 tokens: one prefill chunk size, 16 new tokens, no stop ids) on `generate`'s own
# Generator (`generator_for`), so that their engines, and `generate_batch`'s, reuse the programs one
# of them compiled: what each asserts does not depend on the slot count or the prompts' lengths.
SHARED = dict(slots=2, max_prompt_tokens=16, max_new_tokens=16, stop_token_ids=())


def _prompts(count=40, seed=0, longest=300):
    """count prompts of 3..longest tokens: the fitted pattern (every other one) and noise, lengths spread."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(3, longest, count).astype(int)
    rng.shuffle(lengths)
    out = []
    for i, n in enumerate(lengths):
        if i % 2:
            out.append([int(t) for t in fitted_models.pattern_batch(rng, 1, int(n))[0]])
        else:
            out.append([int(t) for t in rng.integers(0, 40, size=int(n))])
    return out


# [plain] under `make test-all`; covered by default: [speculative] (the same engine, slots and prompts,
# against generate) and test_benchmark_cli.py::test_concurrency_runs_the_engine_and_profile_verify_
# writes_a_cost_table_it_reads (newer-jax leg: an engine without a drafter, its tokens equal a speculative engine's)
@pytest.mark.parametrize("speculative", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["speculative", "plain"])
def test_forty_prompts_through_eight_slots_equal_generate_alone(fitted, speculative):
    target, drafter = fitted
    drafter = drafter if speculative else None
    prompts = _prompts()
    engine = Generator(target, drafter).engine(slots=8, max_prompt_tokens=300, max_new_tokens=24,
                                               stop_token_ids=(5,))
    results = engine.generate(prompts)
    chunk_sizes = {min(max(16, 1 << (len(p) - 1).bit_length()), 256) for p in prompts}
    assert engine.compiled_programs == 2 + len(chunk_sizes)  # the empty state, the decode loop, a prefill each
    assert engine.stats.returns > 40 // 8  # slots were refilled while others decoded
    # one ragged batch: its rows are each prompt alone, tokens and acceptance lengths
    # (test_generate.py::test_greedy_ragged_batch_equals_rows_alone), with a compile per bucket fewer
    want = generate(target, drafter, prompts, max_new_tokens=24, stop_token_ids=(5,))
    if speculative:
        assert [r.acceptance_lengths for r in results] == want.acceptance_lengths
    assert all(r.ok for r in results)
    assert [r.tokens for r in results] == want.tokens
    if speculative:  # the fitted drafter is accepted on the pattern's prompts: blocks, not steps
        assert np.mean([r.tau for r in results[1::2]]) > 2
    again = dict(engine.run(prompts[::-1]))
    assert engine.stats.compile_seconds == 0.0  # nothing compiled again for another order
    assert [again[i].tokens for i in range(40)] == [r.tokens for r in results[::-1]]


def test_results_come_back_as_prompts_complete(fitted):
    target, drafter = fitted
    prompts = [[1, 2, 3], [7, 9, 11, 13], [2, 4], list(range(1, 17)), [5, 6, 7]]
    engine = generator_for(target, drafter).engine(**SHARED)
    run = engine.run(prompts)
    first_index, first = next(run)
    assert engine.stats.prefill_chunks == 2  # yielded while three prompts still wait for a slot
    rest = dict(run)
    assert sorted([first_index, *rest]) == [0, 1, 2, 3, 4] and first_index in (0, 1)
    assert len(first.tokens) == 16 and all(len(r.tokens) == 16 for r in rest.values())


# newer-jax leg only (`one_leg`); both legs run the engine (above) and the exact sampling rule's
# chi-squares (test_sampling.py)
@pytest.mark.one_leg
def test_sampling_through_the_engine_is_the_target_distribution_in_any_order():
    target, drafter = sampling_pair()
    depth, count = 2, 1500
    others = [[2, 3], [5, 1, 1, 4], [3]]
    prompts = [PROMPT] * count + others * 20
    order = np.random.default_rng(0).permutation(len(prompts))
    seeds = list(range(len(prompts)))
    engine = Generator(target, drafter).engine(slots=48, max_prompt_tokens=8, max_new_tokens=depth,
                                               stop_token_ids=(), temperature=1.0)
    results = engine.generate([prompts[i] for i in order], seeds=[seeds[i] for i in order])
    by_prompt = {int(i): r.tokens for i, r in zip(order, results)}
    samples = [tuple(by_prompt[i]) for i in range(count)]
    assert chi_square_pvalue(samples, exact_joint(target, depth=depth)) > 1e-3
    # a prompt's sample follows its own seed: the same in another order and other slots
    shuffled = np.random.default_rng(1).permutation(len(prompts))[:120]
    engine_small = Generator(target, drafter).engine(slots=5, max_prompt_tokens=8, max_new_tokens=depth,
                                                     stop_token_ids=(), temperature=1.0)
    again = engine_small.generate([prompts[i] for i in shuffled], seeds=[seeds[i] for i in shuffled])
    assert [r.tokens for r in again] == [by_prompt[int(i)] for i in shuffled]


def test_bad_input(fitted):
    target, drafter = fitted
    generator = generator_for(target, drafter)
    engine = generator.engine(**SHARED)
    with pytest.raises(ValueError, match="no prompts"):
        engine.generate([])
    with pytest.raises(ValueError, match="slots"):
        generator.engine(slots=0)
    with pytest.raises(ValueError, match="prompts\\[1\\] is empty"):
        engine.generate([[1, 2], []])
    with pytest.raises(ValueError, match="seeds"):
        engine.generate([[1, 2]], seeds=[1, 2])
    results = engine.generate([[1, 2, 3], list(range(1, 30)), [4, 5]])
    assert [r.ok for r in results] == [True, False, True]
    assert "prompt too long: 29 tokens" in results[1].error and results[1].tokens == []
    assert results[0].tokens == generate(target, drafter, [[1, 2, 3]], max_new_tokens=16, stop_token_ids=()).tokens[0]
    assert generate_batch(target, drafter, [[1, 2, 3]], slots=2, max_new_tokens=16, stop_token_ids=())[0].tokens == \
        results[0].tokens


def test_a_verify_budget_or_cost_table_changes_what_is_verified_not_the_tokens(fitted):
    target, drafter = fitted
    prompts = _prompts(10, seed=3, longest=16)
    generator = generator_for(target, drafter)
    full = generator.engine(**SHARED)
    want = full.generate(prompts)
    g = drafter.config.block_size
    assert full.stats.verified_per_cycle == 2 * g
    budget = generator.engine(**SHARED, verify_budget=2 * 2 + 1)  # slots x width <= 5: width 2
    got = budget.generate(prompts)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert max(n for r in got for n in r.acceptance_lengths) == 2 < max(n for r in want for n in r.acceptance_lengths)
    assert budget.stats.verified_per_cycle == 2 * 2
    # a cost table that makes wide verifies dear: narrower cycles, the same tokens
    costs = {1: 1.0, 2: 1.05, 4: 1.5, g: 8.0}
    cheap = generator.engine(**SHARED, verify_costs=costs)
    assert [r.tokens for r in cheap.generate(prompts)] == [r.tokens for r in want]
    assert 1 < cheap.stats.verified_per_cycle / 2 <= 4  # widths 2 and 4 chosen, never the block
    solo = generate(target, drafter, prompts[:3], max_new_tokens=16, stop_token_ids=(), verify_costs=costs,
                    verify_budget=6)  # generate takes them too; the budget bounds the table's choice to width 2
    assert solo.tokens == [r.tokens for r in want[:3]]
    assert max(n for row in solo.acceptance_lengths for n in row) <= 2
    with pytest.raises(ValueError, match="need a drafter"):
        generate(target, None, prompts[:1], verify_budget=8)
    with pytest.raises(ValueError, match="verify_costs: a width"):
        generate(target, drafter, prompts[:1], verify_costs={g + 1: 1.0})
    with pytest.raises(ValueError, match="min_draft_probability and verify_budget"):
        generate(target, drafter, prompts[:1], verify_budget=8, min_draft_probability=0.5)


# newer-jax leg only (`one_leg`); both legs run its parts: slots refilled (the forty prompts above), the
# hybrid's states rolled back (test_conformance_qwen3_5_moe.py's rejections) and the ring draft cache
# (test_drafter_reference.py::test_greedy_with_a_bounded_draft_context_equals_plain_decoding)
@pytest.mark.one_leg
def test_a_reused_slot_starts_clean_with_a_hybrid_target_and_a_ring_draft_cache():
    """A Qwen3.5 hybrid (its slots carry recurrent states that a new prompt must not inherit) with a
    drafter that sees only its last 8 positions (a ring context cache): seven prompts through three
    slots equal one ragged `generate` of them (whose rows equal each prompt alone)."""
    from support.families import tiny_target
    from support.speculative import tiny_drafter

    target = tiny_target("qwen3_5")
    drafter = tiny_drafter(target, block_size=4)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, target.config.vocab_size - 1, size=n)]
               for n in (3, 16, 9, 14, 5, 12, 4)]  # <= 16: one prefill chunk size; most longer than the ring of 8
    options = dict(max_new_tokens=10, stop_token_ids=(), draft_context=8)
    got = Generator(target, drafter).engine(slots=3, max_prompt_tokens=16, **options).generate(prompts)
    assert [r.tokens for r in got] == generate(target, drafter, prompts, **options).tokens


def sharded_engine_run(out):
    """(In a process with 8 CPU devices.) A tiny target and drafter on a data=2 x tensor=2 mesh: the
    engine's outputs, and one device's."""
    import json

    import jax

    from dflash_jax import sharding
    from dflash_jax.models.config import ModelConfig
    from dflash_jax.models.target import init_target_params, Target
    from support.speculative import tiny_drafter

    config = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, max_position_embeddings=256)
    target = Target(config, init_target_params(config, jax.random.PRNGKey(0)))
    drafter = tiny_drafter(target, block_size=4)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 60, size=n)] for n in (3, 21, 8, 40, 5, 12)]
    options = dict(max_new_tokens=10, stop_token_ids=())
    mesh = sharding.make_mesh(data=2, tensor=2, devices=jax.devices()[:4])
    found = {}
    for name, m in (("one", None), ("mesh", mesh)):
        for mode, d in (("spec", drafter), ("plain", None)):
            found[f"{name}-{mode}"] = [r.tokens for r in generate_batch(target, d, prompts, slots=4, mesh=m, **options)]
    found["generate"] = generate(target, drafter, prompts, **options).tokens
    with open(out, "w") as f:
        json.dump(found, f)


@pytest.mark.slow
def test_the_engine_on_a_mesh_gives_one_devices_output():
    from support.devices import run_8_devices

    found = run_8_devices("sharded_engine_run({out})", "test_engine")
    assert found["mesh-spec"] == found["one-spec"] == found["generate"]
    assert found["mesh-plain"] == found["one-plain"] == found["generate"]


def test_what_a_cycle_verifies_never_reads_a_sampled_draft():
    """The drafter's confidence that `_verify_plan` chooses the width from is the same whichever drafts
    the sampling drew (two keys, different drafts): the choice is independent of the drafts, which the
    exact rule needs (reading a sampled draft's own probability biases the output)."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.decode import sampling
    from dflash_jax.decode.loop import _propose, GenerationConfig, prefill, SamplingParams

    target, drafter = sampling_pair()
    cfg = GenerationConfig(max_new_tokens=4, block_size=4, sampling=True, verify_widths=(1, 2, 4),
                           verify_policy="costs")
    params = SamplingParams(temperature=jnp.float32(1.0), top_p=jnp.float32(1.0),
                            stop_token_ids=jnp.full((8,), -1, jnp.int32), verify_costs=jnp.ones((3,), jnp.float32))
    tokens = jnp.asarray([PROMPT + [0]] * 64, jnp.int32)
    lengths = jnp.full((64,), len(PROMPT), jnp.int32)

    @jax.jit
    def propose(key):
        state = prefill(target.spec, drafter.spec, cfg, target.params, drafter.loop_params, tokens, lengths,
                        jax.random.PRNGKey(0), params)
        anchors = sampling.gather_rows(state.tokens, state.lengths - 1)
        return _propose(target.spec, drafter.spec, cfg, target.params, drafter.loop_params, anchors,
                        state.draft_cache, key, params)

    drafts_a, _, confidence_a, _ = propose(jax.random.PRNGKey(1))
    drafts_b, _, confidence_b, _ = propose(jax.random.PRNGKey(2))
    assert np.any(np.asarray(drafts_a) != np.asarray(drafts_b))
    assert confidence_a.shape == drafts_a.shape
    np.testing.assert_array_equal(np.asarray(confidence_a), np.asarray(confidence_b))
