"""The DFlash drafter: fused context projection and K/V-injected decoder layers (pure Flax).

context = hidden_norm(fc(concat(target features)))                      [B, C, D]
each layer: q from the (input-normed) block states; k, v from the SAME k_proj/v_proj applied to
the context (not normed by input_layernorm) and to the block states; k_norm on both; RoPE at each
token's own position; attention over [visible context ; block] (a sliding layer: each query's own
window, causal inside the block unless the config's is_causal says otherwise; `kernels.masks`); pre-norm
residual attention + SwiGLU MLP. The block embeddings enter times input_embedding_scale; the output
goes through `norm`, then the TARGET's LM head (or a reduced vocabulary's own), times
output_multiplier, softcapped (`DrafterConfig.draft_logits`).

Two entry points share the layers:
* inference: `append_context` projects the features of newly committed tokens into every layer's
  context K/V and appends them to a static-shape draft cache (`KVCache`, rollback by length);
  `draft_hidden` runs one block per row against the cached context: attention reads the cache's
  used slots and the block's own K/V in two parts (`cache_attention`). Block K/V are never kept.
* training: `train_hidden` runs a packed sequence [context | N blocks] where block j sees context
  positions < anchor_j and its own block only.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import backends
from dflash_jax.drafters import generations
from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.drafters.draft_vocab import DraftVocab
from dflash_jax.kernels import masks
from dflash_jax.layers.attention import attention, cache_attention
from dflash_jax.layers.common import AttentionProjections, make_dense, MLP, RMSNorm, Rotary, run_layers
from dflash_jax.models.cache import KVCache, RingKVCache
from dflash_jax.models.spec import on_spec

DECODE_WEIGHTS = ("stored", "q8_0")  # the weights a backend's decode layout keeps (`DrafterSpec`)


def _select_ranges(windowed: bool, windowed_ranges, full_ranges):
    return jax.tree_util.tree_map(lambda w, f: jnp.where(windowed, w, f), windowed_ranges, full_ranges)


class DrafterLayer(nn.Module):
    """One K/V-injected layer. Its methods are scanned over layers as (carry, per-layer xs,
    shared): `shared` is broadcast to every layer (read-only inputs such as the cache)."""

    config: DrafterConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    backend: str = "xla"  # whose products and cache read (`dflash_jax.backends`)
    kv_replicas: int = 1  # sharding: copies of each kv head (`DrafterSpec.kv_replicas`)

    def setup(self):
        cfg = self.config
        self.self_attn = AttentionProjections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                              cfg.head_dim, True, cfg.attention_bias, cfg.rms_norm_eps,
                                              self.dtype, self.backend, kv_replicas=self.kv_replicas)
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.mlp = MLP(cfg.intermediate_size, False, self.dtype, self.backend)
        generation = generations.of(cfg)
        # the generation's modules around the sublayers (DFlash2's convolutions: attention_conv, mlp_conv)
        self.wraps_sublayers = generation.wraps_sublayers
        for name, module in generation.layer_modules(cfg, self.dtype, self.backend).items():
            setattr(self, name, module)

    def context_kv(self, carry, _, shared):
        """shared (context [B, C, D], cos, sin) -> per-layer context keys/values [B, C, Hkv, Dh]."""
        context, cos, sin = shared
        return carry, self.self_attn.keys_values(context, cos, sin)

    def _block_qkv(self, hidden, cos, sin, block):
        """Block states [B, Tq, D] (blocks of `block` positions) -> (queries [B, Tq, H, Dh], keys,
        values [B, Tq, Hkv, Dh]), and for DFlash2 the attention output's convolution kernel (None
        otherwise)."""
        x = self.input_layernorm(hidden)
        dyn = None
        if self.wraps_sublayers:
            x, dyn = self.attention_conv.prepare(x, block)
        return (self.self_attn.queries(x, cos, sin), *self.self_attn.keys_values(x, cos, sin)), dyn

    def _residual(self, hidden, attended, dyn, block):
        if not self.wraps_sublayers:
            hidden = hidden + self.self_attn.output(attended)
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.attention_conv.finish(self.self_attn.output(attended), dyn, block)
        x, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(hidden), block)
        return hidden + self.mlp_conv.finish(self.mlp(x), dyn, block)

    def __call__(self, hidden, layer_xs, shared):
        """Training: hidden [B, Tq, D]; layer_xs (context k, context v [B, C, Hkv, Dh], windowed
        flag); shared (cos, sin, full ranges, windowed ranges) over keys [context ; blocks]."""
        cos, sin, full_ranges, windowed_ranges = shared
        k_ctx, v_ctx, windowed = layer_xs
        block = self.config.block_size  # packed blocks of the config's size (`DrafterSpec.train_hidden`)
        (q, k_blk, v_blk), dyn = self._block_qkv(hidden, cos, sin, block)
        k = jnp.concatenate([k_ctx.astype(k_blk.dtype), k_blk], axis=1)
        v = jnp.concatenate([v_ctx.astype(v_blk.dtype), v_blk], axis=1)
        ranges = _select_ranges(windowed, windowed_ranges, full_ranges)
        return self._residual(hidden, attention(q, k, v, ranges, impl=self.attn_impl), dyn, block), None

    def decode(self, hidden, layer_xs, shared):
        """Inference: hidden [B, G, D]; layer_xs (layer index, windowed flag); shared (cos, sin,
        context cache, full ranges, windowed ranges), each ranges a pair (over the cache's slots,
        over the block's keys: `kernels.masks.drafter_cached`). The cache is only read
        (`cache_attention`), never concatenated with the block."""
        cos, sin, cache, full_ranges, windowed_ranges = shared
        layer, windowed = layer_xs
        block = hidden.shape[1]  # one block per row
        (q, k_blk, v_blk), dyn = self._block_qkv(hidden, cos, sin, block)
        cache_ranges, block_ranges = _select_ranges(windowed, windowed_ranges, full_ranges)
        attended = cache_attention(q, cache.k, cache.v, layer, cache_ranges, k_blk, v_blk, block_ranges,
                                   impl=self.attn_impl, backend=self.backend)
        return self._residual(hidden, attended, dyn, block), None


class DrafterModel(nn.Module):
    """The drafter over params in `backend`'s layout (stacked for XLA, what `init` makes; a
    backend's own decode layout otherwise, `backends.base.Backend.drafter_params`)."""

    config: DrafterConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    backend: str = "xla"
    kv_replicas: int = 1  # sharding: copies of each kv head (`DrafterSpec.kv_replicas`)

    def setup(self):
        cfg = self.config
        self.fc = make_dense(cfg.hidden_size, False, self.dtype, self.backend)
        self.hidden_norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self._make_layers()
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.rotary = Rotary(cfg)
        # the generation's modules at the top (DFlash2's selector; DSpark's own tables and heads, read as
        # arrays by `drafters.dspark.draft`)
        heads = generations.of(cfg).head_modules(cfg, self.dtype)
        self.head_names = tuple(heads)
        for name, module in heads.items():
            setattr(self, name, module)

    def _make_layers(self):
        """All layers as one scanned module: params stacked [L, ...] under "layers"."""
        self.layers = nn.scan(
            DrafterLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast),
            length=self.config.num_layers,
            check_constancy_invariants=False,  # as TargetModel's scan (why: there)
            methods=["context_kv", "__call__", "decode"],
        )(self.config, self.dtype, self.attn_impl, self.backend, self.kv_replicas)

    def _windowed_layers(self):
        return jnp.asarray([w > 0 for w in self.config.layer_windows])

    def _context(self, features, positions):
        """features [B, C, n*D] at positions [B, C] -> (fused context [B, C, D], cos, sin)."""
        if features.shape[-1] != self.config.num_features * self.config.hidden_size:
            raise ValueError(f"features have width {features.shape[-1]}, expected "
                             f"{self.config.num_features} x {self.config.hidden_size}")
        return (self.hidden_norm(self.fc(features.astype(self.dtype))), *self.rotary(positions))

    def _run_layers(self, method: str, carry, xs, shared):
        """Every layer's `method` in turn: carry through, xs sliced per layer (leading axis L),
        shared the same for all -> (carry, per-layer outputs stacked [L, ...]): the scanned module,
        or the backend's own loop over the stacked params."""
        return run_layers(self, DrafterLayer, method, carry, xs, shared)

    def context_kv(self, features, positions):
        """features [B, C, n*D] at positions [B, C] -> keys, values [L, B, C, Hkv, Dh]."""
        _, (k, v) = self._run_layers("context_kv", None, None, self._context(features, positions))
        return k, v

    def blocks(self, block_embeds, positions, k_ctx, v_ctx, full_ranges, windowed_ranges):
        """block_embeds [B, Tq, D] at positions [B, Tq] against context K/V [L, B, C, Hkv, Dh]."""
        cos, sin = self.rotary(positions)
        per_layer = (k_ctx, v_ctx, self._windowed_layers())
        hidden, _ = self._run_layers("__call__", block_embeds.astype(self.dtype), per_layer,
                                     (cos, sin, full_ranges, windowed_ranges))
        return self.norm(hidden)

    def cached_blocks(self, block_embeds, positions, cache: KVCache, full_ranges, windowed_ranges):
        """block_embeds [B, G, D] at positions [B, G] against the context cache; ranges: pairs (over
        the cache's slots, over the block) -> hidden [B, G, D]."""
        cos, sin = self.rotary(positions)
        layers = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        hidden, _ = self._run_layers("decode", block_embeds.astype(self.dtype), (layers, self._windowed_layers()),
                                     (cos, sin, cache, full_ranges, windowed_ranges))
        return self.norm(hidden)

    def __call__(self, features, positions, block_embeds, block_positions, full_ranges, windowed_ranges):
        """Context K/V and blocks in one call (used by `init` and by training)."""
        k, v = self.context_kv(features, positions)
        hidden = self.blocks(block_embeds, block_positions, k, v, full_ranges, windowed_ranges)
        if self.head_names and self.is_initializing():  # creates the heads' weights
            generations.of(self.config).init_heads(self.config, {n: getattr(self, n) for n in self.head_names},
                                                   hidden)
        return hidden


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """What a drafter computes, without its weights: config, compute dtype, attention
    implementation and the weights a backend's decode layout keeps (`decode_weights`: "stored", the
    weights as loaded; "q8_0", 8 bits and a scale per 32 weights where the backend has such panels
    (the CPU's: about half of bfloat16's bytes to stream in every cycle): drafts from slightly
    different weights, verified as any draft, so the output does not change). Static and hashable
    (a jit static argument and a compile-cache key). `params` below is `Drafter.loop_params`: the
    module params, or {"drafter": module params, "draft_head": ...} with a reduced draft
    vocabulary."""

    config: DrafterConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    decode_weights: str = "stored"
    kv_replicas: int = 1  # sharding: each kv head repeated for a mesh (`dflash_jax.sharding.spec_for_mesh`)

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        if self.decode_weights not in DECODE_WEIGHTS:
            raise ValueError(f"decode_weights must be one of {DECODE_WEIGHTS}, got {self.decode_weights!r}")

    def module_params(self, loop_params):
        """The Flax module's params inside `loop_params` (without a reduced vocabulary's head)."""
        return loop_params if self.config.draft_vocab_size is None else loop_params["drafter"]

    @property
    def module(self) -> DrafterModel:
        return DrafterModel(self.config, self.dtype, self.attn_impl, kv_replicas=self.kv_replicas)

    def module_for(self, loop_params) -> DrafterModel:
        """The module that reads `loop_params`, on the backend whose layout they are in
        (`backends.of_drafter_params`)."""
        return self._module_reading(self.module_params(loop_params))

    def _module_reading(self, module_params) -> DrafterModel:
        return DrafterModel(self.config, self.dtype, self.attn_impl, backends.of_drafter_params(module_params),
                            self.kv_replicas)

    def decode_params(self, loop_params, backend: str = "auto"):
        """`loop_params` in the layout `backend` drafts with ("auto": this process's,
        `backends.resolve`), `decode_weights` applied; params already in it are returned as they
        are. Run it outside jit."""
        return backends.get(backends.resolve(backend)).drafter_params(self, loop_params)

    def draft_head_logits(self, loop_params, hidden):
        """float32 logits [..., Vd] of a reduced draft vocabulary's own head for hidden [..., D]
        (kernel [D, Vd], or in the backend's layout, which reads it once for all the block's slots)."""
        backend = backends.get(backends.of_drafter_params(self.module_params(loop_params)))
        return backend.matmul(hidden.astype(jnp.float32), loop_params["draft_head"]["kernel"],
                              self.config.draft_vocab_size)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def init_cache(self, batch: int, capacity: int, window: int = 0) -> KVCache:
        """An empty context cache of `capacity` positions (the block never goes into it); window > 0:
        a `RingKVCache` of `capacity` slots of which the drafter sees the last `window` positions of
        any context (a bounded context for long inputs)."""
        if window:
            return RingKVCache.for_window(self.config, batch, window, capacity, self.dtype, self.kv_replicas)
        return KVCache.for_model(self.config, batch, capacity, self.dtype, kv_replicas=self.kv_replicas)

    def append_context(self, params, cache: KVCache, features, num_new=None) -> KVCache:
        """Append the features [B, T, n*D] of newly committed tokens (positions lengths .. +T-1).
        Rows commit num_new[b] <= T tokens (default T); slots past that are overwritten later.
        params: `loop_params`."""
        t = features.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        k, v = self.module_for(params).apply({"params": self.module_params(params)}, features, positions,
                                             method="context_kv")
        return cache.append(k, v, t if num_new is None else num_new)

    def draft_hidden(self, params, block_embeds, cache: KVCache):
        """One block per row, block_embeds [B, G, D] at positions lengths .. lengths + G - 1 (the
        anchor sits at position lengths[b]); sees the row's cached context. -> hidden [B, G, D].
        params: `loop_params`."""
        g = block_embeds.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]
        cfg, ring = self.config, cache.window if isinstance(cache, RingKVCache) else 0
        full = masks.drafter_cached(cache.lengths, cache.capacity, g, causal=cfg.full_layers_causal,
                                    ring_window=ring)
        windowed = masks.drafter_cached(cache.lengths, cache.capacity, g, cfg.sliding_window,
                                        causal=cfg.sliding_layers_causal, ring_window=ring)
        return self.module_for(params).apply({"params": self.module_params(params)}, block_embeds,
                                             positions, cache, full, windowed, method="cached_blocks")

    @property
    def generation(self) -> generations.Generation:
        """The drafter's generation (`drafters.generations`): its proposal, heads, names and loss."""
        return generations.of(self.config)

    def select(self, params, hidden, logits, anchors, temperature=None, key=None):
        """A DFlash2 drafter's candidate-selector walk over the proposal slots (`drafters.dflash2.select`:
        hidden [B, S, D], draft logits [B, S, V], anchors [B]; temperature None: greedy) -> (drafts,
        candidates, chosen indices, q over the candidates). params: `loop_params`."""
        return self.generation.walk(self, params, hidden, logits, anchors, temperature, key)

    def train_hidden(self, params, features, block_embeds, anchors, block_valid):
        """Packed training forward.

        features [B, C, n*D] of the whole sequence (positions 0..C-1); block_embeds [B, N*G, D]
        (block j = [token at anchors[j], mask x (G-1)]); anchors [B, N]; block_valid [B, N].
        -> hidden [B, N*G, D]; slot k of block j predicts the token at anchors[j] + k.
        """
        b, c = features.shape[:2]
        n = anchors.shape[1]
        g = block_embeds.shape[1] // n
        if g * n != block_embeds.shape[1]:
            raise ValueError(f"block_embeds length {block_embeds.shape[1]} is not N={n} blocks")
        if self.generation.wraps_sublayers and g != self.config.block_size:
            raise ValueError(f"a DFlash2 drafter's convolutions run over blocks of block_size="
                             f"{self.config.block_size}; got blocks of {g}")
        positions = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
        block_positions = (anchors[:, :, None] + jnp.arange(g, dtype=jnp.int32)).reshape(b, n * g)
        cfg = self.config
        full = masks.drafter_training(anchors, block_valid, c, g, causal=cfg.full_layers_causal)
        windowed = masks.drafter_training(anchors, block_valid, c, g, cfg.sliding_window,
                                          causal=cfg.sliding_layers_causal)
        return self._module_reading(params).apply({"params": params}, features, positions, block_embeds,
                                                  block_positions, full, windowed)


@dataclasses.dataclass
class Drafter:
    """A loaded drafter: its weights (and draft head) and the config.json it came from, beside the
    static description (`spec`, whose pure functions are reachable from here too).

    With a reduced draft vocabulary (config.draft_vocab_size = Vd) the drafter has its own head,
    `draft_head` = {"kernel": [D, Vd], "draft_to_target": int32 [Vd] (ascending target ids)}, kept
    apart from the Flax module's params. `loop_params` is what generation passes into its jitted
    loop as `drafter_params` (never closed over): the module params alone, or {"drafter": module
    params, "draft_head": draft_head}. `append_context` and `draft_hidden` take that layout.
    """

    config: DrafterConfig
    params: Any
    hf_config: dict = dataclasses.field(default_factory=dict)
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    draft_head: Any = None
    decode_weights: str = "stored"  # see `DrafterSpec`
    mesh: Any = None  # the mesh `params` are placed on (`load_drafter(..., mesh=...)`), as `Target.mesh`

    def __post_init__(self):
        size = self.config.draft_vocab_size
        if self.draft_head is None:
            if size is not None and self.params is not None:
                raise ValueError(f"the drafter config has draft_vocab_size={size} but no draft_head was given")
            return
        if size is None:
            raise ValueError("a draft_head needs config.draft_vocab_size (use Drafter.with_draft_vocab)")
        kernel, ids = self.draft_head["kernel"], self.draft_head["draft_to_target"]
        if kernel.shape != (self.config.hidden_size, size) or ids.shape != (size,):
            raise ValueError(f"draft_head: kernel {kernel.shape} and draft_to_target {ids.shape} must be "
                             f"[{self.config.hidden_size}, {size}] and [{size}]")

    def __repr__(self) -> str:
        """What the drafter is, in one line (its params and config.json are not printed)."""
        c = self.config
        vocab = f"{c.draft_vocab_size} of {c.vocab_size}" if c.draft_vocab_size is not None else c.vocab_size
        return (f"Drafter({c.generation}, {c.num_layers} layers, block {c.block_size}, target layers "
                f"{list(c.target_layer_ids)}, vocab {vocab}, dtype {jnp.dtype(self.dtype).name})")

    def with_draft_vocab(self, kernel, vocab: DraftVocab) -> "Drafter":
        """This drafter drafting over `vocab` with head kernel [D, Vd] (stored in self.dtype)."""
        if vocab.target_vocab_size != self.config.vocab_size:
            raise ValueError(f"the draft vocabulary maps into {vocab.target_vocab_size} target ids, the "
                             f"drafter's vocabulary has {self.config.vocab_size}")
        head = {"kernel": jnp.asarray(kernel, self.dtype),
                "draft_to_target": jnp.asarray(vocab.draft_to_target, jnp.int32)}
        config = dataclasses.replace(self.config, draft_vocab_size=vocab.size)
        return dataclasses.replace(self, config=config, draft_head=head)

    @property
    def draft_vocab(self) -> DraftVocab | None:
        if self.draft_head is None:
            return None
        return DraftVocab(np.asarray(jax.device_get(self.draft_head["draft_to_target"])), self.config.vocab_size)

    @property
    def loop_params(self):
        """The params generation passes into its jitted loop (see the class docstring)."""
        if self.config.draft_vocab_size is None:
            return self.params
        return {"drafter": self.params, "draft_head": self.draft_head}

    @property
    def spec(self) -> DrafterSpec:
        return DrafterSpec(self.config, self.dtype, self.attn_impl, self.decode_weights)

    module = property(lambda self: self.spec.module, doc="The Flax module (`DrafterSpec.module`).")
    generation = property(lambda self: generations.of(self.config), doc="`DrafterSpec.generation`.")
    block_size = property(lambda self: self.config.block_size)
    init_cache = on_spec("init_cache")
    append_context = on_spec("append_context")
    draft_hidden = on_spec("draft_hidden")
    train_hidden = on_spec("train_hidden")
    select = on_spec("select")
    draft_head_logits = on_spec("draft_head_logits")


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def init_drafter_params(config: DrafterConfig, rng, dtype=jnp.float32):
    """Random params (jitted, like init_target_params)."""
    b, c, g = 1, 2, config.block_size
    features = jnp.zeros((b, c, config.num_features * config.hidden_size), dtype)
    positions = jnp.zeros((b, c), jnp.int32)
    block = jnp.zeros((b, g, config.hidden_size), dtype)
    block_positions = jnp.zeros((b, g), jnp.int32)
    ranges = masks.drafter_inference(jnp.zeros((b,), jnp.int32), c, g)
    return DrafterModel(config, dtype).init(rng, features, positions, block, block_positions, ranges,
                                            ranges)["params"]


def drafter_param_shapes(config: DrafterConfig, dtype=jnp.float32):
    return jax.eval_shape(lambda: init_drafter_params(config, jax.random.PRNGKey(0), dtype))
