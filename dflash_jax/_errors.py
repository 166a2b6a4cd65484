"""The errors a user can cause with a bad file or a mismatched pair, one class per kind of problem.

All are ValueError subclasses, so `except ValueError` catches every bad input; each message names the
file (and the field or tensor) at fault. These are the only definitions: the training scripts raise
the same classes (`train.config`, `train.checkpointing` import them from here).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A JSON file (config.json, generation_config.json, a shard index) or a training config (YAML, or
    its command-line overrides) that cannot be used: invalid JSON or YAML, a missing or unknown field
    or a field of the wrong type or value, or settings that do not fit together."""


class CheckpointError(ValueError):
    """A damaged or inconsistent weights file or directory (safetensors, pytorch_model.bin, Orbax,
    a training run's checkpoints), or tensors that do not fit the model's config (missing, unused,
    wrong shape)."""


class TorchRequiredError(ImportError, ValueError):
    """A pytorch_model.bin checkpoint was given and torch is not installed."""


class DrafterMismatchError(ValueError):
    """The drafter was trained for a different target."""
