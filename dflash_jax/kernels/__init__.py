"""Attention kernels over the `KeyRanges` mask language, each beside its plain-jnp reference.

`KeyRanges` (two half-open key ranges per query, defined in `dflash_jax.kernels.masks`) is exported here,
since every function of this package takes one.

`block_attention` (Pallas GPU kernels, forward and backward) and its tiles (`BlockSizes`,
`KEY_TILE`; the tile bookkeeping in `tile_plan`) sit beside `reference` (dense and cache-chunked
attention: the ground truth in the kernel tests and the path where the kernel cannot run).
`dflash_jax.layers.attention` dispatches between them; nothing in this package imports it. The CPU
kernels (C++ through XLA's FFI) belong to the CPU backend, `dflash_jax.backends.cpu`.
"""
from dflash_jax.kernels.masks import KeyRanges
from dflash_jax.kernels.block_attention import (
    KEY_TILE,
    BlockSizes,
    block_attention,
    block_attention_with_lse,
    unsupported_reason,
)
from dflash_jax.kernels.reference import (
    check_gqa,
    chunked_cache_attention_with_lse,
    reference_attention,
    reference_attention_with_lse,
    with_sinks,
)
from dflash_jax.kernels.tile_plan import round_up

__all__ = [
    "KeyRanges", "KEY_TILE", "BlockSizes", "block_attention", "block_attention_with_lse", "unsupported_reason",
    "check_gqa", "chunked_cache_attention_with_lse", "reference_attention",
    "reference_attention_with_lse", "round_up", "with_sinks",
]
