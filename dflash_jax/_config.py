"""Frozen, hashable model configs built from Hugging Face `config.json` dictionaries."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

from dflash_jax._errors import ConfigError

# Hugging Face `architectures` class name -> our architecture key (ModelConfig.arch).
ARCH_BY_HF_CLASS = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # its text model; the vision tower is not read
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",  # Qwen3.5 / Qwen3.6 hybrids whose every MLP is an MoE block
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "GptOssForCausalLM": "gpt_oss",
}
MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama", "qwen3_moe": "qwen3_moe", "qwen3_5": "qwen3_5",
               "qwen3_5_text": "qwen3_5",
               "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe", "gpt_oss": "gpt_oss"}
HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe")  # families with Gated DeltaNet ("linear_attention") layers
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
LINEAR = "linear_attention"
ARCHS = tuple(sorted(set(ARCH_BY_HF_CLASS.values())))
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MOE_ROUTERS = ("softmax_topk", "topk_softmax")  # Qwen3-MoE: top k of the softmax; gpt-oss: softmax of the top k
# What transformers' GptOssConfig fills in where a gpt-oss config.json is silent (its defaults are
# gpt-oss-120b's shapes; the released configs state these fields anyway).
GPT_OSS_DEFAULTS = {
    "rope_theta": 150000.0, "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "attention_bias": True, "tie_word_embeddings": False, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
}
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
                   default_intermediate_size=REQUIRED) -> dict:
    """The decoder-stack fields that target and drafter configs share (same dataclass field names):
    sizes, norm epsilon, RoPE, and per-layer attention windows. hybrid: a family with Gated DeltaNet
    layers (partial rotary and "linear_attention" layer types allowed; the caller adds the
    partial_rotary_factor this returns under that key). default_intermediate_size: where the family's
    configs may lack `intermediate_size` (Qwen3.5-MoE)."""
    num_layers = fields.int("num_hidden_layers")
    num_heads = fields.int("num_attention_heads")
    hidden_size = fields.int("hidden_size")
    theta, scaling, partial_rotary = rope_settings(fields, partial=hybrid)
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
        **({"partial_rotary_factor": partial_rotary} if hybrid else {}),
    )


def layer_pattern(layer_types) -> tuple[str, ...]:
    """The shortest prefix whose repeats make up `layer_types` (all of it when none does): a hybrid
    target's layers are stacked per position of it."""
    n = len(layer_types)
    for p in range(1, n + 1):
        if n % p == 0 and all(layer_types[i] == layer_types[i % p] for i in range(n)):
            return tuple(layer_types[:p])
    return tuple(layer_types)


def check_gqa(num_heads: int, num_kv_heads: int) -> int:
    """The query heads per kv head; ValueError unless num_heads is a multiple of num_kv_heads."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    return num_heads // num_kv_heads


class LayerLayout:
    """Shared by model and drafter configs: size checks, per-layer attention windows and RoPE settings.
    Expects the fields num_layers, num_heads, num_kv_heads, layer_types, sliding_window, rope_scaling."""

    def _validate_sizes(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
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
class ModelConfig(LayerLayout):
    """A decoder-only target: Qwen3 or Llama, or a Qwen3.5 hybrid ("qwen3_5": Gated DeltaNet
    "linear_attention" layers between gated full-attention layers; the `linear_*` fields size the
    former, `partial_rotary_factor` the part of each attention head that is rotated). MoE targets
    ("qwen3_moe", "gpt_oss", and the hybrid "qwen3_5_moe") have `num_experts` > 0: every layer's MLP is
    the MoE block, with a sigmoid-gated shared expert where `shared_expert_intermediate_size` > 0
    (Qwen3.5-MoE), or gpt-oss's router and experts (`moe_router`, `router_bias`, `expert_bias`,
    `swiglu_limit`) beside its attention sinks; their `intermediate_size` sizes no layer (it is a
    drafter's default width)."""

    arch: str  # "qwen3" | "llama" | "qwen3_moe" | "qwen3_5" | "qwen3_5_moe" | "gpt_oss"
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
    # Qwen3.5 hybrids (zero elsewhere)
    partial_rotary_factor: float = 1.0
    linear_conv_kernel_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # mixture-of-experts MLPs (Qwen3-MoE; 0 experts: a dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE's shared expert (0: none)
    # gpt-oss: attention sinks (one learned logit per query head in each softmax), the router's
    # order (`MOE_ROUTERS`) and bias, expert biases, and the clamped SwiGLU of its experts
    # (swiglu_limit 0: plain SwiGLU)
    attention_sinks: bool = False
    moe_router: str = "softmax_topk"
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; supported: {ARCHS}")
        self._validate_sizes("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                             "num_kv_heads", "head_dim")
        self._validate_layer_types(LAYER_TYPES if self.is_hybrid_arch else LAYER_TYPES[:2])
        if self.is_hybrid_arch:
            self._validate_sizes("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                                 "linear_key_head_dim", "linear_value_head_dim")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple "
                                 f"of linear_num_key_heads ({self.linear_num_key_heads})")
        if self.num_experts:
            self._validate_sizes("num_experts_per_tok", "moe_intermediate_size")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                                 f"({self.num_experts})")
        if self.shared_expert_intermediate_size < 0 or (self.shared_expert_intermediate_size
                                                        and self.arch != "qwen3_5_moe"):
            raise ValueError(f"shared_expert_intermediate_size ({self.shared_expert_intermediate_size}) must be "
                             "0, or positive for a qwen3_5_moe target")
        if self.arch == "qwen3_5_moe":
            self._validate_sizes("num_experts", "shared_expert_intermediate_size")
            if not self.norm_topk_prob:
                raise ValueError("a qwen3_5_moe router always renormalises its top-k weights: norm_topk_prob "
                                 "must be True")
        if self.moe_router not in MOE_ROUTERS:
            raise ValueError(f"unknown moe_router {self.moe_router!r}; supported: {MOE_ROUTERS}")
        if not self.num_experts and (self.router_bias or self.expert_bias or self.swiglu_limit
                                     or self.moe_router != "softmax_topk"):
            raise ValueError("router_bias, expert_bias, swiglu_limit and moe_router describe MoE layers; "
                             "num_experts is 0")
        if self.swiglu_limit < 0 or self.swiglu_alpha <= 0:
            raise ValueError(f"swiglu_limit must be >= 0 and swiglu_alpha > 0, got {self.swiglu_limit} and "
                             f"{self.swiglu_alpha}")
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"the rotated part of a head ({self.head_dim} x {self.partial_rotary_factor}) "
                             "must be a positive even number of dims")

    @property
    def is_hybrid_arch(self) -> bool:
        """A family with Gated DeltaNet layers (`HYBRID_ARCHS`): its own model class and cache."""
        return self.arch in HYBRID_ARCHS

    @property
    def rotary_dim(self) -> int:
        """The dims of each attention head that RoPE rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """The layers that keep keys and values in the KV cache (all but linear-attention ones)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t != "linear_attention")

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear-attention layer's causal conv: q, k (key heads) and v (value heads)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @classmethod
    def from_hf_config(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        """From a transformers config dict; `source` (the file) is named in every error."""
        fields = ConfigFields(hf, source)
        archs = fields.str_list("architectures", ())
        model_type = hf.get("model_type")
        arch = next((ARCH_BY_HF_CLASS[a] for a in archs if a in ARCH_BY_HF_CLASS), None)
        if arch is None and model_type in MODEL_TYPES and not archs:
            arch = MODEL_TYPES[model_type]
        if arch is None:
            raise fields.error(f"unsupported architecture {list(archs) or model_type!r}; supported: "
                               f"{sorted(ARCH_BY_HF_CLASS)}")
        hybrid = arch in HYBRID_ARCHS
        if hybrid and isinstance(hf.get("text_config"), dict):
            # a multimodal checkpoint's config: the text model's fields, the top level's where it has none
            top = {k: v for k, v in hf.items() if k in ("tie_word_embeddings", "eos_token_id", "bos_token_id",
                                                         "pad_token_id")}
            fields = ConfigFields({**top, **{k: v for k, v in hf["text_config"].items() if v is not None}},
                                  source, "text_config.")
        linear = {}
        if hybrid:
            linear = dict(linear_conv_kernel_dim=fields.int("linear_conv_kernel_dim", 4),
                          linear_num_key_heads=fields.int("linear_num_key_heads", 16),
                          linear_num_value_heads=fields.int("linear_num_value_heads", 32),
                          linear_key_head_dim=fields.int("linear_key_head_dim", 128),
                          linear_value_head_dim=fields.int("linear_value_head_dim", 128))
        moe = {}
        if arch == "qwen3_5_moe":
            # transformers' Qwen3_5MoeTextConfig: every layer's MLP is the sparse block (it deletes
            # mlp_only_layers, decoder_sparse_step and norm_topk_prob: its router always renormalises
            # the top k, `Qwen3_5MoeTopKRouter`); a shared expert beside the routed ones
            moe = dict(num_experts=fields.int("num_experts", 256),
                       num_experts_per_tok=fields.int("num_experts_per_tok", 8),
                       moe_intermediate_size=fields.int("moe_intermediate_size", 512),
                       shared_expert_intermediate_size=fields.int("shared_expert_intermediate_size", 512),
                       norm_topk_prob=True)
        if arch == "gpt_oss":
            fields = ConfigFields(_gpt_oss_defaults(fields), source)
            experts = fields.int("num_local_experts", None)
            top_k = fields.int("num_experts_per_tok", None)
            moe = dict(num_experts=fields.int("num_experts") if experts is None else experts,
                       num_experts_per_tok=fields.int("experts_per_token") if top_k is None else top_k,
                       moe_intermediate_size=fields.int("intermediate_size"), moe_router="topk_softmax",
                       router_bias=True, expert_bias=True, attention_sinks=True,
                       swiglu_limit=fields.float("swiglu_limit"), swiglu_alpha=fields.float("swiglu_alpha"))
        if arch == "qwen3_moe":
            sparse_step = fields.int("decoder_sparse_step", 1)
            dense_layers = fields.int_list("mlp_only_layers", ())
            # released configs say num_experts; transformers 5 writes its alias num_local_experts
            experts = fields.int("num_experts", None)
            experts = fields.int("num_local_experts") if experts is None else experts
            if experts and (dense_layers or sparse_step != 1):
                raise fields.error("dense MLP layers among the MoE ones (mlp_only_layers, decoder_sparse_step "
                                   "> 1) are not supported yet: every layer must be an MoE layer")
            moe = dict(num_experts=experts, num_experts_per_tok=fields.int("num_experts_per_tok"),
                       moe_intermediate_size=fields.int("moe_intermediate_size"),
                       norm_topk_prob=fields.bool("norm_topk_prob", False))
        return fields.build(
            cls,
            arch=arch,
            vocab_size=fields.int("vocab_size"),
            **decoder_fields(fields, default_max_positions=4096, hybrid=hybrid,
                             # no dense MLP: the Qwen family's dense width, 3 x hidden (a drafter's default)
                             default_intermediate_size=(3 * fields.int("hidden_size") if arch == "qwen3_5_moe"
                                                        else REQUIRED)),
            **linear,
            **moe,
            tie_word_embeddings=fields.bool("tie_word_embeddings", False),
            qk_norm=arch in ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe"),
            attention_bias=fields.bool("attention_bias", False),
            mlp_bias=fields.bool("mlp_bias", False),
            bos_token_id=fields.int("bos_token_id", None),
            eos_token_ids=fields.int_or_int_list("eos_token_id"),
            pad_token_id=fields.int("pad_token_id", None),
        )


def _gpt_oss_defaults(fields: ConfigFields) -> dict:
    """A gpt-oss config dict with transformers' GptOssConfig defaults where it is silent (`GPT_OSS_DEFAULTS`;
    layer_types: sliding and full layers alternating, the first sliding). Its MXFP4 `quantization_config`
    is the only one read (the experts are dequantised on load, `loading.mxfp4`)."""
    hf = fields.hf
    quant = fields.section("quantization_config").hf.get("quant_method")
    if quant not in (None, "mxfp4"):
        raise fields.error(f"quantization_config.quant_method {quant!r} is not supported for gpt-oss (mxfp4 is)")
    out = {k: v for k, v in GPT_OSS_DEFAULTS.items() if k not in ("rope_scaling", "rope_theta")}
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        out["rope_scaling"] = GPT_OSS_DEFAULTS["rope_scaling"]
    if hf.get("rope_theta") is None and (hf.get("rope_parameters") or {}).get("rope_theta") is None:
        out["rope_theta"] = GPT_OSS_DEFAULTS["rope_theta"]
    layers = hf.get("num_hidden_layers")
    if hf.get("layer_types") is None and isinstance(layers, int):
        out["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return {**out, **{k: v for k, v in hf.items() if v is not None}}
