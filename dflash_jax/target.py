"""The target model (Qwen3 / Llama) as a pure functional Flax module with a static-shape KV cache.

`TargetModel.__call__(tokens, cache, capture=...)` runs T new tokens per row at that row's own
offset (`cache.lengths`), returns the final-normed hidden states, the features of the captured
layers concatenated on the last axis (layer id i = Hugging Face `hidden_states[i + 1]`: the output
of decoder layer i, except that the last layer's entry is after the final norm, as in HF),
and the NEW cache. Layers run under `nn.scan` over stacked per-layer params; `UnrolledTargetModel`
runs the same layers in a Python loop over per-layer params (`unstack_layers`), which is what
`generate` decodes with on a CPU. `TargetSpec` (static, hashable) picks the module from the params'
layout; `Target` is a loaded target: spec, params and tokenizer.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import masks
from dflash_jax.attention import attention, cache_attention
from dflash_jax.cache import KVCache
from dflash_jax.config import ModelConfig
from dflash_jax.kernels.cpu_matmul import PANEL, is_packed, pack_kernel, rows_matmul
from dflash_jax.layers import MLP, AttentionProjections, RMSNorm, Rotary
from dflash_jax.model_spec import on_spec

PREFILL_CHUNK = 256  # tokens per step of `Target.prefill`


class TargetLayer(nn.Module):
    """One pre-norm decoder layer; the scan body.

    carry: (hidden [B, T, D], features [B, T, n, D] | None); xs: (layer index, window, capture
    slot or -1); broadcast: (positions [B, T], cos, sin, cache | None). With a cache, attention
    reads the cache's used slots and the T new keys (`cache_attention`) and the layer's new keys
    and values [B, T, Hkv, Dh] come out as ys (the caller writes all layers' rows at once);
    without one, attention is over the T new keys only and ys is None.
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
        attn = AttentionProjections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.qk_norm, cfg.attention_bias, cfg.rms_norm_eps, self.dtype,
                                    self.packed_weights, name="self_attn")
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="input_layernorm")(hidden)
        q = attn.queries(x, cos, sin)
        k, v = attn.keys_values(x, cos, sin)
        ranges = masks.causal(positions, window)  # over cache slots (== positions)
        if cache is None:
            attended = attention(q, k, v, ranges, impl=self.attn_impl)
        else:
            offsets = cache.lengths
            attended = cache_attention(q, cache.k, cache.v, layer, ranges.segment(0, offsets), k, v,
                                       ranges.segment(offsets, offsets + k.shape[1]), impl=self.attn_impl)
        hidden = hidden + attn.output(attended)
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(hidden)
        hidden = hidden + MLP(cfg.intermediate_size, cfg.mlp_bias, self.dtype, self.packed_weights,
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
                 capture: Sequence[int] = (), num_new=None):
        """tokens [B, T] -> (hidden [B, T, D], features [B, T, len(capture) * D] | None, cache).

        With a cache, row b's tokens go to positions lengths[b] .. lengths[b] + T - 1, and the
        returned cache has lengths + num_new (default T: pass fewer for right-padded rows).
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


class UnrolledTargetModel(TargetModel):
    """TargetModel over per-layer params "layer_0" .. "layer_{L-1}" (see `unstack_layers`): a
    Python loop over the layers instead of a scan. Same results. On a CPU the scan slices every
    layer's weights out of the stacked arrays with a copy in every step (XLA CPU's dot reads a
    materialised operand), which more than doubles the memory traffic of a decode step
    (SmolLM2-135M, one token, no cache: 42 ms scanned, 25 ms unrolled). Compiles more slowly.

    The layers' kernels are packed for the CPU rows kernel (`layers.DensePacked`,
    `kernels.cpu_matmul.pack_kernel`): their products (a decode step, a verify, a prefill chunk)
    stream each weight once where XLA's GEMM reads it several times over for a few rows.

    The LM head is packed too ("head", made by `unstack_layers` from the tied embedding or from
    lm_head), read by the same kernel: XLA CPU turns one row against the [V, D] embedding into a
    loop fusion that transposes it (SmolLM2: 7.2 ms of a 50 ms decode step). A tied embedding is
    not kept beside it: `embed` reads the token rows out of the packed head."""

    def _make_layers(self):
        # Flax names the list's modules layer_0, layer_1, ...
        self.layer = [TargetLayer(self.config, self.dtype, self.attn_impl, packed_weights=True)
                      for _ in range(self.config.num_layers)]

    def setup(self):
        super().setup()
        cfg = self.config
        self.head = self.param("head", lambda key: pack_kernel(jnp.zeros((cfg.hidden_size, cfg.vocab_size),
                                                                         self.dtype)))

    def embed(self, tokens):
        """With tied embeddings the token rows are read out of the packed head (`unstack_layers`
        keeps no second copy of the embedding): the same floats, gathered."""
        if not self.config.tie_word_embeddings:
            return super().embed(tokens)
        head = self.head
        if is_packed(head):  # [P, D, 16]: column t of [D, V] is panel t // 16, lane t % 16
            return head[tokens // PANEL, :, tokens % PANEL].astype(self.dtype)
        return jnp.take(head.T, tokens, axis=0).astype(self.dtype)

    def logits(self, hidden):
        # the barrier keeps the final norm out of XLA's product, which would make it a loop fusion
        hidden = jax.lax.optimization_barrier(hidden.astype(self.dtype))
        return rows_matmul(hidden, self.head, self.config.vocab_size).astype(jnp.float32)

    def _run_layers(self, carry, layer_xs, positions, cos, sin, cache):
        def run(module, carry):
            new_kv = []
            traced_once = _layer_call(module.config, module.dtype, module.attn_impl)  # see `_layer_call`
            for i, layer in enumerate(module.layer):
                xs = tuple(x[i] for x in layer_xs)
                if module.is_initializing():  # the params do not exist yet: Flax creates them here
                    carry, kv = layer(carry, xs, positions, cos, sin, cache)
                else:
                    carry, kv = traced_once(module.variables["params"][f"layer_{i}"], carry, xs, positions, cos,
                                            sin, cache)
                new_kv.append(kv)
            return carry, (None if cache is None else tuple(jnp.stack(parts) for parts in zip(*new_kv)))

        if cache is None:
            return run(self, carry)
        # With a cache, the layers run as the body of a while loop that makes one trip. Unrolled at
        # the top level, every layer's attention loop is a while that reads the cache, the rows
        # are written after them, and XLA's copy insertion copies the whole cache (twice, K and V)
        # in every step rather than order those reads before the write (SmolLM2, 4096 slots: 20 ms
        # of a 110 ms step). Inside one loop body, as in the scanned model, it does not.
        kv_shape = (self.config.num_layers, *positions.shape, self.config.num_kv_heads, self.config.head_dim)
        zeros = jnp.zeros(kv_shape, cache.k.dtype)
        one_trip = jax.lax.optimization_barrier(jnp.int32(1))  # opaque: XLA would inline a constant trip count

        def body(module, state):
            trips, carry, _ = state
            carry, new_kv = run(module, carry)
            return trips + 1, carry, new_kv

        _, carry, new_kv = nn.while_loop(lambda module, state: state[0] < one_trip, body, self,
                                         (jnp.int32(0), carry, (zeros, zeros)))
        return carry, new_kv


@functools.cache
def _layer_call(config: ModelConfig, dtype, attn_impl: str):
    """A packed `TargetLayer` as one jitted function of (layer params, carry, layer xs, positions,
    cos, sin, cache). Called inside the unrolled model's trace, every layer with the same shapes
    reuses its one trace and lowering (a nested call that XLA inlines: the compiled program is the
    unrolled one), where 30 separate Flax layer calls were traced one by one: SmolLM2's 16-token
    verify traced in 1.45 s that way."""
    layer = TargetLayer(config, dtype, attn_impl, packed_weights=True, parent=None)  # unbound, not a submodule
    return jax.jit(lambda params, *args: layer.apply({"params": params}, *args))


def unstack_layers(params, *, release: bool = False) -> dict:
    """Stacked target params ("layers" [L, ...]) -> UnrolledTargetModel params: one separate array
    per layer and weight, kernels packed (`kernels.cpu_matmul.pack_kernel`), and the LM head packed
    as "head" (an untied lm_head moves there; a tied embedding moves there too, and the model's
    `embed` reads it from there). Run it outside jit: inside, the slices would be copies again.
    release: the caller gives `params` up: each stacked weight leaves the dict once it is unstacked,
    so that the copy never holds all the weights twice."""
    if "layers" not in params:
        return params
    out = unstack_layer_params(params, release=release)
    if "lm_head" in out:
        head = out.pop("lm_head")["kernel"]
    else:
        head = np.asarray(out.pop("embed_tokens")["embedding"]).T
    if release:
        params.pop("lm_head" if "lm_head" in params else "embed_tokens")
    out["head"] = pack_kernel(head)
    return out


LAYOUTS = ("auto", "stacked", "unrolled")


def params_in_layout(params, layout: str = "auto", *, release: bool = False):
    """Stacked target params in the layout asked for: "stacked" as they are (what the scanned
    `TargetModel`, training, sharding and GPUs use), "unrolled" through `unstack_layers` (what a
    CPU decodes with: `UnrolledTargetModel`), "auto" unrolled when JAX's default backend is the CPU,
    stacked elsewhere. release: see `unstack_layers` (a loader's own params)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if layout == "auto":
        layout = "unrolled" if jax.default_backend() == "cpu" else "stacked"
    if layout == "unrolled":
        return unstack_layers(params, release=release)
    if is_unstacked(params):
        raise ValueError("these params are unrolled (one array per layer, kernels packed); the stacked "
                         "layout is made at load time: load_target(..., layout=\"stacked\")")
    return params


def unstack_layer_params(params, *, release: bool = False) -> dict:
    """params with stacked "layers" [L, ...] -> "layer_0" .. "layer_{L-1}", each weight its own
    array and every dense kernel packed for the CPU rows kernel (`layers.DensePacked`); the other
    entries as they are. Shared by the target and the drafter. release: as in `unstack_layers`."""
    stacked = flax.traverse_util.flatten_dict(params.pop("layers") if release else params["layers"])
    num_layers = next(iter(stacked.values())).shape[0]
    per_layer = [{} for _ in range(num_layers)]
    for path in list(stacked):
        weights = np.asarray(stacked.pop(path))  # sliced on the host: one copy per layer
        for i, layer in enumerate(per_layer):
            layer[path] = pack_kernel(weights[i]) if path[-1] == "kernel" else jnp.asarray(weights[i])
        del weights
    out = {k: v for k, v in params.items() if k != "layers"}
    out.update({f"layer_{i}": flax.traverse_util.unflatten_dict(layer) for i, layer in enumerate(per_layer)})
    return out


def is_unstacked(params) -> bool:
    return "layer_0" in params


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """What a target computes, without its weights: config, compute dtype and attention
    implementation. Static and hashable (a jit static argument and a compile-cache key); every
    function takes the params explicitly."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))  # float32, np.float32, "float32": one key

    @property
    def module(self) -> TargetModel:
        return TargetModel(self.config, self.dtype, self.attn_impl)

    def module_for(self, params) -> TargetModel:
        """The module that reads `params`: scanned (stacked layers) or unrolled (`unstack_layers`)."""
        cls = UnrolledTargetModel if is_unstacked(params) else TargetModel
        return cls(self.config, self.dtype, self.attn_impl)

    def forward(self, params, tokens, cache=None, *, positions=None, capture: Sequence[int] = (),
                num_new=None):
        """See `TargetModel.__call__`. With a cache, more than PREFILL_CHUNK tokens go through
        `prefill` (same results, chunk by chunk)."""
        if cache is None:
            return self.module_for(params).apply({"params": params}, tokens, positions=positions,
                                                 capture=capture)
        check_fits(cache, tokens.shape[1])
        if positions is None and tokens.shape[1] > PREFILL_CHUNK:
            return self.prefill(params, tokens, cache, capture=capture, num_new=num_new)
        return self.module_for(params).apply({"params": params}, tokens, cache, positions=positions,
                                             capture=capture, num_new=num_new)

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
        return KVCache.for_model(self.config, batch, capacity, self.dtype)


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

    @property
    def spec(self) -> TargetSpec:
        return TargetSpec(self.config, self.dtype, self.attn_impl)

    module = property(lambda self: self.spec.module, doc="The scanned module (`TargetSpec.module`).")
    module_for = on_spec("module_for")
    forward = on_spec("forward")
    prefill = on_spec("prefill")
    embed = on_spec("embed")
    logits = on_spec("logits")
    init_cache = on_spec("init_cache")


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
