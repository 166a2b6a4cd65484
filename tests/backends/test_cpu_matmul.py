"""The CPU rows kernel (`dflash_jax.backends.cpu.matmul`): its products over packed weights equal
numpy's for every row count, odd sizes included, and a row's result does not depend on how many
rows share the product; it is what the compiled program calls for float32; other dtypes and
DFLASH_CPU_KERNELS=0 keep plain kernels and XLA's product."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.backends.cpu import ffi as cpu_ffi
from dflash_jax.backends.cpu.matmul import (GGML_BLOCK_BYTES, PANEL, PANEL_BLOCK_BYTES, NARROW_TARGET_NAME,
                                         TARGET_NAME, available, dequantize_panels, pack_kernel, pack_quantized,
                                         rows_matmul)

needs_kernel = pytest.mark.skipif(not available(), reason="the CPU rows kernel is not built here "
                                  "(no C++ compiler, no AVX2/FMA, or DFLASH_CPU_KERNELS=0)")


def _inputs(lead, k, n, seed=0):
    """x [*lead, K] and a dense kernel [K, N]."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((*lead, k)).astype(np.float32),
            rng.standard_normal((k, n)).astype(np.float32))


def _calls_kernel(fn, *args) -> bool:
    return TARGET_NAME in jax.jit(fn).lower(*args).compile().as_text()


def _product(n):
    return lambda x, w: rows_matmul(x, w, n)


@functools.cache
def _jitted_product(n):
    """jax.jit(_product(n)), one per n for the module: a shape it multiplies is compiled once, and
    its `lower(...).compile()` is that program (a new function would be traced and compiled anew).
    The tests that change how rows_matmul traces (monkeypatched `available`, a cache reset) keep
    new functions of their own."""
    return jax.jit(_product(n))


@functools.cache
def _jitted_layer_product(n):
    """rows_matmul of layer i of a stack, jitted once per n (as `_jitted_product`)."""
    return jax.jit(lambda x, w, i: rows_matmul(x, w, n, i))


def check_rows_products(panels, x, want, n: int, target_name: str, row_counts) -> np.ndarray:
    """The custom call `target_name` multiplies the first `rows` of x by `panels` as `want` does,
    to float rounding, for every count of row_counts, and each row's result is bit for bit its
    result alone (what makes a verify and a decode step agree). -> the rows' results alone."""
    product = _jitted_product(n)
    alone = np.stack([np.asarray(product(x[m:m + 1], panels))[0] for m in range(len(x))])
    for rows in row_counts:
        got = np.asarray(product(x[:rows], panels))
        assert target_name in product.lower(x[:rows], panels).compile().as_text()
        np.testing.assert_allclose(got, want[:rows], rtol=1e-5, atol=1e-5 * np.abs(want).max())
        for m in range(rows):  # a row's result does not depend on the rows beside it
            np.testing.assert_array_equal(got[m], alone[m], err_msg=f"row {m} of {rows}")
    return alone


def check_stacked_layers_are_their_own_products(stack, k: int, n: int) -> None:
    """Each layer of a stack of panels (K = k), read in place by index, multiplies as that layer alone."""
    ones = np.ones((2, k), np.float32)
    for layer in range(stack.shape[0]):
        in_stack = _jitted_layer_product(n)(ones, stack, jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(in_stack), np.asarray(_jitted_product(n)(ones, stack[layer])))


@needs_kernel
@pytest.mark.parametrize("lead", [(1,), (2,), (3,), (1, 5), (2, 8), (16,), (8, 17)])
@pytest.mark.parametrize("k,n", [(7, 1), (64, 5), (200, 130), (576, 333), (24, 4097)])
def test_rows_kernel_equals_numpy(lead, k, n):
    x, w = _inputs(lead, k, n)
    packed = pack_kernel(w)
    assert packed.shape == (-(-n // PANEL), k, PANEL)
    got = np.asarray(_jitted_product(n)(x, packed))
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert got.shape == (*lead, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(k))
    assert TARGET_NAME in _jitted_product(n).lower(x, packed).compile().as_text()  # the program that ran


@needs_kernel
@pytest.mark.parametrize("rows", [2, 5, 7, 11, 16, 40])
def test_a_rows_result_does_not_depend_on_the_other_rows(rows):
    """Every output is one chain of FMAs over k, whatever tile the row falls in: a row alone and
    the same row among others give bit-identical results (a verify and a decode step agree)."""
    x, w = _inputs((rows,), 576, 600, seed=rows)
    packed = pack_kernel(w)
    together = np.asarray(_jitted_product(600)(x, packed))
    for m in range(rows):
        alone = np.asarray(_jitted_product(600)(x[m:m + 1], packed))
        np.testing.assert_array_equal(alone[0], together[m])


@pytest.mark.parametrize("kernels", [True, False])
def test_a_stacks_layer_is_read_in_place_and_equals_its_own_product(kernels, monkeypatch):
    """`rows_matmul(x, stack, n, layer)` over `pack_kernel` of stacked kernels [L, K, N] equals the
    product with kernel `layer` packed alone, bit for bit, for a traced layer index, with the
    kernel reading the stack in place; without the kernel (plain stacks) XLA multiplies the slice."""
    if not kernels:
        monkeypatch.setattr(cpu_ffi, "available", lambda: False)
        monkeypatch.setattr("dflash_jax.backends.cpu.matmul.available", lambda: False)
    elif not available():
        pytest.skip("the CPU rows kernel is not built here")
    rng = np.random.default_rng(5)
    stack = rng.standard_normal((3, 200, 130)).astype(np.float32)
    x = rng.standard_normal((4, 200)).astype(np.float32)
    packed = pack_kernel(stack)
    assert packed.shape == ((3, 9, 200, PANEL) if kernels else (3, 200, 130))
    product = jax.jit(lambda x, w, layer: rows_matmul(x, w, 130, layer))
    for layer in range(3):
        want = np.asarray(jax.jit(_product(130))(x, pack_kernel(stack[layer])))
        np.testing.assert_array_equal(np.asarray(product(x, packed, jnp.int32(layer))), want)
    hlo = product.lower(x, packed, jnp.int32(0)).compile().as_text()
    assert (TARGET_NAME in hlo) == kernels
    if kernels:  # the stack goes into the call whole: no [200, 16]-panel slice of it is made
        assert "f32[9,200,16]" not in hlo


@pytest.mark.parametrize("kernels", [True, False])
def test_kernels_side_by_side_pack_as_their_concatenation(kernels, monkeypatch):
    """`pack_kernel(a, b, c)` is the packing of their columns side by side (one product of all
    three, split afterwards: what a fused q/k/v product reads), for one kernel and for stacks,
    concrete and traced; without the rows kernel it is the plain concatenation. Widths that are not
    whole panels (but the last) or different leading shapes are refused."""
    if not kernels:
        monkeypatch.setattr("dflash_jax.backends.cpu.matmul.available", lambda: False)
    elif not available():
        pytest.skip("the CPU rows kernel is not built here")
    rng = np.random.default_rng(9)
    for lead in ((), (3,)):
        parts = [rng.standard_normal((*lead, 40, n)).astype(np.float32) for n in (32, 16, 21)]
        whole = np.concatenate(parts, axis=-1)
        np.testing.assert_array_equal(np.asarray(pack_kernel(*parts)), np.asarray(pack_kernel(whole)))
        traced = jax.jit(lambda *ws: pack_kernel(*ws))(*parts)
        np.testing.assert_array_equal(np.asarray(traced), np.asarray(pack_kernel(whole)))
    with pytest.raises(ValueError, match="whole panels"):
        pack_kernel(parts[2], parts[0])
    with pytest.raises(ValueError, match="leading shape"):
        pack_kernel(parts[0], parts[1][0])


@needs_kernel
def test_concurrent_products_share_the_helper_threads_safely():
    """Independent products in one program may run at the same time on XLA's threads: the one
    that finds the helpers busy computes alone; every result must still be right."""
    # big enough that each product is split over the helpers (the kernel's kMinMultiplyAddsToSplit)
    x, _ = _inputs((2,), 256, 1)
    ws = [_inputs((1,), 256, 1500 + 37 * i, seed=i + 1)[1] for i in range(12)]
    assert all(2 * 256 * w.shape[1] >= 1 << 18 for w in ws)
    got = jax.jit(lambda x, ws: [rows_matmul(x, pack_kernel(w), w.shape[1]) for w in ws])(x, ws)
    for g, w in zip(got, ws):
        np.testing.assert_allclose(np.asarray(g), x @ w, rtol=1e-5, atol=1e-3)


def test_other_dtypes_keep_plain_kernels_and_xlas_product():
    x, w = _inputs((2,), 32, 48)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    assert pack_kernel(wb).shape == wb.shape  # only float32 kernels are packed
    assert not _calls_kernel(_product(48), xb, pack_kernel(wb))
    assert rows_matmul(xb, pack_kernel(wb), 48).dtype == jnp.bfloat16


def test_disabled_by_the_environment():
    env = {**os.environ, "DFLASH_CPU_KERNELS": "0"}
    code = ("import numpy as np; from dflash_jax.backends.cpu.matmul import available, pack_kernel; "
            "assert not available(); assert pack_kernel(np.ones((8, 40), np.float32)).shape == (8, 40)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_a_failed_build_falls_back(monkeypatch, tmp_path):
    """A compiler that fails leaves `available()` False (logged), never an exception."""
    monkeypatch.setattr(cpu_ffi, "_cpu_supports_avx2_fma_f16c", lambda: True)
    monkeypatch.setenv("DFLASH_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setattr(cpu_ffi.shutil, "which", lambda name: "/bin/false")
    cpu_ffi.available.cache_clear()
    try:
        assert cpu_ffi.available() is False
    finally:
        cpu_ffi.available.cache_clear()


@needs_kernel
def test_available_again_after_a_cache_reset():
    """Registering the FFI target twice in one process must not turn the kernel off."""
    cpu_ffi.available.cache_clear()
    assert cpu_ffi.available()
    x, w = _inputs((2,), 16, 40)
    assert _calls_kernel(_product(40), x, pack_kernel(w))


def _ggml_blocks(quant_type: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGML blocks [n, k / 32, bytes] of `quant_type` with sane float16 scales."""
    rng = np.random.default_rng(seed)
    size = GGML_BLOCK_BYTES[quant_type]
    blocks = rng.integers(0, 256, (n, k // 32, size), dtype=np.uint8)
    scales = 2 if quant_type == "Q4_1" else 1  # d (and m) at the front of every block
    values = rng.normal(0, 0.05, (n, k // 32, scales)).astype(np.float16)
    blocks[..., :2 * scales] = values.view(np.uint8).reshape(n, k // 32, 2 * scales)
    return blocks


def _dequantized(blocks: np.ndarray, quant_type: str) -> np.ndarray:
    """gguf-py's own dequantisation (what the loader's float32 weights are) -> [n, k] float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, nb, _ = blocks.shape
    flat = dequantize(blocks.reshape(n, -1), GGMLQuantizationType[quant_type])
    return np.asarray(flat, np.float32).reshape(n, nb * 32)


@needs_kernel
@pytest.mark.parametrize("quant_type", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(48, 64), (40, 576), (96, 1536)])
def test_quantized_panels_multiply_as_their_dequantised_floats(quant_type, n, k):
    """`pack_quantized` keeps a GGUF weight's own blocks, whose floats (`dequantize_panels`, XLA's
    path) are bit for bit gguf-py's dequantisation. The kernel multiplies them in factored form,
    d (x . q) + m (sum of x) per block: the product of those floats to float rounding, and every
    row's result bit for bit the same whatever rows share the call (1-3 rows in registers, 4-6 in
    two passes, groups of them, from a buffer of widened values past 30 rows), so a verify and a
    decode step agree."""
    blocks = _ggml_blocks(quant_type, n, k, seed=n + k)
    weight = _dequantized(blocks, quant_type)  # [out, in]
    panels, floats = pack_quantized(blocks, quant_type), pack_kernel(weight.T.copy())
    assert panels.dtype == np.uint8 and panels.shape == (-(-n // PANEL), k // 32, PANEL_BLOCK_BYTES[quant_type])
    np.testing.assert_array_equal(np.asarray(dequantize_panels(panels)), np.asarray(floats))
    x = np.random.default_rng(k).standard_normal((40, k)).astype(np.float32)
    want = x.astype(np.float64) @ weight.T.astype(np.float64)
    alone = check_rows_products(panels, x, want, n, NARROW_TARGET_NAME, (1, 2, 3, 4, 5, 6, 7, 16, 40))
    xla = np.asarray(_jitted_product(n)(x, floats))  # the float32 panels: the same weights
    np.testing.assert_allclose(alone, xla, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    check_stacked_layers_are_their_own_products(
        pack_quantized(np.stack([blocks, _ggml_blocks(quant_type, n, k, seed=1)]), quant_type), k, n)


def test_quantized_panels_reject_other_blocks_and_widths():
    with pytest.raises(ValueError, match="Q4_1 blocks of 20 bytes"):
        pack_quantized(np.zeros((16, 2, 34), np.uint8), "Q4_1")
    with pytest.raises(ValueError, match="Q2_K"):
        pack_quantized(np.zeros((16, 2, 34), np.uint8), "Q2_K")
    panels = pack_quantized(_ggml_blocks("Q8_0", 16, 64), "Q8_0")
    with pytest.raises(ValueError, match="K = 64"):
        rows_matmul(jnp.ones((1, 32)), panels, 16)


@needs_kernel
@pytest.mark.parametrize("k,n", [(64, 16), (576, 600), (1728, 40)])
def test_bfloat16_weights_pack_narrow_and_multiply_bit_for_bit(k, n):
    """A float32 kernel whose weights are all bfloat16 values (a bf16 checkpoint loaded as float32)
    packs as bfloat16 panels: half the bytes, and the same products bit for bit as its float32
    panels, through the kernel (1-6 rows in registers, more through a buffer) and through XLA."""
    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((k, n)).astype(jnp.bfloat16).astype(np.float32)
    narrow = pack_kernel(w)
    floats = np.swapaxes(np.pad(w, ((0, 0), (0, -n % PANEL))).reshape(k, -1, PANEL), 0, 1)
    assert narrow.dtype == np.uint8 and narrow.shape == (-(-n // PANEL), k // 32, PANEL_BLOCK_BYTES["BF16"])
    np.testing.assert_array_equal(np.asarray(dequantize_panels(narrow)), floats)
    for rows in (1, 2, 3, 6, 7, 16):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        got = np.asarray(_jitted_product(n)(x, narrow))
        np.testing.assert_array_equal(got, np.asarray(_jitted_product(n)(x, jnp.asarray(floats))))
    assert NARROW_TARGET_NAME in _jitted_product(n).lower(x, narrow).compile().as_text()
    assert pack_kernel(w[:40]).shape == (-(-n // PANEL), 40, PANEL)  # K not a multiple of 32: float32
    w[-1, -1] += 1e-3  # one weight that bfloat16 cannot hold: float32 panels
    assert pack_kernel(w).shape == (-(-n // PANEL), k, PANEL)
