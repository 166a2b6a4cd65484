"""Frozen, hashable model configs built from Hugging Face `config.json` dictionaries."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

from dflash_jax._errors import ConfigError

LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
LINEAR = "linear_attention"
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MOE_ROUTERS = ("softmax_topk", "topk_softmax")  # Qwen3-MoE: top k of the softmax; gpt-oss: softmax of the top k
# DeepSeek-V3, GLM-4 MoE, MiniMax-M2: sigmoid scores, a correction bias for choosing, group-limited top k
MOE_ROUTERS += ("sigmoid_grouped",)
REQUIRED = object()  # ConfigFields default: the field must be present


def _freeze(value: Any) -> Any:
    """Dicts/lists -> sorted tuples so that configs stay hashable (usable as jit static args)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def read_json(path: str | Path) -> Any:
    """The parsed JSON of a file; ConfigError naming the file (and the position) when it is not JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason})") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e


def read_config_json(path: str | Path) -> dict:
    """config.json of a directory (or the file itself) as a dict."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    hf = read_json(path)
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    return hf


def write_config_json(directory: Path, hf: dict) -> None:
    """DIR/config.json, written to a temporary file first so a reader never sees half of it."""
    tmp = directory / f".config.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    tmp.replace(directory / "config.json")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ConfigFields:
    """Typed reads of one config dict. A missing required field, or a value of the wrong type, raises
    ConfigError naming the file and the field ("DIR/config.json: field 'hidden_size' must be an
    integer, got '576'"). A JSON null counts as absent."""

    def __init__(self, hf: dict, source: str = "config.json", prefix: str = ""):
        self.hf, self.source, self.prefix = hf, source, prefix

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {message}")

    def _read(self, name: str, default, ok: Callable[[Any], bool], kind: str):
        value = self.hf.get(name)
        if value is None:
            if default is REQUIRED:
                raise self.error(f"missing required field {self.prefix + name!r}")
            return default
        if not ok(value):
            raise self.error(f"field {self.prefix + name!r} must be {kind}, got {value!r}")
        return value

    def int(self, name: str, default=REQUIRED) -> int:
        return self._read(name, default, _is_int, "an integer")

    def float(self, name: str, default=REQUIRED) -> float:
        value = self._read(name, default, _is_number, "a number")
        return value if value is None else float(value)

    def bool(self, name: str, default=REQUIRED) -> bool:
        return self._read(name, default, lambda v: isinstance(v, bool), "true or false")

    def int_list(self, name: str, default=REQUIRED) -> tuple[int, ...]:
        ok = lambda v: isinstance(v, list) and all(_is_int(i) for i in v)  # noqa: E731
        value = self._read(name, default, ok, "a list of integers")
        return value if value is default else tuple(value)

    def int_or_int_list(self, name: str) -> tuple[int, ...]:
        """An optional integer or list of integers (e.g. eos_token_id) as a tuple."""
        ok = lambda v: _is_int(v) or (isinstance(v, list) and all(_is_int(i) for i in v))  # noqa: E731
        value = self._read(name, (), ok, "an integer or a list of integers")
        return tuple(value) if isinstance(value, (list, tuple)) else (value,)

    def str_list(self, name: str, default=REQUIRED) -> tuple[str, ...] | None:
        ok = lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v)  # noqa: E731
        value = self._read(name, default, ok, "a list of strings")
        return value if value is default else tuple(value)

    def section(self, name: str) -> "ConfigFields":
        """The fields of a nested object (e.g. dflash_config); absent means empty."""
        value = self._read(name, {}, lambda v: isinstance(v, dict), "an object")
        return ConfigFields(value, self.source, f"{self.prefix}{name}.")

    def build(self, cls, **kwargs):
        """cls(**kwargs), its validation errors reported against this file."""
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise self.error(str(e)) from e


def default_stop_token_ids(config: "ModelConfig", tokenizer=None) -> list[int]:
    """The stop tokens of plain generation: the config's EOS ids (config.json and
    generation_config.json) plus the tokenizer's EOS token."""
    stops = list(config.eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and int(eos) not in stops:
        stops.append(int(eos))
    return stops


def rope_settings(fields: ConfigFields, partial: bool = False) -> tuple[float, tuple, float]:
    """(rope_theta, frozen scaling dict, partial_rotary_factor) from either the transformers<5
    `rope_theta`+`rope_scaling` fields or the transformers>=5 `rope_parameters` field. partial: the
    family rotates a part of each head (Qwen3.5); elsewhere a factor other than 1 is refused. The
    multimodal sections of Qwen3.5's rope (`mrope_section`) give plain positions for text and are
    dropped."""
    params = dict(fields.section("rope_parameters").hf)
    scaling = dict(fields.section("rope_scaling").hf)
    theta = params.pop("rope_theta", fields.float("rope_theta", 10000.0))
    if not _is_number(theta):
        raise fields.error(f"field 'rope_parameters.rope_theta' must be a number, got {theta!r}")
    scaling = {**params, **scaling}
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise fields.error(f"unsupported rope type {rope_type!r}; supported: {ROPE_TYPES}")
    factor = scaling.pop("partial_rotary_factor", fields.float("partial_rotary_factor", 1.0))
    if not _is_number(factor) or not 0 < factor <= 1:
        raise fields.error(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    if factor != 1.0 and not partial:
        raise fields.error("partial_rotary_factor != 1 is not supported for this architecture")
    for multimodal in ("mrope_section", "mrope_interleaved"):
        scaling.pop(multimodal, None)
    return float(theta), _freeze({"rope_type": rope_type, **scaling}), float(factor)


def resolve_layer_types(fields: ConfigFields, num_layers: int, hybrid: bool = False) -> tuple[str, ...]:
    layer_types = fields.str_list("layer_types", None)
    if layer_types is None and hybrid:  # Qwen3.5's default: every `full_attention_interval`-th layer is full
        interval = fields.int("full_attention_interval", 4)
        layer_types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(num_layers))
    if layer_types is None:
        window = fields.int("sliding_window", 0)
        max_window_layers = fields.int("max_window_layers", num_layers)
        use_sliding = fields.bool("use_sliding_window", False) and window
        layer_types = tuple(
            "sliding_attention" if use_sliding and i >= max_window_layers else "full_attention"
            for i in range(num_layers)
        )
    if len(layer_types) != num_layers:
        raise fields.error(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    allowed = LAYER_TYPES if hybrid else LAYER_TYPES[:2]
    for t in layer_types:
        if t not in allowed:
            raise fields.error(f"unsupported layer type {t!r}")
    return layer_types


def decoder_fields(fields: ConfigFields, default_max_positions: int, hybrid: bool = False,
                   default_intermediate_size=REQUIRED, partial_rotary: bool = False) -> dict:
    """The decoder-stack fields that target and drafter configs share (same dataclass field names):
    sizes, norm epsilon, RoPE, and per-layer attention windows. hybrid: a family with Gated DeltaNet
    layers (partial rotary and "linear_attention" layer types allowed; the caller adds the
    partial_rotary_factor this returns under that key). default_intermediate_size: where the family's
    configs may lack `intermediate_size` (Qwen3.5-MoE). partial_rotary: a family that is not hybrid but
    rotates a part of each head (GLM-4 MoE, MiniMax-M2): the partial_rotary_factor is read and returned."""
    num_layers = fields.int("num_hidden_layers")
    num_heads = fields.int("num_attention_heads")
    hidden_size = fields.int("hidden_size")
    partial = hybrid or partial_rotary
    theta, scaling, partial_rotary = rope_settings(fields, partial=partial)
    layer_types = resolve_layer_types(fields, num_layers, hybrid)
    return dict(
        hidden_size=hidden_size,
        intermediate_size=fields.int("intermediate_size", default_intermediate_size),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=fields.int("num_key_value_heads", num_heads),
        head_dim=fields.int("head_dim", hidden_size // max(num_heads, 1)),
        rms_norm_eps=fields.float("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=fields.int("max_position_embeddings", default_max_positions),
        layer_types=layer_types,
        sliding_window=fields.int("sliding_window", 0) if "sliding_attention" in layer_types else 0,
        **({"partial_rotary_factor": partial_rotary} if partial else {}),
    )


def layer_pattern(layer_types) -> tuple[str, ...]:
    """The shortest prefix whose repeats make up `layer_types` (all of it when none does): a hybrid
    target's layers are stacked per position of it."""
    n = len(layer_types)
    for p in range(1, n + 1):
        if n % p == 0 and all(layer_types[i] == layer_types[i % p] for i in range(n)):
            return tuple(layer_types[:p])
    return tuple(layer_types)


class LayerLayout:
    """Shared by model and drafter configs: size checks, per-layer attention windows and RoPE settings.
    Expects the fields num_layers, num_heads, num_kv_heads, layer_types, sliding_window, rope_scaling."""

    def _validate_sizes(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        from dflash_jax.kernels.reference import check_gqa  # the attention's head grouping (jax on first use)

        check_gqa(self.num_heads, self.num_kv_heads)

    def _validate_layer_types(self, allowed: tuple[str, ...] = LAYER_TYPES[:2]) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(allowed))
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported here; allowed: {list(allowed)}")
        if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
            raise ValueError("sliding_attention layers need a positive sliding_window")

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per-layer attention window (0 = full attention)."""
        return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in self.layer_types)

    @property
    def rope(self) -> dict:
        return dict(self.rope_scaling)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A family's mixture-of-experts MLPs: `num_experts` routed experts of width `intermediate_size`, the
    top `num_experts_per_tok` chosen per token by `router` (`MOE_ROUTERS`; with a bias where
    `router_bias`), renormalised where `norm_topk_prob`; a sigmoid-gated shared expert where
    `shared_expert_intermediate_size` > 0 (Qwen3.5-MoE); expert biases and the clamped SwiGLU of
    gpt-oss (`swiglu_limit` 0: plain SwiGLU). `dense_layers`: the layers whose MLP is the dense one
    of the model's `intermediate_size` instead (Qwen3-MoE's `mlp_only_layers` and
    `decoder_sparse_step`; DeepSeek-V3's `first_k_dense_replace`).

    router "sigmoid_grouped" (DeepSeek-V3, GLM-4 MoE, MiniMax-M2; `layers.moe.route_sigmoid_grouped`): the
    experts chosen by sigmoid(logits) + a correction bias among the best `topk_group` of `n_group`
    groups, weighted by their unbiased scores (renormalised where `norm_topk_prob`, with `norm_topk_eps`
    added to the sum) times `routed_scaling_factor`. `shared_expert_gate` False: the shared expert is
    added ungated (DeepSeek-V3's and GLM's `shared_experts`, of width moe_intermediate_size x
    n_shared_experts)."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    router: str = "softmax_topk"
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    dense_layers: tuple[int, ...] = ()
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_eps: float = 0.0
    shared_expert_gate: bool = True

    def __post_init__(self):
        for name in ("num_experts", "num_experts_per_tok", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"moe {name} must be positive, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("shared_expert_intermediate_size must be >= 0, got "
                             f"{self.shared_expert_intermediate_size}")
        if self.router not in MOE_ROUTERS:
            raise ValueError(f"unknown moe router {self.router!r}; supported: {MOE_ROUTERS}")
        if self.swiglu_limit < 0 or self.swiglu_alpha <= 0:
            raise ValueError(f"swiglu_limit must be >= 0 and swiglu_alpha > 0, got {self.swiglu_limit} and "
                             f"{self.swiglu_alpha}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))
        self._validate_sigmoid_router()

    def _validate_sigmoid_router(self):
        grouped = (self.n_group, self.topk_group, self.routed_scaling_factor, self.norm_topk_eps) != (1, 1, 1.0, 0.0)
        if self.router != "sigmoid_grouped":
            if grouped:
                raise ValueError(f"n_group, topk_group, routed_scaling_factor and norm_topk_eps belong to the "
                                 f"sigmoid_grouped router, not {self.router!r}")
            return
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must be >= 1 and divide num_experts ({self.num_experts})")
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(f"each of the n_group ({self.n_group}) groups needs >= 2 experts (a group is scored "
                             f"by its 2 best), got {per_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of the "
                             f"topk_group ({self.topk_group}) groups kept ({self.topk_group * per_group})")
        if not self.routed_scaling_factor > 0 or self.norm_topk_eps < 0:
            raise ValueError(f"routed_scaling_factor must be > 0 and norm_topk_eps >= 0, got "
                             f"{self.routed_scaling_factor} and {self.norm_topk_eps}")
        if self.router_bias:
            raise ValueError("the sigmoid_grouped router has a correction bias, not a router_bias")


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """A hybrid family's Gated DeltaNet ("linear_attention") layers: a causal conv of width
    `conv_kernel_dim` over q, k and v, `num_key_heads` q/k heads of `key_head_dim`, `num_value_heads`
    v heads of `value_head_dim`."""

    conv_kernel_dim: int = 4
    num_key_heads: int = 16
    num_value_heads: int = 32
    key_head_dim: int = 128
    value_head_dim: int = 128

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"linear_{field.name} must be positive, got {getattr(self, field.name)}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_key_heads})")

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k (key heads) and v (value heads)."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V3's `DeepseekV3Attention`): keys and values come from a
    per-token latent of `kv_lora_rank` (normed) through `kv_b_proj` into `qk_nope_head_dim` key and
    `v_head_dim` value dims per head, beside one rotary key of `qk_rope_head_dim` shared by every
    head; the queries through a low-rank path of `q_lora_rank` (0: a plain q_proj). `rope_interleave`:
    the rotary dims are stored in interleaved pairs (x0, x1), (x2, x3), ..."""

    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    q_lora_rank: int = 0
    rope_interleave: bool = True

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank < 0:
            raise ValueError(f"q_lora_rank must be positive (or absent), got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """A query's (and a materialised key's) dims per head: the non-rotary then the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """The values per token and layer a latent cache holds: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig(LayerLayout):
    """A decoder-only target of one family (`arch`, a name of the `dflash_jax.families` registry, whose
    module reads config.json into this and checks what its family allows). The fields every family
    has are here; what only some have is nested: `moe` (mixture-of-experts MLPs, None: dense) and
    `linear` (Gated DeltaNet layers, None: none). `intermediate_size` is the dense MLP's width (the
    default width of a drafter for an all-MoE target)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = (("rope_type", "default"),)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    partial_rotary_factor: float = 1.0  # the part of each attention head RoPE rotates
    attention_sinks: bool = False  # one learned logit per query head in each softmax (gpt-oss)
    moe: MoEConfig | None = None
    linear: LinearAttentionConfig | None = None
    final_logit_softcapping: float = 0.0  # c > 0: the target's logits are c * tanh(z / c) (Gemma 4)
    family_options: Any = None  # a family's own frozen, hashable config (its module defines it; Gemma 4's)
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V3), None: q/k/v heads

    def __post_init__(self):
        from dflash_jax.models import registry as families

        family = families.get(self.arch)  # ValueError naming the known ones
        self._validate_sizes("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                             "num_kv_heads", "head_dim")
        self._validate_layer_types(LAYER_TYPES if self.linear is not None else LAYER_TYPES[:2])
        if LINEAR in self.layer_types and self.linear is None:
            raise ValueError("linear_attention layers need the linear attention sizes (linear=)")
        if self.moe is not None:
            bad = [i for i in self.moe.dense_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"dense MLP layers {bad} out of range for {self.num_layers} layers")
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"the rotated part of a head ({self.head_dim} x {self.partial_rotary_factor}) "
                             "must be a positive even number of dims")
        if self.final_logit_softcapping < 0:
            raise ValueError(f"final_logit_softcapping must be >= 0, got {self.final_logit_softcapping}")
        family.validate(self)

    @property
    def family(self):
        """The module-level family object of `arch` (`dflash_jax.families`)."""
        from dflash_jax.models import registry as families

        return families.get(self.arch)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0: a dense target)."""
        return 0 if self.moe is None else self.moe.num_experts

    @property
    def is_hybrid_arch(self) -> bool:
        """A target with Gated DeltaNet layers: its cache holds their recurrent states (`HybridCache`)."""
        return self.linear is not None

    @property
    def rotary_dim(self) -> int:
        """The dims of each attention head that RoPE rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mlp_kinds(self) -> tuple[str, ...]:
        """Per layer, its MLP: "moe" or "dense"."""
        dense = () if self.moe is None else self.moe.dense_layers
        return tuple("moe" if self.moe is not None and i not in dense else "dense" for i in range(self.num_layers))

    @property
    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        """Per layer, (its token mixer: "attention" (full or sliding: the window is data) or
        "linear_attention", its MLP: `mlp_kinds`): what the decoder stack groups into scanned segments
        (`dflash_jax.models.stack`)."""
        family = self.family
        mixers = (family.layer_mixer(self, i, t) for i, t in enumerate(self.layer_types))
        return tuple(zip(mixers, self.mlp_kinds))

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """The layers that keep keys and values in the KV cache (all but linear-attention ones)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t != LINEAR)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def kv_groups(self) -> tuple[tuple[tuple[int, int], tuple[int, ...]], ...]:
        """The layers that keep keys and values in the KV cache, grouped by their shape: ((kv heads, head
        dim), layer ids) per group, in the order of each group's first layer (`Family.kv_shape`). One
        group for a family whose attention layers are alike; Gemma 4's full layers are a group apart."""
        family, groups = self.family, {}
        for i, (mixer, _) in zip(range(self.num_layers), self.layer_kinds):
            shape = family.kv_shape(self, mixer)
            if shape is not None:
                groups.setdefault(shape, []).append(i)
        return tuple((shape, tuple(ids)) for shape, ids in groups.items())

    @classmethod
    def from_hf_config(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        """From a transformers config dict: the family its `architectures` (or, without them, its
        `model_type`) names reads it (`dflash_jax.families`); `source` (the file) is named in every error."""
        from dflash_jax.models import registry as families

        fields = ConfigFields(hf, source)
        family = families.for_hf_config(fields)
        return family.read_config(fields)
