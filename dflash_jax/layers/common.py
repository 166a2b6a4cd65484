"""Building blocks shared by the target and the drafter: RMSNorm, rotary embedding, SwiGLU MLP and
attention projections. Their weight products come from the module's backend (`make_dense`)."""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import backends

Dtype = Any


def rms_normalize(x, eps: float):
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32 (every RMSNorm's core)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def token_positions(tokens, cache, positions=None):
    """The positions [B, T] of a forward's tokens: `positions` where given, else each row's next T
    after its cached length (0 .. T-1 without a cache)."""
    if positions is not None:
        return positions
    b, t = tokens.shape
    offsets = cache.lengths if cache is not None else jnp.zeros((b,), jnp.int32)
    return offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


class RMSNorm(nn.Module):
    """Hugging Face RMSNorm: normalise in float32, cast back, then scale; with scale_in_float32
    (gpt-oss's `GptOssRMSNorm`), scale in float32 and cast once (the same in float32, one rounding
    fewer in bfloat16)."""

    eps: float = 1e-6
    dtype: Dtype = jnp.float32
    scale_in_float32: bool = False

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        if self.scale_in_float32:
            return (scale.astype(jnp.float32) * rms_normalize(x, self.eps)).astype(x.dtype)
        return scale * rms_normalize(x, self.eps).astype(x.dtype)


def run_layers(model: nn.Module, layer_cls: type, method: str, carry, xs, *shared):
    """Every layer of a bound `model` (a TargetModel or DrafterModel: fields config, dtype,
    attn_impl, backend; its stacked layers under params["layers"], scanned by `model.layers`) runs
    `method`(carry, xs[i], *shared) in turn -> (carry, per-layer outputs stacked [L, ...]): the
    model's own `nn.scan`, or its backend's loop over the stacked params
    (`backends.base.Backend.layer_loop`), which reads a layout made from stacked params and so
    cannot initialise them."""
    loop = backends.get(model.backend).layer_loop
    if loop is None:
        return getattr(model.layers, method)(carry, xs, *shared)
    if model.is_initializing():
        raise TypeError(f"the {model.backend} backend's params are made from stacked ones "
                        f"(Backend.target_params / drafter_params); initialise {type(model).__name__} "
                        "with backend='xla'")
    layer = layer_cls(model.config, model.dtype, model.attn_impl, model.backend, model.kv_replicas, parent=None)
    return loop(layer, model.variables["params"]["layers"], carry, xs, *shared, method=method)


class Capture:
    """Which decoder-layer outputs a forward captures (`capture`: layer ids, Hugging Face's
    hidden_states[i + 1]). Hugging Face's entry for the last layer is the final-NORMED output; every
    other id is a raw decoder-layer output, written inside the layer loop into a buffer [B, T, n, D]
    once even when listed twice (`slots[i]`: layer i's place in it, -1 for none)."""

    def __init__(self, capture, num_layers: int):
        for layer in capture:
            if not 0 <= layer < num_layers:
                raise ValueError(f"capture layer {layer} out of range for {num_layers} layers")
        self.capture, self.last = tuple(capture), num_layers - 1
        inner = sorted({layer for layer in capture if layer != self.last})
        self.slots = np.full((num_layers,), -1, np.int32)
        self.slots[inner] = np.arange(len(inner))
        self.count = len(inner)

    def buffer(self, b: int, t: int, width: int, dtype):
        return jnp.zeros((b, t, self.count, width), dtype) if self.count else None

    def features(self, normed, buffer):
        """The captured features [B, T, len(capture) * D] (None when nothing is captured)."""
        if not self.capture:
            return None
        return jnp.concatenate([normed if layer == self.last else buffer[:, :, self.slots[layer]]
                                for layer in self.capture], axis=-1)


def capture_into(features, slot, hidden):
    """A capture buffer [B, T, n, D] with `hidden` written at `slot` (unchanged when slot < 0 or
    there is no buffer); inside the layer loop, slot is traced."""
    if features is None:
        return None
    index = jnp.maximum(slot, 0)
    current = jax.lax.dynamic_index_in_dim(features, index, axis=2, keepdims=False)
    update = jnp.where(slot >= 0, hidden.astype(features.dtype), current)
    return jax.lax.dynamic_update_index_in_dim(features, update, index, axis=2)


def make_dense(features: int, use_bias: bool, dtype: Dtype, backend: str = "xla", name: str | None = None):
    """The module of one weight product on `backend` (`backends.base.Backend.dense`): `nn.Dense`
    (kernel [in, out]) on XLA."""
    return backends.get(backend).dense(features, use_bias, dtype, name=name)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). fused: gate and up are one product ("gate_up_proj",
    their columns side by side: a backend's decode layout, `Backend.fuses`)."""

    intermediate_size: int
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    backend: str = "xla"  # whose products (`make_dense`)
    fused: bool = False

    @nn.compact
    def __call__(self, x):
        dense = lambda n, name: make_dense(n, self.use_bias, self.dtype, self.backend, name=name)
        n = self.intermediate_size
        if self.fused:
            gate_up = dense(2 * n, "gate_up_proj")(x)
            gate, up = gate_up[..., :n], gate_up[..., n:]
        else:
            gate, up = dense(n, "gate_proj")(x), dense(n, "up_proj")(x)
        return dense(x.shape[-1], "down_proj")(nn.silu(gate) * up)


def _yarn_inv_freq(head_dim: int, theta: float, rope: dict, max_pos: int) -> tuple[np.ndarray, float]:
    factor = rope["factor"]
    original = rope.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


def rope_frequencies(head_dim: int, theta: float, rope: dict, max_pos: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale, as Hugging Face computes them."""
    rope_type = rope.get("rope_type", "default")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / rope["factor"], 1.0
    if rope_type == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if rope_type == "yarn":
        inv_freq, scale = _yarn_inv_freq(head_dim, theta, rope, max_pos)
        return inv_freq.astype(np.float32), scale
    raise ValueError(f"unsupported rope type {rope_type!r}")


def rotary_cos_sin(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0):
    """cos, sin of shape [B, T, head_dim] (float32) for integer positions [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


class Rotary:
    """RoPE of one model config (fields head_dim, rope_theta, rope, max_position_embeddings; a
    `rotary_dim` where only the first dims of a head rotate, Qwen3.5): `rotary(positions [B, T])`
    -> cos, sin [B, T, rotary_dim]. Shared by the target and the drafter."""

    def __init__(self, config):
        dim = getattr(config, "rotary_dim", config.head_dim)
        inv_freq, self.scale = rope_frequencies(dim, config.rope_theta, config.rope,
                                                config.max_position_embeddings)
        self.inv_freq = np.asarray(inv_freq)

    def __call__(self, positions: jax.Array):
        return rotary_cos_sin(positions, self.inv_freq, self.scale)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, D] rotated half-by-half (Hugging Face layout); cos/sin [B, T, R]: the first R <= D
    dims rotate, the rest pass (partial rotary)."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return jnp.concatenate([apply_rotary(x[..., :r], cos, sin), x[..., r:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class AttentionProjections(nn.Module):
    """q/k/v/o projections with optional per-head q/k RMSNorm (Qwen3) and RoPE.

    Split into `queries`, `keys_values` and `output` so the drafter can apply the same k/v
    projections to the target context and to its own block.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool = False
    use_bias: bool = False
    eps: float = 1e-6
    dtype: Dtype = jnp.float32
    backend: str = "xla"  # whose products (`make_dense`)
    fused: bool = False  # q, k, v as one product ("qkv_proj": a backend's decode layout, `Backend.fuses`)
    attention_sinks: bool = False  # a learned logit per query head, "sinks" [num_heads] (gpt-oss)
    # sharding: each projected kv head repeated this many times (consecutive copies), for a tensor
    # axis larger than the kv heads (`dflash_jax.sharding`, kv-head replication)
    kv_replicas: int = 1

    def setup(self):
        dense = lambda n: make_dense(n, self.use_bias, self.dtype, self.backend)
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.fused:
            self.qkv_proj = dense(q_width + 2 * kv_width)
        else:
            self.q_proj = dense(q_width)
            self.k_proj = dense(kv_width)
            self.v_proj = dense(kv_width)
        self.o_proj = dense(self.hidden_size)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.eps, self.dtype)
            self.k_norm = RMSNorm(self.eps, self.dtype)
        if self.attention_sinks:
            self.sinks = self.param("sinks", nn.initializers.zeros, (self.num_heads,), self.dtype)

    def _heads(self, y, heads: int):
        return y.reshape(*y.shape[:-1], heads, self.head_dim)

    def _rotated_queries(self, q, cos, sin):
        q = self._heads(q, self.num_heads)
        return apply_rotary(self.q_norm(q) if self.qk_norm else q, cos, sin)

    def _rotated_keys(self, k, cos, sin):
        k = self._heads(k, self.num_kv_heads)
        return apply_rotary(self.k_norm(k) if self.qk_norm else k, cos, sin)

    def queries(self, x, cos, sin):
        return self._rotated_queries(self.q_proj(x), cos, sin)

    def _replicated(self, kv):
        return kv if self.kv_replicas == 1 else jnp.repeat(kv, self.kv_replicas, axis=2)  # sharding

    def keys_values(self, x, cos, sin):
        return (self._replicated(self._rotated_keys(self.k_proj(x), cos, sin)),
                self._replicated(self._heads(self.v_proj(x), self.num_kv_heads)))

    def queries_keys_values(self, x, cos, sin):
        """(queries, keys, values) of the same x: `queries` and `keys_values`, or, fused, one
        product whose columns are q | k | v."""
        if not self.fused:
            return (self.queries(x, cos, sin), *self.keys_values(x, cos, sin))
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)
        q, k, v = qkv[..., :q_width], qkv[..., q_width:q_width + kv_width], qkv[..., q_width + kv_width:]
        return (self._rotated_queries(q, cos, sin), self._replicated(self._rotated_keys(k, cos, sin)),
                self._replicated(self._heads(v, self.num_kv_heads)))

    def output(self, attended):
        """attended [B, T, H, D] -> [B, T, hidden]."""
        return self.o_proj(attended.reshape(*attended.shape[:-2], self.num_heads * self.head_dim))
