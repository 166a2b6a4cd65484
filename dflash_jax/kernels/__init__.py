"""Pallas kernels. Each ships beside a plain-jnp reference and is reached through a dispatcher."""
from dflash_jax.kernels.block_attention import (
    block_attention,
    block_attention_with_lse,
    unsupported_reason,
)

__all__ = ["block_attention", "block_attention_with_lse", "unsupported_reason"]
