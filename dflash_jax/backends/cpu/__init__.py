"""The CPU backend: C++ kernels through XLA's FFI, behind `dflash_jax.backends.base.Backend`.

- `matmul`: weight products of a few rows (`rows_matmul`) over kernels packed in panels of 16
  columns (`pack_kernel`, float32 or bfloat16; GGUF Q4_1 / Q8_0 blocks as stored, `pack_quantized`);
- `attention`: attention over one layer of a KV cache and the step's new keys, one custom call;
- `ffi`: builds both from `cpu_rows_matmul.cc` and `cpu_cache_attention.cc` (and the helper threads
  of `cpu_pool.h`) with the machine's C++ compiler on first use; where that cannot happen every
  operation falls back to XLA's, with the same layouts;
- `layout`: the packed decode layout of a target and a drafter (a `BackendLayout` tagged "cpu"),
  its dense module and the loop over stacked layers that reads each kernel in place;
- `gguf_panels`: a GGUF target's quantized blocks kept as the file stores them.

Nothing outside this package imports it but the registry (`dflash_jax.backends.get("cpu")`).
"""
from __future__ import annotations

import jax

from dflash_jax.backends.base import Backend, gathers_experts
from dflash_jax.backends.cpu import attention, layout
from dflash_jax.backends.cpu.matmul import is_packed, packs_side_by_side, rows_matmul, uses_int8_activations


class CpuBackend(Backend):
    """Packed panels through the rows kernel, the layers read in place, the CPU cache read."""

    name = "cpu"
    layer_loop = staticmethod(layout.scan_stacked_layers)

    def dense(self, features, use_bias, dtype, name=None):
        return layout.DensePacked(features, use_bias, dtype, name=name)

    def fuses(self, *widths):
        return packs_side_by_side(*widths)

    def embed(self, model, tokens):
        return layout.target_embed(model, tokens)

    def logits(self, model, hidden):
        return layout.target_logits(model, hidden)

    def matmul(self, x, kernel, features):
        return rows_matmul(x, kernel if is_packed(kernel) else kernel.astype(x.dtype), features)

    def expert_form(self, pairs, num_experts, expert_bytes):
        return "gathered" if gathers_experts(pairs, num_experts, expert_bytes, on_cpu=True) else "sorted"

    def cache_attention(self, q, cache_k, cache_v, layer, cache_ranges, k, v, ranges, *, scale):
        if not attention.applies(q, cache_k, k):  # float32 queries, a built library: else the seam's choice
            return None
        return attention.cache_attention(q, cache_k, cache_v, layer, cache_ranges, k, v, ranges,
                                         scale=scale).astype(q.dtype)

    def supports(self, config):
        """The packed layout holds Qwen3 / Llama layers (attention and a dense SwiGLU MLP): not a
        hybrid's Gated DeltaNet layers, nor a mixture-of-experts MLP, nor multi-head latent attention, nor a
        family's own layers (`Family.plain_layers`)."""
        return not (config.is_hybrid_arch or config.num_experts or config.attention_sinks or config.mla is not None
                    or not config.family.plain_layers)

    def target_params(self, params, *, release=False):
        return layout.pack_layers(params, release=release)

    def drafter_params(self, spec, loop_params):
        return layout.pack_drafter(spec, loop_params)

    def activations(self, params):
        return "int8" if any(uses_int8_activations(w) for w in jax.tree_util.tree_leaves(params)) else "float32"

    def gguf_weights(self, tensors, config, activations):
        from dflash_jax.backends.cpu.gguf_panels import stored_panels

        return stored_panels(tensors, config, activations)
