"""Drafter training with a tiny target of a conformance row's family: its HF directory written from our random
weights, the features the training reads checked, a short online run."""
from __future__ import annotations

import json

import numpy as np


def saved_target(family: str, directory, **overrides):
    """The row's tiny target (`families.tiny_target`, with `overrides`) written as an HF directory (config.json of
    the same config, model.safetensors through the export name table) and loaded from it."""
    from dflash_jax import load_target
    from dflash_jax.formats.names import params_to_hf, target_rules
    from dflash_jax.formats.safetensors_io import save_safetensors
    from support import families

    row = families.FAMILIES[family]
    built = families.tiny_target(family, **overrides)
    cfg = built.config
    directory.mkdir(parents=True, exist_ok=True)
    save_safetensors(params_to_hf(target_rules(cfg), built.params, cfg.num_layers), directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({"architectures": [row.hf_class], **row.config,
                                                       **row.decode_overrides, **overrides}))
    return load_target(directory, tokenizer=False)


def features_of_each_layer(target, tokens, layer_ids) -> np.ndarray:
    """[B, T, n*D]: the outputs of layers `layer_ids`, each captured by a forward of its own and concatenated."""
    return np.concatenate([np.asarray(target.forward(target.params, tokens, capture=(i,))[1]) for i in layer_ids],
                          axis=-1)


def train_online(target_dir, target, tmp_path, layer_ids, steps: int) -> list[float]:
    """`train.train` online from `target_dir` for `steps` steps (a one-layer drafter, block 4, 8 anchors a row,
    on the target's own greedy continuations of pattern prompts) -> the loss at every step."""
    from support import fitted_models
    from train.config import config_from_dict
    from train.train import train

    prompts = fitted_models.pattern_batch(np.random.default_rng(1), 16, 4).tolist()
    data = tmp_path / "train.jsonl"
    fitted_models.write_self_continuations(target, data, prompts, 16, 12)
    cfg = target.config
    run = tmp_path / "run"
    last = train(config_from_dict({
        "model": {"target": str(target_dir), "num_layers": 1, "intermediate_size": 64, "block_size": 4,
                  "target_layer_ids": list(layer_ids), "mask_token_id": cfg.vocab_size - 1},
        "data": {"path": str(data), "max_length": 32, "batch_size": 8, "seed": 3},
        "optim": {"learning_rate": 3e-3, "warmup_ratio": 0.05},
        "run": {"out_dir": str(run), "steps": steps, "num_anchors": 8, "log_every": 1,
                "checkpoint_every": steps, "async_checkpointing": False, "shard_target": True}}))
    assert last["step"] == steps
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def check_features_then_train(family: str, tmp_path, layer_ids, vocab: int, steps: int) -> list[float]:
    """`train.train` with a saved `family` target: the features the online step and `train.cache_features`
    read are the chosen layers' outputs (the cache's in bfloat16), then the losses of a short online run
    (checked finite; the caller checks that they fall)."""
    import jax.numpy as jnp

    from train import step as step_lib
    from train.cache_features import _feature_fn

    target = saved_target(family, tmp_path / "target")
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, vocab, size=(2, 40)), jnp.int32)
    each = features_of_each_layer(target, tokens, layer_ids)
    online = step_lib.target_features(target, target.params, tokens, layer_ids)
    cached, _ = _feature_fn(target, layer_ids)(target.params, tokens)
    np.testing.assert_array_equal(np.asarray(online), each)
    np.testing.assert_allclose(np.asarray(cached, np.float32), np.asarray(online.astype(jnp.bfloat16), np.float32),
                               atol=2e-2, rtol=1e-2)
    losses = train_online(tmp_path / "target", target, tmp_path, layer_ids, steps=steps)
    assert len(losses) == steps and np.all(np.isfinite(losses))
    return losses
