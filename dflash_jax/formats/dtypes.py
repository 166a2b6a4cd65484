"""Parameter/activation dtypes by name: what `load_target(..., dtype=...)` and friends accept."""
from __future__ import annotations

import jax.numpy as jnp

PARAM_DTYPES_BY_NAME = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "f32": jnp.float32,
                        "bf16": jnp.bfloat16}


def resolve_dtype(dtype):
    """"float32" / "bfloat16" (or f32 / bf16, or the jnp dtype itself) -> jnp.float32 / jnp.bfloat16."""
    if isinstance(dtype, str):
        if dtype not in PARAM_DTYPES_BY_NAME:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(PARAM_DTYPES_BY_NAME)}")
        return PARAM_DTYPES_BY_NAME[dtype]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    return dtype


def dtype_name(dtype) -> str:
    """The name config.json uses for a param dtype: "bfloat16" or "float32"."""
    return "bfloat16" if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else "float32"


def stored_dtype_name(hf: dict) -> str:
    """The dtype a config.json says its weights were saved in (`dtype`, or the older `torch_dtype`):
    "bfloat16", else "float32"."""
    stored = hf.get("dtype") or hf.get("torch_dtype")
    return "bfloat16" if stored in ("bfloat16", "bf16") else "float32"
