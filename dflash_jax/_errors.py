"""The errors a user can cause with a bad file or a mismatched pair, one class per kind of problem.

All are ValueError subclasses, so `except ValueError` catches every bad input; each message names the
file (and the field or tensor) at fault.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A JSON file (config.json, generation_config.json, a shard index) that cannot be used: invalid
    JSON, a missing field or a field of the wrong type or value."""


class CheckpointError(ValueError):
    """A damaged or inconsistent weights file or directory (safetensors, pytorch_model.bin, Orbax), or
    tensors that do not fit the model's config (missing, unused, wrong shape)."""


class TorchRequiredError(ImportError, ValueError):
    """A pytorch_model.bin checkpoint was given and torch is not installed."""


class DrafterMismatchError(ValueError):
    """The drafter was trained for a different target."""
