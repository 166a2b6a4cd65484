"""Training configuration: frozen, validated dataclasses loaded from YAML with dotted overrides.

    cfg = load_config("configs/tiny_cpu.yaml", ["optim.learning_rate=1e-3", "run.steps=50"])

Sections: `model` (target and drafter shape), `data` (train.data.DataConfig), `optim`, `run`.
Unknown keys and values of the wrong type raise ConfigError (`dflash_jax.ConfigError`, a
ValueError) naming the file and the key.

A file may name a base (or a list of them, applied in order) at its top level:

    base: base.yaml          # relative to the file that names it
    optim:
      learning_rate: 1.0e-3

The file's values deep-merge over its bases': mappings merge key by key, anything else (scalars,
lists, null) replaces. Bases may have bases; a cycle or a missing base raises ConfigError naming
the file. Command-line overrides apply last, over the merged values.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from dflash_jax._errors import ConfigError
from dflash_jax.drafters import generations
from train.data import DataConfig

FEATURE_MODES = ("online", "offline")
COMPUTE_DTYPES = ("float32", "bfloat16")
LABELS = ("tokens", "target", "distribution")  # run.labels: see train.step
FC_INITS = ("random", "last_feature")
GENERATIONS = generations.names()  # model.generation: the drafter architecture trained
# Each newer generation's own model fields and their defaults, and its loss weights in `run` with
# theirs (`Generation.train_defaults`, `loss_weight_defaults`)
GENERATION_FIELDS = {g.name: g.train_defaults for g in generations.GENERATIONS.values() if g.train_defaults}
GENERATION_LOSS_WEIGHTS = {g.name: g.loss_weight_defaults for g in generations.GENERATIONS.values()
                           if g.loss_weight_defaults}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    target: str = "smollm2"  # HF directory or .gguf file; "smollm2" = the embedded SmolLM2-135M GGUF
    target_dtype: str = "float32"
    num_layers: int = 1  # drafter depth
    intermediate_size: int | None = None  # drafter MLP width; None = the target's
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None  # None = the official selection rule
    mask_token_id: int | None = None  # None = resolve_mask_token_id(tokenizer)
    warm_start: bool = False  # drafter layers <- target layers (warm_start_layers, default the top ones)
    warm_start_layers: tuple[int, ...] | None = None  # target layer copied into each drafter layer
    fc_init: str = "random"  # "last_feature": fc passes the deepest captured feature through
    draft_vocab_size: int = 0  # 0 = full target vocabulary
    sliding_window: int = 0  # > 0: every drafter layer sees only this many context positions back
    # causal inside the block: None = the reference's default (sliding layers causal, full ones not)
    is_causal: bool | None = None
    draft_vocab_path: str | None = None  # saved DraftVocab (.npz); built from data counts when absent
    init_from: str | None = None  # an exported drafter directory: its weights (and draft vocabulary)
                                  # start the run instead of warm_start/fc_init; block_size may differ
    # The drafter's generation: "dflash", "dflash2" (convolutions and a candidate selector: the
    # conv_* and selector_* fields) or "dspark" (own tables, Markov and confidence heads: markov_rank,
    # confidence_head*, sample_from_anchor). A generation's fields may be set only for it; unset
    # (null) ones take GENERATION_FIELDS' defaults (`generation_field`).
    generation: str = "dflash"
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    markov_rank: int | None = None  # 0: no Markov head
    confidence_head: bool | None = None
    confidence_head_with_markov: bool | None = None
    sample_from_anchor: bool | None = None  # False: the older 1+N block, whose anchor slot does not propose

    def __post_init__(self):
        _check(self.target_dtype in COMPUTE_DTYPES, f"model.target_dtype must be one of {COMPUTE_DTYPES}")
        _check(self.num_layers >= 1, "model.num_layers must be >= 1")
        _check(self.block_size >= 2, "model.block_size must be >= 2")
        _check(self.intermediate_size is None or self.intermediate_size >= 1,
               "model.intermediate_size must be positive")
        _check(self.fc_init in FC_INITS, f"model.fc_init must be one of {FC_INITS}")
        _check(self.draft_vocab_size >= 0, "model.draft_vocab_size must be >= 0")
        _check(self.sliding_window >= 0, "model.sliding_window must be >= 0")
        _check(self.warm_start_layers is None or (self.warm_start and len(self.warm_start_layers) == self.num_layers),
               "model.warm_start_layers needs model.warm_start: true and one target layer per drafter layer "
               "(model.num_layers)")
        _check(self.generation in GENERATIONS, f"model.generation must be one of {GENERATIONS}")
        kind = generations.get(self.generation)
        if not kind.draft_vocab_allowed:
            _check(not self.draft_vocab_size, f"model.draft_vocab_size: a {self.generation} drafter drafts over the "
                                              "whole vocabulary (set it to 0)")
        for generation, fields in GENERATION_FIELDS.items():
            for name in fields:
                _check(generation == self.generation or getattr(self, name) is None,
                       f"model.{name} is a {generation} drafter's field; model.generation is {self.generation}")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            _check(getattr(self, name) is None or getattr(self, name) >= 1, f"model.{name} must be >= 1")
        _check(self.markov_rank is None or self.markov_rank >= 0, "model.markov_rank must be >= 0 (0: no Markov head)")
        problem = kind.check_train_fields(self.generation_field)
        _check(problem is None, problem)

    def generation_field(self, name: str):
        """A field of model.generation's own: its value, or its default when unset."""
        value = getattr(self, name)
        return GENERATION_FIELDS[self.generation][name] if value is None else value


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    final_lr_ratio: float = 0.0  # cosine decays to learning_rate * final_lr_ratio
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    grad_accum: int = 1  # micro-batches per optimizer step (the global batch is split)

    def __post_init__(self):
        _check(self.learning_rate > 0, "optim.learning_rate must be positive")
        _check(0 <= self.warmup_ratio < 1, "optim.warmup_ratio must be in [0, 1)")
        _check(self.grad_accum >= 1, "optim.grad_accum must be >= 1")
        _check(self.clip_norm > 0, "optim.clip_norm must be positive")


@dataclasses.dataclass(frozen=True)
class RunSettings:
    out_dir: str = "runs/default"
    steps: int = 1000
    seed: int = 0
    num_anchors: int = 64  # blocks per sequence, redrawn every step
    anchor_chunk: int = 0  # > 0: attend in groups of this many anchors (cheaper attention, same loss)
    decay: float | None = None  # slot-weight decay; None = the paper's value for the block size
    labels: str = "tokens"  # "tokens": the text's next tokens; "target": the target's greedy choices;
    # "distribution": the target's distribution over its label_top_k likeliest next tokens (soft labels)
    label_top_k: int = 8
    compute_dtype: str = "float32"  # drafter activations; master params stay float32
    logits_chunk: int = 1024
    mesh_data: int = -1  # -1 = all devices / mesh_fsdp
    mesh_fsdp: int = 1
    shard_target: bool = False  # fsdp-shard the frozen target like the drafter (else replicated)
    log_every: int = 10
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    async_checkpointing: bool = True
    eval_every: int = 0  # 0 = never; tau with generate on held-out prompts
    eval_path: str | None = None  # pre-tokenized JSONL; the prompt is each record's unmasked prefix
    eval_prompts: int = 4
    eval_max_new_tokens: int = 64
    # Loss weights of the newer generations, only with model.generation their own; unset (null):
    # GENERATION_LOSS_WEIGHTS' defaults (`TrainConfig.loss_weight`). DFlash2's selector
    # cross-entropy; DSpark's cross-entropy, L1 distance |p_d - p_t|_1 and confidence BCE. DSpark's
    # decay (run.decay null): 4.0, DeepSpec's loss_decay_gamma.
    selector_loss_alpha: float | None = None
    ce_loss_alpha: float | None = None
    l1_loss_alpha: float | None = None
    confidence_loss_alpha: float | None = None

    def __post_init__(self):
        _check(self.steps >= 1, "run.steps must be >= 1")
        _check(self.num_anchors >= 1, "run.num_anchors must be >= 1")
        _check(self.anchor_chunk == 0 or self.num_anchors % self.anchor_chunk == 0,
               "run.num_anchors must be a multiple of run.anchor_chunk")
        _check(self.labels in LABELS, f"run.labels must be one of {LABELS}")
        _check(self.label_top_k >= 1, "run.label_top_k must be >= 1")
        _check(self.compute_dtype in COMPUTE_DTYPES, f"run.compute_dtype must be one of {COMPUTE_DTYPES}")
        _check(self.mesh_fsdp >= 1 and (self.mesh_data >= 1 or self.mesh_data == -1),
               "run.mesh_data must be -1 or >= 1 and run.mesh_fsdp >= 1")
        for name in ("log_every", "checkpoint_every", "keep_checkpoints"):
            _check(getattr(self, name) >= 1, f"run.{name} must be >= 1")
        _check(self.eval_every == 0 or self.eval_path, "run.eval_every > 0 needs run.eval_path")
        for name in ("selector_loss_alpha", "ce_loss_alpha", "l1_loss_alpha", "confidence_loss_alpha"):
            _check(getattr(self, name) is None or 0 <= getattr(self, name) < float("inf"),
                   f"run.{name} must be a finite number >= 0")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelSettings = ModelSettings()
    data: DataConfig = None  # type: ignore[assignment]  # required: data.path
    optim: OptimSettings = OptimSettings()
    run: RunSettings = RunSettings()

    def __post_init__(self):
        _check(self.data is not None, "the `data` section (with data.path) is required")
        _check(self.data.batch_size % self.optim.grad_accum == 0,
               f"data.batch_size ({self.data.batch_size}) must be a multiple of optim.grad_accum "
               f"({self.optim.grad_accum})")
        for generation, weights in GENERATION_LOSS_WEIGHTS.items():
            for name in weights:
                _check(generation == self.model.generation or getattr(self.run, name) is None,
                       f"run.{name} weighs a {generation} drafter's loss; model.generation is {self.model.generation}")
        _check(not generations.get(self.model.generation).trains_own_loss or self.run.labels == "tokens",
               f"run.labels: a {self.model.generation} drafter learns the text's next tokens with the target's "
               "whole distribution (DeepSpec's loss); run.labels must be 'tokens'")

    def loss_weight(self, name: str) -> float:
        """A loss weight of model.generation's own (GENERATION_LOSS_WEIGHTS): run's value, or its default."""
        value = getattr(self.run, name)
        return GENERATION_LOSS_WEIGHTS[self.model.generation][name] if value is None else value

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Convert a YAML value to the field's annotated type (int, float, bool, str, X | None,
    X | Y, tuple[int, ...]) or raise ConfigError naming the key."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        for option in inner[:-1]:  # e.g. str | tuple[str, ...]: the first type the value fits
            try:
                return _coerce(value, option, key)
            except ConfigError:
                pass
        return _coerce(value, inner[-1], key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return tuple(_coerce(v, typing.get_args(hint)[0], key) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 2e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {hint}")


def _build(cls, values: dict, prefix: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"unknown key(s) {[prefix + k for k in unknown]}; known in "
                          f"{prefix.rstrip('.') or 'the top level'}: {names}")
    kwargs = {}
    for name in names:
        if name not in values:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, values[name] or {}, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(values[name], hint, prefix + name)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from e


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        child = tree.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
        tree = child
    tree[leaf] = value


BASE_KEY = "base"  # top-level key naming the file(s) a config layers over


def _merge(base: dict, overlay: dict) -> dict:
    """`overlay` over `base`: mappings merge key by key, any other value replaces."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _base_names(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{where}: `{BASE_KEY}` must be a file name or a list of them, got {value!r}")
    return names


def _resolve_bases(values: dict, base_dir: Path, where: str, chain: tuple[Path, ...]) -> dict:
    """`values` (read from `where`, whose bases are named relative to `base_dir`) merged over its bases."""
    values = dict(values)
    merged: dict = {}
    for name in _base_names(values.pop(BASE_KEY, None), where):
        merged = _merge(merged, _read_layered(base_dir / name, chain, named_by=where))
    return _merge(merged, values)


def _read_layered(path: Path, chain: tuple[Path, ...], named_by: str | None = None) -> dict:
    """The values of the YAML file at `path`, merged over its bases (recursively)."""
    if not path.is_file():
        if named_by is None:
            raise ConfigError(f"config file not found: {path}")
        raise ConfigError(f"{named_by}: base config file not found: {path}")
    key = path.resolve()
    if key in chain:
        cycle = " -> ".join(str(p) for p in (*chain[chain.index(key):], key))
        raise ConfigError(f"{path}: `{BASE_KEY}` files form a cycle: {cycle}")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: config: expected a mapping, got {values!r}")
    return _resolve_bases(values, path.parent, str(path), (*chain, key))


def load_values(path: str | Path) -> dict:
    """The raw values of a config file after its `base:` files are merged in (no overrides, no
    validation): what `load_config` builds the TrainConfig from."""
    return _read_layered(Path(path), ())


def config_from_dict(values: dict, overrides: typing.Sequence[str] = (),
                     base_dir: str | Path | None = None) -> TrainConfig:
    """A TrainConfig from parsed YAML values; a `base:` key in them names files relative to
    `base_dir` (default: the working directory). Overrides apply after the bases."""
    values = values or {}
    if isinstance(values, dict) and BASE_KEY in values:
        values = _resolve_bases(values, Path.cwd() if base_dir is None else Path(base_dir), "config", ())
    values = {k: dict(v) if isinstance(v, dict) else v for k, v in values.items()}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        _set_dotted(values, key.strip(), yaml.safe_load(raw))
    return _build(TrainConfig, values, "")


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> TrainConfig:
    path = Path(path)
    values = _read_layered(path, ())  # names the file on a missing file, bad YAML, a bad or cyclic base
    try:
        return config_from_dict(values, overrides)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
