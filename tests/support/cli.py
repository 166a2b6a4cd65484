"""Helpers for the command-line programs' tests."""
from __future__ import annotations

from pathlib import Path

import pytest


def kwargs_given_to_load_target(monkeypatch, target_path: Path, **load_models_kwargs) -> dict:
    """The keyword arguments `cli.common.load_models(target_path, None, "float32", ...)` passes to
    `load_target` (a stand-in that records them and stops there)."""
    from dflash_jax.cli import common
    from dflash_jax.loading import target_loader

    seen = {}

    def load_target(path, dtype, **kwargs):
        seen.update(kwargs)
        raise FileNotFoundError("stop here")

    monkeypatch.setattr(target_loader, "load_target", load_target)
    with pytest.raises(common.CLIError, match="stop here"):
        common.load_models(target_path, None, "float32", **load_models_kwargs)
    return seen
