"""Official DFlash drafter directories (config.json + model.safetensors) <-> `Drafter`."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp

from dflash_jax.config import read_config_json
from dflash_jax.drafter import Drafter, drafter_param_shapes
from dflash_jax.drafter_config import DrafterConfig, resolve_mask_token_id
from dflash_jax.loading.names import drafter_rules, hf_to_params, params_to_hf
from dflash_jax.loading.safetensors_io import ShardedCheckpoint, save_safetensors
from dflash_jax.loading.target_loader import resolve_dtype


class DrafterMismatchError(ValueError):
    """The drafter was trained for a different target."""


def validate_pair(config: DrafterConfig, target) -> None:
    """Raise DrafterMismatchError naming both sides when the drafter cannot serve this target."""
    tc = target.config
    problems = []
    if config.hidden_size != tc.hidden_size:
        problems.append(f"hidden size: drafter {config.hidden_size} vs target {tc.hidden_size}")
    if config.vocab_size != tc.vocab_size:
        problems.append(f"vocab size: drafter {config.vocab_size} vs target {tc.vocab_size}")
    if config.num_target_layers is not None and config.num_target_layers != tc.num_layers:
        problems.append(f"number of target layers: drafter expects {config.num_target_layers}, "
                        f"target has {tc.num_layers}")
    bad = [i for i in config.target_layer_ids if not 0 <= i < tc.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} out of range for a {tc.num_layers}-layer target")
    if config.mask_token_id is None or not 0 <= config.mask_token_id < tc.vocab_size:
        problems.append(f"mask token id {config.mask_token_id} is not inside the target vocabulary "
                        f"(size {tc.vocab_size})")
    if problems:
        raise DrafterMismatchError("drafter does not match target: " + "; ".join(problems))


def load_drafter(path: str | Path, target=None, dtype="float32", *, attn_impl: str = "auto") -> Drafter:
    """Read an official DFlash drafter directory; validate it against `target` when given."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter directory does not exist: {path}")
    dtype = resolve_dtype(dtype)
    hf = read_config_json(path)
    config = DrafterConfig.from_hf_config(hf)
    if config.mask_token_id is None:
        tokenizer = getattr(target, "tokenizer", None)
        mask = resolve_mask_token_id(None, tokenizer, target.config.vocab_size if target else None)
        config = dataclasses.replace(config, mask_token_id=mask)
    if target is not None:
        if config.num_target_layers is None:
            config = dataclasses.replace(config, num_target_layers=target.config.num_layers)
        validate_pair(config, target)
    shapes = drafter_param_shapes(config, dtype)
    params = hf_to_params(drafter_rules(config.attention_bias), ShardedCheckpoint(path), shapes,
                          config.num_layers, dtype)
    return Drafter(config, params, hf, dtype, attn_impl)


def save_drafter(drafter: Drafter, out_dir: str | Path) -> Path:
    """Write the official layout: config.json + model.safetensors (the params' dtype)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = params_to_hf(drafter_rules(drafter.config.attention_bias), drafter.params,
                           drafter.config.num_layers)
    dtype_name = "bfloat16" if jnp.dtype(drafter.dtype) == jnp.dtype(jnp.bfloat16) else "float32"
    save_safetensors(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    hf = drafter.config.to_hf_config(drafter.hf_config, dtype_name)
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out_dir

