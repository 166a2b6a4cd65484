"""Weight products of a few rows on a CPU: `rows_matmul(x, w)` = x @ W in float32, with W packed
by `pack_kernel` into panels of 16 columns.

XLA:CPU's GEMM kernels read the weights several times over for 2-16 rows (the LM head of
SmolLM2, 576 x 49,152 f32, on a 2-core AVX2 machine: 6.1 ms for one row, 16.0 for two, 26.7 for
four, 50.3 for sixteen; `python -m infer.benchmark_matmul`), which is what a speculative verify of
a block multiplies. `cpu_rows_matmul.cc` streams each panel of W once, keeps a tile of rows x 16
columns in registers and splits the panels over the cores. It is compiled on first use with the
machine's C++ compiler (`kernels.cpu_ffi`) and called through XLA's FFI. Where it cannot run (not
an x86-64 CPU with AVX2 and FMA, no compiler, a failed build, or DFLASH_CPU_KERNELS=0)
`pack_kernel` leaves W as it is, [K, N], and the product is XLA's; packed weights on another
backend go through XLA too. More rows (a batch-8 verify: 128; prefill chunks) run through the same
kernel: XLA's product of the packed panels would copy them into a GEMM layout first (SmolLM2's LM
head at 128 rows: 241 ms through XLA on the panels, 124 ms XLA on [K, N], 102 ms here; one-off
script).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import host_arrays
from dflash_jax.kernels.cpu_ffi import available

TARGET_NAME = "dflash_rows_matmul"
PANEL = 16  # columns per panel of a packed kernel


def packs_side_by_side(*widths: int) -> bool:
    """Whether kernels of these output widths can be packed as one (`pack_kernel(a, b, ...)`): every
    one but the last a whole number of 16-column panels, so that each starts on a panel."""
    return all(w % PANEL == 0 for w in widths[:-1])


def pack_kernel(kernel, *more) -> jax.Array:
    """A dense kernel [K, N] (`nn.Dense`'s [in, out]) as the rows kernel reads it: panels
    [ceil(N / 16), K, 16], panel p holding columns 16p .. 16p + 15 (zeros past N); a stack of
    kernels [L, K, N] (a scanned model's) -> [L, ceil(N / 16), K, 16]. With `more` kernels of the
    same leading shape, their columns follow the first kernel's, as one product of them all would
    read them (every kernel but the last a whole number of panels wide). Left as it is (the kernels
    concatenated) where the rows kernel is unavailable or the dtype is not float32. Concrete
    arrays are packed with numpy into a buffer JAX adopts without another copy (`host_arrays`:
    packing SmolLM2's stacks took 0.70 s, 0.77 s with that copy, medians of 4 in one process);
    under a trace (an initializer) it is jnp."""
    kernels = (kernel, *more)
    widths = [w.shape[-1] for w in kernels]
    if any(w.shape[:-1] != kernel.shape[:-1] for w in kernels) or not packs_side_by_side(*widths):
        raise ValueError(f"pack_kernel: kernels side by side need one leading shape and whole panels of "
                         f"{PANEL} columns but the last: {[tuple(w.shape) for w in kernels]}")
    if kernel.dtype != jnp.float32 or kernel.ndim not in (2, 3) or not available():
        return jnp.asarray(kernel) if not more else jnp.concatenate(kernels, axis=-1)
    try:
        kernels, xp = [np.asarray(w) for w in kernels], np
    except jax.errors.TracerArrayConversionError:
        xp = jnp
    *lead, k, _ = kernel.shape

    def panels_of(w):
        n = w.shape[-1]
        if n % PANEL:
            w = xp.pad(w, [(0, 0)] * (len(lead) + 1) + [(0, -n % PANEL)])
        return xp.swapaxes(w.reshape(*lead, k, -1, PANEL), -3, -2)

    if xp is jnp:
        return jnp.concatenate([panels_of(w) for w in kernels], axis=-3)
    panels = [-(-n // PANEL) for n in widths]
    out = host_arrays.empty((*lead, sum(panels), k, PANEL), np.float32)  # one copy, adopted as it is
    start = 0
    for w, count in zip(kernels, panels):
        out[..., start:start + count, :, :] = panels_of(w)
        start += count
    return host_arrays.adopt(out)


def is_packed(w, stacked: bool = False) -> bool:
    """Whether w is `pack_kernel`'s panels (of a stack of kernels when `stacked`)."""
    return w.ndim == 3 + stacked


def _xla_panels(x, panels):
    y = jax.lax.dot_general(x, panels, (((x.ndim - 1,), (1,)), ((), ())))  # [..., P, 16]
    return y.reshape(*x.shape[:-1], -1)


def rows_matmul(x: jax.Array, w: jax.Array, features: int, layer=None) -> jax.Array:
    """x [..., K] @ W -> [..., features], W being a `pack_kernel` result: panels [P, K, 16] or a
    plain [K, N]; with `layer` (an int32 scalar, traced or not), W is a stack of them ([L, P, K, 16]
    or [L, K, N]) and the product uses W[layer], which the kernel reads in place. Panels go through
    the kernel on a CPU for float32 inputs, through XLA otherwise; a plain kernel is XLA's
    product (of a slice: a copy)."""
    stacked = layer is not None
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)

    def one(w):
        return jax.lax.dynamic_index_in_dim(w, index, keepdims=False) if stacked else w

    if not is_packed(w, stacked):
        return jnp.dot(x, one(w))
    rows = int(np.prod(x.shape[:-1]))
    if x.dtype == w.dtype == jnp.float32 and rows > 0 and available():
        def kernel(x, w):
            out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[-3] * PANEL,), jnp.float32)
            return jax.ffi.ffi_call(TARGET_NAME, out)(x, w, index)

        if jax.default_backend() == "cpu":  # lowered for the CPU alone: no XLA branch to trace
            y = kernel(x, w)
        else:  # a GPU host decoding on its CPU device: the kernel there, XLA's product elsewhere
            y = jax.lax.platform_dependent(x, w, cpu=kernel, default=lambda x, w: _xla_panels(x, one(w)))
    else:
        y = _xla_panels(x, one(w))
    return y if y.shape[-1] == features else y[..., :features]
