"""Data files shipped inside installed PyPI packages (models, prompt sets), found without importing
the packages: their own dependencies (llm, llama-cpp-python, ray, ...) are not installed here."""
from __future__ import annotations

import importlib.util
from pathlib import Path


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
