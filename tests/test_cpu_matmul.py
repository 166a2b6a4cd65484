"""The CPU rows kernel (`dflash_jax.kernels.cpu_matmul`): its products equal numpy's for every row
count, odd sizes included; it is what the compiled program calls for 1-16 float32 rows; more rows,
other dtypes and DFLASH_CPU_KERNELS=0 take XLA's product."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.kernels import cpu_matmul
from dflash_jax.kernels.cpu_matmul import MAX_ROWS, TARGET_NAME, available, rows_matmul

needs_kernel = pytest.mark.skipif(not available(), reason="the CPU rows kernel is not built here "
                                  "(no C++ compiler, no AVX2/FMA, or DFLASH_CPU_KERNELS=0)")


def _inputs(lead, k, n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((*lead, k)).astype(np.float32),
            rng.standard_normal((n, k)).astype(np.float32))


def _calls_kernel(fn, *args) -> bool:
    return TARGET_NAME in jax.jit(fn).lower(*args).compile().as_text()


@needs_kernel
@pytest.mark.parametrize("lead", [(1,), (2,), (3,), (1, 5), (2, 8), (MAX_ROWS,)])
@pytest.mark.parametrize("k,n", [(7, 1), (64, 5), (200, 130), (576, 333), (24, 4097)])
def test_rows_kernel_equals_numpy(lead, k, n):
    x, w = _inputs(lead, k, n)
    got = np.asarray(jax.jit(rows_matmul)(x, w))
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    assert got.shape == (*lead, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(k))
    assert _calls_kernel(rows_matmul, x, w)


@needs_kernel
def test_concurrent_products_share_the_helper_threads_safely():
    """Independent products in one program may run at the same time on XLA's threads: the one
    that finds the helpers busy computes alone; every result must still be right."""
    # big enough that each product is split over the helpers (the kernel's kMinMultiplyAddsToSplit)
    x, _ = _inputs((2,), 256, 1)
    ws = [_inputs((1,), 256, 1500 + 37 * i, seed=i + 1)[1] for i in range(12)]
    assert all(2 * 256 * w.shape[0] >= 1 << 18 for w in ws)
    got = jax.jit(lambda x, ws: [rows_matmul(x, w) for w in ws])(x, ws)
    for g, w in zip(got, ws):
        np.testing.assert_allclose(np.asarray(g), x @ w.T, rtol=1e-5, atol=1e-3)


def test_more_rows_or_other_dtypes_take_xlas_product():
    x, w = _inputs((MAX_ROWS + 1,), 32, 48)
    np.testing.assert_allclose(np.asarray(jax.jit(rows_matmul)(x, w)), x @ w.T, rtol=1e-5, atol=1e-4)
    assert not _calls_kernel(rows_matmul, x, w)
    xb, wb = jnp.asarray(x[:2], jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    assert not _calls_kernel(rows_matmul, xb, wb)
    assert rows_matmul(xb, wb).dtype == jnp.bfloat16


def test_disabled_by_the_environment():
    env = {**os.environ, "DFLASH_CPU_KERNELS": "0"}
    code = "from dflash_jax.kernels.cpu_matmul import available; assert not available()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_a_failed_build_falls_back(monkeypatch, tmp_path):
    """A compiler that fails leaves `available()` False (logged), never an exception."""
    monkeypatch.setattr(cpu_matmul, "_cpu_supports_avx2_fma", lambda: True)
    monkeypatch.setenv("DFLASH_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setattr(cpu_matmul.shutil, "which", lambda name: "/bin/false")
    cpu_matmul.available.cache_clear()
    try:
        assert cpu_matmul.available() is False
    finally:
        cpu_matmul.available.cache_clear()


@needs_kernel
def test_available_again_after_a_cache_reset():
    """Registering the FFI target twice in one process must not turn the kernel off."""
    cpu_matmul.available.cache_clear()
    assert cpu_matmul.available()
    x, w = _inputs((2,), 16, 40)
    assert _calls_kernel(rows_matmul, x, w)
