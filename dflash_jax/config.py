"""Frozen, hashable model configs built from Hugging Face `config.json` dictionaries."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _freeze(value: Any) -> Any:
    """Dicts/lists -> sorted tuples so that configs stay hashable (usable as jit static args)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def read_config_json(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    return json.loads(path.read_text())


def rope_settings(hf: dict) -> tuple[float, tuple]:
    """(rope_theta, frozen scaling dict) from either the transformers<5 `rope_theta`+`rope_scaling`
    fields or the transformers>=5 `rope_parameters` field."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = {**params, **scaling}
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {ROPE_TYPES}")
    if scaling.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return float(theta), _freeze({"rope_type": rope_type, **scaling})


def resolve_layer_types(hf: dict, num_layers: int) -> tuple[str, ...]:
    layer_types = hf.get("layer_types")
    if layer_types is None:
        window, max_window_layers = hf.get("sliding_window"), hf.get("max_window_layers", num_layers)
        use_sliding = hf.get("use_sliding_window", False) and window
        layer_types = [
            "sliding_attention" if use_sliding and i >= max_window_layers else "full_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    for t in layer_types:
        if t not in ("full_attention", "sliding_attention"):
            raise ValueError(f"unsupported layer type {t!r}")
    return tuple(layer_types)


class LayerLayout:
    """Shared by model and drafter configs: per-layer attention windows and RoPE settings.
    Expects the fields num_layers, layer_types, sliding_window, rope_scaling."""

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
        if self.arch not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"unknown arch {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self._validate_layer_types()

    @classmethod
    def from_hf_config(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and model_type in SUPPORTED_ARCHITECTURES.values() and not archs:
            arch = model_type
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}")
        num_layers = hf["num_hidden_layers"]
        num_heads = hf["num_attention_heads"]
        theta, scaling = rope_settings(hf)
        eos = hf.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        layer_types = resolve_layer_types(hf, num_layers)
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=arch == "qwen3",
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            layer_types=layer_types,
            sliding_window=(hf.get("sliding_window") or 0) if "sliding_attention" in layer_types else 0,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=hf.get("pad_token_id"),
        )
