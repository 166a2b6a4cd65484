"""Looked-up drafts (`dflash_jax.decode.lookup`): the search against a plain Python one, and generate with
lookup: greedy output bit-identical to plain greedy decoding while the looked-up tokens change
what is drafted; argument checks; the CLI default."""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.cli import common
from dflash_jax.decode import lookup as _lookup
from dflash_jax.engine.generator import generate
from support.speculative import plain_greedy, prompts_mix


# jitted, as the decode loop runs them: one program per shape, not one per eager op
lookup_drafts = jax.jit(_lookup.lookup_drafts, static_argnums=(2, 3))
merge_lookup = jax.jit(_lookup.merge_lookup)


def reference(seq, length, longest, count):
    """The latest earlier occurrence of the last n tokens (n = longest .. 2, longest first), and
    the committed tokens after it (None where none)."""
    for n in range(longest, 1, -1):
        if length < n:
            continue
        for j in range(length - 1, n - 1, -1):
            if list(seq[j - n:j]) == list(seq[length - n:length]):
                return [int(seq[j + k]) if j + k < length else None for k in range(count)]
    return [None] * count


@pytest.mark.parametrize("longest,count", [(2, 1), (3, 1), (3, 3), (4, 2)])
def test_lookup_matches_a_plain_search(longest, count):
    rng = np.random.default_rng(longest * 10 + count)
    for _ in range(40):
        tokens = rng.integers(0, 4, size=(5, 24)).astype(np.int32)  # 4 ids: many repeats
        lengths = rng.integers(0, 25, size=5).astype(np.int32)
        drafts, found = map(np.asarray, lookup_drafts(jnp.asarray(tokens), jnp.asarray(lengths), longest, count))
        for b in range(5):
            want = reference(tokens[b], int(lengths[b]), longest, count)
            got = [int(drafts[b, k]) if found[b, k] else None for k in range(count)]
            assert got == want, (tokens[b, :lengths[b]].tolist(), longest)


def test_a_longer_match_wins_and_uncommitted_tokens_are_never_proposed():
    # last tokens 7 8 9: "8 9" last occurred at 5-6 (then 1), "7 8 9" at 0-2 (then 3)
    row = [7, 8, 9, 3, 0, 8, 9, 1, 7, 8, 9, 5, 5]  # the two 5s are past the committed length
    drafts, found = lookup_drafts(jnp.asarray([row], jnp.int32), jnp.asarray([11]), 3, 3)
    assert np.asarray(drafts).tolist() == [[3, 0, 8]] and np.asarray(found).all()
    drafts, found = lookup_drafts(jnp.asarray([row], jnp.int32), jnp.asarray([11]), 2, 3)
    assert np.asarray(drafts)[0, :2].tolist() == [1, 7] and np.asarray(found).tolist() == [[True, True, True]]
    # "9 3" never occurred before position 4: nothing found
    drafts, found = lookup_drafts(jnp.asarray([row], jnp.int32), jnp.asarray([4]), 3, 2)
    assert not np.asarray(found).any()


def test_merge_lookup_replaces_found_slots_and_their_distributions():
    tokens = jnp.asarray([[1, 2, 3, 1, 2, 0], [4, 4, 5, 6, 0, 0]], jnp.int32)
    lengths = jnp.asarray([5, 4])  # row 0 ends "1 2" (seen at 0-1, then 3), row 1 "5 6" (not seen)
    drafts = jnp.asarray([[9, 9], [8, 8]], jnp.int32)
    probs = jnp.full((2, 2, 10), 0.1)
    looked_up, found = lookup_drafts(tokens, lengths, 3, 2)
    out, out_probs = merge_lookup(drafts, probs, looked_up, found)
    assert np.asarray(out).tolist() == [[3, 1], [8, 8]]
    assert np.asarray(out_probs[0, 0]).tolist() == [0.0, 0.0, 0.0, 1.0] + [0.0] * 6
    np.testing.assert_array_equal(np.asarray(out_probs[1]), np.asarray(probs[1]))
    assert merge_lookup(drafts, None, looked_up, found)[1] is None


def test_greedy_with_lookup_equals_plain_decoding(fitted):
    target, drafter = fitted
    prompts = prompts_mix(7)
    with_lookup_result = generate(target, drafter, prompts, max_new_tokens=40, stop_token_ids=(), lookup=3)
    without = generate(target, drafter, prompts, max_new_tokens=40, stop_token_ids=())
    for prompt, row in zip(prompts, with_lookup_result.tokens):
        assert row == plain_greedy(target, prompt, 40)
    assert with_lookup_result.tokens == without.tokens
    # the looked-up tokens were drafted: some cycles accepted differently
    assert with_lookup_result.acceptance_lengths != without.acceptance_lengths


@pytest.mark.parametrize("kw,match", [
    (dict(lookup=1), "lookup must be 0"),
    (dict(lookup=-2), "lookup must be >= 0"),
])
def test_bad_lookup_arguments(fitted, kw, match):
    target, drafter = fitted
    with pytest.raises(ValueError, match=match):
        generate(target, drafter, [[1, 2, 3]], max_new_tokens=4, **kw)
    with pytest.raises(TypeError, match="lookup must be an int"):
        generate(target, drafter, [[1, 2, 3]], max_new_tokens=4, lookup=2.0)
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, None, [[1, 2, 3]], max_new_tokens=4, lookup=2)


def test_cli_lookup_default_follows_the_drafter(tmp_path, capsys):
    args = argparse.Namespace(lookup=None)
    shipped = common.shipped_drafter_dir()
    if shipped is not None:
        assert common.lookup_for(args, shipped) == common.SHIPPED_DRAFTER_LOOKUP
    assert common.lookup_for(args, tmp_path) == 0
    assert common.lookup_for(argparse.Namespace(lookup=4), tmp_path) == 4
    assert common.lookup_for(argparse.Namespace(lookup=0), shipped or tmp_path) == 0
    assert common.lookup_for(argparse.Namespace(lookup=3), None) == 0
    assert "--lookup only applies with a drafter" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    common.add_drafting_flags(parser)
    with pytest.raises(SystemExit):
        common.check_drafting_flags(parser, parser.parse_args(["--lookup", "1"]))
