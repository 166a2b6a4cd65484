"""Gated verification (`generate(min_draft_probability=...)`): a cycle verifies its drafts only
where some live row's first draft is likely enough under the drafter, else it runs the anchor
alone. Greedy output stays bit-identical to plain greedy decoding whatever the threshold; the gate
really changes which cycles verify drafts; sampling keeps the target's distribution
(test_sampling); no cache is copied (test_decode_hlo)."""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.cli import common
from dflash_jax.decode.loop import _top_probability
from dflash_jax.engine.generator import generate
from support.speculative import plain_greedy, prompts_mix


def test_the_gate_reads_the_top_probability_of_the_first_slot():
    """What a cycle compares with the threshold: the largest softmax probability of the drafter's first
    slot (a greedy draft's own; stable for logits far from 0). It never reads the drafted token, so at
    temperature > 0 the choice to verify is independent of the sampled draft, as the exact rule needs."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 50)) * 5 + jnp.asarray([[0.0], [300.0], [-300.0], [7.0]])
    want = np.max(np.asarray(jax.nn.softmax(logits, -1)), -1)
    np.testing.assert_allclose(np.asarray(_top_probability(logits)), want, rtol=1e-5)


@pytest.mark.parametrize("lookup", [0, 3])
def test_greedy_with_gated_drafts_equals_plain_decoding(fitted, lookup):
    target, drafter = fitted
    prompts = prompts_mix(5)
    ungated = generate(target, drafter, prompts, max_new_tokens=30, stop_token_ids=(), lookup=lookup)
    for threshold in (0.9, 1.0):
        gated = generate(target, drafter, prompts, max_new_tokens=30, stop_token_ids=(), lookup=lookup,
                         min_draft_probability=threshold)
        assert gated.tokens == ungated.tokens
        for prompt, row in zip(prompts, gated.tokens):
            assert row == plain_greedy(target, prompt, 30)
        # the gate turned some cycles into single steps, so the rows ran more cycles
        assert sum(gated.num_cycles) > sum(ungated.num_cycles)


def test_a_certain_lookup_passes_the_gate(fitted):
    """Looked-up tokens count as probability 1: with the gate at 1.0 the drafter's drafts never
    pass (every cycle is a single step), but on a row whose answer repeats itself the cycles
    whose slots the lookup filled still verify, and accept, drafts."""
    target, drafter = fitted
    # the batch (and options) of test_greedy_with_gated_drafts_equals_plain_decoding, whose programs
    # these calls reuse; the gate is batch-wide, and at 1.0 no row's drafter draft passes it
    prompts = prompts_mix(5)  # the first: the fitted pattern, its answer cycles through the same tokens
    drafter_only = generate(target, drafter, prompts, max_new_tokens=30, stop_token_ids=(),
                            min_draft_probability=1.0)
    looked_up = generate(target, drafter, prompts, max_new_tokens=30, stop_token_ids=(), lookup=3,
                         min_draft_probability=1.0)
    assert drafter_only.tokens == looked_up.tokens == [plain_greedy(target, prompt, 30) for prompt in prompts]
    assert all(set(lengths) == {1} for lengths in drafter_only.acceptance_lengths)
    assert max(looked_up.acceptance_lengths[0]) > 1


@pytest.mark.parametrize("kw,error,match", [
    (dict(min_draft_probability=-0.1), ValueError, r"min_draft_probability must be in \[0, 1\]"),
    (dict(min_draft_probability=1.5), ValueError, r"min_draft_probability must be in \[0, 1\]"),
    (dict(min_draft_probability="0.5"), TypeError, "min_draft_probability must be a number"),
])
def test_bad_gate_arguments(fitted, kw, error, match):
    target, drafter = fitted
    with pytest.raises(error, match=match):
        generate(target, drafter, [[1, 2, 3]], max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, None, [[1, 2, 3]], max_new_tokens=4, min_draft_probability=0.5)


def test_cli_gate_default_follows_the_drafter(tmp_path, capsys):
    """The CLIs gate at SHIPPED_DRAFTER_MIN_DRAFT_PROBABILITY with the shipped SmolLM2 drafter, not
    with any other unless asked; a value out of [0, 1] is refused."""
    args = argparse.Namespace(lookup=None, min_draft_probability=None, drafter_weights=None)
    shipped = common.shipped_drafter_dir()
    if shipped is not None:
        common.resolve_drafting(args, shipped)
        assert args.min_draft_probability == common.SHIPPED_DRAFTER_MIN_DRAFT_PROBABILITY
        assert common.drafting_kwargs(args, object()) == dict(
            lookup=common.SHIPPED_DRAFTER_LOOKUP, min_draft_probability=common.SHIPPED_DRAFTER_MIN_DRAFT_PROBABILITY)
    assert common.min_draft_probability_for(argparse.Namespace(min_draft_probability=None), tmp_path) == 0.0
    assert common.min_draft_probability_for(argparse.Namespace(min_draft_probability=0.5), tmp_path) == 0.5
    assert common.min_draft_probability_for(argparse.Namespace(min_draft_probability=0.5), None) == 0.0
    assert "--min-draft-probability only applies with a drafter" in capsys.readouterr().err
    assert common.drafting_kwargs(argparse.Namespace(lookup=3, min_draft_probability=0.5), None) == dict(
        lookup=0, min_draft_probability=0.0)
    parser = argparse.ArgumentParser()
    common.add_drafting_flags(parser)
    for bad in ("-0.5", "1.5"):
        with pytest.raises(SystemExit):
            common.check_drafting_flags(parser, parser.parse_args(["--min-draft-probability", bad]))
