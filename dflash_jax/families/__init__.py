"""Target families: one module each, registered by the Hugging Face names it reads.

A family (`base.Family`) owns what is particular to it: reading its config.json into a `ModelConfig`
(with its nested family configs), what it allows there, its layer kinds (token mixers and MLPs), its
checkpoint name table (both directions) and the adapters its released checkpoints need (fused
experts, MXFP4, the prefix of a multimodal checkpoint's text model). The model, the loaders, the
converter and the sharding rules ask the family; nothing else branches on `arch`.

Adding a family: a module here that defines a `Family` subclass and registers an instance, its name
in `MODULES` (`dflash_jax.models.registry`), and a row in the conformance table of the tests
(tests/support/families.py).
"""
from __future__ import annotations

from dflash_jax.models.registry import for_hf_config, get, hf_classes, MODULES, names, register

__all__ = ["MODULES", "for_hf_config", "get", "hf_classes", "names", "register"]
