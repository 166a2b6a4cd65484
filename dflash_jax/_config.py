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
}
ARCHS = tuple(sorted(set(ARCH_BY_HF_CLASS.values())))
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
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


def rope_settings(fields: ConfigFields) -> tuple[float, tuple]:
    """(rope_theta, frozen scaling dict) from either the transformers<5 `rope_theta`+`rope_scaling`
    fields or the transformers>=5 `rope_parameters` field."""
    params = dict(fields.section("rope_parameters").hf)
    scaling = dict(fields.section("rope_scaling").hf)
    theta = params.pop("rope_theta", fields.float("rope_theta", 10000.0))
    if not _is_number(theta):
        raise fields.error(f"field 'rope_parameters.rope_theta' must be a number, got {theta!r}")
    scaling = {**params, **scaling}
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise fields.error(f"unsupported rope type {rope_type!r}; supported: {ROPE_TYPES}")
    if scaling.pop("partial_rotary_factor", 1.0) != 1.0:
        raise fields.error("partial_rotary_factor != 1 is not supported")
    return float(theta), _freeze({"rope_type": rope_type, **scaling})


def resolve_layer_types(fields: ConfigFields, num_layers: int) -> tuple[str, ...]:
    layer_types = fields.str_list("layer_types", None)
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
    for t in layer_types:
        if t not in ("full_attention", "sliding_attention"):
            raise fields.error(f"unsupported layer type {t!r}")
    return layer_types


def decoder_fields(fields: ConfigFields, default_max_positions: int) -> dict:
    """The decoder-stack fields that target and drafter configs share (same dataclass field names):
    sizes, norm epsilon, RoPE, and per-layer attention windows."""
    num_layers = fields.int("num_hidden_layers")
    num_heads = fields.int("num_attention_heads")
    hidden_size = fields.int("hidden_size")
    theta, scaling = rope_settings(fields)
    layer_types = resolve_layer_types(fields, num_layers)
    return dict(
        hidden_size=hidden_size,
        intermediate_size=fields.int("intermediate_size"),
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
    )


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

    def _validate_layer_types(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
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
    """A decoder-only target (Qwen3 or Llama family)."""

    arch: str  # "qwen3" | "llama"
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

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; supported: {ARCHS}")
        self._validate_sizes("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                             "num_kv_heads", "head_dim")
        self._validate_layer_types()

    @classmethod
    def from_hf_config(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        """From a transformers config dict; `source` (the file) is named in every error."""
        fields = ConfigFields(hf, source)
        archs = fields.str_list("architectures", ())
        model_type = hf.get("model_type")
        arch = next((ARCH_BY_HF_CLASS[a] for a in archs if a in ARCH_BY_HF_CLASS), None)
        if arch is None and model_type in ARCHS and not archs:
            arch = model_type
        if arch is None:
            raise fields.error(f"unsupported architecture {list(archs) or model_type!r}; supported: "
                               f"{sorted(ARCH_BY_HF_CLASS)}")
        return fields.build(
            cls,
            arch=arch,
            vocab_size=fields.int("vocab_size"),
            **decoder_fields(fields, default_max_positions=4096),
            tie_word_embeddings=fields.bool("tie_word_embeddings", False),
            qk_norm=arch == "qwen3",
            attention_bias=fields.bool("attention_bias", False),
            mlp_bias=fields.bool("mlp_bias", False),
            bos_token_id=fields.int("bos_token_id", None),
            eos_token_ids=fields.int_or_int_list("eos_token_id"),
            pad_token_id=fields.int("pad_token_id", None),
        )
