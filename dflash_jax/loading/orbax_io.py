"""Drafters as Orbax checkpoints: DIR/config.json (the official config) + DIR/params (Orbax).

Training checkpoints use the same layout, so a trained drafter converts with `dflash_jax.convert`.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from dflash_jax.drafter import Drafter, drafter_param_shapes
from dflash_jax.drafter_config import DrafterConfig
from dflash_jax.loading.target_loader import resolve_dtype


def save_orbax_drafter(drafter: Drafter, out_dir: str | Path) -> Path:
    out_dir = Path(out_dir).absolute()
    if (out_dir / "params").exists():
        raise FileExistsError(f"{out_dir / 'params'} already exists; choose a new directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype_name = "bfloat16" if jnp.dtype(drafter.dtype) == jnp.dtype(jnp.bfloat16) else "float32"
    hf = drafter.config.to_hf_config(drafter.hf_config, dtype_name)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out_dir / "params", drafter.params)
    checkpointer.wait_until_finished()
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out_dir


def load_orbax_drafter(path: str | Path, dtype=None, attn_impl: str = "auto") -> Drafter:
    """Restore an Orbax drafter; dtype None keeps the stored one."""
    path = Path(path).absolute()
    if not (path / "params").exists() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an Orbax drafter directory (needs config.json and params/)")
    hf = json.loads((path / "config.json").read_text())
    config = DrafterConfig.from_hf_config(hf)
    stored = jnp.bfloat16 if hf.get("dtype") == "bfloat16" else jnp.float32
    abstract = drafter_param_shapes(config, stored)
    params = ocp.StandardCheckpointer().restore(path / "params", abstract)
    if dtype is not None:
        dtype = resolve_dtype(dtype)
        params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
    return Drafter(config, params, hf, dtype or stored, attn_impl)
