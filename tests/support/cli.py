"""Helpers for the command-line programs' tests."""
from __future__ import annotations

from pathlib import Path

import pytest


def kwargs_given_to_load_target(monkeypatch, target_path: Path, **load_models_kwargs) -> dict:
    """The keyword arguments `cli.common.load_models(target_path, None, "float32", ...)` passes to
    `load_target` (a stand-in that records them and stops there)."""
    from dflash_jax.cli import common
    from dflash_jax.loading import target_loader

    seen = {}

    def load_target(path, dtype, **kwargs):
        seen.update(kwargs)
        raise FileNotFoundError("stop here")

    monkeypatch.setattr(target_loader, "load_target", load_target)
    with pytest.raises(common.CLIError, match="stop here"):
        common.load_models(target_path, None, "float32", **load_models_kwargs)
    return seen


# A Qwen3-shaped target small enough to compile in seconds, for `infer.benchmark --random-target` (as a
# RANDOM_TARGETS entry: its config.json and mask token id; hidden 32: DFlash2's groups of 16 divide it).
TINY = ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 96, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
         "tie_word_embeddings": True, "eos_token_id": 1}, 95)

