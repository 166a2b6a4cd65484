"""The CPU kernels' helper threads (`dflash_jax/backends/cpu/cpu_pool.h`) on their own: a small C++
program (`tests/backends/cpu_pool_check.cc`), built here with the compiler the kernels use, runs jobs through
a pool and checks that every part runs exactly once, whoever claims it: the caller taking back every
part of a pool without helper threads (the path a busy machine takes, made certain), helpers racing
the caller, helpers kept off the cores by busy threads, and two callers sharing one pool."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dflash_jax.backends.cpu import ffi as cpu_ffi

CHECK = Path(__file__).with_name("cpu_pool_check.cc")


@pytest.fixture(scope="module")
def pool_check(tmp_path_factory) -> Path:
    compiler = cpu_ffi.find_compiler()
    if compiler is None or not cpu_ffi._cpu_supports_avx2_fma_f16c():
        pytest.skip("the CPU kernels are not built here (no C++ compiler or not an x86-64 CPU with AVX2)")
    binary = tmp_path_factory.mktemp("pool") / "cpu_pool_check"
    include = cpu_ffi.HEADERS[0].parent
    built = subprocess.run([compiler, "-O2", "-std=c++17", "-pthread", f"-I{include}", str(CHECK), "-o", str(binary)],
                           capture_output=True, text=True)
    assert built.returncode == 0, f"{CHECK.name} did not build:\n{built.stderr[-2000:]}"
    return binary


def test_every_part_runs_once_whoever_claims_it(pool_check):
    result = subprocess.run([str(pool_check)], capture_output=True, text=True, timeout=120)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert [line.split(":")[0] for line in lines] == ["ok"] * 4, result.stdout
    assert "the caller ran all 2000 parts" in lines[0]
