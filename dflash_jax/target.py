"""The target model (Qwen3 / Llama) as a pure functional Flax module with a static-shape KV cache.

`TargetModel.__call__(tokens, cache, capture=...)` runs T new tokens per row at that row's own
offset (`cache.lengths`), returns the final-normed hidden states, the features of the captured
layers concatenated on the last axis (layer id i = Hugging Face `hidden_states[i + 1]`: the output
of decoder layer i, except that the last layer's entry is after the final norm, as in HF),
and the NEW cache. Layers run under `nn.scan` over stacked per-layer params; `PackedTargetModel`
runs the same layers over params laid out for a CPU decode (`pack_layers`: kernels packed for the
CPU rows kernel, read in place), which is what `generate` decodes with on a CPU. `TargetSpec`
(static, hashable) picks the module from the params' layout; `Target` is a loaded target: spec,
params and tokenizer.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import masks
from dflash_jax.attention import attention, cache_attention
from dflash_jax.cache import KVCache, resolve_kv_cache_dtype
from dflash_jax.config import ModelConfig
from dflash_jax.kernels.cpu_matmul import (PANEL, dequantize_panels, is_packed, is_narrow, pack_kernel,
                                         packs_side_by_side, rows_matmul, uses_int8_activations)
from dflash_jax.layers import (MLP, AttentionProjections, RMSNorm, Rotary, fuse_stacked_projections,
                               pack_stacked_kernels, scan_stacked_layers)
from dflash_jax.model_spec import on_spec

PREFILL_CHUNK = 256  # tokens per step of `Target.prefill`


class TargetLayer(nn.Module):
    """One pre-norm decoder layer; the scan body.

    carry: (hidden [B, T, D], features [B, T, n, D] | None); xs: (layer index, window, capture
    slot or -1); broadcast: (positions [B, T], cos, sin, cache | None). With a cache, attention
    reads the cache's used slots and the T new keys (`cache_attention`) and the layer's new keys
    and values [B, T, Hkv, Dh] come out as ys (the caller writes all layers' rows at once);
    without one, attention is over the T new keys only and ys is None. The new keys and values
    are rounded to the cache's dtype before attention reads them (a float16 cache): a token then
    sees the same numbers for its block-mates in a verify as a later step reads from the cache, so
    speculative decoding stays identical to plain decoding.
    """

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    packed_weights: bool = False  # kernels packed for the CPU rows kernel (`layers.DensePacked`)

    @nn.compact
    def __call__(self, carry, layer_xs, positions, cos, sin, cache: KVCache | None):
        cfg = self.config
        hidden, features = carry
        layer, window, slot = layer_xs
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused_qkv = self.packed_weights and packs_side_by_side(q_width, kv_width, kv_width)  # as pack_layers fuses
        attn = AttentionProjections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.qk_norm, cfg.attention_bias, cfg.rms_norm_eps, self.dtype,
                                    self.packed_weights, fused_qkv, name="self_attn")
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="input_layernorm")(hidden)
        q, k, v = attn.queries_keys_values(x, cos, sin)
        ranges = masks.causal(positions, window)  # over cache slots (== positions)
        if cache is None:
            attended = attention(q, k, v, ranges, impl=self.attn_impl)
        else:
            offsets = cache.lengths
            k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
            attended = cache_attention(q, cache.k, cache.v, layer, ranges.segment(0, offsets), k, v,
                                       ranges.segment(offsets, offsets + k.shape[1]), impl=self.attn_impl)
        hidden = hidden + attn.output(attended)
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(hidden)
        fused_mlp = self.packed_weights and packs_side_by_side(cfg.intermediate_size, cfg.intermediate_size)
        hidden = hidden + MLP(cfg.intermediate_size, cfg.mlp_bias, self.dtype, self.packed_weights, fused_mlp,
                              name="mlp")(x)
        if features is not None:
            index = jnp.maximum(slot, 0)
            current = jax.lax.dynamic_index_in_dim(features, index, axis=2, keepdims=False)
            update = jnp.where(slot >= 0, hidden.astype(features.dtype), current)
            features = jax.lax.dynamic_update_index_in_dim(features, update, index, axis=2)
        return (hidden, features), (None if cache is None else (k, v))


class TargetModel(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"

    def setup(self):
        cfg = self.config
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype,
                                     param_dtype=self.dtype)
        self._make_layers()
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype,
                                    param_dtype=self.dtype)
        self.rotary = Rotary(cfg)

    def __call__(self, tokens, cache: KVCache | None = None, *, positions=None,
                 capture: Sequence[int] = (), num_new=None, write_cache: bool = True):
        """tokens [B, T] -> (hidden [B, T, D], features [B, T, len(capture) * D] | None, cache).

        With a cache, row b's tokens go to positions lengths[b] .. lengths[b] + T - 1, and the
        returned cache has lengths + num_new (default T: pass fewer for right-padded rows).
        write_cache=False returns the tokens' keys and values (k, v), each [L, B, T, Hkv, Dh], in
        place of the cache, which is only read (for `KVCache.append` later: a `lax.cond` that
        returned the whole cache would copy it).
        Without a cache, `positions` defaults to 0..T-1 and attention is causal over the T tokens.
        """
        cfg = self.config
        hidden = self.embed(tokens)
        b, t = tokens.shape
        offsets = cache.lengths if cache is not None else jnp.zeros((b,), jnp.int32)
        if positions is None:
            positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        cos, sin = self.rotary(positions)
        for layer in capture:
            if not 0 <= layer < cfg.num_layers:
                raise ValueError(f"capture layer {layer} out of range for {cfg.num_layers} layers")
        # Hugging Face's hidden_states[L] (layer id L-1) is the final-NORMED output; every other id
        # is a raw decoder-layer output, captured inside the scan once even when listed twice.
        last = cfg.num_layers - 1
        inner = sorted({layer for layer in capture if layer != last})
        slots = np.full((cfg.num_layers,), -1, np.int32)
        slots[inner] = np.arange(len(inner))
        buffer = jnp.zeros((b, t, len(inner), cfg.hidden_size), self.dtype) if inner else None
        layer_xs = (jnp.arange(cfg.num_layers, dtype=jnp.int32),
                    jnp.asarray(cfg.layer_windows, jnp.int32), jnp.asarray(slots))
        (hidden, buffer), new_kv = self._run_layers((hidden, buffer), layer_xs, positions, cos, sin, cache)
        hidden = self.norm(hidden)
        features = None
        if capture:
            features = jnp.concatenate(
                [hidden if layer == last else buffer[:, :, slots[layer]] for layer in capture], axis=-1)
        if cache is not None and not write_cache:
            return hidden, features, new_kv
        if cache is not None:
            cache = cache.append(*new_kv, t if num_new is None else num_new)
        return hidden, features, cache

    def _make_layers(self):
        """All layers as one scanned module: params stacked [L, ...] under "layers"."""
        self.layers = nn.scan(
            TargetLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=self.config.num_layers,
            # Flax's invariant check traces the layer body a second time, with partial evaluation,
            # to prove broadcast inputs constant (the layers take nothing broadcast but inputs, no
            # broadcast variables): skipping it halves the body's tracing (this model's forward
            # traced in 38 -> 21 ms, 30 layers, tiny widths), and it is the check that raised
            # "broadcasted variable has a data dependency on the scan body" around the Pallas cache
            # read on a GPU (jax 0.11.2; see attention.cache_attention). The scanned layers'
            # random initialisation from a given seed changed with it (compared leaf by leaf).
            check_constancy_invariants=False,
        )(self.config, self.dtype, self.attn_impl)

    def _run_layers(self, carry, layer_xs, positions, cos, sin, cache):
        return self.layers(carry, layer_xs, positions, cos, sin, cache)

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def logits(self, hidden):
        """Final-normed hidden [..., D] -> float32 logits [..., V]."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)


class PackedTargetModel(TargetModel):
    """TargetModel over params laid out for a CPU decode (`pack_layers`): the layers stacked as in
    the scanned model, but every kernel packed for the CPU rows kernel ([L, P, K, 16],
    `kernels.cpu_matmul.pack_kernel`), and the LM head packed as "head". Same results as the scanned
    model (the products stream each weight once where XLA's GEMM reads it several times over for a
    few rows), bit for bit the same as a Python loop over per-layer params, which it replaced.

    The layers run as a loop over the layer index (`layers.scan_stacked_layers`, a `lax.scan`), as
    in the scanned model, but the products read their layer's kernel inside the stack
    (`layers.DensePacked` and its `STACKED` collection): the scanned model slices every layer's
    weights out of the stack with a copy in every step (SmolLM2-135M, one token, no cache: 42 ms
    scanned, 25 ms with per-layer arrays).
    Only the small per-layer params (norm scales, biases) are sliced. q/k/v and gate/up are one
    product each where their widths allow (`pack_layers`). XLA compiles one layer, not
    all of them: SmolLM2's 300-token prefill 5.1 -> 2.0 s, one-token step 3.1 -> 1.6 s, 16-token
    verify 2.4 -> 0.9 s against the Python loop over per-layer params (one-off script, one process).

    The LM head is read by the rows kernel too: XLA CPU turns one row against the [V, D] embedding
    into a loop fusion that transposes it (SmolLM2: 7.2 ms of a 50 ms decode step). A tied
    embedding is not kept beside it: `embed` reads the token rows out of the packed head."""

    def _make_layers(self):
        pass  # params["layers"] are read as they are in _run_layers

    def setup(self):
        super().setup()
        cfg = self.config
        if self.has_variable("params", "head"):  # float32 or quantized panels (loading.gguf_panels)
            self.head = self.get_variable("params", "head")
        else:
            self.head = self.param("head", lambda key: pack_kernel(jnp.zeros((cfg.hidden_size, cfg.vocab_size),
                                                                             self.dtype)))

    def embed(self, tokens):
        """With tied embeddings the token rows are read out of the packed head (`pack_layers`
        keeps no second copy of the embedding): the same floats, gathered."""
        if not self.config.tie_word_embeddings:
            return super().embed(tokens)
        head = self.head
        if is_narrow(head):  # [P, D / 32, bytes]: the token's panel, dequantized, at lane t % 16
            panels = dequantize_panels(head[tokens // PANEL])  # [..., D, 16]
            return jnp.take_along_axis(panels, (tokens % PANEL)[..., None, None], axis=-1)[..., 0].astype(self.dtype)
        if is_packed(head):  # [P, D, 16]: column t of [D, V] is panel t // 16, lane t % 16
            return head[tokens // PANEL, :, tokens % PANEL].astype(self.dtype)
        return jnp.take(head.T, tokens, axis=0).astype(self.dtype)

    def logits(self, hidden):
        # the barrier keeps the final norm out of XLA's product, which would make it a loop fusion
        hidden = jax.lax.optimization_barrier(hidden.astype(self.dtype))
        return rows_matmul(hidden, self.head, self.config.vocab_size).astype(jnp.float32)

    def _run_layers(self, carry, layer_xs, positions, cos, sin, cache):
        if self.is_initializing():
            raise TypeError("PackedTargetModel reads packed params (pack_layers); initialise TargetModel")
        layer = TargetLayer(self.config, self.dtype, self.attn_impl, packed_weights=True, parent=None)
        # With a cache, every layer's attention reads it inside the loop and the new rows are
        # written after it, so XLA does not copy the cache to order the two.
        return scan_stacked_layers(layer, self.variables["params"]["layers"], carry, layer_xs, positions, cos,
                                   sin, cache)


def pack_layers(params, *, release: bool = False) -> dict:
    """Stacked target params -> PackedTargetModel params: every stacked kernel packed
    ([L, K, N] -> [L, P, K, 16]), q/k/v and gate/up each fused into one product where their widths
    allow (`layers.fuse_stacked_projections`: "qkv_proj", "gate_up_proj"; `TargetLayer` fuses by
    the same rule), and the LM head packed as "head" (an untied lm_head moves there; a
    tied embedding moves there too, and the model's `embed` reads it from there; params without
    either leave "head" to their caller, as `load_target` does with a GGUF's own blocks). Packed params are
    returned as they are. release: the caller gives `params` up: each stacked weight leaves the dict
    once it is packed, so that the copy never holds all the weights twice."""
    if is_packed_layout(params):
        return params
    layers = fuse_stacked_projections(params.pop("layers") if release else params["layers"], release=release)
    layers = pack_stacked_kernels(layers, release=release)
    head_entry = "lm_head" if "lm_head" in params else "embed_tokens"
    out = {k: v for k, v in params.items() if k not in ("layers", head_entry)}
    head = params.pop(head_entry, None) if release else params.get(head_entry)
    if head is None:  # a loader that has the head's panels already (`loading.gguf_panels`) adds them
        return {**out, "layers": layers}
    kernel = head["kernel"] if head_entry == "lm_head" else np.asarray(head["embedding"]).T
    del head
    return {**out, "layers": layers, "head": pack_kernel(kernel)}


def is_packed_layout(params) -> bool:
    """Whether `params` are laid out for a CPU decode (`pack_layers`, `PackedTargetModel`)."""
    return "head" in params


LAYOUTS = ("auto", "stacked", "packed")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")


def resolve_layout(layout: str) -> str:
    """"stacked" or "packed": the layout asked for, "auto" resolved for JAX's default backend."""
    check_layout(layout)
    if layout == "auto":
        return "packed" if jax.default_backend() == "cpu" else "stacked"
    return layout


def params_in_layout(params, layout: str = "auto", *, release: bool = False):
    """Stacked target params in the layout asked for: "stacked" as they are (what the scanned
    `TargetModel`, training, sharding and GPUs use), "packed" through `pack_layers` (what a CPU
    decodes with: `PackedTargetModel`), "auto" packed when JAX's default backend is the CPU,
    stacked elsewhere. release: see `pack_layers` (a loader's own params)."""
    layout = resolve_layout(layout)
    if layout == "packed":
        return pack_layers(params, release=release)
    if is_packed_layout(params):
        raise ValueError("these params are packed for a CPU decode; the stacked layout is made at load "
                         "time: load_target(..., layout=\"stacked\")")
    return params


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """What a target computes, without its weights: config, compute dtype, attention
    implementation and the dtype its KV cache stores (None: the compute dtype; float16 under a
    float32 model halves the bytes a decode step reads from the cache, at float16's precision for
    keys and values). Static and hashable (a jit static argument and a compile-cache key); every
    function takes the params explicitly."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    kv_cache_dtype: Any = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))  # float32, np.float32, "float32": one key
        object.__setattr__(self, "kv_cache_dtype", resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype))

    @property
    def module(self) -> TargetModel:
        return TargetModel(self.config, self.dtype, self.attn_impl)

    def module_for(self, params) -> TargetModel:
        """The module that reads `params`: scanned (stacked layers) or packed (`pack_layers`)."""
        cls = PackedTargetModel if is_packed_layout(params) else TargetModel
        return cls(self.config, self.dtype, self.attn_impl)

    def forward(self, params, tokens, cache=None, *, positions=None, capture: Sequence[int] = (),
                num_new=None, write_cache: bool = True):
        """See `TargetModel.__call__`. With a cache, more than PREFILL_CHUNK tokens go through
        `prefill` (same results, chunk by chunk; not with write_cache=False)."""
        if cache is None:
            return self.module_for(params).apply({"params": params}, tokens, positions=positions,
                                                 capture=capture)
        check_fits(cache, tokens.shape[1])
        if positions is None and tokens.shape[1] > PREFILL_CHUNK:
            if not write_cache:
                raise ValueError(f"write_cache=False takes at most {PREFILL_CHUNK} tokens, got {tokens.shape[1]}")
            return self.prefill(params, tokens, cache, capture=capture, num_new=num_new)
        return self.module_for(params).apply({"params": params}, tokens, cache, positions=positions,
                                             capture=capture, num_new=num_new, write_cache=write_cache)

    def prefill(self, params, tokens, cache: KVCache, *, capture: Sequence[int] = (), num_new=None,
                chunk_size: int = PREFILL_CHUNK):
        """`forward` with a cache, chunk_size tokens at a time (a `lax.scan` over chunks carrying
        the cache, then the remainder): peak memory follows the chunk, and each chunk's attention
        reads only the filled slots. tokens [B, T] -> (hidden [B, T, D], features | None, cache)."""
        check_fits(cache, tokens.shape[1])
        b, t = tokens.shape
        size = min(chunk_size, t)
        whole, rest = divmod(t, size)
        start = cache.lengths
        module = self.module_for(params)
        apply = lambda c, chunk: module.apply({"params": params}, chunk, c, capture=capture)

        def step(c, chunk):  # chunk [B, size]
            hidden, features, c = apply(c, chunk)
            return c, (hidden, features)

        chunks = tokens[:, : whole * size].reshape(b, whole, size).swapaxes(0, 1)
        cache, outputs = jax.lax.scan(step, cache, chunks)
        hidden, features = jax.tree_util.tree_map(
            lambda x: x.swapaxes(0, 1).reshape(b, whole * size, *x.shape[3:]), outputs)
        if rest:
            hidden_rest, features_rest, cache = apply(cache, tokens[:, whole * size:])
            hidden = jnp.concatenate([hidden, hidden_rest], axis=1)
            if features is not None:
                features = jnp.concatenate([features, features_rest], axis=1)
        return hidden, features, cache.with_lengths(start + jnp.asarray(t if num_new is None else num_new))

    def embed(self, params, tokens):
        return self.module_for(params).apply({"params": params}, tokens, method="embed")

    def logits(self, params, hidden):
        return self.module_for(params).apply({"params": params}, hidden, method="logits")

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache.for_model(self.config, batch, capacity, self.kv_cache_dtype)


@dataclasses.dataclass
class Target:
    """A loaded target: its weights and tokenizer beside the static description (`spec`).

    The pure functions (`forward`, `prefill`, `embed`, `logits`, `init_cache`, `module_for`) are the
    spec's, reachable from here for convenience; jitted code takes `spec` and the params apart.
    """

    config: ModelConfig
    params: Any
    tokenizer: Any = None
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    kv_cache_dtype: Any = None  # None or "auto": dtype (see `TargetSpec`)

    @property
    def spec(self) -> TargetSpec:
        return TargetSpec(self.config, self.dtype, self.attn_impl, self.kv_cache_dtype)

    module = property(lambda self: self.spec.module_for(self.params),
                      doc="The Flax module that reads `params`: scanned, or packed on a CPU (`module_for`).")
    module_for = on_spec("module_for")
    forward = on_spec("forward")
    prefill = on_spec("prefill")
    embed = on_spec("embed")
    logits = on_spec("logits")
    init_cache = on_spec("init_cache")

    @property
    def decode_activations(self) -> str:
        """"int8" where the params hold Q4_1 panels for int8 activations (`load_target(...,
        decode_activations="int8")`), else "float32"."""
        return "int8" if any(uses_int8_activations(w) for w in jax.tree_util.tree_leaves(self.params)) else "float32"


def check_fits(cache: KVCache, num_tokens: int) -> None:
    """Raise when num_tokens more positions do not fit in the cache (checked when lengths are
    concrete; under jit the caller sizes the cache, as `generate` does)."""
    if num_tokens > cache.capacity:
        raise ValueError(f"{num_tokens} tokens are longer than the cache ({cache.capacity} positions)")
    try:
        need = int(jnp.max(cache.lengths)) + num_tokens
    except jax.errors.ConcretizationTypeError:  # traced lengths: the caller sized the cache
        return
    if need > cache.capacity:
        raise ValueError(f"prompt too long for the cache: {need} positions needed, "
                         f"capacity {cache.capacity}")


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def init_target_params(config: ModelConfig, rng, dtype=jnp.float32):
    """Random params (for tests and shape templates). Jitted: an eager `init` dispatches every op of
    the forward pass one at a time, several times slower even for a tiny model."""
    def forward_and_logits(module, tokens):
        hidden, _, _ = module(tokens)
        return module.logits(hidden)

    tokens = jnp.zeros((1, 1), jnp.int32)
    return TargetModel(config, dtype).init(rng, tokens, method=forward_and_logits)["params"]


def target_param_shapes(config: ModelConfig, dtype=jnp.float32):
    return jax.eval_shape(lambda: init_target_params(config, jax.random.PRNGKey(0), dtype))
