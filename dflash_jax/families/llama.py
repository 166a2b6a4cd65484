"""Llama (`LlamaForCausalLM`; SmolLM2 and the GGUF files are Llama too): attention with optional
biases, a dense SwiGLU MLP; RoPE of the default, linear, llama3 and yarn types."""
from dflash_jax.families import register
from dflash_jax.families.base import Family


class Llama(Family):
    name = "llama"
    hf_classes = ("LlamaForCausalLM",)
    model_types = ("llama",)

    def validate(self, config):
        super().validate(config)
        if config.moe is not None or config.attention_sinks:
            raise ValueError("a llama target has a dense MLP and no attention sinks")


LLAMA = register(Llama())
