"""Gemma 4 (`Gemma4ForCausalLM`, and the text model of `Gemma4ForConditionalGeneration`; transformers
`gemma4`): the family and its layers.

Sliding and full attention layers (`layer_types`) of different shapes: the full layers have their own
head size and kv-head count (`global_head_dim`, `num_global_key_value_heads`, or a saved config's
`per_layer_config`), their own RoPE ("proportional": the first `partial_rotary_factor` of each head's
frequency pairs rotate, with frequencies over the whole head, the rest pass), and with
`attention_k_eq_v` no v_proj (the values are the key projection before its norm and RoPE). Queries and
keys are RMS-normed per head, values normed without a scale; the attention is unscaled (scale 1). The
MLP is GeGLU (gelu_pytorch_tanh); each layer has sandwich norms (before and after the attention and the
feed-forward) and ends multiplied by its `layer_scalar`. The embedding is scaled by sqrt(hidden) (in
the embedding's dtype) and the logits softcapped (`final_logit_softcapping`), in `Target.logits`, so
that greedy decoding, sampling and acceptance all see the softcapped distribution.

The sliding and full layers are distinct layer kinds ("sliding_attention", "full_attention"), so the
stack (`dflash_jax.models.stack`) scans them in separate positions of its pattern, and their keys and values
sit in a `GroupedKVCache` (one `KVCache` per shape) where the shapes differ. On a tensor axis larger than a
kind's kv heads, that kind's heads are copied (`sharding.group_kv_replicas`: gemma-4-31B on tensor=8 splits the
sliding layers' 16 kv heads and copies each of the full layers' 4 twice), in its layers and its cache group.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.layers.attention import causal_attention
from dflash_jax.models.cache import GroupedKVCache
from dflash_jax.models.config import _freeze, ConfigFields, ModelConfig, MoEConfig
from dflash_jax.layers.common import RMSNorm, apply_rotary, capture_into, make_dense, rms_normalize, rope_frequencies, \
    rotary_cos_sin
from dflash_jax.families import register
from dflash_jax.families.base import Family
from dflash_jax.formats.names import _linear_rules, Rule
from dflash_jax.layers.moe import grouped_experts
from dflash_jax.sharding import declare_param_axes, replicas_of_group

log = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"
KV_SHARED = "_kv_shared"  # a mixer's suffix: a layer that reads an earlier layer's keys and values
# What a Gemma 4 multimodal checkpoint carries beside its text model: not read (a note says how many).
UNUSED = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
# Gemma4TextConfig's defaults where a config.json is silent (the released configs state them)
DEFAULTS = {"head_dim": 256, "sliding_window": 512, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
            "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0,
            "eos_token_id": 1, "bos_token_id": 2, "hidden_size_per_layer_input": 256,
            "vocab_size_per_layer_input": 262144}
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}


@dataclasses.dataclass(frozen=True)
class Gemma4Options:
    """What only a Gemma 4 config has (`ModelConfig.family_options`; the sliding layers' shapes and RoPE are
    ModelConfig's head_dim, num_kv_heads, rope_theta and rope_scaling): the full layers' head size, kv
    heads and RoPE (theta and the frozen rope dict: rope_type, partial_rotary_factor, factor), whether
    their keys and values share one projection (`attention_k_eq_v`), the width of the per-layer inputs
    (`hidden_size_per_layer_input`, 0: none) and the size of their table, and the layers at the end that
    read an earlier layer's keys and values (`num_kv_shared_layers`), whose MLP is twice as wide where
    `use_double_wide_mlp`."""

    global_head_dim: int
    global_kv_heads: int
    global_rope_theta: float = 1000000.0
    global_rope: tuple = (("partial_rotary_factor", 0.25), ("rope_type", "proportional"))
    attention_k_eq_v: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False

    def __post_init__(self):
        for name in ("global_head_dim", "global_kv_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "num_kv_shared_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        rope_type = dict(self.global_rope).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported full-attention rope type {rope_type!r}; supported: {ROPE_TYPES}")


def _options(config: ModelConfig) -> Gemma4Options:
    return config.family_options


def first_kv_shared_layer(config: ModelConfig) -> int:
    """The first of the last `num_kv_shared_layers` layers, which read an earlier layer's keys and values."""
    return config.num_layers - _options(config).num_kv_shared_layers


def kv_source(config: ModelConfig, kind: str) -> tuple[int, int]:
    """(KV group, index in it) of the layer whose keys and values the kv-shared layers of `kind` (SLIDING or
    FULL) read: the last layer of that type before the shared ones (transformers' "store" layer)."""
    producer = max(i for i, t in enumerate(config.layer_types[:first_kv_shared_layer(config)]) if t == kind)
    return next((g, ids.index(producer)) for g, (_, ids) in enumerate(config.kv_groups) if producer in ids)


def proportional_inv_freq(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """transformers' "proportional" RoPE: inverse frequencies [head_dim // 2], the first
    int(partial_rotary_factor * head_dim // 2) of them theta^(-2i / head_dim) (over the whole head), the
    rest 0 (those pairs do not rotate), all divided by `factor`."""
    angles = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
    rotated = 1.0 / theta ** (np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / head_dim)
    inv_freq = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)]).astype(np.float32)
    return inv_freq / np.float32(rope.get("factor", 1.0))


def layer_rotary(config: ModelConfig, full: bool):
    """(inverse frequencies, cos/sin scale) of a sliding or a full layer's RoPE."""
    if not full:
        return rope_frequencies(config.head_dim, config.rope_theta, config.rope, config.max_position_embeddings)
    opts = _options(config)
    rope = dict(opts.global_rope)
    if rope.get("rope_type", "default") == "proportional":
        return proportional_inv_freq(opts.global_head_dim, opts.global_rope_theta, rope), 1.0
    return rope_frequencies(opts.global_head_dim, opts.global_rope_theta, rope, config.max_position_embeddings)


# ---------------------------------------------------------------------------------------------
# The layers


def gelu_tanh(x):
    """gelu_pytorch_tanh."""
    return jax.nn.gelu(x, approximate=True)


class GeGLU(nn.Module):
    """Gemma's MLP: down(gelu_tanh(gate(x)) * up(x))."""

    intermediate_size: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        dense = lambda n, name: make_dense(n, False, self.dtype, name=name)  # noqa: E731
        n = self.intermediate_size
        return dense(x.shape[-1], "down_proj")(gelu_tanh(dense(n, "gate_proj")(x)) * dense(n, "up_proj")(x))


class Gemma4Router(nn.Module):
    """Gemma 4's router (`Gemma4TextRouter`): x [N, D] -> (weights [N, k] float32, expert ids [N, k]). The
    RMS-normed x (no weight of its own) times `scale` [D] and D^-0.5, projected to the experts' logits
    ("proj"); the top k of their softmax (float32), renormalised to sum to 1, each times its expert's
    `per_expert_scale`."""

    num_experts: int
    top_k: int
    eps: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,), self.dtype)
        per_expert = self.param("per_expert_scale", nn.initializers.ones, (self.num_experts,), self.dtype)
        normed = rms_normalize(x, self.eps).astype(x.dtype) * scale.astype(x.dtype) * d ** -0.5
        logits = nn.Dense(self.num_experts, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                          name="proj")(normed)
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), self.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * per_expert.astype(jnp.float32)[experts], experts


class Gemma4Experts(nn.Module):
    """Gemma 4's experts (`Gemma4TextExperts`): gate_up_proj [E, D, 2I] (each expert's gate columns, then its
    up columns: the checkpoint's [E, 2I, D] with its last two axes swapped) and down_proj [E, I, D]; GeGLU
    experts, run as `dflash_jax.layers.moe.grouped_experts` (x [N, D], weights and expert ids [N, k] -> [N, D])."""

    num_experts: int
    intermediate_size: int
    dtype: Any = jnp.float32
    backend: str = "xla"

    @nn.compact
    def __call__(self, x, weights, experts):
        e, i, d = self.num_experts, self.intermediate_size, x.shape[-1]
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        gate_up = self.param("gate_up_proj", init, (e, d, 2 * i), self.dtype)
        down = self.param("down_proj", init, (e, i, d), self.dtype)
        return grouped_experts(x, experts, weights.astype(x.dtype), gate_up[..., :i], gate_up[..., i:], down,
                               activation=lambda gate, up: gelu_tanh(gate) * up, backend=self.backend)


class Gemma4Attention(nn.Module):
    """One layer's attention: q/k/v projections (no v_proj on a full layer with `attention_k_eq_v`: the values
    are the key projection), per-head RMSNorm of queries and keys (with scales) and of values (without),
    RoPE of the layer's kind on queries and keys, unscaled attention (scale 1) over the layer's window.
    -> (output [B, T, D], the new (k, v) [B, T, Hkv, Dh] in the cache's dtype, or None without a cache and
    without kv-shared layers to read them).

    kv_shared: a layer with no keys of its own (q_proj, q_norm and o_proj only): `cache` is (the whole KV
    cache | None, the new (k, v) per KV group of the layers before it) and it attends over its source's
    (`kv_source`) cached and new keys."""

    config: ModelConfig
    full: bool
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    backend: str = "xla"
    kv_shared: bool = False
    kv_replicas: int = 1  # sharding: copies of each of this layer's kv heads (`sharding.group_kv_replicas`)

    @nn.compact
    def __call__(self, x, positions, window, cache, layer):
        cfg, opts = self.config, _options(self.config)
        h = cfg.num_heads
        hkv, d = (opts.global_kv_heads, opts.global_head_dim) if self.full else (cfg.num_kv_heads, cfg.head_dim)
        b, t, _ = x.shape
        dense = lambda n, name: make_dense(n, cfg.attention_bias, self.dtype, self.backend, name=name)  # noqa: E731
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, True, name=name)  # noqa: E731
        inv_freq, scale = layer_rotary(cfg, self.full)
        cos, sin = rotary_cos_sin(positions, inv_freq, scale)
        q = apply_rotary(norm("q_norm")(dense(h * d, "q_proj")(x).reshape(b, t, h, d)), cos, sin)
        out = lambda attended: dense(cfg.hidden_size, "o_proj")(attended.reshape(b, t, h * d))  # noqa: E731
        attend = lambda k, v, cache, layer: causal_attention(  # noqa: E731
            q, k, v, positions, window, cache, layer, scale=1.0, impl=self.attn_impl, backend=self.backend)
        if self.kv_shared:
            (whole, shared), (g, layer) = cache, kv_source(cfg, FULL if self.full else SLIDING)
            source = whole.groups[g] if isinstance(whole, GroupedKVCache) else whole
            return out(attend(shared[g][0][layer], shared[g][1][layer], source, layer)[0]), None
        raw_k = dense(hkv * d, "k_proj")(x).reshape(b, t, hkv, d)
        raw_v = raw_k if self.full and opts.attention_k_eq_v else dense(hkv * d, "v_proj")(x).reshape(b, t, hkv, d)
        k = apply_rotary(norm("k_norm")(raw_k), cos, sin)
        v = rms_normalize(raw_v, cfg.rms_norm_eps).astype(raw_v.dtype)
        if self.kv_replicas > 1:  # sharding: kv-head replication, the copies of a head side by side
            k, v = jnp.repeat(k, self.kv_replicas, axis=2), jnp.repeat(v, self.kv_replicas, axis=2)
        attended, new = attend(k, v, cache, layer)
        # without a cache the new keys are wanted only by the kv-shared layers
        return out(attended), (new if cache is not None or opts.num_kv_shared_layers else None)


class Gemma4Layer(nn.Module):
    """One Gemma 4 decoder layer (transformers' `Gemma4TextDecoderLayer`), called as every layer of the stack
    is (`dflash_jax.models.target.TargetLayer`): carry (hidden, features | None), xs (KV-cache layer index in its
    group, window, capture slot, and with per-layer inputs its own [B, T, P]), broadcast positions, cos, sin
    (unused: the layer's kind has its own RoPE) and its group's KV cache | None (a kv-shared layer's:
    `Gemma4Attention`). ys: the new (k, v), None without a cache.

    h += post_attention_norm(attention(input_norm(h))); h += post_feedforward_norm(mlp(pre_feedforward_norm(h)));
    with the MoE block (mlp "moe"), the MLP's part is post_feedforward_norm_1(mlp(...)) plus
    post_feedforward_norm_2(experts(pre_feedforward_norm_2(h), router(h))), both from the h before them; with
    per-layer inputs, h += post_per_layer_input_norm(per_layer_projection(gelu_tanh(per_layer_input_gate(h))
    * its input)); h *= layer_scalar."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attn_impl: str = "auto"
    backend: str = "xla"
    # sharding: copies of each kv head, one count or one per kv group (`sharding.group_kv_replicas`)
    kv_replicas: int | tuple[int, ...] = 1
    mixer: str = "auto"  # `Gemma4.layer_mixer`'s; "auto": the first layer's (a stack of identical layers)
    mlp: str = "auto"  # "dense" | "moe"; "auto": the first layer's

    @nn.compact
    def __call__(self, carry, layer_xs, positions, cos, sin, cache):
        cfg = self.config
        opts = _options(cfg)
        hidden, features = carry
        layer, window, slot, *own = layer_xs
        mixer, mlp_kind = (cfg.layer_kinds[0][i] if kind == "auto" else kind for i, kind in enumerate((self.mixer,
                                                                                                       self.mlp)))
        kv_shared = mixer.endswith(KV_SHARED)
        full = mixer.removesuffix(KV_SHARED) == FULL
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, True, name=name)  # noqa: E731
        dense = lambda n, name: make_dense(n, False, self.dtype, self.backend, name=name)  # noqa: E731
        shape = None if kv_shared else self.config.family.kv_shape(cfg, mixer)
        group = next((g for g, (s, _) in enumerate(cfg.kv_groups) if s == shape), 0)
        attention = Gemma4Attention(cfg, full, self.dtype, self.attn_impl, self.backend, kv_shared,
                                    replicas_of_group(self.kv_replicas, group), name="self_attn")
        attended, new = attention(norm("input_layernorm")(hidden), positions, window, cache, layer)
        hidden = hidden + norm("post_attention_layernorm")(attended)
        x = norm("pre_feedforward_layernorm")(hidden)
        width = cfg.intermediate_size * (2 if kv_shared and opts.double_wide_mlp else 1)
        mlp = GeGLU(width, self.dtype, name="mlp")(x)
        if mlp_kind == "moe":
            moe, flat = cfg.moe, hidden.reshape(-1, hidden.shape[-1])
            weights, experts = Gemma4Router(moe.num_experts, moe.num_experts_per_tok, cfg.rms_norm_eps, self.dtype,
                                            name="router")(flat)
            routed = Gemma4Experts(moe.num_experts, moe.intermediate_size, self.dtype, self.backend, name="experts")(
                norm("pre_feedforward_layernorm_2")(flat), weights, experts).reshape(hidden.shape)
            mlp = norm("post_feedforward_layernorm_1")(mlp) + norm("post_feedforward_layernorm_2")(routed)
        hidden = hidden + norm("post_feedforward_layernorm")(mlp)
        if opts.hidden_size_per_layer_input:
            gate = gelu_tanh(dense(opts.hidden_size_per_layer_input, "per_layer_input_gate")(hidden)) * own[0]
            hidden = hidden + norm("post_per_layer_input_norm")(dense(cfg.hidden_size, "per_layer_projection")(gate))
        scalar = self.param("layer_scalar", nn.initializers.ones, (1,), self.dtype)
        hidden = hidden * scalar.astype(hidden.dtype)
        return (hidden, capture_into(features, slot, hidden)), new


class PerLayerInputs(nn.Module):
    """Gemma 4's per-layer inputs: (tokens [B, T], their scaled embeddings [B, T, D]) -> [B, T, L, P], layer
    i's own input [..., i, :]: (norm(per_layer_model_projection(embeddings) / sqrt(D)) + the tokens' rows
    of embed_tokens_per_layer times sqrt(P)) / sqrt(2), each [L * P] row read as [L, P]."""

    config: ModelConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens, embeds):
        cfg, opts = self.config, _options(self.config)
        n, p = cfg.num_layers, opts.hidden_size_per_layer_input
        table = nn.Embed(opts.vocab_size_per_layer_input, n * p, dtype=self.dtype, param_dtype=self.dtype,
                         name="embed_tokens_per_layer")
        own = table(tokens)
        own = (own * jnp.asarray(p ** 0.5, own.dtype)).reshape(*tokens.shape, n, p)
        projected = make_dense(n * p, False, self.dtype, name="per_layer_model_projection")(embeds)
        projected = (projected * cfg.hidden_size ** -0.5).reshape(*tokens.shape, n, p)
        projected = RMSNorm(cfg.rms_norm_eps, self.dtype, True, name="per_layer_projection_norm")(projected)
        return (projected + own) * 2.0 ** -0.5


declare_param_axes({
    ("layer_scalar",): ("norm",),
    ("per_layer_input_gate", "kernel"): ("embed", "embed"), ("per_layer_projection", "kernel"): ("embed", "embed"),
    ("per_layer_model_projection", "kernel"): ("embed", "embed"),
    ("embed_tokens_per_layer", "embedding"): ("vocab", "embed"),
    # the MoE block: experts over `expert`, each whole (gate and up side by side in one tensor: no tensor split)
    ("router", "proj", "kernel"): ("embed", "router"), ("router", "per_expert_scale"): ("router",),
    ("experts", "gate_up_proj"): ("expert", "embed", "embed"), ("experts", "down_proj"): ("expert", "embed", "embed"),
})


# ---------------------------------------------------------------------------------------------
# The family


def _per_layer_shapes(fields: ConfigFields, layer_types, k_eq_v: bool) -> tuple[int, int]:
    """(head dim, kv heads) of the full layers: a saved config's `per_layer_config` (layer index -> the fields
    it overrides; transformers 5 writes it), else `global_head_dim` (512 where absent) and, with
    attention_k_eq_v, `num_global_key_value_heads` (else the sliding layers' kv heads), as
    Gemma4TextConfig decides."""
    heads = fields.int("num_key_value_heads", fields.int("num_attention_heads"))
    per_layer = fields.hf.get("per_layer_config")
    if per_layer is None:
        global_heads = fields.int("num_global_key_value_heads", None) if k_eq_v else None
        return fields.int("global_head_dim", 512), heads if global_heads is None else global_heads
    if not isinstance(per_layer, dict):
        raise fields.error(f"field 'per_layer_config' must be an object, got {per_layer!r}")
    head_dim = fields.int("head_dim")
    shapes = {}
    for key, override in per_layer.items():
        if not str(key).isdigit() or not 0 <= int(key) < len(layer_types) or not isinstance(override, dict):
            raise fields.error(f"per_layer_config entry {key!r}: expected a layer index and an object")
        unknown = sorted(set(override) - {"head_dim", "num_key_value_heads"})
        if unknown:
            raise fields.error(f"per_layer_config[{key}] overrides {unknown}, which gemma4 does not support "
                               "(head_dim and num_key_value_heads only)")
        shapes[int(key)] = (override.get("head_dim", head_dim), override.get("num_key_value_heads", heads))
    full = {shapes.get(i, (head_dim, heads)) for i, t in enumerate(layer_types) if t == FULL}
    sliding = {shapes.get(i, (head_dim, heads)) for i, t in enumerate(layer_types) if t != FULL}
    if len(full) > 1 or sliding - {(head_dim, heads)}:
        raise fields.error("per_layer_config: gemma4 needs every full layer of one shape and the sliding layers of "
                           f"the top-level head_dim and num_key_value_heads; got full {sorted(full)}, sliding "
                           f"{sorted(sliding)}")
    return next(iter(full)) if full else (head_dim, heads)


class Gemma4(Family):
    name = "gemma4"
    hf_classes = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")  # the latter: its text model
    model_types = ("gemma4_text", "gemma4")
    qk_norm = True
    norm_scale_in_float32 = True  # Gemma4RMSNorm scales in float32
    default_max_positions = 131072
    checkpoint_prefixes = ("model.language_model.", "model.")
    plain_layers = False  # `Gemma4Layer`

    def config_fields(self, fields: ConfigFields) -> ConfigFields:
        """The text model's fields (a multimodal config's `text_config`, the top level's token ids and tie where
        it has none), Gemma4TextConfig's defaults where they are absent (`DEFAULTS`; a null
        hidden_size_per_layer_input is none, as there; layer_types: five
        sliding layers to one full, the last always full), and the sliding layers' RoPE as the config's
        `rope_parameters` (the full layers' under `full_attention_rope_parameters`)."""
        hf, prefix = fields.hf, ""
        text = hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf
        off = {k: 0 for k in ("hidden_size_per_layer_input",) if k in text and text[k] is None}  # null: none
        if text is not hf:
            top = {k: v for k, v in hf.items() if k in ("tie_word_embeddings", "eos_token_id", "bos_token_id",
                                                         "pad_token_id") and v is not None}
            hf, prefix = {**top, **{k: v for k, v in text.items() if v is not None}}, "text_config."
        hf = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}, **off}
        layers = hf.get("num_hidden_layers")
        if hf.get("layer_types") is None and isinstance(layers, int):
            hf["layer_types"] = [SLIDING if (i + 1) % 6 and i < layers - 1 else FULL for i in range(layers)]
        if isinstance(hf.get("layer_types"), list) and hf["layer_types"] and hf["layer_types"][-1] != FULL:
            log.warning("%s: gemma4's last layer is always full attention (as transformers forces it)", fields.source)
            hf["layer_types"] = [*hf["layer_types"][:-1], FULL]
        rope = hf.get("rope_parameters") or DEFAULT_ROPE
        if hf.get("rope_scaling") is not None or not isinstance(rope, dict) or set(rope) - {SLIDING, FULL}:
            raise fields.error("gemma4 reads rope_parameters per layer type ({'sliding_attention': {...}, "
                               f"'full_attention': {{...}}}}), got {rope!r}")
        hf["rope_parameters"] = rope.get(SLIDING, DEFAULT_ROPE[SLIDING])
        hf["full_attention_rope_parameters"] = rope.get(FULL, DEFAULT_ROPE[FULL])
        hf.pop("rope_theta", None)
        return ConfigFields(hf, fields.source, prefix)

    def family_fields(self, fields: ConfigFields) -> dict:
        activation = fields.hf.get("hidden_activation", fields.hf.get("hidden_act"))
        if activation != "gelu_pytorch_tanh":
            raise fields.error(f"gemma4: hidden_activation {activation!r} is not supported (gelu_pytorch_tanh is)")
        if fields.hf.get("use_bidirectional_attention") == "all":
            raise fields.error("gemma4: use_bidirectional_attention 'all' (bidirectional text) is not supported")
        full_rope = fields.section("full_attention_rope_parameters")
        rope = dict(full_rope.hf)
        theta = rope.pop("rope_theta", 1000000.0)
        rope.setdefault("rope_type", "default")
        k_eq_v = fields.bool("attention_k_eq_v", False)
        head_dim, kv_heads = _per_layer_shapes(fields, fields.hf.get("layer_types") or (), k_eq_v)
        options = fields.build(
            Gemma4Options, global_head_dim=head_dim, global_kv_heads=kv_heads, global_rope_theta=float(theta),
            global_rope=_freeze(rope), attention_k_eq_v=k_eq_v,
            hidden_size_per_layer_input=fields.int("hidden_size_per_layer_input", 0),
            vocab_size_per_layer_input=fields.int("vocab_size_per_layer_input", 0),
            num_kv_shared_layers=fields.int("num_kv_shared_layers", 0),
            double_wide_mlp=fields.bool("use_double_wide_mlp", False))
        out = dict(family_options=options, final_logit_softcapping=fields.float("final_logit_softcapping", 0.0))
        if fields.bool("enable_moe_block", False):  # every layer: the dense MLP and the MoE block beside it
            # Gemma4TextRouter: the top k of the softmax, renormalised (and its own norm, scales: `Gemma4Router`)
            out["moe"] = fields.build(MoEConfig, num_experts=fields.int("num_experts"),
                                      num_experts_per_tok=fields.int("top_k_experts"),
                                      intermediate_size=fields.int("moe_intermediate_size"), norm_topk_prob=True)
        return out

    def validate(self, config):
        super().validate(config)
        opts = config.family_options
        if not isinstance(opts, Gemma4Options):
            raise ValueError("a gemma4 target needs its Gemma4Options (family_options=)")
        if config.attention_sinks or config.linear is not None:
            raise ValueError("a gemma4 target has no attention sinks or linear attention")
        moe = config.moe
        if moe is not None and (moe.router != "softmax_topk" or not moe.norm_topk_prob or moe.router_bias
                                or moe.expert_bias or moe.swiglu_limit or moe.shared_expert_intermediate_size
                                or moe.dense_layers):
            raise ValueError("a gemma4 MoE block is in every layer, routed by the renormalised top k of the softmax "
                             "(`Gemma4Router`), without biases, a shared expert or a clamped SwiGLU")
        if config.mlp_bias:
            raise ValueError("a gemma4 MLP has no biases")
        if opts.hidden_size_per_layer_input and not opts.vocab_size_per_layer_input:
            raise ValueError("gemma4: per-layer inputs need vocab_size_per_layer_input > 0")
        if opts.num_kv_shared_layers:
            first = first_kv_shared_layer(config)
            if first <= 0:
                raise ValueError(f"gemma4: num_kv_shared_layers ({opts.num_kv_shared_layers}) must leave layers that "
                                 f"keep keys of their own ({config.num_layers} layers)")
            if set(config.layer_types[first:]) - set(config.layer_types[:first]):
                raise ValueError("gemma4: every layer type among the kv-shared layers needs a layer of its type "
                                 "before them (whose keys they read)")
        for mixer in (SLIDING, FULL):
            heads, _ = self.kv_shape(config, mixer)
            if config.num_heads % heads:
                raise ValueError(f"gemma4 {mixer} layers: query heads ({config.num_heads}) must be a multiple of "
                                 f"kv heads ({heads})")
        rope = dict(opts.global_rope)
        if rope.get("rope_type") != "proportional" and rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("gemma4: a full layer's partial_rotary_factor is read with the proportional rope only, "
                             f"not with {rope.get('rope_type')!r}")

    def layer_mixer(self, config, layer, layer_type):
        """"sliding_attention" | "full_attention" (layers of different shapes and RoPE), with `KV_SHARED`
        appended for the last `num_kv_shared_layers` layers."""
        return layer_type + (KV_SHARED if layer >= first_kv_shared_layer(config) else "")

    def kv_shape(self, config, mixer):
        if mixer.endswith(KV_SHARED):
            return None
        if mixer == FULL:
            opts = _options(config)
            return opts.global_kv_heads, opts.global_head_dim
        return config.num_kv_heads, config.head_dim

    def embedding_scale(self, config):
        return config.hidden_size ** 0.5

    def layer_inputs(self, config, dtype):
        return PerLayerInputs(config, dtype) if _options(config).hidden_size_per_layer_input else None

    def layer_module(self, mixer: str):
        return Gemma4Layer

    def target_rules(self, config, prefix="model."):
        """The common table and, with per-layer inputs, their model-level weights."""
        rules = super().target_rules(config, prefix)
        if _options(config).hidden_size_per_layer_input:
            own = ("layer_inputs",)
            rules += [Rule(f"{prefix}embed_tokens_per_layer.weight", (*own, "embed_tokens_per_layer", "embedding")),
                      Rule(f"{prefix}per_layer_model_projection.weight", (*own, "per_layer_model_projection", "kernel"),
                           transpose=True),
                      Rule(f"{prefix}per_layer_projection_norm.weight", (*own, "per_layer_projection_norm", "scale"))]
        return rules

    def mixer_rules(self, config, mixer, hf, path, ids):
        """The attention (no v_proj on a full layer with attention_k_eq_v; q/k norms, the value norm has no
        weight; a kv-shared layer's q_proj, q_norm and o_proj only) and the layer's own weights beside it: its
        pre/post feed-forward norms, its per-layer input's gate, projection and norm, and `layer_scalar`."""
        attn, opts = (*path, "self_attn"), _options(config)
        if mixer.endswith(KV_SHARED):
            names, norms = ("q_proj", "o_proj"), ("q_norm",)
        else:
            names = ("q_proj", "k_proj", "o_proj") if mixer == FULL and opts.attention_k_eq_v else \
                ("q_proj", "k_proj", "v_proj", "o_proj")
            norms = ("q_norm", "k_norm")
        own_norms = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        rules = (_linear_rules(f"{hf}.self_attn", attn, names, config.attention_bias, ids)
                 + [Rule(f"{hf}.self_attn.{n}.weight", (*attn, n, "scale"), layer_ids=ids) for n in norms])
        if opts.hidden_size_per_layer_input:
            rules += _linear_rules(hf, path, ("per_layer_input_gate", "per_layer_projection"), False, ids)
            own_norms += ("post_per_layer_input_norm",)
        return (rules + [Rule(f"{hf}.{n}.weight", (*path, n, "scale"), layer_ids=ids) for n in own_norms]
                + [Rule(f"{hf}.layer_scalar", (*path, "layer_scalar"), layer_ids=ids)])

    def mlp_rules(self, config, mlp, hf, path, ids):
        """The dense GeGLU and, with the MoE block, beside it (at the layer's level): the router's proj, scale and
        per_expert_scale, the fused experts (gate_up_proj [E, 2I, D] and down_proj [E, D, I], their last two
        axes swapped) and the block's three norms."""
        rules = _linear_rules(f"{hf}.mlp", path, ("gate_proj", "up_proj", "down_proj"), False, ids)
        if mlp != "moe":
            return rules
        layer = path[:-1]
        return rules + [
            Rule(f"{hf}.router.proj.weight", (*layer, "router", "proj", "kernel"), transpose=True, layer_ids=ids),
            Rule(f"{hf}.router.scale", (*layer, "router", "scale"), layer_ids=ids),
            Rule(f"{hf}.router.per_expert_scale", (*layer, "router", "per_expert_scale"), layer_ids=ids),
            Rule(f"{hf}.experts.gate_up_proj", (*layer, "experts", "gate_up_proj"), swap_last=True, layer_ids=ids),
            Rule(f"{hf}.experts.down_proj", (*layer, "experts", "down_proj"), swap_last=True, layer_ids=ids),
        ] + [Rule(f"{hf}.{n}.weight", (*layer, n, "scale"), layer_ids=ids)
             for n in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")]

    def adapt_tensors(self, config, tensors, source):
        return tensors  # the experts are read fused, as released (`mlp_rules`)

    def unused_tensors(self, name: str) -> bool:
        return name.startswith(UNUSED)

    def allow_extra(self, config, tensors, source, prefix):
        """The towers of a multimodal checkpoint, and a kv-shared layer's own k/v projections and norms (which it
        does not use; transformers ignores them too)."""
        unused = sum(1 for n in tensors if n.startswith(UNUSED))
        if unused:
            log.info("%s: %d tensor(s) of the vision / audio towers are not read (text model only)", source, unused)
        shared = {f"{prefix}layers.{i}.self_attn.{n}.weight" for i in range(first_kv_shared_layer(config),
                                                                           config.num_layers)
                  for n in ("k_proj", "v_proj", "k_norm", "v_norm")}
        base = super().allow_extra(config, tensors, source, prefix)
        return lambda name: base(name) or name in shared


GEMMA4 = register(Gemma4())
