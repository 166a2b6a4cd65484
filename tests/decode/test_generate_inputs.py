"""Bad arguments to generate / generate_stream: each raises at the call with the exception type
stated here and a message that names the argument; and the result helpers (decode speed apart from
the prefill's token, the answer text without its stop token), prompt buckets, the compile cache."""
import dataclasses
import warnings

import jax.numpy as jnp
import pytest

from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.drafters.drafter import Drafter, drafter_param_shapes
from dflash_jax.engine import generator as speculative
from dflash_jax.engine.generator import generate, generate_stream, GenerationResult
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.target import Target, target_param_shapes, TargetSpec
from support.families import drawn_params

VOCAB = 16
TARGET = ModelConfig(arch="llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=128)
DRAFTER = DrafterConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=8, vocab_size=VOCAB, num_target_layers=2, target_layer_ids=(0, 1),
                        block_size=4, mask_token_id=VOCAB - 1)


@pytest.fixture(scope="module")
def pair():
    target = Target(TARGET, drawn_params(target_param_shapes(TARGET), 0))
    return target, Drafter(DRAFTER, drawn_params(drafter_param_shapes(DRAFTER), 1))


BAD_CALLS = [
    # (keyword arguments, exception type, words the message must contain)
    (dict(prompts=[1, 2, 3]), ValueError, ["prompts", "[[1, 2, 3]]"]),
    (dict(prompts="hello"), TypeError, ["prompts", "tokenizer"]),
    (dict(prompts=[[1, 2.5]]), TypeError, ["prompts[0]", "integer"]),
    (dict(prompts=[[1, 2], [VOCAB]]), ValueError, ["prompts[1]", str(VOCAB)]),
    (dict(temperature=float("nan")), ValueError, ["temperature", "nan"]),
    (dict(temperature=float("inf")), ValueError, ["temperature", "inf"]),
    (dict(temperature="0.5"), TypeError, ["temperature"]),
    (dict(top_p=0.0), ValueError, ["top_p"]),
    (dict(top_p=float("nan")), ValueError, ["top_p"]),
    (dict(top_k=VOCAB + 1), ValueError, ["top_k", "vocabulary", str(VOCAB)]),
    (dict(top_k=-1), ValueError, ["top_k"]),
    (dict(top_k=2.0), TypeError, ["top_k"]),
    (dict(stop_token_ids=[-1]), ValueError, ["stop_token_ids", "-1"]),
    (dict(stop_token_ids=[3, VOCAB]), ValueError, ["stop_token_ids", str(VOCAB)]),
    (dict(stop_token_ids="</s>"), TypeError, ["stop_token_ids"]),
    (dict(max_new_tokens=0), ValueError, ["max_new_tokens"]),
    (dict(max_new_tokens=2.0), TypeError, ["max_new_tokens"]),
    (dict(block_size=1), ValueError, ["block_size"]),
    (dict(seed=0.5), TypeError, ["seed"]),
    (dict(acceptance="greedy"), ValueError, ["acceptance"]),
]


@pytest.mark.parametrize("entry", ["generate", "generate_stream"])
@pytest.mark.parametrize("kwargs, error, words", BAD_CALLS, ids=[
    "-".join(f"{k}={v!r}" for k, v in kw.items()) for kw, _, _ in BAD_CALLS])
def test_bad_argument_raises_at_the_call_and_names_it(pair, entry, kwargs, error, words):
    target, drafter = pair
    kwargs = {"max_new_tokens": 4, **kwargs}
    prompts = kwargs.pop("prompts", [[1, 2, 3]])
    run = {"generate": generate, "generate_stream": generate_stream}[entry]
    with pytest.raises(error) as caught:
        run(target, drafter, prompts, **kwargs)  # the stream is never iterated: it raises eagerly
    assert type(caught.value) is error
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


MISUSED_MODELS = [
    # (what is passed as (target, drafter), words the TypeError must contain)
    ("target-as-a-path", lambda t, d: ("models/qwen3", d), ["target", "path", "dflash_jax.load_target"]),
    ("drafter-as-a-path", lambda t, d: (t, "checkpoints/smollm2-dflash"), ["drafter", "path",
                                                                           "dflash_jax.load_drafter"]),
    ("swapped", lambda t, d: (d, t), ["swapped", "generate(target, drafter"]),
    ("drafter-alone", lambda t, d: (d, None), ["swapped", "drafter=None"]),
    ("target-as-the-drafter", lambda t, d: (t, t), ["drafter is a target", "load_drafter"]),
    ("something-else", lambda t, d: (t, 3), ["drafter", "int"]),
]


@pytest.mark.parametrize("entry", ["generate", "generate_stream", "Generator"])
@pytest.mark.parametrize("case, swap, words", MISUSED_MODELS, ids=[c for c, _, _ in MISUSED_MODELS])
def test_models_in_the_wrong_place_raise_a_type_error_with_the_fix(pair, entry, case, swap, words):
    target, drafter = swap(*pair)
    with pytest.raises(TypeError) as caught:
        if entry == "Generator":
            speculative.Generator(target, drafter)
        else:
            {"generate": generate, "generate_stream": generate_stream}[entry](target, drafter, [[1, 2]],
                                                                              max_new_tokens=4)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_text_where_token_ids_belong_points_at_the_tokenizer(pair):
    target, drafter = pair
    for prompts, where in (("hello", "prompts"), (["hello"], "prompts[0]"), ([[1, 2], "hi"], "prompts[1]")):
        with pytest.raises(TypeError) as caught:
            generate(target, drafter, prompts, max_new_tokens=4)
        assert where in str(caught.value) and "target.tokenizer.encode(text)" in str(caught.value), str(caught.value)


# Programs are compiled per batch size, prompt bucket and max_new_tokens room (a multiple of 64):
# the tests below that generate use two rows in the first bucket and a room of 64 (TWO_ROWS) where
# their assertions do not depend on the shape, so that they share the prefill and loop programs
# (`generator_for`'s, and the run's persistent compilation cache across their own Generators).
TWO_ROWS = [[1, 2, 3], [3]]


def test_an_int_stop_id_is_one_stop_id(pair):
    target, drafter = pair
    free = generate(target, drafter, TWO_ROWS, max_new_tokens=6, stop_token_ids=())
    stop = free.tokens[0][2]
    first = free.tokens[0].index(stop)
    as_int = generate(target, drafter, TWO_ROWS, max_new_tokens=6, stop_token_ids=stop)
    assert as_int.tokens == generate(target, drafter, TWO_ROWS, max_new_tokens=6,
                                     stop_token_ids=[stop]).tokens
    assert as_int.tokens[0] == free.tokens[0][: first + 1]


def test_block_size_beyond_training_warns_naming_both(pair):
    target, drafter = pair
    options = dict(max_new_tokens=3, temperature=0.0, top_k=0, top_p=1.0, stop_token_ids=(), seed=0,
                   acceptance="exact")
    with pytest.warns(UserWarning, match=r"block_size 6 .*trained for \(4\)"):
        cfg, _, _ = speculative._prepare(target, drafter, [[1, 2]], block_size=6, **options)
    assert cfg.block_size == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        speculative._prepare(target, drafter, [[1, 2]], block_size=4, **options)


class _Tokenizer:
    """decode() that shows which ids and which skip_special_tokens it was given."""

    def decode(self, ids, skip_special_tokens=False):
        return f"{list(ids)}/{skip_special_tokens}"


def test_result_text_and_decode_speed():
    result = GenerationResult(tokens=[[5, 6, 2], [7, 8]], acceptance_lengths=[[1, 1], [1]],
                              prefill_seconds=1.0, decode_seconds=2.0, compile_seconds=0.0, block_size=1,
                              stop_token_ids=(2,))
    assert result.text(_Tokenizer()) == "[5, 6]/True"  # the closing stop token is dropped
    assert result.text(_Tokenizer(), row=1) == "[7, 8]/True"
    assert result.num_generated == 5 and result.num_decoded == 3  # each row's first token is the prefill's
    assert result.decode_tokens_per_second == pytest.approx(3 / 2.0)
    assert result.tokens_per_second == pytest.approx(5 / 3.0)


def test_results_models_and_counts_print_short(pair):
    """A result, a target and a drafter print in one line (no token lists, weights or tokenizer);
    acceptance_counts is keyed by acceptance length, as the CLIs print it."""
    result = GenerationResult(tokens=[[5, 6, 2], [7, 8]], acceptance_lengths=[[1, 2], [1]],
                              prefill_seconds=1.0, decode_seconds=2.0, compile_seconds=0.0, block_size=4,
                              stop_token_ids=(2,))
    assert result.acceptance_counts() == {1: 2, 2: 1, 3: 0, 4: 0}
    assert result.histogram().tolist() == [0, 2, 1, 0, 0]
    assert repr(result) == ("GenerationResult(2 rows, tokens [3, 2], tau 1.33, acceptance {1: 2, 2: 1, 3: 0, 4: 0}, "
                            "decode 1.5 tokens/s)")
    target, drafter = pair
    assert repr(target) == ("Target(llama, 2 layers, hidden 16, vocab 16, dtype float32, params stacked, "
                            "tokenizer none, mesh None)")
    assert repr(drafter) == "Drafter(dflash, 1 layers, block 4, target layers [0, 1], vocab 16, dtype float32)"


class _Bytes:
    """A byte-level tokenizer: id i < 256 is byte i, 256 a special token ("<stop>")."""

    def decode(self, ids, skip_special_tokens=False):
        special = b"" if skip_special_tokens else b"<stop>"
        return b"".join(bytes([i]) if i < 256 else special for i in ids).decode("utf-8", errors="replace")


def test_stream_text_keeps_characters_whole_and_leaves_out_the_stop_token():
    """"é" (two UTF-8 bytes) split over two cycles comes out whole; the stop id (here an ordinary
    byte, 0x21 "!") is left out of the text and kept in the stream's tokens."""
    chunks = [[[ord("a")]], [[0xC3]], [[0xA9, ord(" ")]], [[ord("b"), 0x21]]]
    stream = speculative.GenerationStream(iter(chunks), 0.0, stop_token_ids=(0x21,))
    pieces = list(stream.text(_Bytes()))
    assert pieces == ["a", "é ", "b"], pieces
    assert stream.tokens == [[ord("a"), 0xC3, 0xA9, ord(" "), ord("b"), 0x21]]


def test_stream_reports_compile_time_and_matches_generate(pair):
    target, drafter = pair
    stream = generate_stream(target, drafter, [[3, 4], [5]], max_new_tokens=7, stop_token_ids=(), seed=1)
    assert stream.compile_seconds > 0.0  # its cycle program: no test compiled one before
    chunks = list(stream)
    full = generate(target, drafter, [[3, 4], [5]], max_new_tokens=7, stop_token_ids=(), seed=1)
    assert [sum((c[b] for c in chunks), []) for b in range(2)] == full.tokens
    assert generate_stream(target, drafter, [[3, 4], [5]], max_new_tokens=7, stop_token_ids=(),
                           seed=1).compile_seconds == 0.0


def test_prompt_buckets_are_powers_of_two_then_multiples_of_1024():
    assert [speculative.prompt_bucket(n) for n in (1, 16, 17, 300, 1024)] == [16, 16, 32, 512, 1024]
    assert [speculative.prompt_bucket(n) for n in (1025, 2048, 3035, 4097)] == [2048, 2048, 3072, 5120]
    assert len({speculative.prompt_bucket(n) for n in range(1, 8193)}) == 7 + 7


@pytest.mark.parametrize("bound", ["argument", "default"])
def test_compiled_executables_are_bounded(pair, monkeypatch, bound):
    target, _ = pair
    if bound == "default":
        monkeypatch.setattr(speculative, "MAX_COMPILED", 2)
    generator = speculative.Generator(target, None, max_compiled=2 if bound == "argument" else None)
    for new in (2, 70):  # max_new_tokens in two buckets of 64: a new program each (prefill + loop)
        generator.generate(TWO_ROWS, max_new_tokens=new, stop_token_ids=())
        assert generator.compile_cache_size == 2
    assert generator.generate(TWO_ROWS, max_new_tokens=70, stop_token_ids=()).compile_seconds == 0.0
    assert generator.generate(TWO_ROWS, max_new_tokens=2, stop_token_ids=()).compile_seconds > 0.0


@pytest.mark.parametrize("speculative_pair", [False, True], ids=["plain", "speculative"])
def test_max_new_tokens_in_one_bucket_share_a_program_and_each_call_stops_at_its_own(pair, speculative_pair):
    """max_new_tokens is an argument of the compiled programs, their room a multiple of 64: calls
    asking for 1..64 new tokens run one prefill and one loop, and each stops at its own count."""
    target, drafter = pair
    generator = speculative.Generator(target, drafter if speculative_pair else None)
    longest = generator.generate(TWO_ROWS, max_new_tokens=64, stop_token_ids=())
    assert [len(row) for row in longest.tokens] == [64, 64]
    for new in (1, 5, 17, 63):
        got = generator.generate(TWO_ROWS, max_new_tokens=new, stop_token_ids=())
        assert got.compile_seconds == 0.0 and generator.compile_cache_size == 2
        assert got.tokens == [row[:new] for row in longest.tokens]
        for accepted, whole in zip(got.acceptance_lengths, longest.acceptance_lengths):
            assert 1 + sum(accepted) >= new and accepted == whole[:len(accepted)]  # the prefill gives one
    assert generator.generate(TWO_ROWS, max_new_tokens=65, stop_token_ids=()).compile_seconds > 0.0


def test_models_with_one_spec_share_executables_and_weights_are_arguments(pair):
    """The executables are keyed by the static spec; the weights enter as arguments, so another
    target of the same spec reuses them (no compile) and still decodes with its own weights."""
    target, _ = pair
    assert target.spec == TargetSpec(TARGET, "float32")
    assert hash(target.spec) == hash(TargetSpec(TARGET, jnp.float32))
    assert target.spec != TargetSpec(TARGET, jnp.bfloat16)
    prompts = TWO_ROWS  # the greedy check below reads the first row
    first = generate(target, None, prompts, max_new_tokens=6, stop_token_ids=())
    other = dataclasses.replace(target, params=drawn_params(target_param_shapes(TARGET), 9))
    again = generate(other, None, prompts, max_new_tokens=6, stop_token_ids=())
    assert again.compile_seconds == 0.0
    assert again.tokens != first.tokens  # different weights decode differently here

    def greedy_under(model, tokens):  # each token is the model's argmax given the prompt and the ones before
        hidden, _, _ = model.forward(model.params, jnp.asarray([prompts[0] + tokens[:-1]]))
        return [int(t) for t in jnp.argmax(model.logits(model.params, hidden)[0, len(prompts[0]) - 1:], -1)]

    assert greedy_under(other, again.tokens[0]) == again.tokens[0]
    assert greedy_under(target, first.tokens[0]) == first.tokens[0]


def test_sampling_options_hold_the_public_keywords_and_their_defaults():
    """generate, generate_stream, Generator.generate and Generator.stream keep their keywords for
    users; inside, one `SamplingOptions` flows. Its fields are those keywords (the mesh aside),
    in order, with the same defaults."""
    import inspect

    fields = [(f.name, f.default) for f in dataclasses.fields(speculative.SamplingOptions)]
    for fn in (generate, generate_stream, speculative.Generator.generate, speculative.Generator.stream):
        keywords = [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "mesh"]
        assert keywords == fields, fn.__qualname__
    options = speculative.SamplingOptions(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.temperature = 1.0
    with pytest.raises(TypeError, match="not both"):
        speculative._as_options(options, {"top_k": 2})


def test_a_warning_points_at_the_callers_line(pair):
    """The warning is issued while the call checks its arguments, before anything is compiled; each
    call then fails the prompt-length check (2 + 127 tokens > the target's 128 positions), so the
    three entry points' warnings are checked without compiling a block_size 6 program for them."""
    target, drafter = pair
    too_long = dict(max_new_tokens=127, block_size=6)
    for call in (lambda: generate(target, drafter, [[1, 2]], **too_long),
                 lambda: speculative.Generator(target, drafter).generate([[1, 2]], **too_long),
                 lambda: generate_stream(target, drafter, [[1, 2]], **too_long)):
        with pytest.warns(UserWarning, match="block_size 6") as caught:
            with pytest.raises(ValueError, match="prompt too long"):
                call()
        assert caught[0].filename == __file__, caught[0].filename


def test_release_generators_drops_what_generate_keeps(pair):
    import dflash_jax

    target, _ = pair
    generate(target, None, TWO_ROWS, max_new_tokens=3, stop_token_ids=())
    kept = speculative.generator_for(target)
    assert kept in speculative._GENERATORS.values()
    assert dflash_jax.release_generators() >= 1 and not speculative._GENERATORS
    assert dflash_jax.release_generators() == 0
    again = generate(target, None, TWO_ROWS, max_new_tokens=3, stop_token_ids=())
    assert again.compile_seconds > 0.0 and speculative.generator_for(target) is not kept
