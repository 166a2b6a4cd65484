"""Generation with a reduced draft vocabulary: the drafter's own head over Vd target ids, mapped back
through draft_to_target; the target verifies over its full vocabulary, so greedy output equals plain
decoding and sampling stays lossless. Saved in EAGLE-3's layout (d2t, t2d, lm_head.weight)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import fitted_models
from dflash_jax._errors import CheckpointError, ConfigError
from dflash_jax.decode import sampling
from dflash_jax.decode.loop import _propose, GenerationConfig, prefill, SamplingParams
from dflash_jax.drafters.draft_vocab import DraftVocab
from dflash_jax.drafters.drafter import Drafter
from dflash_jax.engine.generator import generate
from dflash_jax.formats.safetensors_io import SafetensorsFile, save_safetensors
from dflash_jax.loading.drafter_io import load_drafter, save_drafter
from dflash_jax.models.target import Target
from train.drafter_init import target_head_kernel

PATTERN_IDS = np.arange(fitted_models.MODULUS)  # every id the fitted pattern uses
HALF_IDS = np.arange(0, fitted_models.MODULUS, 2)  # half of them: many drafts are wrong


def reduced(drafter: Drafter, target: Target, ids) -> Drafter:
    """The drafter with its own head: the target LM head's columns of the kept ids."""
    head = target_head_kernel(target, target.params)[:, np.asarray(ids)]
    return drafter.with_draft_vocab(head, DraftVocab(np.asarray(ids), target.config.vocab_size))


@pytest.fixture(scope="module")
def prompts():
    rows = fitted_models.pattern_batch(np.random.default_rng(5), 3, 9).tolist()
    return [rows[0], rows[1][:5], rows[2][:7]]  # ragged


@pytest.fixture(scope="module")
def reduced_runs(fitted, prompts):
    """generate's results for the prompts with each reduced head (covering, half), computed once: the
    tests below assert on the same runs (each run compiled and executed once, not once a test)."""
    target, drafter = fitted
    return {name: generate(target, reduced(drafter, target, ids), prompts, max_new_tokens=24, stop_token_ids=())
            for name, ids in (("covering", PATTERN_IDS), ("half", HALF_IDS))}


@pytest.mark.parametrize("ids", [PATTERN_IDS, HALF_IDS], ids=["covering", "half"])
def test_greedy_equals_plain_decoding(fitted, prompts, reduced_runs, ids):
    target, drafter = fitted
    plain = generate(target, None, prompts, max_new_tokens=24, stop_token_ids=())
    out = reduced_runs["covering" if len(ids) == len(PATTERN_IDS) else "half"]
    assert out.tokens == plain.tokens
    assert out.tau > (3.0 if len(ids) == len(PATTERN_IDS) else 1.0)


def test_covering_vocabulary_keeps_the_full_drafter_tau(fitted, prompts, reduced_runs):
    """Over the ids the pattern uses, the reduced head drafts what the full head drafts."""
    target, drafter = fitted
    full = generate(target, drafter, prompts, max_new_tokens=24, stop_token_ids=())
    part, half = reduced_runs["covering"], reduced_runs["half"]
    assert part.acceptance_lengths == full.acceptance_lengths
    assert half.tau < part.tau


def test_draft_distribution_lives_on_the_kept_ids(fitted, prompts):
    """Exact sampling: the draft distribution over the full vocabulary sums to 1, is zero outside the
    kept ids, and the drafts are kept ids (top_k larger than Vd keeps the whole draft vocabulary)."""
    target, drafter = fitted
    ids = HALF_IDS
    small = reduced(drafter, target, ids)
    cfg = GenerationConfig(max_new_tokens=4, block_size=small.block_size, sampling=True, top_k=30,
                           gate_drafts=True)
    params = SamplingParams(temperature=jnp.float32(1.0), top_p=jnp.float32(1.0),
                            stop_token_ids=jnp.full((8,), -1, jnp.int32))
    tokens = jnp.asarray([p + [0] * (9 - len(p)) for p in prompts], jnp.int32)
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)

    @jax.jit
    def first_proposal(target_params, drafter_params):
        state = prefill(target, small, cfg, target_params, drafter_params, tokens, lengths,
                        jax.random.PRNGKey(0), params)
        anchors = sampling.gather_rows(state.tokens, state.lengths - 1)
        return _propose(target, small, cfg, target_params, drafter_params, anchors, state.draft_cache,
                        jax.random.PRNGKey(1), params)

    drafts, probs, first, _ = jax.device_get(first_proposal(target.params, small.loop_params))  # _: no limit
    assert probs.shape == (3, small.block_size - 1, target.config.vocab_size)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    outside = np.setdiff1d(np.arange(target.config.vocab_size), ids)
    assert np.all(probs[..., outside] == 0) and np.all(probs[..., ids] > 0)
    assert np.isin(drafts, ids).all()
    assert np.all(np.take_along_axis(probs, drafts[..., None], -1) > 0)
    # what gated verification compares with its threshold: the top probability of the first slot's draft
    # distribution (at temperature 1, top_k keeping the whole draft vocabulary), not the sampled draft's own
    np.testing.assert_allclose(first, probs[:, 0].max(-1), rtol=1e-6)


def test_cpu_decode_packs_the_draft_head(fitted):
    """What a CPU drafts with (`DrafterSpec.decode_params`) packs the reduced vocabulary's head for
    the rows kernel too; its logits equal the plain product's, for a block's several slots."""
    from dflash_jax.backends.cpu.matmul import available, is_packed

    target, drafter = fitted
    small = reduced(drafter, target, HALF_IDS)
    packed = small.spec.decode_params(small.loop_params)
    assert is_packed(packed["draft_head"]["kernel"]) == available()
    assert not is_packed(small.loop_params["draft_head"]["kernel"])
    np.testing.assert_array_equal(packed["draft_head"]["draft_to_target"], small.draft_head["draft_to_target"])
    hidden = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 64)).astype(np.float32))
    want = np.asarray(hidden) @ np.asarray(small.draft_head["kernel"])
    for params in (small.loop_params, packed):
        got = small.draft_head_logits(params, hidden)
        assert got.shape == (2, 5, len(HALF_IDS)) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _saved(tmp_path, fitted):
    target, drafter = fitted
    small = reduced(drafter, target, HALF_IDS)
    return target, small, save_drafter(small, tmp_path / "small")


def test_save_load_round_trip_is_bit_exact(tmp_path, fitted):
    target, small, path = _saved(tmp_path, fitted)
    assert json.loads((path / "config.json").read_text())["draft_vocab_size"] == len(HALF_IDS)
    tensors = SafetensorsFile(path / "model.safetensors")
    d2t, t2d, head = tensors["d2t"], tensors["t2d"], tensors["lm_head.weight"]
    assert d2t.dtype == np.int64 and t2d.dtype == bool and head.shape == (len(HALF_IDS), 64)
    np.testing.assert_array_equal(d2t + np.arange(len(d2t)), HALF_IDS)
    loaded = load_drafter(path, target=target)
    assert loaded.config == small.config
    jax.tree.map(np.testing.assert_array_equal, loaded.loop_params, small.loop_params)
    again = load_drafter(save_drafter(loaded, tmp_path / "again"), target=target)
    jax.tree.map(np.testing.assert_array_equal, again.loop_params, small.loop_params)
    saved_again = SafetensorsFile(tmp_path / "again" / "model.safetensors")
    for name in ("d2t", "t2d", "lm_head.weight"):
        np.testing.assert_array_equal(saved_again[name], tensors[name])
        assert saved_again[name].dtype == tensors[name].dtype


def test_damaged_or_misplaced_vocabulary_tensors_fail_clearly(tmp_path, fitted):
    target, small, path = _saved(tmp_path, fitted)
    file = path / "model.safetensors"
    tensors = {name: np.asarray(value) for name, value in SafetensorsFile(file).items()}
    damaged = dict(tensors, d2t=tensors["d2t"] + (np.arange(len(HALF_IDS)) == 3))
    save_safetensors(damaged, file)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*d2t and t2d disagree"):
        load_drafter(path, target=target)
    save_safetensors(dict(tensors, d2t=tensors["d2t"][:-1]), file)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor d2t"):
        load_drafter(path, target=target)
    # lm_head.weight without draft_vocab_size in config.json is a tensor the model does not use.
    save_safetensors(tensors, file)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "draft_vocab_size"}))
    with pytest.raises(CheckpointError, match="does not use.*lm_head.weight"):
        load_drafter(path, target=target)
    (path / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 49}))
    with pytest.raises(ConfigError, match=r"config\.json.*draft_vocab_size must lie in \[1, vocab_size=48\]"):
        load_drafter(path, target=target)


def test_training_measures_tau_of_a_reduced_vocabulary_run(fitted, prompts):
    from train.train import measure_tau

    target, drafter = fitted
    params = {"drafter": drafter.params, "draft_head": target_head_kernel(target, target.params)[:, PATTERN_IDS]}
    vocab = DraftVocab(PATTERN_IDS, target.config.vocab_size)
    tau = measure_tau(target, drafter.config, params, prompts, 24, vocab)
    assert tau == generate(target, reduced(drafter, target, PATTERN_IDS), prompts, max_new_tokens=24,
                           block_size=drafter.block_size).tau > 3.0
