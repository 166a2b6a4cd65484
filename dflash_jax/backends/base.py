"""The backend seam: the operations a backend may replace, each with its default.

The models (`dflash_jax._target`, `dflash_jax._drafter`, `dflash_jax._layers`) are written once against
`Backend`. A module names its backend by a string (a static, hashable module attribute) and asks
`dflash_jax.backends.get(name)` for:

- `dense`: the module of one weight product (a projection of a layer, the drafter's `fc`);
- `fuses`: whether the target's decode layout holds several products side by side as one
  (q | k | v, gate | up), so that the layer builds one module for them;
- `layer_loop`: the loop over stacked layers, or None for the models' own `nn.scan`;
- `embed` / `logits`: the target's token embedding and LM head;
- `matmul`: a product with a kernel kept outside a module (a reduced draft vocabulary's head);
- `cache_attention`: the read of one KV-cache layer plus the new keys, or None to let the attention
  seam (`dflash_jax._attention`) choose between its Pallas kernel and the jnp reference;
- `target_params` / `drafter_params`: the parameter layout a decode reads, derived from the
  stacked params every loader, trainer and converter uses; `owns_target` / `owns_drafter` tell a
  layout apart; `activations` names how its products round activations;
- `gguf_weights`: a loader hook for keeping a GGUF file's quantized blocks as they are.

`Backend` itself is the XLA backend: what training, sharding, GPUs and TPUs run (`nn.Dense`, the
layers' `nn.scan` over stacked params, the attention seam's dispatch, params as loaded). The CPU
backend (`dflash_jax.backends.cpu`) plugs its C++ kernels and packed layouts in here.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

ACTIVATIONS = ("float32", "int8")  # how a decode's products may round activations (`Backend.activations`)


class Backend:
    """The XLA backend, and the interface every backend implements (see the module docstring)."""

    name = "xla"
    # (layer, stack, carry, xs, *shared, method=...) -> (carry, ys), or None: the model's nn.scan
    layer_loop: Callable | None = None

    def dense(self, features: int, use_bias: bool, dtype: Any, name: str | None = None) -> nn.Module:
        """The module of one weight product: kernel [in, out] under "kernel", bias under "bias"."""
        return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)

    def fuses(self, *widths: int) -> bool:
        """Whether the target's decode layout holds products of these output widths as one."""
        return False

    def embed(self, model, tokens):
        """tokens [...] -> embeddings [..., D] of a bound `TargetModel`."""
        return model.embed_tokens(tokens)

    def logits(self, model, hidden):
        """Final-normed hidden [..., D] of a bound `TargetModel` -> float32 logits [..., V]."""
        if model.config.tie_word_embeddings:
            return model.embed_tokens.attend(hidden).astype(jnp.float32)
        return model.lm_head(hidden).astype(jnp.float32)

    def matmul(self, x, kernel, features: int):
        """x [..., K] @ kernel -> [..., features] in x's dtype (kernel [K, features] here)."""
        return jnp.dot(x, kernel.astype(x.dtype))

    def cache_attention(self, q, cache_k, cache_v, layer, cache_ranges, k, v, ranges, *, scale: float):
        """Attention over layer `layer` of a cache and the new keys (`attention.cache_attention`'s
        arguments), or None where this backend leaves it to the attention seam."""
        return None

    def target_params(self, params, *, release: bool = False):
        """Stacked target params in the layout this backend decodes with (here: as they are).
        release: the caller gives `params` up (a backend that copies may free them as it goes)."""
        return params

    def drafter_params(self, spec, loop_params):
        """A drafter's loop params (`Drafter.loop_params`) in the layout this backend drafts with."""
        return loop_params

    def owns_target(self, params) -> bool:
        """Whether target params are in this backend's own decode layout (one no other reads)."""
        return False

    def owns_drafter(self, module_params) -> bool:
        """Whether drafter module params are in this backend's own decode layout."""
        return False

    def activations(self, params) -> str:
        """How the products over these params round activations: one of ACTIVATIONS."""
        return "float32"

    def gguf_weights(self, tensors, config, activations: str):
        """A GGUF target's weights this backend keeps as the file stores them: an object with
        `skip` (stacked param paths the loader need not read) and `place(params)` (the decode
        params with those weights put in), or None to load every weight as floats."""
        return None
