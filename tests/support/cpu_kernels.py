"""Checks of the CPU rows kernel shared by the test modules (test_cpu_matmul.py keeps its own copy
of these until its owner imports them from here)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.backends.cpu.matmul import GGML_BLOCK_BYTES, available, rows_matmul

needs_kernel = pytest.mark.skipif(not available(), reason="the CPU rows kernel is not built here "
                                  "(no C++ compiler, no AVX2/FMA, or DFLASH_CPU_KERNELS=0)")


def _product(n):
    return lambda x, w: rows_matmul(x, w, n)


def check_rows_products(panels, x, want, n: int, target_name: str, row_counts) -> np.ndarray:
    """The custom call `target_name` multiplies the first `rows` of x by `panels` as `want` does,
    to float rounding, for every count of row_counts, and each row's result is bit for bit its
    result alone (what makes a verify and a decode step agree). -> the rows' results alone."""
    product = jax.jit(_product(n))
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
        in_stack = jax.jit(lambda x, w, i: rows_matmul(x, w, n, i))(ones, stack, jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(in_stack), np.asarray(jax.jit(_product(n))(ones, stack[layer])))


def ggml_blocks(quant_type: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGML blocks [n, k / 32, bytes] of `quant_type` with sane float16 scales."""
    rng = np.random.default_rng(seed)
    size = GGML_BLOCK_BYTES[quant_type]
    blocks = rng.integers(0, 256, (n, k // 32, size), dtype=np.uint8)
    scales = 2 if quant_type == "Q4_1" else 1  # d (and m) at the front of every block
    values = rng.normal(0, 0.05, (n, k // 32, scales)).astype(np.float16)
    blocks[..., :2 * scales] = values.view(np.uint8).reshape(n, k // 32, 2 * scales)
    return blocks
