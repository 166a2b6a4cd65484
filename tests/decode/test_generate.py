"""generate: greedy output is bit-identical to plain greedy decoding; batching, stops, limits,
acceptance statistics, streaming, no recompiles, no host transfers inside the loop."""
import jax
import numpy as np
import pytest

from dflash_jax.engine import generator as gen
from dflash_jax.engine.generator import generate, generate_stream
from dflash_jax.loading.drafter_io import DrafterMismatchError
from support.speculative import plain_greedy, prompts_mix


@pytest.mark.parametrize("max_new", [1, 13, 40])
def test_greedy_equals_plain_decoding_batch1(fitted, max_new):
    target, drafter = fitted
    for prompt in prompts_mix()[:4]:
        got = generate(target, drafter, [prompt], max_new_tokens=max_new, stop_token_ids=())
        assert got.tokens[0] == plain_greedy(target, prompt, max_new)
        assert sum(got.acceptance_lengths[0]) >= len(got.tokens[0]) - 1  # prefill gives one token


def test_greedy_ragged_batch_equals_rows_alone(fitted):
    target, drafter = fitted
    prompts = prompts_mix(1)
    batch = generate(target, drafter, prompts, max_new_tokens=37, stop_token_ids=())
    for prompt, row, accepted in zip(prompts, batch.tokens, batch.acceptance_lengths):
        assert row == plain_greedy(target, prompt, 37)
        alone = generate(target, drafter, [prompt], max_new_tokens=37, stop_token_ids=())
        assert row == alone.tokens[0] and accepted == alone.acceptance_lengths[0]


def test_stop_tokens_cut_output(fitted):
    target, drafter = fitted
    prompts = prompts_mix(2)
    free = generate(target, drafter, prompts, max_new_tokens=30, stop_token_ids=())
    stop = free.tokens[0][9]  # a token the first row emits mid-block
    got = generate(target, drafter, prompts, max_new_tokens=30, stop_token_ids=[stop])
    for prompt, row in zip(prompts, got.tokens):
        want = plain_greedy(target, prompt, 30, stops=(stop,))
        assert row == want
        assert stop not in row[:-1]
    assert got.tokens[0][-1] == stop and len(got.tokens[0]) <= 10


def test_autoregressive_mode_is_the_same_loop(fitted):
    target, _ = fitted
    prompts = prompts_mix(3)
    got = generate(target, None, prompts, max_new_tokens=21, stop_token_ids=())
    assert got.tau == 1.0 and got.block_size == 1
    for prompt, row in zip(prompts, got.tokens):
        assert row == plain_greedy(target, prompt, 21)


def test_every_acceptance_length_occurs(fitted):
    target, drafter = fitted
    prompts = prompts_mix(4) + prompts_mix(5)
    result = generate(target, drafter, prompts, max_new_tokens=48, stop_token_ids=())
    hist = result.histogram()
    g = drafter.config.block_size
    assert hist[0] == 0 and len(hist) == g + 1
    assert all(hist[k] > 0 for k in range(1, g + 1)), hist
    assert result.tau > 2.0
    flat = [n for row in result.acceptance_lengths for n in row]
    assert result.tau == pytest.approx(np.mean(flat))


def test_block_size_override_and_stream(fitted):
    target, drafter = fitted
    prompts = prompts_mix(6)[:3]
    full = generate(target, drafter, prompts, max_new_tokens=25, block_size=5, stop_token_ids=())
    assert max(max(a) for a in full.acceptance_lengths) <= 5
    chunks = list(generate_stream(target, drafter, prompts, max_new_tokens=25, block_size=5, stop_token_ids=()))
    streamed = [sum((c[b] for c in chunks), []) for b in range(3)]
    assert streamed == full.tokens
    assert len(chunks) > 2


def test_same_bucket_does_not_recompile_and_no_transfers_in_loop(fitted):
    target, drafter = fitted
    first = generate(target, drafter, [[1, 2, 3], [4, 5]], max_new_tokens=16, stop_token_ids=())
    generator = gen.generator_for(target, drafter)  # what generate used
    size = generator.compile_cache_size
    second = generate(target, drafter, [[7, 8, 9, 10, 11], [3]], max_new_tokens=16, stop_token_ids=())
    assert second.compile_seconds == 0.0 and generator.compile_cache_size == size
    assert first.compile_seconds >= 0.0
    cfg, args, _ = generator._prepare([[1, 2, 3], [4, 5]], max_new_tokens=16, temperature=0.0,
                                      top_k=0, top_p=1.0, stop_token_ids=(), block_size=None, seed=0,
                                      acceptance="exact")
    prefill_fn, decode_fn, compile_seconds = generator._executables(cfg, args, "decode")
    assert compile_seconds == 0.0
    state = prefill_fn(*args)
    with jax.transfer_guard("disallow"):
        out = decode_fn(args[0], args[1], state, args[-1])
        jax.block_until_ready(out)


def test_bad_input(fitted, tmp_path):
    target, drafter = fitted
    with pytest.raises(ValueError, match="prompt too long"):
        generate(target, drafter, [[1] * 500], max_new_tokens=20)
    with pytest.raises(ValueError, match="at least one token"):
        generate(target, drafter, [[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="token ids"):
        generate(target, drafter, [[999]], max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        generate(target, drafter, [[1]], max_new_tokens=4, temperature=-1)
    import dataclasses
    wrong = dataclasses.replace(drafter, config=dataclasses.replace(drafter.config, num_target_layers=5,
                                                                    target_layer_ids=(0, 4)))
    with pytest.raises(DrafterMismatchError, match="number of target layers"):
        generate(target, wrong, [[1, 2]], max_new_tokens=4)


def test_array_with_lengths_prompts(fitted):
    target, drafter = fitted
    prompts = prompts_mix(7)[:3]
    array = np.zeros((3, 12), np.int32)
    for i, p in enumerate(prompts):
        array[i, : len(p)] = p
    lengths = np.asarray([len(p) for p in prompts])
    got = generate(target, drafter, (array, lengths), max_new_tokens=10, stop_token_ids=())
    assert got.tokens == generate(target, drafter, prompts, max_new_tokens=10, stop_token_ids=()).tokens


def test_many_stop_ids_and_two_row_list_prompts(fitted):
    target, drafter = fitted
    few = generate(target, drafter, ([1, 2, 3], [4, 5, 6]), max_new_tokens=8, stop_token_ids=[44])
    many = generate(target, drafter, ([1, 2, 3], [4, 5, 6]), max_new_tokens=8,
                    stop_token_ids=list(range(30, 40)))  # 10 ids: a second padded stop shape
    assert len(few.tokens) == len(many.tokens) == 2  # a 2-tuple of lists is two prompts, not (array, lengths)
