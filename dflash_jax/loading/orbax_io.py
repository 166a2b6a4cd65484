"""Drafters as Orbax checkpoints: DIR/config.json (the official config) + DIR/params (Orbax).

Training checkpoints use the same layout, so a trained drafter converts with `dflash_jax.convert`.
"""
from __future__ import annotations

import re
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from dflash_jax._errors import CheckpointError
from dflash_jax.drafters.config import DrafterConfig, is_speculators_dspark
from dflash_jax.drafters.drafter import Drafter, drafter_param_shapes
from dflash_jax.formats.dtypes import dtype_name, PARAM_DTYPES_BY_NAME, resolve_dtype, stored_dtype_name
from dflash_jax.models.config import read_config_json, write_config_json


def save_orbax_drafter(drafter: Drafter, out_dir: str | Path) -> Path:
    """DIR/params (Orbax writes it atomically) then DIR/config.json; refuses an existing DIR/params."""
    out_dir = Path(out_dir).absolute()
    if (out_dir / "params").exists():
        raise FileExistsError(f"{out_dir / 'params'} already exists; choose a new directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    # every table is in the params: a drafter loaded in the speculators layout is written as DeepSpec's
    base = None if is_speculators_dspark(drafter.hf_config or {}) else drafter.hf_config
    hf = drafter.config.to_hf_config(base, dtype_name(drafter.dtype))
    with ocp.StandardCheckpointer() as checkpointer:  # closed: its threads and pending work end here
        checkpointer.save(out_dir / "params", drafter.params)
        checkpointer.wait_until_finished()
    write_config_json(out_dir, hf)
    return out_dir


def _storage_problem(error: BaseException) -> str:
    """The innermost cause of an Orbax/TensorStore failure as one short line (what is missing or
    unreadable), without the storage driver's spec dump."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).split("[tensorstore_spec=")[0].split("See full TensorStore details")[0]
    text = re.sub(r' in OCDBT database at local file "[^"]*"', "", text)
    text = " ".join(text.split())
    return f"{type(error).__name__}: {text[:300]}"


def load_orbax_drafter(path: str | Path, dtype=None, attn_impl: str = "auto") -> Drafter:
    """Restore an Orbax drafter; dtype None keeps the stored one. A damaged checkpoint raises one
    CheckpointError naming it and what is missing or unreadable."""
    path = Path(path).absolute()
    if not (path / "params").is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an Orbax drafter directory (needs config.json and params/)")
    hf = read_config_json(path)
    config = DrafterConfig.from_hf_config(hf, source=str(path / "config.json"))
    stored = PARAM_DTYPES_BY_NAME[stored_dtype_name(hf)]
    abstract = drafter_param_shapes(config, stored)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(path / "params", abstract)
    except Exception as e:  # Orbax/TensorStore raise plain Exception, ValueError, OSError, JSON errors
        raise CheckpointError(f"damaged Orbax checkpoint {path / 'params'}: {_storage_problem(e)}") from e
    if dtype is not None:
        dtype = resolve_dtype(dtype)
        params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
    return Drafter(config, params, hf, dtype or stored, attn_impl)
