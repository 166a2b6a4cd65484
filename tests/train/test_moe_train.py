"""Training a drafter for a mixture-of-experts target (Qwen3-MoE): `train.cache_features` stores
what the online step computes, `train.train` runs online from the target's checkpoint directory
(the target sharded by the training rules) and offline from a feature cache, and what it trains is
a drafter the target verifies losslessly. No torch: the target is built and saved here."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import fitted_models
from support.families import save_target_dir
from dflash_jax import generate, load_target
from dflash_jax.drafters.drafter import Drafter
from dflash_jax.models.target import init_target_params, Target
from train import checkpointing, step as step_lib
from train.cache_features import _feature_fn, cache_features
from train.config import config_from_dict
from train.train import drafter_config_for, train

PROMPT, NEW = 4, 20
CONFIG = fitted_models.MOE_TARGET_CONFIG


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(target loaded from its directory, the directory, train JSONL, held-out prompts, the
    target's greedy continuations of those): a random Qwen3-MoE target and its own greedy
    continuations of pattern prompts, the training rows' written out, the held-out rows' kept (one
    batch: rows decode as they would alone, tests/decode/test_generate.py's ragged-batch test)."""
    root = tmp_path_factory.mktemp("moe-train")
    built = Target(CONFIG, init_target_params(CONFIG, jax.random.PRNGKey(4)))
    save_target_dir(built, root / "target")
    target = load_target(root / "target", tokenizer=False)
    assert target.config.num_experts == 8
    prompts = fitted_models.pattern_batch(np.random.default_rng(1), 40, PROMPT).tolist()
    greedy = generate(target, None, prompts, max_new_tokens=NEW, stop_token_ids=()).tokens
    data = root / "train.jsonl"
    with data.open("w") as f:
        for p, t in zip(prompts[:32], greedy[:32]):
            f.write(json.dumps({"tokens": p + t, "loss_mask": [0] * len(p) + [1] * len(t)}) + "\n")
    return target, root / "target", data, prompts[32:], greedy[32:]


def test_cached_features_equal_the_online_ones(moe):
    """`train.cache_features`'s target pass (the cached prefill, 256 tokens a chunk: 300 positions
    make two) equals the online step's one causal pass, in the bfloat16 both are stored in; its next
    tokens are the forward's argmax."""
    target = moe[0]
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 40, size=(2, 300)), jnp.int32)
    layer_ids = (0, 2)
    cached, next_tokens = _feature_fn(target, layer_ids)(target.params, tokens)
    # the online features and the reference argmax compiled (as a train step runs them), not op by op,
    # both in one program (one compile)
    online, greedy = jax.jit(lambda p, t: (step_lib.target_features(target, p, t, layer_ids),
                                           jnp.argmax(target.logits(p, target.forward(p, t)[0]), -1)))(
        target.params, tokens)
    np.testing.assert_allclose(np.asarray(cached, np.float32), np.asarray(online.astype(jnp.bfloat16), np.float32),
                               atol=2e-2, rtol=1e-2)
    np.testing.assert_array_equal(np.asarray(next_tokens), np.asarray(greedy))


def _config(target_dir, data, out_dir, steps, log_every=None, **data_extra):
    log_every = steps if log_every is None else log_every
    return config_from_dict({
        "model": {"target": str(target_dir), "num_layers": 1, "intermediate_size": 64, "block_size": 4,
                  "target_layer_ids": [0, 2], "mask_token_id": fitted_models.MASK},
        "data": {"path": str(data), "max_length": 32, "batch_size": 8, "seed": 3, **data_extra},
        "optim": {"learning_rate": 3e-3, "warmup_ratio": 0.05},
        "run": {"out_dir": str(out_dir), "steps": steps, "num_anchors": 8, "log_every": log_every,
                "checkpoint_every": steps, "async_checkpointing": False, "shard_target": True}})


def test_online_training_from_the_checkpoint_directory(moe, tmp_path):
    """`train.train` loads the MoE target from its directory and trains online; the loss at the
    last step is well below the first step's, and the trained drafter's output is the target's
    greedy output."""
    target, target_dir, data, held_out, greedy = moe
    cfg = _config(target_dir, data, tmp_path / "run", steps=30, log_every=1)
    last = train(cfg)
    assert last["step"] == 30 and np.isfinite(last["loss"])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in logged if r.get("step") == 1)
    assert last["loss"] < 0.6 * first["loss"], (first["loss"], last["loss"])  # measured: 4.52 -> 1.78
    _, params = checkpointing.restore_params(tmp_path / "run")
    drafter = Drafter(drafter_config_for(cfg, target), params["drafter"])
    trained = generate(target, drafter, held_out, max_new_tokens=NEW, stop_token_ids=())
    assert trained.tokens == greedy  # the target's own greedy continuations (the fixture's batch)


@pytest.mark.slow  # covered by default: test_cached_features_equal_the_online_ones (this MoE target's cache_features
# pass), test_train_data.py::test_feature_cache_round_trip (a cache read back through the iterator equals a forward
# at every real position of ragged rows), test_train_run.py::test_a_run_learns_the_targets_distribution_from_a_top_k
# _cache (train.train offline from feature caches; nothing of the target but its tables runs offline): `make test-all`
def test_cache_features_then_offline_training(moe, tmp_path):
    """The offline pipeline: features of the records cached (equal to a forward's at every real
    position of ragged rows), then `train.train` from the cache."""
    from train.data import DataConfig, load_token_records, make_iterator

    target, target_dir, data, _, _ = moe
    layers = (0, 2)
    records = load_token_records(data, None, 32)
    cache_features(target, records, tmp_path / "cache", layers, batch_size=4, buckets=(32,), progress=False)
    forward = jax.jit(lambda params, tokens: target.forward(params, tokens, capture=layers))
    config = DataConfig(str(tmp_path / "cache"), max_length=32, batch_size=4, buckets=(32,), num_epochs=1)
    for batch in make_iterator(config, process_index=0, process_count=1):
        _, online, _ = forward(target.params, batch["tokens"])
        for row, n in enumerate(batch["lengths"]):
            np.testing.assert_allclose(batch["features"][row, :n].astype(np.float32), np.asarray(online[row, :n]),
                                       rtol=1e-2, atol=1e-2)
    cfg = _config(target_dir, tmp_path / "cache", tmp_path / "run", steps=2, buckets=[32])
    assert train(cfg, target=target)["step"] == 2
