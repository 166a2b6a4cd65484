"""Weight products of a few rows on a CPU: `rows_matmul(x, w)` = x @ W in float32, with W packed
by `pack_kernel` into panels of 16 columns.

XLA:CPU's GEMM kernels read the weights several times over for 2-16 rows, so their cost grows
with the rows while the weights stream from memory, and 2-16 rows are what a speculative verify of
a block multiplies (`python -m infer.benchmark_matmul` shows it on this machine).
`cpu_rows_matmul.cc` streams each panel of W once, keeps a tile of rows x 16 columns in registers
and splits the panels over the cores, so a few rows cost about what one row costs. It is compiled
on first use with the machine's C++ compiler (`backends.cpu.ffi`) and called through XLA's FFI.
Where it cannot run (not an x86-64 CPU with AVX2 and FMA, no compiler, a failed build, or
DFLASH_CPU_KERNELS=0) `pack_kernel` leaves W as it is, [K, N], and the product is XLA's; packed
weights on another backend go through XLA too. More rows (a batch-8 verify: 128; prefill chunks)
run through the same kernel: XLA's product of the packed panels would copy them into a GEMM
layout first, and the kernel is faster there than XLA's product of W as [K, N] as well.

Narrow panels hold the same weights in fewer bytes: a weight a GGUF file stores in Q4_1 or Q8_0
blocks can stay in them (`pack_quantized`, used by `backends.cpu.gguf_panels` for a CPU decode), and
`pack_kernel` keeps bfloat16 where every weight is a bfloat16 value. bfloat16 widens exactly as the
kernel multiplies: the product is bit for bit that of the float32 panels, from half of the bytes.
Quantized blocks multiply in factored form, d (x . q) + m (sum of x) per block of 32, so a decode
step reads a sixth (Q4_1) of float32's bytes, without dequantising: the product of gguf-py's
dequantised floats to float rounding. Float weights can be quantized into Q8_0 blocks too
(`pack_kernel(..., quantize="q8_0")`: what a drafter's `decode_weights="q8_0"` drafts with), at
8 bits and a scale per 32 weights. Either way a row's result does not depend on the other rows of
the call (a verify and a decode step agree).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import _host_arrays as host_arrays
from dflash_jax.backends.base import ACTIVATIONS  # what `pack_quantized(..., activations=...)` takes
from dflash_jax.backends.cpu.ffi import available

TARGET_NAME = "dflash_rows_matmul"
NARROW_TARGET_NAME = "dflash_rows_matmul_narrow"
INT8_TARGET_NAME = "dflash_rows_matmul_int8"  # Q4_1 panels for int8 activations
PANEL = 16  # columns per panel of a packed kernel
QUANT_BLOCK = 32  # k per block of narrow panels (GGML's Q4_1 and Q8_0 blocks; bfloat16 too)
# GGML's block of 32 weights (bytes: float16 scale [and offset], then the values) and the narrow
# panel block the kernel reads for 32 k x 16 columns (Q4_1: float16 scales and offsets, Q8_0:
# float32 scales, then the values by k; bfloat16: the values alone; Q4_1 for int8 activations:
# Q4_1's 320 bytes with the values in quads of k, the panels typed int8 to tell them apart).
GGML_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
PANEL_BLOCK_BYTES = {"Q4_1": 320, "Q8_0": 576, "BF16": 1024}
QUANTIZE_CHOICES = (None, "q8_0")  # what `pack_kernel(..., quantize=...)` takes


def packs_side_by_side(*widths: int) -> bool:
    """Whether kernels of these output widths can be packed as one (`pack_kernel(a, b, ...)`): every
    one but the last a whole number of 16-column panels, so that each starts on a panel."""
    return all(w % PANEL == 0 for w in widths[:-1])


def quantize_q8_0(kernel) -> np.ndarray:
    """A float kernel [..., K, N] (`nn.Dense`'s [in, out], K a multiple of 32) as GGML Q8_0 blocks
    [..., N, K / 32, 34] uint8 (`pack_quantized`'s input): per 32 weights of a column, a float16
    scale d = max |w| / 127 and the int8 values round(w / d), so that d * q is within d / 2 of w."""
    w = np.asarray(kernel, np.float32)
    *lead, k, n = w.shape
    if k % QUANT_BLOCK:
        raise ValueError(f"quantize_q8_0: K = {k} is not a multiple of {QUANT_BLOCK}")
    blocks = np.swapaxes(w, -1, -2).reshape(*lead, n, k // QUANT_BLOCK, QUANT_BLOCK)
    scale = (np.abs(blocks).max(axis=-1, keepdims=True) / 127).astype(np.float16)
    d = scale.astype(np.float32)
    inverse = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    values = np.clip(np.rint(blocks * inverse), -127, 127).astype(np.int8)
    out = np.empty((*lead, n, k // QUANT_BLOCK, GGML_BLOCK_BYTES["Q8_0"]), np.uint8)
    out[..., :2] = scale.view(np.uint8)
    out[..., 2:] = values.view(np.uint8)
    return out


def pack_kernel(kernel, *more, quantize: str | None = None) -> jax.Array:
    """A dense kernel [K, N] (`nn.Dense`'s [in, out]) as the rows kernel reads it: panels
    [ceil(N / 16), K, 16], panel p holding columns 16p .. 16p + 15 (zeros past N); a stack of
    kernels [L, K, N] (a scanned model's) -> [L, ceil(N / 16), K, 16]. With `more` kernels of the
    same leading shape, their columns follow the first kernel's, as one product of them all would
    read them (every kernel but the last a whole number of panels wide). Where every weight is a
    bfloat16 value (a checkpoint stored in bfloat16, loaded as float32) and K a multiple of 32, the
    panels are bfloat16 ([..., P, K / 32, 1024] bytes, `is_narrow`): the same products, bit for bit,
    from half the bytes (the shipped drafter's decode params: 51.2 MB -> 25.6). quantize="q8_0":
    Q8_0 panels instead wherever K is a multiple of 32 and the kernel is concrete (`quantize_q8_0`,
    `pack_quantized`; about a quarter of float32's bytes, the products those of weights rounded to
    8 bits per block). Left as it is (the kernels concatenated) where the rows kernel is
    unavailable or the dtype is not float32. Concrete arrays are packed with numpy into a buffer
    JAX adopts without another copy (`host_arrays`: the packed stacks are never held twice);
    under a trace (an initializer) it is jnp."""
    kernels = (kernel, *more)
    widths = [w.shape[-1] for w in kernels]
    if any(w.shape[:-1] != kernel.shape[:-1] for w in kernels) or not packs_side_by_side(*widths):
        raise ValueError(f"pack_kernel: kernels side by side need one leading shape and whole panels of "
                         f"{PANEL} columns but the last: {[tuple(w.shape) for w in kernels]}")
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"pack_kernel: quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")
    if kernel.dtype != jnp.float32 or kernel.ndim not in (2, 3) or not available():
        return jnp.asarray(kernel) if not more else jnp.concatenate(kernels, axis=-1)
    try:
        kernels, xp = [np.asarray(w) for w in kernels], np
    except jax.errors.TracerArrayConversionError:
        xp = jnp
    *lead, k, _ = kernel.shape
    if quantize == "q8_0" and xp is np and k % QUANT_BLOCK == 0:
        return pack_quantized(quantize_q8_0(np.concatenate(kernels, axis=-1)), "Q8_0")

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
    narrow = _bfloat16_panels(out)
    return host_arrays.adopt(out if narrow is None else narrow)


def is_packed(w, stacked: bool = False) -> bool:
    """Whether w is `pack_kernel`'s or `pack_quantized`'s panels, float32 or narrow (of a stack of
    kernels when `stacked`)."""
    return w.ndim == 3 + stacked


def is_narrow(w) -> bool:
    """Whether w is narrow panels, [..., P, K / 32, bytes] uint8: `pack_quantized`'s (Q4_1: 320
    bytes per block, Q8_0: 576; int8 for int8 activations) or `pack_kernel`'s bfloat16 ones (1024)."""
    return w.dtype in (jnp.uint8, jnp.int8)


def _bfloat16_panels(panels: np.ndarray) -> np.ndarray | None:
    """float32 panels [..., P, K, 16] -> bfloat16 panel blocks [..., P, K / 32, 1024] uint8 where
    every weight is a bfloat16 value (the low 16 bits of each float are zero: a checkpoint stored in
    bfloat16) and K is a multiple of 32; None otherwise (checked on a sample first, so that float32
    weights cost a glance, not a pass)."""
    *lead, p, k, _ = panels.shape
    bits = panels.view(np.uint32)
    if k % QUANT_BLOCK or k == 0 or np.any(bits.reshape(-1)[:4096] & 0xFFFF) or np.any(bits & 0xFFFF):
        return None
    out = host_arrays.empty((*lead, p, k // QUANT_BLOCK, PANEL_BLOCK_BYTES["BF16"]), np.uint8)
    out.view(np.uint16).reshape(bits.shape)[...] = bits >> 16
    return out


def pack_quantized(blocks: np.ndarray, quant_type: str, activations: str = "float32") -> jax.Array:
    """A weight as a GGUF file stores it, GGML blocks [..., N, K / 32, block bytes] (Hugging Face's
    [out, in] rows, so N output columns; `GGUFTensors.stored_blocks`), as panels of 16 columns the
    rows kernel multiplies as they are: [..., ceil(N / 16), K / 32, PANEL_BLOCK_BYTES] uint8.
    Panel p, block b holds the 16 columns' scales d (Q4_1: float16 as the file stores them, then
    the offsets m; Q8_0: float32) and their values k by k (Q4_1: byte j of a k = column j's 4 bits
    | column j + 8's << 4; Q8_0: the 16 int8). The weights are GGML's own floats: `dequantize_panels`
    of it equals gguf-py's dequantisation (d * q + m, d * q) transposed into `pack_kernel`'s panels,
    bit for bit.

    activations="int8" (Q4_1 only): panels the kernel multiplies as llama.cpp's CPU backend does,
    each row of x rounded to int8 per block of 32 (`round_activations`) and the 4-bit values
    multiplied as integers: the same 320 bytes per block, the values in quads of 4 k (32 bytes,
    byte 16 h + 2 c + t holding column c's value at k 4 j + 2 h + t (low 4 bits) and column c + 8's
    (high)), typed int8 (`uses_int8_activations`). A different product, x's rounding included: a
    target loaded so is another (near) model, the same in a verify and in a step."""
    if quant_type not in GGML_BLOCK_BYTES:
        raise ValueError(f"pack_quantized reads {' or '.join(GGML_BLOCK_BYTES)} blocks, not {quant_type}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"pack_quantized: activations must be one of {ACTIVATIONS}, not {activations!r}")
    if activations == "int8" and quant_type != "Q4_1":
        raise ValueError(f"pack_quantized: int8 activations multiply Q4_1 blocks, not {quant_type}")
    if blocks.shape[-1] != GGML_BLOCK_BYTES[quant_type]:
        raise ValueError(f"pack_quantized: {quant_type} blocks of {GGML_BLOCK_BYTES[quant_type]} bytes "
                         f"expected, got [..., {blocks.shape[-1]}]")
    blocks = np.asarray(blocks, np.uint8)
    *lead, n, nb, _ = blocks.shape
    if n % PANEL:
        blocks = np.pad(blocks, [(0, 0)] * len(lead) + [(0, -n % PANEL), (0, 0), (0, 0)])  # zero scales: 0
    p = blocks.shape[-3] // PANEL
    panels = blocks.reshape(*lead, p, PANEL, nb, -1)
    by_block = lambda a: np.swapaxes(a, -2, -3)  # [..., P, 16, nb, ...] -> [..., P, nb, 16, ...]

    def scales(at):  # float16 at bytes [at, at + 2) of every block -> float32 bytes [..., P, nb, 64]
        f16 = np.ascontiguousarray(panels[..., at:at + 2]).view(np.float16)[..., 0]  # [..., P, 16, nb]
        f32 = np.ascontiguousarray(np.swapaxes(f16, -1, -2), np.float32)
        return f32.view(np.uint8).reshape(*lead, p, nb, 4 * PANEL)

    def halves(at):  # the float16 bytes [at, at + 2) of every block, by column -> [..., P, nb, 32]
        return np.ascontiguousarray(by_block(panels[..., at:at + 2])).reshape(*lead, p, nb, 2 * PANEL)

    if quant_type == "Q4_1":
        qs = panels[..., 4:]  # byte i: element i (low 4 bits), element i + 16 (high)
        values = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [..., P, 16, nb, 32]
        values = np.moveaxis(by_block(values), -2, -1)  # [..., P, nb, 32 k, 16 columns]
        packed = values[..., :8] | (values[..., 8:] << 4)
        if activations == "int8":  # [.., 32 k, 8] -> [.., quad j, lane h, column c, t], k = 4 j + 2 h + t
            packed = np.swapaxes(packed.reshape(*lead, p, nb, QUANT_BLOCK // 4, 2, 2, 8), -1, -2)
        parts = [halves(0), halves(2), packed.reshape(*lead, p, nb, -1)]
    else:
        values = np.moveaxis(by_block(panels[..., 2:]), -2, -1)  # int8 bytes [..., P, nb, 32 k, 16]
        parts = [scales(0), values.reshape(*lead, p, nb, -1)]
    out = host_arrays.empty((*lead, p, nb, PANEL_BLOCK_BYTES[quant_type]), np.uint8)
    np.concatenate(parts, axis=-1, out=out)
    return host_arrays.adopt(out.view(np.int8) if activations == "int8" else out)


def dequantize_panels(w) -> jax.Array:
    """Narrow panels [..., P, K / 32, bytes] (`pack_quantized`'s, or `pack_kernel`'s bfloat16 ones)
    -> their float32 panels [..., P, K, 16], the floats the kernel multiplies by: XLA's path where
    the kernel cannot run, and the embedding rows of a narrow tied head."""
    *lead, p, nb, size = w.shape
    int8 = uses_int8_activations(w)
    w = jax.lax.bitcast_convert_type(w, jnp.uint8) if int8 else w
    if size == PANEL_BLOCK_BYTES["Q4_1"]:
        halves = lambda b: jax.lax.bitcast_convert_type(b.reshape(*lead, p, nb, PANEL, 2),  # noqa: E731
                                                        jnp.float16).astype(jnp.float32)[..., None, :]
        q = w[..., 64:]
        if int8:  # [.., quad j, lane h, column c, t] -> [.., k, c]
            q = jnp.swapaxes(q.reshape(*lead, p, nb, QUANT_BLOCK // 4, 2, 8, 2), -1, -2)
        q = q.reshape(*lead, p, nb, QUANT_BLOCK, 8)
        values = jnp.concatenate([q & 15, q >> 4], axis=-1).astype(jnp.float32)
        weights = values * halves(w[..., :32]) + halves(w[..., 32:64])
        return weights.reshape(*lead, p, nb * QUANT_BLOCK, PANEL)
    if size == PANEL_BLOCK_BYTES["BF16"]:
        halves = jax.lax.bitcast_convert_type(w.reshape(*lead, p, nb * QUANT_BLOCK, PANEL, 2), jnp.uint16)
        return jax.lax.bitcast_convert_type(halves.astype(jnp.uint32) << 16, jnp.float32)
    d = jax.lax.bitcast_convert_type(w[..., :64].reshape(*lead, p, nb, PANEL, 4), jnp.float32)[..., None, :]
    values = jax.lax.bitcast_convert_type(w[..., 64:], jnp.int8).reshape(*lead, p, nb, QUANT_BLOCK, PANEL)  # Q8_0
    return (values.astype(jnp.float32) * d).reshape(*lead, p, nb * QUANT_BLOCK, PANEL)


def uses_int8_activations(w) -> bool:
    """Whether w is Q4_1 panels for int8 activations (`pack_quantized(..., activations="int8")`:
    typed int8)."""
    return w.dtype == jnp.int8


def round_activations(x: jax.Array) -> jax.Array:
    """x [..., K] (K a multiple of 32) as the int8-activation kernel sees it: each block of 32
    rounded to int8 values q with one scale d = max |x| / 127, GGML's Q8_1; -> d * q, float32."""
    x = x.astype(jnp.float32)
    blocks = x.reshape(*x.shape[:-1], -1, QUANT_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    inverse = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    return (jnp.round(blocks * inverse) * (amax / 127.0)).reshape(x.shape)


def _xla_panels(x, panels):
    if uses_int8_activations(panels):
        x = round_activations(x)
    if is_narrow(panels):
        panels = dequantize_panels(panels).astype(x.dtype)
    y = jax.lax.dot_general(x, panels, (((x.ndim - 1,), (1,)), ((), ())))  # [..., P, 16]
    return y.reshape(*x.shape[:-1], -1)


def rows_matmul(x: jax.Array, w: jax.Array, features: int, layer=None) -> jax.Array:
    """x [..., K] @ W -> [..., features], W being a `pack_kernel` or `pack_quantized` result: panels
    [P, K, 16], narrow panels [P, K / 32, bytes] or a plain [K, N]; with `layer` (an int32 scalar,
    traced or not), W is a stack of them ([L, ...]) and the product uses W[layer], which the
    kernel reads in place. Panels go through the kernel on a CPU for float32 inputs, through XLA
    otherwise; a plain kernel is XLA's product (of a slice: a copy)."""
    stacked = layer is not None
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)

    def one(w):
        return jax.lax.dynamic_index_in_dim(w, index, keepdims=False) if stacked else w

    if not is_packed(w, stacked):
        return jnp.dot(x, one(w))
    rows = int(np.prod(x.shape[:-1]))
    narrow = is_narrow(w)
    if narrow and x.shape[-1] != w.shape[-2] * QUANT_BLOCK:
        raise ValueError(f"rows_matmul: x [..., {x.shape[-1]}] against narrow panels of "
                         f"K = {w.shape[-2] * QUANT_BLOCK}")
    if x.dtype == jnp.float32 and (narrow or w.dtype == jnp.float32) and rows > 0 and available():
        def kernel(x, w):
            out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[-3] * PANEL,), jnp.float32)
            name = INT8_TARGET_NAME if uses_int8_activations(w) else NARROW_TARGET_NAME if narrow else TARGET_NAME
            return jax.ffi.ffi_call(name, out)(x, w, index)

        if jax.default_backend() == "cpu":  # lowered for the CPU alone: no XLA branch to trace
            y = kernel(x, w)
        else:  # a GPU host decoding on its CPU device: the kernel there, XLA's product elsewhere
            y = jax.lax.platform_dependent(x, w, cpu=kernel, default=lambda x, w: _xla_panels(x, one(w)))
    else:
        y = _xla_panels(x, one(w))
    return y if y.shape[-1] == features else y[..., :features]
