"""The attention seam: every attention in dflash_jax (target, drafter, training) calls `attention`
or, when part of its keys sit in a KV cache, `cache_attention`. Both dispatch between the kernel the
platform registers (`dflash_jax.kernels.registry`: the Pallas Triton kernel on a GPU,
`kernels.block_attention`) and the plain-jnp reference beside it (`dflash_jax.kernels.reference`).

q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D] with Hq % Hkv == 0 (GQA without repeating K/V);
ranges: `masks.KeyRanges` ([B, Tq, 2] bounds). Output [B, Tq, Hq, D] in q's dtype. Scores,
softmax and accumulation are float32. A query that sees no key yields zeros (never NaN).

`cache_attention` attends over two parts, the used slots of one layer of a cache and the new keys,
and merges them with their softmax statistics (out, log-sum-exp): the cache is only read, in key
chunks whose count follows the filled length (not the capacity), and never concatenated. A backend
may take the cache read over (`backends.base.Backend.cache_attention`: the CPU backend's one custom
call for float32).

`sinks` [Hq] (gpt-oss's attention sinks): one learned logit per query head that joins each query's
softmax denominator and carries no value (`kernels.reference.with_sinks`). The Pallas kernel takes
it inside its softmax (`block_attention(..., sinks=)`, differentiable); through a cache it is
added once, after the two parts are merged.

Under a device mesh whose `tensor` axis is > 1 (heads split, `dflash_jax.sharding`; the mesh in
context at trace time: `jax.set_mesh`, which the Generator sets around its compiles), the kernel
runs under `jax.shard_map`: each device attends its own query heads over its own kv heads (the
batch over `data` where that axis divides it). XLA's SPMD partitioner cannot split the kernel's
custom call and would gather its operands (a whole KV cache layer) onto every device.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dflash_jax import backends
from dflash_jax.kernels import registry
from dflash_jax.kernels.reference import (
    CACHE_CHUNK,
    chunked_cache_attention_with_lse,
    reference_attention,
    reference_attention_with_lse,
    with_sinks,
)
from dflash_jax.kernels import masks
from dflash_jax.kernels.masks import KeyRanges

__all__ = [
    "IMPLS", "attention", "cache_attention", "causal_attention", "chunked_cache_attention_with_lse", "merge_with_lse",
    "reference_attention", "reference_attention_with_lse",
]

IMPLS = ("auto", "reference", "pallas", "pallas_interpret")

logger = logging.getLogger("dflash_jax.layers.attention")
_logged_reasons: set[str] = set()


def _log_once(level: int, reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.log(level, "attention: using the reference implementation: %s", reason)


def _platform() -> str:
    """The platform "auto" dispatches for ("cpu", "gpu", "tpu"): the backends' answer
    (`backends.platform`, JAX's default backend)."""
    return backends.platform()


def merge_with_lse(first, second, *, return_lse: bool = False):
    """Merge two partial attentions over disjoint key sets: (out, lse) pairs -> out float32 (and
    the merged lse with return_lse)."""
    (out1, lse1), (out2, lse2) = first, second
    lse = jnp.logaddexp(lse1, lse2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight1, weight2 = jnp.exp(lse1 - safe)[..., None], jnp.exp(lse2 - safe)[..., None]
    out = out1.astype(jnp.float32) * weight1 + out2.astype(jnp.float32) * weight2
    return (out, lse) if return_lse else out


def _mesh_axis(mesh, name: str) -> int:
    return int(dict(zip(mesh.axis_names, mesh.axis_sizes)).get(name, 1)) if mesh is not None else 1


def _shard_map():
    """jax.shard_map (jax >= 0.7: check_vma) or jax.experimental.shard_map (older: check_rep)."""
    if hasattr(jax, "shard_map"):
        return lambda f, **kw: jax.shard_map(f, check_vma=False, **kw)
    from jax.experimental.shard_map import shard_map  # pragma: no cover - older jax

    return lambda f, **kw: shard_map(f, check_rep=False, **kw)


def _per_device_heads(kernel, q, k, v, ranges: KeyRanges, sinks):
    """kernel(q, k, v, ranges, sinks) -> an output tree of [B, Tq, Hq, ...] arrays; run under
    `jax.shard_map` over the heads (`tensor`) and the batch (`data`, where it divides B) when the
    mesh in context has tensor > 1 and the tensor axis divides the kv heads, else called as is
    (also inside a shard_map that already made `tensor` manual: the heads are local there)."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except AttributeError:  # pragma: no cover - older jax
        mesh = None
    tensor = _mesh_axis(mesh, "tensor")
    if tensor <= 1 or k.shape[2] % tensor or "tensor" in getattr(mesh, "manual_axes", ()):
        return kernel(q, k, v, ranges, sinks)
    data = _mesh_axis(mesh, "data")
    rows = "data" if data > 1 and q.shape[0] % data == 0 else None
    heads = P(rows, None, "tensor", None)  # q [B, Tq, Hq, D], k, v [B, Tk, Hkv, D]
    ranges_spec = P(rows if ranges.start.shape[0] == q.shape[0] else None, None, None)

    def local(q, k, v, start, end, *sinks):
        return kernel(q, k, v, KeyRanges(start, end), *(sinks or (None,)))

    args = (q, k, v, ranges.start, ranges.end) + (() if sinks is None else (sinks,))
    in_specs = (heads, heads, heads, ranges_spec, ranges_spec) + (() if sinks is None else (P("tensor"),))
    out_specs = jax.tree_util.tree_map(lambda x: P(rows, None, "tensor", *([None] * (x.ndim - 3))),
                                       jax.eval_shape(kernel, q, k, v, ranges, sinks))
    return _shard_map()(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)


def _kernel_mode(impl: str, q, k, v, ranges: KeyRanges, scale):
    """None: use the reference; else (the platform's kernel, its `interpret` flag). Validates impl.
    "auto" takes the kernel the platform registers (`kernels.registry.KERNELS`) where it supports the
    inputs; "pallas" / "pallas_interpret" the platform's kernel, else the one Pallas interprets
    anywhere (`registry.forced`), which raises on unsupported inputs."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS}")
    if impl == "reference":
        return None
    platform = _platform()
    if impl == "auto":
        kernel = registry.for_platform(platform)
        if kernel is None:
            _log_once(logging.DEBUG, f"backend is {platform!r}, no attention kernel is registered for it")
            return None
        reason = kernel.unsupported_reason(q, k, v, ranges, scale)
        if reason is not None:
            _log_once(logging.WARNING, reason)
            return None
        return kernel, False
    return registry.forced(platform), impl == "pallas_interpret"


def attention(q, k, v, ranges: KeyRanges, *, scale: float | None = None, impl: str = "auto", sinks=None):
    """Dispatch to the best implementation available for this backend and shape.

    impl: "auto" takes the Pallas kernel on GPU when it supports the shape and the reference
    otherwise (logging the reason once); "pallas" forces the kernel (ValueError if unsupported);
    "pallas_interpret" runs the kernel in Pallas interpret mode (CPU tests); "reference" the
    reference. sinks [Hq]: attention sinks (module docstring).
    """
    mode = _kernel_mode(impl, q, k, v, ranges, scale)
    if mode is None:
        return reference_attention(q, k, v, ranges, scale=scale, sinks=sinks)
    kernel, interpret = mode
    return _per_device_heads(
        lambda q, k, v, r, s: kernel.attention(q, k, v, r, scale=scale, interpret=interpret, sinks=s),
        q, k, v, ranges, sinks)


def _partial(q, k, v, ranges: KeyRanges, scale, impl: str):
    """(out, lse) of one part through the kernel or the dense reference (per `attention`'s rules)."""
    mode = _kernel_mode(impl, q, k, v, ranges, scale)
    if mode is None:
        return reference_attention_with_lse(q, k, v, ranges, scale=scale)
    kernel, interpret = mode
    return _per_device_heads(
        lambda q, k, v, r, _: kernel.attention_with_lse(q, k, v, r, scale=scale, interpret=interpret),
        q, k, v, ranges, None)


def cache_attention(q, cache_k, cache_v, layer, cache_ranges: KeyRanges, k, v, ranges: KeyRanges, *,
                    scale: float | None = None, impl: str = "auto", chunk_size: int = CACHE_CHUNK,
                    backend: str = "xla", sinks=None):
    """Attention of q [B, Tq, Hq, D] over [layer `layer` of cache_k/v [L, B, S, Hkv, D] ; k, v
    [B, T, Hkv, D]]: cache_ranges index the cache slots, ranges the new keys (0 .. T-1); build
    both from one `KeyRanges` with `KeyRanges.segment`. -> [B, Tq, Hq, D] in q's dtype.

    The reference reads the cache in chunks of chunk_size keys bounded by the visible slots; the
    kernel ("pallas" / "pallas_interpret") reads the layer's slots and skips key tiles outside the
    ranges. "auto" first offers the read to `backend` (the calling model's: the CPU backend takes
    float32 where its kernels are built), then follows `attention`'s rule: the kernel on a GPU where
    it supports the shapes, the reference elsewhere. sinks [Hq]: attention sinks, added once to the
    merged softmax (module docstring).
    """
    if impl == "auto" and sinks is None:
        taken = backends.get(backend).cache_attention(q, cache_k, cache_v, layer, cache_ranges, k, v, ranges,
                                                      scale=q.shape[-1] ** -0.5 if scale is None else scale)
        if taken is not None:
            return taken
    layer_k = jax.lax.dynamic_index_in_dim(cache_k, layer, axis=0, keepdims=False)
    layer_v = jax.lax.dynamic_index_in_dim(cache_v, layer, axis=0, keepdims=False)
    if _kernel_mode(impl, q, layer_k, layer_v, cache_ranges, scale) is None:
        cached = chunked_cache_attention_with_lse(q, cache_k, cache_v, layer, cache_ranges, scale=scale,
                                                  chunk_size=chunk_size)
    else:
        cached = _partial(q, layer_k, layer_v, cache_ranges, scale, impl)
    new = _partial(q, k, v, ranges, scale, impl)
    if sinks is None:
        return merge_with_lse(cached, new).astype(q.dtype)
    return with_sinks(*merge_with_lse(cached, new, return_lse=True), sinks)[0].astype(q.dtype)


def causal_attention(q, k, v, positions, window, cache, layer, *, scale: float | None = None, impl: str = "auto",
                     backend: str = "xla", sinks=None):
    """A target layer's causal attention of q [B, T, Hq, D] at `positions` [B, T] (a `window` of 0:
    unbounded): over the new keys alone when `cache` is None, else over layer `layer` of the cache's
    used slots (its `k`, `v` [L, B, S, Hkv, D], `lengths` [B]) and the new keys (`cache_attention`).
    The new k, v are rounded to the cache's dtype first: a token then sees its block-mates as a later
    step reads them back from the cache. -> (output [B, T, Hq, D], (k, v) as attended)."""
    ranges = masks.causal(positions, window)  # over cache slots (== positions)
    if cache is None:
        return attention(q, k, v, ranges, scale=scale, impl=impl, sinks=sinks), (k, v)
    offsets = cache.lengths
    k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
    attended = cache_attention(q, cache.k, cache.v, layer, ranges.segment(0, offsets), k, v,
                               ranges.segment(offsets, offsets + k.shape[1]), scale=scale, impl=impl, backend=backend,
                               sinks=sinks)
    return attended, (k, v)
