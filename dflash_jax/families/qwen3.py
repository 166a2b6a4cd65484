"""Qwen3 (`Qwen3ForCausalLM`): Llama's layers with an RMSNorm of each head's query and key."""
from dflash_jax.families import register
from dflash_jax.families.llama import Llama


class Qwen3(Llama):
    name = "qwen3"
    hf_classes = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    qk_norm = True


QWEN3 = register(Qwen3())
