"""The backend seam: the operations a backend may replace, each with its default.

The models (`dflash_jax.models.target`, `dflash_jax.drafters.drafter`, `dflash_jax.layers.common`,
`dflash_jax.layers.moe`) are written once against `Backend`. A module names its backend by a string
(a static, hashable module attribute) and asks `dflash_jax.backends.get(name)` for:

- `dense`: the module of one weight product (a projection of a layer, the drafter's `fc`);
- `fuses`: whether the target's decode layout holds several products side by side as one
  (q | k | v, gate | up), so that the layer builds one module for them;
- `layer_loop`: the loop over stacked layers, or None for the models' own `nn.scan`;
- `embed` / `logits`: the target's token embedding and LM head;
- `matmul`: a product with a kernel kept outside a module (a reduced draft vocabulary's head);
- `expert_form`: how a mixture-of-experts layer multiplies its (token, expert) pairs, a static
  choice made at trace time from the shapes (`dflash_jax.layers.moe.FORMS`);
- `cache_attention`: the read of one KV-cache layer plus the new keys, or None to let the attention
  seam (`dflash_jax.layers.attention`) choose between its Pallas kernel and the jnp reference;
- `supports`: whether the backend's own decode layout holds a target of this config;
- `target_params` / `drafter_params`: the parameter layout a decode reads, derived from the
  stacked params every loader, trainer and converter uses; a backend's own layout is a
  `BackendLayout` (a dict tagged with the backend's name), so that the registry tells layouts apart
  by the tag (`backends.of_target_params`), never by keys or ranks; `activations` names how its
  products round activations;
- `gguf_weights`: a loader hook for keeping a GGUF file's quantized blocks as they are.

`Backend` itself is the XLA backend: what training, sharding, GPUs and TPUs run (`nn.Dense`, the
layers' `nn.scan` over stacked params, the attention seam's dispatch, params as loaded). The CPU
backend (`dflash_jax.backends.cpu`) plugs its C++ kernels and packed layouts in here.

`platform()` is the one question about the platform that the models may have answered, and only
through a backend: JAX's default backend, the platform a program is compiled for unless told
otherwise (`tests/test_imports.py` checks that no model module asks it, nor uses
`jax.lax.platform_dependent`).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

ACTIVATIONS = ("float32", "int8")  # how a decode's products may round activations (`Backend.activations`)
EXPERT_FORMS = ("gathered", "sorted")  # `Backend.expert_form`'s answers (`dflash_jax.layers.moe.FORMS`)
CPU_GATHER_BYTES = 4 << 30  # on a CPU, the most expert weights a mixture-of-experts layer gathers at once


def platform() -> str:
    """The platform programs are compiled for unless told otherwise: JAX's default backend ("cpu",
    "gpu", "tpu"). The models never ask it themselves: a backend answers for them."""
    return jax.default_backend()


def gathers_experts(pairs: int, num_experts: int, expert_bytes: int, on_cpu: bool) -> bool:
    """Whether a mixture-of-experts layer gathers each (token, expert) pair's expert weights (rather
    than sorting the pairs by expert for `jax.lax.ragged_dot`): with fewer pairs than experts (a
    decode step) everywhere, since only the chosen experts' weights are read; on a CPU also while
    the gathered weights stay under `CPU_GATHER_BYTES` (a verify of 16 tokens), because XLA's CPU
    backend lowers `ragged_dot` to a dense product with every expert (docs/architecture.md,
    "Mixture-of-experts targets"). expert_bytes: one expert's weights (gate, up and down)."""
    return pairs < num_experts or (on_cpu and pairs * expert_bytes <= CPU_GATHER_BYTES)


class BackendLayout(dict):
    """Params in one backend's own decode layout: the dict a module reads (the same keys and
    nesting), tagged with the name of the backend that reads it (`backend`). A pytree node whose tag
    is static, so it survives `jax.jit`, `tree_map` and `device_put`; params without the tag are
    the stacked layout every backend derives its own from (`Backend.target_params`). A new dict
    made from one (`{**params}`, `flax.traverse_util.unflatten_dict`) is untagged: stacked again."""

    __slots__ = ("_backend",)

    def __init__(self, backend: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._backend = backend

    @property
    def backend(self) -> str:
        return self._backend

    def __reduce__(self):
        return type(self), (self._backend, dict(self))

    def __repr__(self) -> str:
        return f"BackendLayout({self._backend!r}, {dict.__repr__(self)})"


def _flatten_layout(params: BackendLayout):
    keys = sorted(params)
    return [(jax.tree_util.DictKey(k), params[k]) for k in keys], (params.backend, tuple(keys))


def _unflatten_layout(aux, children) -> BackendLayout:
    backend, keys = aux
    return BackendLayout(backend, zip(keys, children))


jax.tree_util.register_pytree_with_keys(BackendLayout, _flatten_layout, _unflatten_layout)


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

    def expert_form(self, pairs: int, num_experts: int, expert_bytes: int) -> str:
        """How a mixture-of-experts layer multiplies `pairs` (token, expert) pairs over `num_experts`
        experts of `expert_bytes` each (static shapes, so a static choice): "gathered" (each pair's
        expert weights gathered) or "sorted" (the pairs sorted by expert, `jax.lax.ragged_dot`).
        XLA's: `gathers_experts` on the platform programs compile for (`platform()`; a program
        compiled for another platform than the default, a GPU host's CPU device say, gets the
        default platform's form: the same results, at another speed)."""
        return "gathered" if gathers_experts(pairs, num_experts, expert_bytes, platform() == "cpu") else "sorted"

    def cache_attention(self, q, cache_k, cache_v, layer, cache_ranges, k, v, ranges, *, scale: float):
        """Attention over layer `layer` of a cache and the new keys (`attention.cache_attention`'s
        arguments), or None where this backend leaves it to the attention seam."""
        return None

    def supports(self, config) -> bool:
        """Whether this backend's decode layout holds a target of this `ModelConfig` (XLA's, the
        stacked layout, holds every one). A target it does not hold decodes from the stacked
        layout on the XLA backend (`backends.decode_backend`)."""
        return True

    def target_params(self, params, *, release: bool = False):
        """Stacked target params in the layout this backend decodes with (here: as they are; a
        backend's own layout is a `BackendLayout` tagged with its name). release: the caller gives
        `params` up (a backend that copies may free them as it goes)."""
        return params

    def drafter_params(self, spec, loop_params):
        """A drafter's loop params (`Drafter.loop_params`) in the layout this backend drafts with
        (its module params a `BackendLayout` where they are this backend's own)."""
        return loop_params

    def activations(self, params) -> str:
        """How the products over these params round activations: one of ACTIVATIONS."""
        return "float32"

    def gguf_weights(self, tensors, config, activations: str):
        """A GGUF target's weights this backend keeps as the file stores them: an object with
        `skip` (stacked param paths the loader need not read) and `place(params)` (the decode
        params with those weights put in), or None to load every weight as floats."""
        return None
