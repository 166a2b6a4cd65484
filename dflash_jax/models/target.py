"""The target model (Qwen3 / Llama; the MoE families Qwen3-MoE and gpt-oss) as a pure functional
Flax module with a static-shape KV cache.

`TargetModel.__call__(tokens, cache, capture=...)` runs T new tokens per row at that row's own
offset (`cache.lengths`), returns the final-normed hidden states, the features of the captured
layers concatenated on the last axis (layer id i = Hugging Face `hidden_states[i + 1]`: the output
of decoder layer i, except that the last layer's entry is after the final norm, as in HF),
and the NEW cache. The weight products, the loop over the stacked layers, the LM head and the
cache read come from the module's backend (`dflash_jax.backends`): on XLA (the default) the
layers run under `nn.scan` over stacked per-layer params. `TargetSpec` (static, hashable) builds
the module for the backend whose layout the params are in; `Target` is a loaded target: spec,
params and tokenizer.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax import backends
from dflash_jax.layers.attention import causal_attention
from dflash_jax.layers.common import AttentionProjections, Capture, Rotary, run_layers, token_positions
from dflash_jax.models.cache import GroupedKVCache, KVCache, resolve_kv_cache_dtype
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.decoder_layer import PreNormLayer
from dflash_jax.models.spec import on_spec
from dflash_jax.models.stack import is_direct, stack_segments

PREFILL_CHUNK = 256  # tokens per step of `Target.prefill`


class TargetLayer(PreNormLayer):
    """One pre-norm decoder layer of standard attention (`PreNormLayer`; Qwen3, Llama, Qwen3-MoE,
    gpt-oss); the scan body.

    With a cache, attention reads the cache's used slots and the T new keys (`cache_attention`) and
    the layer's new keys and values [B, T, Hkv, Dh] come out as ys (the caller writes all layers'
    rows at once); without one, attention is over the T new keys only and ys is None. The new keys
    and values are rounded to the cache's dtype before attention reads them (a float16 cache): a
    token then sees the same numbers for its block-mates in a verify as a later step reads from the
    cache, so speculative decoding stays identical to plain decoding.
    """

    def attend(self, x, positions, window, cos, sin, cache: KVCache | None, layer):
        cfg = self.config
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        attn = AttentionProjections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.qk_norm, cfg.attention_bias, cfg.rms_norm_eps, self.dtype, self.backend,
                                    backends.get(self.backend).fuses(q_width, kv_width, kv_width),
                                    cfg.attention_sinks, self.kv_replicas, name="self_attn")
        q, k, v = attn.queries_keys_values(x, cos, sin)
        attended, new = causal_attention(q, k, v, positions, window, cache, layer, impl=self.attn_impl,
                                         backend=self.backend, sinks=attn.sinks if cfg.attention_sinks else None)
        return attn.output(attended), new


class LayerInputs(NamedTuple):
    """A `StackGroup`'s scanned inputs, one entry per repeat, by name: per KV group the index there of
    the repeat's first layer of that group [G]; its layers' capture slots [P] and attention windows
    [P]; the state of its stateful layers (`Family.stateful_mixers`), by the names the cache gives them
    (`Cache.layer_states`: Qwen3.5's "conv" tails [Ps, B, K-1, C] and delta-rule "state"s [Ps, B, Hv, Dk,
    Dv]; None without a cache or such layers); the layers' own inputs [P, B, T, ...] (None without)."""

    kv_base: Any
    slots: Any
    windows: Any
    states: Any
    inputs: Any


class StackGroup(nn.Module):
    """One repeat of a segment's layer pattern (`dflash_jax.models.stack`); the scan body of a segment.
    carry: (hidden, features | None); xs: a `LayerInputs` (KV groups as `ModelConfig.kv_groups`; with
    the layers' own inputs, `Family.layer_inputs`, each layer gets its own as a fourth entry of its
    xs); broadcast: positions, cos, sin, the KV cache (a KVCache, or a GroupedKVCache where the groups
    differ in shape) | None, and
    `shared`: per KV group the new (k, v) [Lg, B, T, ...] of the layers before this segment, or None. A
    layer that keeps no keys of its own (`Family.kv_shape` None: Gemma 4's kv-shared layers) gets
    (the KV cache, shared) as its cache. ys: per KV group the (k, v) of the repeat's layers of that group
    (None where it has none, or without a cache), and the linear layers' pending inputs stacked (None
    where it has none)."""

    config: ModelConfig
    pattern: tuple  # (mixer, mlp) per position
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    backend: str = "xla"
    kv_replicas: int = 1  # sharding (`TargetSpec`)
    linear_groups: int = 1

    @nn.compact
    def __call__(self, carry, xs, positions, cos, sin, kv_cache, shared=None):
        cfg = self.config
        kv_base, slots, windows, states, inputs = xs.kv_base, xs.slots, xs.windows, xs.states, xs.inputs
        own = lambda p: () if inputs is None else (inputs[p],)  # noqa: E731
        b = carry[0].shape[0]
        shapes = [shape for shape, _ in cfg.kv_groups]
        kv, pending = [[] for _ in shapes], []
        for p, (mixer, mlp) in enumerate(self.pattern):
            layout = {"linear_groups": self.linear_groups} if cfg.family.stateful_mixers else {}  # sharding
            layer = cfg.family.layer_module(mixer)(cfg, self.dtype, self.attn_impl, self.backend, self.kv_replicas,
                                                   mixer=mixer, mlp=mlp, name=f"layer_{p}", **layout)
            shape = cfg.family.kv_shape(cfg, mixer)
            if mixer in cfg.family.stateful_mixers:  # its state by name: the cache's, else its start
                i = len(pending)
                state = ({name: x[i] for name, x in states.items()} if states is not None
                         else cfg.family.initial_layer_state(cfg, mixer, b, self.dtype))
                carry, out = layer(carry, (0, 0, slots[p]), positions, cos, sin, state)
                pending.append(out)
            elif shape is None:  # a layer that keeps no keys of its own
                carry, _ = layer(carry, (0, windows[p], slots[p], *own(p)), positions, cos, sin, (kv_cache, shared))
            else:
                g = shapes.index(shape)
                cache = None if kv_cache is None else kv_cache.kv_group(g)
                carry, out = layer(carry, (kv_base[g] + len(kv[g]), windows[p], slots[p], *own(p)), positions, cos,
                                   sin, cache)
                kv[g].append(out)
        stack = lambda items: (jax.tree_util.tree_map(lambda *x: jnp.stack(x), *items)  # noqa: E731
                               if items and items[0] is not None else None)
        return carry, (tuple(stack(group) for group in kv), stack(pending))


class TargetModel(nn.Module):
    """A target of any family, over params in `backend`'s layout (stacked for XLA, what `init` makes;
    a backend's own decode layout otherwise, `backends.base.Backend.target_params`).

    The layers are the family's (`Family.layer_module`), grouped into segments (`dflash_jax.models.stack`):
    a stack of identical attention layers is one `nn.scan` over the layer (params [L, ...] under
    "layers"; a backend may run its own loop over them); any other stack, one scan per segment over
    `StackGroup`s of its pattern. Its cache: a `KVCache`, or for a hybrid (Gated DeltaNet layers) a
    `HybridCache`; with a cache and write_cache=False the third output is what the cache needs to take
    the new tokens: (k, v) [L, B, T, Hkv, Dh] each for a KVCache (`KVCache.append`), (k, v, linear) for
    a HybridCache (`HybridCache.commit`)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    backend: str = "xla"
    kv_replicas: int = 1  # sharding: copies of each kv head (`TargetSpec.kv_replicas`)
    linear_groups: int = 1  # sharding: a hybrid's Gated DeltaNet q | k | v channel groups (`TargetSpec`)

    def setup(self):
        cfg = self.config
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype,
                                     param_dtype=self.dtype)
        self.segments = stack_segments(cfg.layer_kinds)
        self.direct = is_direct(cfg)
        if self.direct:
            self._make_layers()
        else:
            scan = lambda segment, name: nn.scan(  # noqa: E731
                StackGroup, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                length=segment.repeats,
                check_constancy_invariants=False,  # as `_make_layers` (see there)
            )(cfg, segment.pattern, self.dtype, self.attn_impl, self.backend, self.kv_replicas, self.linear_groups,
              name=name)
            names = ["layers"] if len(self.segments) == 1 else [f"layers_{s}" for s in range(len(self.segments))]
            self.stack = [scan(segment, name) for segment, name in zip(self.segments, names)]
        self.norm = cfg.family.final_norm(cfg, self.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype,
                                    param_dtype=self.dtype)
        self.rotary = Rotary(cfg)
        self.layer_inputs = cfg.family.layer_inputs(cfg, self.dtype)

    def __call__(self, tokens, cache=None, *, positions=None,
                 capture: Sequence[int] = (), num_new=None, write_cache: bool = True):
        """tokens [B, T] -> (hidden [B, T, D], features [B, T, len(capture) * D] | None, cache).

        With a cache, row b's tokens go to positions lengths[b] .. lengths[b] + T - 1, and the
        returned cache has lengths + num_new (default T: pass fewer for right-padded rows).
        write_cache=False returns what the cache needs in place of the cache, which is only read
        (class docstring; for `append` / `commit` later: a `lax.cond` that returned the whole cache
        would copy it).
        Without a cache, `positions` defaults to 0..T-1 and attention is causal over the T tokens.
        """
        cfg = self.config
        hidden = self.embed(tokens)
        inputs = None if self.layer_inputs is None else self.layer_inputs(tokens, hidden)  # [B, T, L, ...]
        b, t = tokens.shape
        positions = token_positions(tokens, cache, positions)
        cos, sin = self.rotary(positions)
        plan = Capture(capture, cfg.num_layers)
        buffer = plan.buffer(b, t, cfg.hidden_size, self.dtype)
        if self.direct:
            layer_xs = (jnp.arange(cfg.num_layers, dtype=jnp.int32),
                        jnp.asarray(cfg.layer_windows, jnp.int32), jnp.asarray(plan.slots),
                        *(() if inputs is None else (jnp.moveaxis(inputs, 2, 0),)))
            (hidden, buffer), pending = self._run_layers((hidden, buffer), layer_xs, positions, cos, sin, cache)
        else:
            (hidden, buffer), pending = self._run_segments((hidden, buffer), plan, positions, cos, sin, cache,
                                                           inputs)
        hidden = self.norm(hidden)
        features = plan.features(hidden, buffer)
        if cache is None:
            return hidden, features, None
        if not write_cache:
            return hidden, features, pending
        return hidden, features, cache.commit(pending, t if num_new is None else num_new)

    def _run_segments(self, carry, plan: Capture, positions, cos, sin, cache, inputs=None):
        """Each segment's scan in turn -> (carry, pending): the attention layers' new (k, v) [La, B, T, ...]
        per KV group, in the form the cache's `commit` takes (`Cache.pending_kv`: one (k, v) for a cache of
        one group, a tuple of them for a GroupedKVCache), plus, where the cache holds stateful layers'
        state, their pending inputs [Ls, B, T, ...]; None without a cache."""
        cfg = self.config
        kv_cache = None if cache is None else cache.attention_cache  # the `Cache` protocol's named parts
        states = {} if cache is None else cache.layer_states  # the stateful layers' state, by name
        stateful = cfg.family.stateful_mixers
        kinds = [mixer for mixer, _ in cfg.layer_kinds]
        group_of = {i: g for g, (_, ids) in enumerate(cfg.kv_groups) for i in ids}  # layer -> its KV group
        kv, linear = [[] for _ in cfg.kv_groups], []
        join = lambda parts: (None if not parts else parts[0] if len(parts) == 1  # noqa: E731
                              else jax.tree_util.tree_map(lambda *x: jnp.concatenate(x), *parts))
        for segment, scan in zip(self.segments, self.stack):
            mixers = [mixer for mixer, _ in segment.pattern]
            per_linear = sum(m in stateful for m in mixers)
            linear_start = sum(k in stateful for k in kinds[:segment.start])
            # per KV group, the index there of each repeat's first layer of that group [repeats, G]
            kv_base = jnp.stack([sum(group_of.get(i) == g for i in range(segment.start))
                                 + sum(group_of.get(i) == g for i in range(segment.start, segment.start + len(mixers)))
                                 * jnp.arange(segment.repeats, dtype=jnp.int32)
                                 for g in range(len(cfg.kv_groups))]
                                or [jnp.zeros((segment.repeats,), jnp.int32)],  # no attention layer: a dummy
                                axis=-1).astype(jnp.int32)
            slots = jnp.asarray(plan.slots[segment.start:segment.stop].reshape(segment.repeats, -1))
            windows = jnp.asarray(cfg.layer_windows[segment.start:segment.stop], jnp.int32).reshape(segment.repeats, -1)
            per_repeat = lambda x: x[linear_start:linear_start + segment.repeats * per_linear].reshape(  # noqa: E731
                segment.repeats, per_linear, *x.shape[1:])
            own = None if inputs is None else jnp.moveaxis(inputs[:, :, segment.start:segment.stop], 2, 0).reshape(
                segment.repeats, len(mixers), *inputs.shape[:2], *inputs.shape[3:])
            segment_states = {name: per_repeat(x) for name, x in states.items()} if states and per_linear else None
            xs = LayerInputs(kv_base, slots, windows, segment_states, own)
            readers = any(m not in stateful and cfg.family.kv_shape(cfg, m) is None for m in mixers)
            shared = tuple(join(group) for group in kv) if readers else None
            carry, (seg_kv, seg_linear) = scan(carry, xs, positions, cos, sin, kv_cache, shared)
            flat = lambda tree: jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), tree)  # noqa: E731
            for g, group in enumerate(seg_kv):
                if group is not None:
                    kv[g].append(flat(group))
            if seg_linear is not None:
                linear.append(flat(seg_linear))
        if kv_cache is not None and len(self.segments) > 1:
            kv = after(kv, carry[0])  # the new keys written after the last segment's reads of the cache
        if kv_cache is None:
            return carry, None
        pending = kv_cache.pending_kv([join(group) for group in kv])  # the cache's own form (per KV group)
        if states:  # a cache with stateful layers: their pending inputs too (its `commit`)
            return carry, (*pending, join(linear))
        return carry, pending

    def _make_layers(self):
        """All layers as one scanned module: params stacked [L, ...] under "layers"."""
        cfg = self.config
        self.layers = nn.scan(
            cfg.family.layer_module(cfg.layer_kinds[0][0]),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=self.config.num_layers,
            # Flax's invariant check traces the layer body a second time, with partial evaluation,
            # to prove broadcast inputs constant (the layers take nothing broadcast but inputs, no
            # broadcast variables): skipping it halves the body's tracing, and the check misfires on
            # the Pallas cache read ("broadcasted variable has a data dependency on the scan body",
            # flax 0.12.10 / jax 0.11.2; tests/kernels/test_kernel_integration.py lowers that path for CUDA).
            # Without it the scanned layers' random initialisation from a seed differs from the
            # checked scan's.
            check_constancy_invariants=False,
        )(self.config, self.dtype, self.attn_impl, self.backend, self.kv_replicas)

    def _run_layers(self, carry, layer_xs, positions, cos, sin, cache):
        """The layers in turn: the scanned module, or the backend's own loop over the stacked params
        (with a cache, every layer's attention reads it inside the loop and the new rows are
        written after it, so XLA does not copy the cache to order the two)."""
        return run_layers(self, TargetLayer, "__call__", carry, layer_xs, positions, cos, sin, cache)

    def embed(self, tokens):
        """tokens [...] -> embeddings [..., D], times the family's embedding scale (in their dtype) where it has one."""
        embeds = backends.get(self.backend).embed(self, tokens)
        scale = self.config.family.embedding_scale(self.config)
        return embeds if scale is None else embeds * jnp.asarray(scale, embeds.dtype)

    def logits(self, hidden):
        """Final-normed hidden [..., D] -> float32 logits [..., V]: the target's distribution, softcapped
        (c * tanh(z / c)) where the config's final_logit_softcapping c > 0."""
        logits = backends.get(self.backend).logits(self, hidden)
        cap = self.config.final_logit_softcapping
        return logits if not cap else cap * jnp.tanh(logits / cap)


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """What a target computes, without its weights: config, compute dtype, attention
    implementation and the dtype its KV cache stores (None: the compute dtype; float16 under a
    float32 model halves the bytes a decode step reads from the cache, at float16's precision for
    keys and values). Static and hashable (a jit static argument and a compile-cache key); every
    function takes the params explicitly. kv_replicas, linear_groups: the tensor-parallel layout
    (`dflash_jax.sharding.spec_for_mesh` sets them for a mesh; 1, 1: one device's): each kv head
    repeated kv_replicas times in the attention and its cache, a hybrid's Gated DeltaNet q | k | v
    channels in linear_groups groups (its params regrouped to match: `sharding.place_params`)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    kv_cache_dtype: Any = None
    kv_replicas: int | tuple[int, ...] = 1  # one count, or one per kv group (`sharding.group_kv_replicas`)
    linear_groups: int = 1

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))  # float32, np.float32, "float32": one key
        object.__setattr__(self, "kv_cache_dtype", resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype))

    @property
    def module(self) -> nn.Module:
        return TargetModel(self.config, self.dtype, self.attn_impl, kv_replicas=self.kv_replicas,
                           linear_groups=self.linear_groups)

    def module_for(self, params) -> nn.Module:
        """The module that reads `params`, on the backend whose layout they are in
        (`backends.of_target_params`: their tag; stacked params are XLA's)."""
        return TargetModel(self.config, self.dtype, self.attn_impl, backends.of_target_params(params),
                           self.kv_replicas, self.linear_groups)

    def decode_params(self, params, backend: str = "auto", *, release: bool = False):
        """Stacked `params` in the layout `backend` decodes with ("auto": this process's,
        `backends.resolve`); params already in it are returned as they are. Run it outside jit.
        A target the backend's layout does not hold (`Backend.supports`: the CPU backend's holds
        no hybrid or MoE target) decodes from its stacked params (`backends.decode_backend`)."""
        return backends.get(backends.decode_backend(self.config, backend)).target_params(params, release=release)

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
        # a stateful layer's state (a hybrid's recurrence) must stop at each row's last token: every
        # chunk says how many of its tokens are the row's (the others leave the state unchanged); a KV
        # cache needs only the total, set at the end
        counted = bool(self.config.family.stateful_mixers)
        total = jnp.broadcast_to(jnp.asarray(t if num_new is None else num_new, jnp.int32), (b,))
        apply = lambda c, chunk, done: module.apply(
            {"params": params}, chunk, c, capture=capture,
            num_new=jnp.clip(total - done, 0, chunk.shape[1]) if counted else None)

        def step(c, xs):  # chunk [B, size]
            chunk, done = xs
            hidden, features, c = apply(c, chunk, done)
            return c, (hidden, features)

        chunks = tokens[:, : whole * size].reshape(b, whole, size).swapaxes(0, 1)
        cache, outputs = jax.lax.scan(step, cache, (chunks, jnp.arange(whole, dtype=jnp.int32) * size))
        hidden, features = jax.tree_util.tree_map(
            lambda x: x.swapaxes(0, 1).reshape(b, whole * size, *x.shape[3:]), outputs)
        if rest:
            hidden_rest, features_rest, cache = apply(cache, tokens[:, whole * size:], whole * size)
            hidden = jnp.concatenate([hidden, hidden_rest], axis=1)
            if features is not None:
                features = jnp.concatenate([features, features_rest], axis=1)
        return hidden, features, cache.with_lengths(start + jnp.asarray(t if num_new is None else num_new))

    def embed(self, params, tokens):
        return self.module_for(params).apply({"params": params}, tokens, method="embed")

    def logits(self, params, hidden):
        return self.module_for(params).apply({"params": params}, hidden, method="logits")

    def init_cache(self, batch: int, capacity: int):
        """An empty cache: the family's own (`Family.init_cache`: a hybrid's `HybridCache` of keys and
        values beside conv tails and delta-rule states, an MLA target's latent cache), else a KVCache
        (a GroupedKVCache where the attention layers differ in shape)."""
        own = self.config.family.init_cache(self.config, batch, capacity, self.kv_cache_dtype,
                                            kv_replicas=self.kv_replicas, groups=self.linear_groups)
        if own is not None:
            return own
        groups, cfg = self.config.kv_groups, self.config
        if len(groups) > 1:  # attention layers of different shapes (Gemma 4)
            return GroupedKVCache.for_model(cfg, batch, capacity, self.kv_cache_dtype, kv_replicas=self.kv_replicas)
        if groups and groups[0] != ((cfg.num_kv_heads, cfg.head_dim), tuple(range(cfg.num_layers))):
            (heads, dim), ids = groups[0]  # one group, not every layer's or not of the config's shape (Gemma 4)
            return KVCache.zeros(len(ids), batch, capacity, heads * self.kv_replicas, dim, self.kv_cache_dtype)
        return KVCache.for_model(self.config, batch, capacity, self.kv_cache_dtype, kv_replicas=self.kv_replicas)


@dataclasses.dataclass
class Target:
    """A loaded target: its weights and tokenizer beside the static description (`spec`).

    The pure functions (`forward`, `prefill`, `embed`, `logits`, `init_cache`, `module_for`) are the
    spec's, reachable from here for convenience; jitted code takes `spec` and the params apart.
    Called outside a trace, `forward`, `prefill` and `logits` run compiled (one program per spec,
    options and argument shapes), as a notebook wants them.
    """

    config: ModelConfig
    params: Any
    tokenizer: Any = None
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    kv_cache_dtype: Any = None  # None or "auto": dtype (see `TargetSpec`)
    # the jax.sharding.Mesh `params` are placed on (`load_target(..., mesh=...)`; rules:
    # `dflash_jax.sharding`), None for one device. Not part of `spec`: a program's shardings are the
    # Generator's, and the same spec compiles for any mesh.
    mesh: Any = None

    def __repr__(self) -> str:
        """What the target is, in one line (its params and tokenizer are not printed)."""
        c = self.config
        layout = None if self.params is None else {v: k for k, v in backends.LAYOUTS.items()}.get(
            backends.of_target_params(self.params))
        mesh = None if self.mesh is None else dict(self.mesh.shape)
        return (f"Target({c.arch}, {c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}, "
                f"dtype {jnp.dtype(self.dtype).name}, params {layout or 'none'}, "
                f"tokenizer {'yes' if self.tokenizer is not None else 'none'}, mesh {mesh})")

    @property
    def spec(self) -> TargetSpec:
        return TargetSpec(self.config, self.dtype, self.attn_impl, self.kv_cache_dtype)

    module = property(lambda self: self.spec.module_for(self.params),
                      doc="The Flax module that reads `params`, on the backend of their layout (`module_for`).")
    module_for = on_spec("module_for")
    embed = on_spec("embed")
    init_cache = on_spec("init_cache")

    def forward(self, params, tokens, cache=None, **options):
        """`TargetSpec.forward`, compiled when called outside a trace (`_compiled`)."""
        return self._compiled("forward", params, tokens, cache, **options)

    def prefill(self, params, tokens, cache, **options):
        """`TargetSpec.prefill`, compiled when called outside a trace (`_compiled`)."""
        return self._compiled("prefill", params, tokens, cache, **options)

    def logits(self, params, hidden):
        """`TargetSpec.logits`, compiled when called outside a trace (`_compiled`)."""
        return self._compiled("logits", params, hidden)

    def _compiled(self, name: str, params, *args, **options):
        """The spec's `name` as one jitted program (kept per spec, options and argument shapes) when
        no argument is traced: run eagerly, every operation would be dispatched alone and every
        layer scan compiled anew on each call. Inside a trace (jit, grad, vmap) the spec's function
        as it is. A cache's room is checked first, while its lengths are concrete."""
        spec = self.spec
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((params, args, options))):
            return getattr(spec, name)(params, *args, **options)
        if name != "logits":
            tokens, cache = jnp.asarray(args[0]), args[1]
            args = (tokens, cache)
            if cache is not None:
                check_fits(cache, tokens.shape[1])
        if "capture" in options:
            options["capture"] = tuple(int(i) for i in options["capture"])
        return _COMPILED[name](spec, params, *args, **options)

    @property
    def decode_activations(self) -> str:
        """How the decode's products round activations: "int8" for a GGUF target loaded with
        `load_target(..., decode_activations="int8")`, else "float32"."""
        return backends.get(backends.of_target_params(self.params)).activations(self.params)


def _spec_call(name: str):
    def run(spec, params, *args, **options):
        return getattr(spec, name)(params, *args, **options)
    return run


# `Target._compiled`'s programs: the spec static, and the options that pick code paths
_COMPILED = {name: jax.jit(_spec_call(name), static_argnums=0,
                           static_argnames=("capture", "write_cache", "chunk_size"))
             for name in ("forward", "prefill", "logits")}


def after(tree, value):
    """`tree` (arrays) plus an exact zero computed from `value` (0 * isfinite(one element)): the same numbers,
    which XLA can compute only after `value`. The new keys of a stack of several segments come out so, tied to
    the final hidden state: XLA then writes them into the cache after every segment has read it, in place.
    Free to write a segment's keys as soon as they are known, it copied the whole cache in every step to keep
    the old rows for a later segment's reads (seen on CPU, jax 0.10, 2026-12-06: Gemma 4's kv-shared layers
    and its short stacks of sliding and full layers, a Qwen3-MoE with `mlp_only_layers`). An optimization
    barrier did not survive to XLA's copy insertion."""
    zero = jnp.isfinite(value.reshape(-1)[0]).astype(jnp.float32) * 0.0
    return jax.tree_util.tree_map(lambda x: x + zero.astype(x.dtype), tree)


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
