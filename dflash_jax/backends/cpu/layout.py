"""The CPU backend's decode layout: weight panels the rows kernel reads (`matmul.pack_kernel`), the
dense module that multiplies with them, and the loop over stacked layers that reads each layer's
kernel in place inside its stack.

Target params (`pack_layers`): the stacked layers with every kernel packed ([L, K, N] -> [L, P, K,
16]), q/k/v and gate/up each fused into one product where their widths allow, and the LM head
packed as "head" (a tied embedding moves there too: the token rows are read out of it). Drafter
params (`pack_drafter`): the layers' and the context projection's kernels packed (optionally
quantized to Q8_0), a reduced draft vocabulary's head too. Both are `BackendLayout`s tagged "cpu"
(`packed`), which is how `backends.of_target_params` / `of_drafter_params` tell them from stacked
params.

Why: XLA:CPU's GEMM reads the weights several times over for the 1-16 rows of a decode step or a
verify, and a scan over stacked params slices every layer's weights out of the stack with a copy in
every step; the rows kernel streams every panel once, from the stack, in place. The figures are in
docs/performance.md.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.backends.base import BackendLayout
from dflash_jax.backends.cpu.matmul import (PANEL, dequantize_panels, is_narrow, is_packed, pack_kernel,
                                            packs_side_by_side, rows_matmul)

Dtype = Any

NAME = "cpu"  # the tag of this backend's params (`BackendLayout.backend`)
STACKED = "stacked"  # the variable collection of stacked layers' kernels in a loop (see DensePacked)

# The products a packed target layer fuses: (fused name, parent, the parts whose columns it holds in order).
FUSED_PROJECTIONS = (("qkv_proj", "self_attn", ("q_proj", "k_proj", "v_proj")),
                     ("gate_up_proj", "mlp", ("gate_proj", "up_proj")))


class DensePacked(nn.Module):
    """`nn.Dense` whose kernel ("kernel", same name and bias) is stored as `pack_kernel` leaves it:
    panels [N / 16, in, 16] where the CPU rows kernel is built, else [in, out]. Products go through
    `rows_matmul`, which streams every weight once on a CPU.

    In a loop over stacked layers (`scan_stacked_layers`) the kernel comes instead from the
    `STACKED` collection: "kernel" holds every layer's ([L, P, K, 16]) and "layer" the index of
    this one, which the rows kernel reads in place (a slice of the stack would be a copy)."""

    features: int
    use_bias: bool = False
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        def init(key, shape, dtype):
            return pack_kernel(nn.initializers.lecun_normal()(key, shape, dtype))

        if self.has_variable(STACKED, "kernel"):  # a loop over stacked layers: every layer's kernel, and which
            kernel, layer = self.get_variable(STACKED, "kernel"), self.get_variable(STACKED, "layer")
        elif self.has_variable("params", "kernel"):  # float32 or narrow panels (`pack_kernel`)
            kernel, layer = self.get_variable("params", "kernel"), None
        else:
            kernel, layer = self.param("kernel", init, (x.shape[-1], self.features), self.dtype), None
        y = rows_matmul(x.astype(self.dtype), kernel, self.features, layer)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


def scan_stacked_layers(layer: nn.Module, stack, carry, xs, *args, method: str = "__call__"):
    """Every layer of `stack` (one layer's params with a leading axis L: stacked, kernels packed by
    `pack_kernel` for the CPU rows kernel) applied in turn as a `lax.scan`: the unbound `layer`
    runs `method`(carry, xs[i], *args) with its small params (norm scales, biases) sliced at i and
    every kernel read in place through `STACKED` (a slice of a stack would be a copy of the weight
    in every call). -> (carry, outputs stacked [L, ...]). XLA compiles one layer, not all of them."""
    flat = flax.traverse_util.flatten_dict(dict(stack))
    kernels = {path: w for path, w in flat.items() if path[-1] == "kernel"}
    small = {path: w for path, w in flat.items() if path[-1] != "kernel"}
    num_layers = next(iter(flat.values())).shape[0]

    def body(carry, scanned):
        index, layer_xs = scanned
        params = {path: jax.lax.dynamic_index_in_dim(w, index, keepdims=False) for path, w in small.items()}
        stacked = {**kernels, **{path[:-1] + ("layer",): index for path in kernels}}
        variables = {"params": flax.traverse_util.unflatten_dict(params),
                     STACKED: flax.traverse_util.unflatten_dict(stacked)}
        return layer.apply(variables, carry, layer_xs, *args, method=method)

    return jax.lax.scan(body, carry, (jnp.arange(num_layers, dtype=jnp.int32), xs))


def pack_stacked_kernels(stack: dict, *, release: bool = False, quantize: str | None = None) -> dict:
    """Stacked layer params with every kernel packed ([L, K, N] -> [L, P, K, 16], `pack_kernel`,
    with its `quantize`), what `scan_stacked_layers` reads. release: the caller gives `stack` up:
    each weight leaves it once packed, so that the weights are never all held twice."""
    flat = flax.traverse_util.flatten_dict(stack)
    if release:
        stack.clear()
    out = {}
    for path in list(flat):
        weight = flat.pop(path)
        out[path] = pack_kernel(weight, quantize=quantize) if path[-1] == "kernel" else weight
        del weight
    return flax.traverse_util.unflatten_dict(out)


def has_packed_kernels(stack) -> bool:
    """Whether stacked layer params hold `pack_kernel`'s panels ([L, P, K, 16])."""
    return any(path[-1] == "kernel" and is_packed(w, stacked=True)
               for path, w in flax.traverse_util.flatten_dict(dict(stack)).items())


def fuse_stacked_projections(stack: dict, *, release: bool = False) -> dict:
    """Stacked layer params with q/k/v and gate/up each made one packed product (`FUSED_PROJECTIONS`:
    kernels side by side, packed by `pack_kernel`; biases concatenated), where `packs_side_by_side`
    allows; the other kernels as they are. One product streams the weights of all three (or two)
    with one call and one split of the columns over the cores (SmolLM2: 211 products per step
    become 121, bit-identical). release: see `pack_stacked_kernels`."""
    out = dict(stack)
    if release:
        stack.clear()
    for fused, parent, parts in FUSED_PROJECTIONS:
        group = dict(out.get(parent, {}))
        if not all(part in group for part in parts):
            continue
        widths = [group[part]["kernel"].shape[-1] for part in parts]
        if not packs_side_by_side(*widths):
            continue
        params = [group.pop(part) for part in parts]
        entry = {"kernel": pack_kernel(*[p.pop("kernel") if release else p["kernel"] for p in params])}
        if any("bias" in p for p in params):
            entry["bias"] = jnp.concatenate([p["bias"] for p in params], axis=-1)
        out[parent] = {**group, fused: entry}
    return out


def packed(params) -> BackendLayout:
    """A params dict in this backend's layout, tagged as such."""
    return BackendLayout(NAME, params)


def is_packed_layout(params) -> bool:
    """Whether target (or drafter module) `params` are laid out for a CPU decode (`pack_layers`,
    `pack_drafter`): tagged by `packed`."""
    return isinstance(params, BackendLayout) and params.backend == NAME


def pack_layers(params, *, release: bool = False) -> dict:
    """Stacked target params -> the CPU decode layout: every stacked kernel packed
    ([L, K, N] -> [L, P, K, 16]), q/k/v and gate/up each fused into one product where their widths
    allow (`fuse_stacked_projections`; `CpuBackend.fuses` tells the layer by the same rule), and the
    LM head packed as "head" (an untied lm_head moves there; a tied embedding moves there too, and
    `target_embed` reads it from there; params without either leave "head" to their caller, as
    `load_target` does with a GGUF's own blocks), tagged (`packed`). Packed params are returned as
    they are. release:
    the caller gives `params` up: each stacked weight leaves the dict once it is packed, so that the
    copy never holds all the weights twice."""
    if is_packed_layout(params):
        return params
    layers = fuse_stacked_projections(params.pop("layers") if release else params["layers"], release=release)
    layers = pack_stacked_kernels(layers, release=release)
    head_entry = "lm_head" if "lm_head" in params else "embed_tokens"
    out = {k: v for k, v in params.items() if k not in ("layers", head_entry)}
    head = params.pop(head_entry, None) if release else params.get(head_entry)
    if head is None:  # a loader that has the head's panels already (`gguf_panels`) adds them
        return packed({**out, "layers": layers})
    kernel = head["kernel"] if head_entry == "lm_head" else np.asarray(head["embedding"]).T
    del head
    return packed({**out, "layers": layers, "head": pack_kernel(kernel)})


def target_embed(model, tokens):
    """Token embeddings of a bound `TargetModel` over packed params. With tied embeddings the token
    rows are read out of the packed head (`pack_layers` keeps no second copy of the embedding): the
    same floats, gathered."""
    if not model.config.tie_word_embeddings:
        return model.embed_tokens(tokens)
    head = model.variables["params"]["head"]
    if is_narrow(head):  # [P, D / 32, bytes]: the token's panel, dequantized, at lane t % 16
        panels = dequantize_panels(head[tokens // PANEL])  # [..., D, 16]
        return jnp.take_along_axis(panels, (tokens % PANEL)[..., None, None], axis=-1)[..., 0].astype(model.dtype)
    if is_packed(head):  # [P, D, 16]: column t of [D, V] is panel t // 16, lane t % 16
        return head[tokens // PANEL, :, tokens % PANEL].astype(model.dtype)
    return jnp.take(head.T, tokens, axis=0).astype(model.dtype)


def target_logits(model, hidden):
    """float32 logits of a bound `TargetModel` over packed params: the head through the rows kernel
    (XLA:CPU turns one row against the [V, D] embedding into a loop fusion that transposes it)."""
    # the barrier keeps the final norm out of XLA's product, which would make it a loop fusion
    hidden = jax.lax.optimization_barrier(hidden.astype(model.dtype))
    return rows_matmul(hidden, model.variables["params"]["head"], model.config.vocab_size).astype(jnp.float32)


def pack_drafter(spec, loop_params):
    """A drafter's loop params with the layers' and the context projection's kernels packed, and a
    reduced draft vocabulary's head too, quantized as `spec.decode_weights` says ("stored": as
    loaded; "q8_0": 8 bits and a scale per 32 weights). The module params are tagged (`packed`)
    where the kernels were packed; where `pack_kernel` leaves them as they are (no rows kernel here,
    weights not float32) they stay untagged and the XLA backend drafts with them. Packed params are
    returned as they are. Run it outside jit."""
    module_params = spec.module_params(loop_params)
    if is_packed_layout(module_params):
        return loop_params
    quantize = None if spec.decode_weights == "stored" else spec.decode_weights
    pack = functools.partial(pack_kernel, quantize=quantize)
    drafter = {**module_params, "fc": {"kernel": pack(module_params["fc"]["kernel"])},
               "layers": pack_stacked_kernels(module_params["layers"], quantize=quantize)}
    if has_packed_kernels(drafter["layers"]):  # this function packed them: its own output, not a guess
        drafter = packed(drafter)
    if spec.config.draft_vocab_size is None:
        return drafter
    head = loop_params["draft_head"]
    return {**loop_params, "drafter": drafter, "draft_head": {**head, "kernel": pack(head["kernel"])}}
