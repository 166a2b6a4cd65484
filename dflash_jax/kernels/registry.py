"""The attention kernels by platform: `KERNELS` maps a JAX platform ("gpu", and next "tpu") to the
`PlatformKernel` that runs block-masked attention there, with the key tile its cache reads want.
`dflash_jax.layers.attention` takes the platform's kernel under impl="auto" (the plain-jnp reference
where the platform has none, as on a CPU), and cache capacities round to `key_tile(platform)`, so a
kernel for a new platform plugs in here beside the others: one entry, no `if` elsewhere.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from dflash_jax.kernels.block_attention import block_attention, block_attention_with_lse, KEY_TILE, unsupported_reason

# Cache capacities round to this where the platform has no kernel (the reference reads any length):
# the GPU kernel's tile, so that a cache built on a CPU has the shapes it has on a GPU.
DEFAULT_KEY_TILE = KEY_TILE


@dataclasses.dataclass(frozen=True)
class PlatformKernel:
    """One platform's block-attention kernel, over the `KeyRanges` mask language:
    `attention(q, k, v, ranges, *, scale, interpret, sinks)` -> out, `attention_with_lse(q, k, v,
    ranges, *, scale, interpret)` -> (out, lse), `unsupported_reason(q, k, v, ranges, scale)` -> a
    reason it cannot run these inputs or None, and `key_tile`: the key tile it reads a cache in
    (capacities are multiples of it)."""

    name: str
    key_tile: int
    attention: Callable
    attention_with_lse: Callable
    unsupported_reason: Callable


TRITON = PlatformKernel("pallas-triton", KEY_TILE, block_attention, block_attention_with_lse, unsupported_reason)
KERNELS: dict[str, PlatformKernel] = {"gpu": TRITON}
# what impl="pallas" / "pallas_interpret" runs where the platform has no kernel of its own: the one
# kernel Pallas interprets on any platform (the kernel tests on a CPU)
INTERPRETABLE = TRITON


def for_platform(platform: str) -> PlatformKernel | None:
    """The kernel registered for `platform`, or None (the reference runs there)."""
    return KERNELS.get(platform)


def forced(platform: str) -> PlatformKernel:
    """The kernel impl="pallas" runs on `platform`: its own, else `INTERPRETABLE`."""
    return KERNELS.get(platform, INTERPRETABLE)


def key_tile(platform: str) -> int:
    """The key tile cache capacities round to on `platform`: its kernel's, else `DEFAULT_KEY_TILE`."""
    kernel = KERNELS.get(platform)
    return DEFAULT_KEY_TILE if kernel is None else kernel.key_tile
