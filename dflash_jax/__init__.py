"""dflash-jax: DFlash block-diffusion speculative decoding in JAX/Flax.

    import dflash_jax
    target = dflash_jax.load_target("path/to/Qwen3-8B", dtype="bfloat16")   # HF dir or .gguf
    drafter = dflash_jax.load_drafter("path/to/Qwen3-8B-DFlash-b16", target=target, dtype="bfloat16")
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    result = dflash_jax.generate(target, drafter, [ids], max_new_tokens=256)
    print(target.tokenizer.decode(result.tokens[0]), result.tau)
"""
from dflash_jax.config import ModelConfig
from dflash_jax.drafter import Drafter
from dflash_jax.drafter_config import DrafterConfig
from dflash_jax.speculative import GenerationResult, generate, generate_stream
from dflash_jax.loading.drafter_io import DrafterMismatchError, load_drafter, save_drafter
from dflash_jax.loading.orbax_io import load_orbax_drafter, save_orbax_drafter
from dflash_jax.loading.target_loader import load_target
from dflash_jax.target import Target

__all__ = [
    "ModelConfig", "DrafterConfig", "Target", "Drafter", "GenerationResult", "DrafterMismatchError",
    "load_target", "load_drafter", "save_drafter", "load_orbax_drafter", "save_orbax_drafter",
    "generate", "generate_stream",
]
