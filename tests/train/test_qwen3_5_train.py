"""Training a drafter for a Qwen3.5 hybrid target: cached (offline) features equal the online ones,
`train.cache_features` and `train.train` take the target's checkpoint directory, and a short run
drafts better than an untrained drafter."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import families, fitted_models
from dflash_jax import generate, load_target
from dflash_jax.drafters.drafter import Drafter, init_drafter_params
from train import checkpointing, step as step_lib
from train.cache_features import _feature_fn
from train.config import config_from_dict
from train.train import drafter_config_for, train

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("this transformers has no Qwen3_5", allow_module_level=True)

PROMPT, NEW = 4, 28


@pytest.fixture(scope="module")
def hybrid_target(tmp_path_factory):
    """(target, its checkpoint directory): a random Qwen3.5 model (transformers' class, saved)."""
    root = tmp_path_factory.mktemp("hybrid-train")
    families.make_hf("qwen3_5", root / "target", seed=3, vocab_size=fitted_models.VOCAB, num_hidden_layers=4)
    return load_target(root / "target", tokenizer=False), root / "target"


@pytest.fixture(scope="module")
def hybrid(hybrid_target):
    """(target, its checkpoint directory, train JSONL, held-out prompts): the target above and its
    own greedy continuations of pattern prompts (only the training runs need these: generating them
    is not the default test's work)."""
    target, target_dir = hybrid_target
    prompts = fitted_models.pattern_batch(np.random.default_rng(1), 72, PROMPT).tolist()
    data = target_dir.parent / "train.jsonl"
    held_out = fitted_models.write_self_continuations(target, data, prompts, 64, NEW)
    return target, target_dir, data, held_out


def test_cached_features_equal_the_online_ones(hybrid_target):
    """What `train.cache_features` stores (the target run as generate's prefill runs it, 256
    tokens at a time through its cache: here 300 positions, so two chunks of the recurrence) is the
    online step's features (one causal pass), in the bfloat16 both are stored in."""
    target = hybrid_target[0]
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 40, size=(2, 300)), jnp.int32)
    layer_ids = (0, 2, 3)
    cached, next_tokens = _feature_fn(target, layer_ids)(target.params, tokens)
    # the online features and the reference argmax in one compiled program (as a train step runs them)
    online, greedy = jax.jit(lambda p, t: (step_lib.target_features(target, p, t, layer_ids),
                                           jnp.argmax(target.logits(p, target.forward(p, t)[0]), -1)))(
        target.params, tokens)
    np.testing.assert_allclose(np.asarray(cached, np.float32), np.asarray(online.astype(jnp.bfloat16), np.float32),
                               atol=2e-2, rtol=1e-2)
    np.testing.assert_array_equal(np.asarray(next_tokens), np.asarray(greedy))


@pytest.mark.slow  # make test-all: training from a checkpoint directory runs by default in test_moe_train
def test_a_short_run_on_the_checkpoint_drafts_better_than_an_untrained_drafter(hybrid, tmp_path):
    target, target_dir, data, held_out = hybrid
    cfg = config_from_dict({
        "model": {"target": str(target_dir), "num_layers": 1, "intermediate_size": 64, "block_size": 4,
                  "target_layer_ids": [1, 3], "mask_token_id": fitted_models.MASK},
        "data": {"path": str(data), "max_length": 32, "batch_size": 8, "seed": 3},
        "optim": {"learning_rate": 3e-3, "warmup_ratio": 0.05},
        "run": {"out_dir": str(tmp_path / "run"), "steps": 80, "num_anchors": 8, "log_every": 40,
                "checkpoint_every": 80, "async_checkpointing": False}})
    last = train(cfg)  # loads the target from its directory, as `python -m train.train` does
    assert last["step"] == 80 and np.isfinite(last["loss"])
    dcfg = drafter_config_for(cfg, target)
    _, params = checkpointing.restore_params(tmp_path / "run")
    untrained = Drafter(dcfg, init_drafter_params(dcfg, jax.random.PRNGKey(0)))
    tau_before = generate(target, untrained, held_out, max_new_tokens=24, stop_token_ids=()).tau
    trained = generate(target, Drafter(dcfg, params["drafter"]), held_out, max_new_tokens=24, stop_token_ids=())
    assert trained.tokens == generate(target, None, held_out, max_new_tokens=24, stop_token_ids=()).tokens
    assert trained.tau > tau_before + 0.15, (tau_before, trained.tau)  # measured: 1.02 -> 1.28


@pytest.mark.slow  # make test-all: covered by default: test_cached_features_equal_the_online_ones (this hybrid's
# cache_features pass), test_train_data.py (regenerate; test_feature_cache_round_trip: a cache read back equals a
# forward at every real position of ragged rows), test_train_run.py's top-k run (train.train offline from caches)
def test_regenerate_then_cache_features_then_train_offline(hybrid, tmp_path):
    """The offline pipeline on a hybrid target: `train.regenerate` answers with its greedy
    decoding, `train.cache_features` stores its features of those records (equal to a forward's
    at every real position, ragged rows in one batch), and `train.train` runs from the cache."""
    import dataclasses

    from support.tokenizers import CharChatTokenizer
    from dflash_jax.models.target import Target
    from train.data import DataConfig, load_token_records, make_iterator
    from train.cache_features import cache_features
    from train.regenerate import RegenerateConfig, regenerate

    loaded = hybrid[0]
    target = Target(dataclasses.replace(loaded.config, eos_token_ids=(2,)), loaded.params, CharChatTokenizer())
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"add {i}" * (1 + i % 3)}]} for i in range(6)]
    stats = regenerate(target, records, tmp_path / "answers",
                       RegenerateConfig(max_new_tokens=8, batch_size=3, max_prompt_tokens=60),
                       progress=False)
    assert stats.responses == 6 and stats.generated_tokens > 0
    tok = target.tokenizer
    first = json.loads(sorted((tmp_path / "answers").glob("shard-*.jsonl"))[0].read_text().splitlines()[0])
    prompt = tok.apply_chat_template(first["messages"][:1], add_generation_prompt=True)
    want = generate(target, None, [prompt], max_new_tokens=8).tokens[0]
    assert first["messages"][1]["content"] == tok.decode(want[:-1] if want[-1] == 2 else want)

    token_records = load_token_records(tmp_path / "answers", tok, 32)
    layers = (1, 3)
    cache_features(target, token_records, tmp_path / "cache", layers, batch_size=3, buckets=(32,), progress=False)
    data = DataConfig(str(tmp_path / "cache"), max_length=32, batch_size=3, buckets=(32,), num_epochs=1)
    forward = jax.jit(lambda params, tokens: target.forward(params, tokens, capture=layers))
    for batch in make_iterator(data, process_index=0, process_count=1):
        _, online, _ = forward(target.params, batch["tokens"])
        for row, n in enumerate(batch["lengths"]):
            np.testing.assert_allclose(batch["features"][row, :n].astype(np.float32), np.asarray(online[row, :n]),
                                       rtol=1e-2, atol=1e-2)
    cfg = config_from_dict({
        "model": {"target": str(hybrid[1]), "num_layers": 1, "intermediate_size": 64, "block_size": 4,
                  "target_layer_ids": list(layers), "mask_token_id": fitted_models.MASK},
        "data": {"path": str(tmp_path / "cache"), "max_length": 32, "batch_size": 3, "buckets": [32]},
        "run": {"out_dir": str(tmp_path / "run"), "steps": 2, "num_anchors": 4, "log_every": 1,
                "checkpoint_every": 2, "async_checkpointing": False}})
    assert train(cfg, target=target)["step"] == 2
