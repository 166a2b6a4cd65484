"""JAX's persistent compilation cache in the user cache directory, so that a new process loads the
executables an earlier one compiled instead of compiling them again.

    from dflash_jax import _compilation_cache as compilation_cache
    compilation_cache.enable()        # $DFLASH_JAX_CACHE_DIR/jax-compilation, else
                                      # $XDG_CACHE_HOME/dflash_jax/jax-compilation, else ~/.cache/...

Ahead-of-time compiles (`jax.jit(f).lower(...).compile()`, what `generate` does) go through the same
cache as ordinary jit calls. The cache is trusted code: do not point it at a directory that others
may write to.
"""
from __future__ import annotations

from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

from dflash_jax._resources import user_cache_dir

SUBDIRECTORY = "jax-compilation"


def _configure(directory: str | None) -> None:
    if jax.config.jax_compilation_cache_dir != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        _jax_cache.reset_cache()  # a cache opened on the old directory would keep being used


def enable(cache_dir: str | Path | None = None) -> Path:
    """Turn JAX's persistent compilation cache on in `cache_dir` (default: `SUBDIRECTORY` of the
    user cache directory, see `dflash_jax._resources.user_cache_dir`), creating it. Every executable
    is stored, however quick its compile or small its size. Returns the directory."""
    directory = Path(cache_dir).expanduser() if cache_dir is not None else user_cache_dir(SUBDIRECTORY)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the compilation cache directory {directory}: {e}") from e
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor
    _configure(str(directory))
    return directory


def disable() -> None:
    """Turn the persistent compilation cache off again (executables stay on disk)."""
    _configure(None)


def directory() -> Path | None:
    """The directory the persistent compilation cache uses now, or None when it is off."""
    value = jax.config.jax_compilation_cache_dir
    return Path(value) if value else None
