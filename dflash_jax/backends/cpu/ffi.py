"""The CPU kernels' shared library: `cpu_rows_matmul.cc` (`matmul.rows_matmul`) and
`cpu_cache_attention.cc` (`attention.cache_attention`), compiled on first use with the
machine's C++ compiler (-O3 -mavx2 -mfma -mf16c; a build of seconds, done once) into the user cache
directory, keyed by the sources, the flags and jaxlib, and registered with XLA's FFI once per process.

`available()` is False, and every caller takes XLA's path, where the kernels cannot run: not an
x86-64 CPU with AVX2, FMA and F16C, no compiler, a failed build (logged once), or DFLASH_CPU_KERNELS=0.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from dflash_jax._resources import user_cache_dir

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_rows_matmul.cc", "cpu_cache_attention.cc"))
HEADERS = (Path(__file__).with_name("cpu_pool.h"),)  # the helper threads both share
# -ffp-contract=off: no fusing of a * b + c
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")
TARGETS = {"dflash_rows_matmul": "DflashRowsMatmul", "dflash_rows_matmul_narrow": "DflashRowsMatmulNarrow",
           "dflash_rows_matmul_int8": "DflashRowsMatmulInt8",
           "dflash_cache_attention": "DflashCacheAttention",
           "dflash_cache_attention_f16": "DflashCacheAttentionF16"}


def _cpu_supports_avx2_fma_f16c() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return {"avx2", "fma", "f16c"} <= set(flags)


def find_compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX (default g++), else c++; None if neither."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _build(compiler: str) -> Path:
    """The shared library for these sources, compiler flags and jaxlib, built once per machine
    into the user cache directory (written to a temporary name, then renamed into place)."""
    import jaxlib

    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(FLAGS).encode()
                         + jaxlib.__version__.encode())
    directory = user_cache_dir("kernels")
    library = directory / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / library.name
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(built), "-lpthread"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, library)
    return library


@functools.cache
def available() -> bool:
    """Whether the kernels are built and registered (once per process; a failure is logged once
    and every caller falls back to XLA)."""
    if os.environ.get("DFLASH_CPU_KERNELS", "1") == "0":
        return False
    if not _cpu_supports_avx2_fma_f16c():
        return False
    compiler = find_compiler()
    if compiler is None:
        log.warning("no C++ compiler found: decoding on the CPU uses XLA's kernels only (slower)")
        return False
    try:
        _register(_build(compiler))
    except Exception as e:  # a failed build must not stop decoding: XLA's path is always there
        log.warning("the CPU kernels are unavailable (%s); using XLA's", e)
        return False
    return True


_registered: list[ctypes.CDLL] = []  # the library stays loaded; XLA knows the targets once per process


def _register(library_path: Path) -> None:
    if _registered:
        return
    library = ctypes.cdll.LoadLibrary(str(library_path))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    _registered.append(library)
