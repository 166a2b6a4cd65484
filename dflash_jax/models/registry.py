"""The family registry: target families register here (`register`, called by each family module at
import) and the models look them up by name (`get`, `names`, `hf_classes`, `for_hf_config`). It sits
below the models, so that a config can find its family without importing the families package: the
built-in family modules (`MODULES`) are plugins this module loads by name on the first lookup.
"""
from __future__ import annotations

import importlib

# The values are `dflash_jax.families.base.Family`s. The family modules import the models, so this
# module imports none of them by name: `_load` loads them (the one upward load the import table allows).

# The family modules, imported on the first lookup (each registers its families).
MODULES = ("llama", "qwen3", "qwen3_moe", "qwen3_5", "gpt_oss", "qwen3_next")
MODULES += ("glm4_moe", "minimax_m2")
MODULES += ("deepseek_v3",)
MODULES += ("gemma4",)

_FAMILIES: dict[str, object] = {}
_loaded = False


def register(family):
    """Add a family to the registry (called by its module at import)."""
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"family {family.name!r} is registered twice")
    _FAMILIES[family.name] = family
    return family


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in MODULES:
            importlib.import_module(f"dflash_jax.families.{module}")


def names() -> tuple[str, ...]:
    """The registered family names (`ModelConfig.arch` values), sorted."""
    _load()
    return tuple(sorted(_FAMILIES))


def get(name: str):
    """The family registered as `name`; ValueError naming the known ones."""
    _load()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown arch {name!r}; supported: {names()}") from None


def hf_classes() -> dict[str, str]:
    """Hugging Face `architectures` class name -> family name."""
    _load()
    return {cls: f.name for f in _FAMILIES.values() for cls in f.hf_classes}


def for_hf_config(fields):
    """The family that reads a config (`models.config.ConfigFields`): by its `architectures`, else (when it
    lists none) by its `model_type`; ConfigError naming what is supported."""
    classes = hf_classes()
    archs = fields.str_list("architectures", ())
    for arch in archs:
        if arch in classes:
            return _FAMILIES[classes[arch]]
    model_type = fields.hf.get("model_type")
    if not archs:
        for family in _FAMILIES.values():
            if model_type in family.model_types:
                return family
    raise fields.error(f"unsupported architecture {list(archs) or model_type!r}; supported: {sorted(classes)}")
