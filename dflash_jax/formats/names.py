"""Declarative name tables: Hugging Face tensor name <-> Flax param path, with per-key transforms.

One table serves both directions (`hf_to_params` when loading, `params_to_hf` when exporting).
Per-layer names contain ``{i}``; their Flax params are stacked on a leading layer axis (nn.scan).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import Any, Callable, Collection, Mapping

import jax
import numpy as np

from dflash_jax import _host_arrays as host_arrays
from dflash_jax._errors import CheckpointError
from dflash_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows of a fused checkpoint tensor of `total` rows (its first axis): a param holds rows `index` of
    it, in that order; the rules of one tensor share it, their rows together covering it once
    (Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped per key head, `families.qwen3_next`)."""

    index: tuple[int, ...]
    total: int


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: str  # Hugging Face name; "{i}" marks the layer index
    path: tuple[str, ...]  # Flax param path
    transpose: bool = False  # PyTorch Linear [out, in] <-> Flax Dense kernel [in, out] (all axes reversed)
    # the HF layers stacked under `path`, in order (None: 0 .. num_layers - 1); a hybrid target
    # stacks every layer of one position of its layer pattern
    layer_ids: tuple[int, ...] | None = None
    # "{e}" in `hf`: one tensor per expert, stacked [layers, experts, ...] (an MoE layer's experts)
    experts: int = 0
    # (start, step): the param is the checkpoint tensor's last-axis columns start::step (gpt-oss's
    # gate and up columns interleaved in one tensor); two rules with steps 2 share the tensor
    columns: tuple[int, int] | None = None
    # the param's output features are these rows of a fused checkpoint tensor (`Rows`)
    rows: Rows | None = None
    # the last two axes swapped: a checkpoint's stacked experts [E, out, in] <-> the param's [E, in, out]
    # (Gemma 4's fused experts)
    swap_last: bool = False

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def stacked_axes(self) -> int:
        """Leading axes of the param that stack checkpoint tensors (layers, then experts)."""
        return int(self.per_layer) + int(self.experts > 0)

    def hf_names(self, num_layers: int) -> list[str]:
        if not self.per_layer:
            return [self.hf]
        ids = range(num_layers) if self.layer_ids is None else self.layer_ids
        if self.experts:
            return [self.hf.format(i=i, e=e) for i in ids for e in range(self.experts)]
        return [self.hf.format(i=i) for i in ids]

    def index(self, k: int):
        """Where the k-th of `hf_names` goes in the stacked param."""
        return divmod(k, self.experts) if self.experts else k


def linear_rules(hf_prefix: str, path: tuple[str, ...], bias: bool) -> list[Rule]:
    """The rules of one linear layer: its weight (transposed) and, with `bias`, its bias."""
    rules = [Rule(f"{hf_prefix}.weight", (*path, "kernel"), transpose=True)]
    if bias:
        rules.append(Rule(f"{hf_prefix}.bias", (*path, "bias")))
    return rules


def decoder_layer_rules(hf_layer: str, qk_norm: bool, attention_bias: bool, mlp_bias: bool) -> list[Rule]:
    """Rules of one Qwen3/Llama decoder layer (shared by the target and the drafter)."""
    rules = [
        Rule(f"{hf_layer}.input_layernorm.weight", ("layers", "input_layernorm", "scale")),
        Rule(f"{hf_layer}.post_attention_layernorm.weight", ("layers", "post_attention_layernorm", "scale")),
    ]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        rules += linear_rules(f"{hf_layer}.self_attn.{proj}", ("layers", "self_attn", proj), attention_bias)
    if qk_norm:
        rules += [Rule(f"{hf_layer}.self_attn.{n}.weight", ("layers", "self_attn", n, "scale"))
                  for n in ("q_norm", "k_norm")]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        rules += linear_rules(f"{hf_layer}.mlp.{proj}", ("layers", "mlp", proj), mlp_bias)
    return rules


def moe_layer_rules(hf_layer: str, experts: int, path: tuple[str, ...] = ("layers", "mlp"),
                    layer_ids: tuple[int, ...] | None = None, shared_expert: bool = False) -> list[Rule]:
    """The MoE block of a Qwen3-MoE layer in its released layout: the router `mlp.gate` [E, D] and
    each expert's gate / up / down projections, stacked [L, E, ...] (kernels [in, out]) under `path`
    (`layer_ids`: `Rule.layer_ids`). shared_expert: Qwen3.5-MoE's shared expert `mlp.shared_expert.*`
    and its gate `mlp.shared_expert_gate` [1, D] too. (A checkpoint whose experts are fused,
    `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, reads through `unfuse_experts`.)"""
    rules = [Rule(f"{hf_layer}.mlp.gate.weight", (*path, "router", "kernel"), transpose=True, layer_ids=layer_ids)]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        rules.append(Rule(f"{hf_layer}.mlp.experts.{{e}}.{proj}.weight", (*path, proj), transpose=True,
                          experts=experts, layer_ids=layer_ids))
    if shared_expert:
        rules += _linear_rules(f"{hf_layer}.mlp.shared_expert", (*path, "shared_expert"),
                               ("gate_proj", "up_proj", "down_proj"), False, layer_ids)
        rules += _linear_rules(f"{hf_layer}.mlp", path, ("shared_expert_gate",), False, layer_ids)
    return rules


_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


class _UnfusedExperts(Mapping):
    """`tensors` with each fused expert tensor shown as the per-expert tensors it holds (views, never
    copies: a memory-mapped file stays unread until a weight is built)."""

    def __init__(self, tensors: Mapping[str, np.ndarray], source: str):
        self._tensors, self._views = tensors, {}
        for name in tensors:
            match = _FUSED_EXPERTS.match(name)
            if match is None:
                self._views[name] = (name, None)
                continue
            shape = np.shape(tensors[name])
            prefix, proj = match["prefix"], match["proj"]
            if len(shape) != 3 or (proj == "gate_up_proj" and shape[1] % 2):
                raise CheckpointError(f"{source}: fused expert tensor {name} has shape {shape}; expected "
                                      "[experts, 2 x width, hidden] (gate_up_proj) or [experts, hidden, width] "
                                      "(down_proj)")
            for e in range(shape[0]):
                if proj == "down_proj":
                    self._views[f"{prefix}.{e}.down_proj.weight"] = (name, (e, slice(None)))
                else:
                    half = shape[1] // 2
                    self._views[f"{prefix}.{e}.gate_proj.weight"] = (name, (e, slice(0, half)))
                    self._views[f"{prefix}.{e}.up_proj.weight"] = (name, (e, slice(half, None)))

    def __getitem__(self, name: str) -> np.ndarray:
        stored, part = self._views[name]
        value = self._tensors[stored]
        return value if part is None else value[part]

    def __contains__(self, name) -> bool:
        return name in self._views

    def __iter__(self):
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)


def unfuse_experts(tensors: Mapping[str, np.ndarray], source: str = "checkpoint") -> Mapping[str, np.ndarray]:
    """An MoE checkpoint as the per-expert names the name table reads. The released Qwen3.5-MoE /
    Qwen3.6-MoE checkpoints (and transformers 5's own modules) hold each layer's experts fused:
    `mlp.experts.gate_up_proj` [E, 2I, D] (gate rows, then up rows) and `mlp.experts.down_proj`
    [E, D, I]; transformers' save_pretrained writes them per expert, `mlp.experts.{e}.gate_proj.weight`
    [I, D] and so on. Either reads the same; a checkpoint without fused tensors is returned as is."""
    if not any(_FUSED_EXPERTS.match(name) for name in tensors):
        return tensors
    return _UnfusedExperts(tensors, source)


def target_rules(cfg: ModelConfig, prefix: str = "model.") -> list[Rule]:
    """The name table of a target: its family's (`dflash_jax.families.base.Family.target_rules`; prefix:
    the text model's prefix in the checkpoint, e.g. "model.language_model." for a multimodal one)."""
    return cfg.family.target_rules(cfg, prefix)


def _linear_rules(hf_prefix: str, path: tuple[str, ...], names, bias: bool, ids) -> list[Rule]:
    return [dataclasses.replace(rule, layer_ids=ids)
            for n in names for rule in linear_rules(f"{hf_prefix}.{n}", (*path, n), bias)]


# Tensors some checkpoints carry that hold no parameters.
IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def hf_to_params(rules: list[Rule], tensors: Mapping[str, np.ndarray], shapes: Any, num_layers: int,
                 dtype, *, allow_extra: Callable[[str], bool] = lambda name: False,
                 progress: Callable | None = None, source: str = "checkpoint",
                 skip: Collection[tuple[str, ...]] = (),
                 shape_of: Callable[[str], tuple[int, ...]] | None = None,
                 place: Callable[[tuple[str, ...], np.ndarray], Any] | None = None) -> dict:
    """Build a Flax params dict from HF-named tensors, one tensor at a time.

    `shapes` is the expected params pytree (e.g. from jax.eval_shape). Every expected tensor must be
    present with the right shape and every tensor present must be mapped (or allowed): otherwise a
    CheckpointError names `source` (the checkpoint's path) and the offenders. `skip`: param paths
    (`Rule.path`) the caller has in another form: their tensors must be present with the right
    shape, found by `shape_of(name)` (default: the tensor's own), but are not read, and the params
    returned lack them. `place(path, array)`: how each finished host array becomes a param (default
    `host_arrays.adopt`; a sharded load puts it on its shards), called before the next is built, so
    the host holds one weight at a time.
    """
    np_dtype = np.dtype(dtype)  # jnp.bfloat16 is ml_dtypes.bfloat16, a numpy dtype
    expected_names = {name for rule in rules for name in rule.hf_names(num_layers)}
    present = set(tensors)
    missing = sorted(expected_names - present)
    if missing:
        raise CheckpointError(f"{source} is missing {len(missing)} tensor(s): {missing[:8]}")
    unmapped = sorted(n for n in present - expected_names
                      if not allow_extra(n) and not any(p.match(n) for p in IGNORED))
    if unmapped:
        raise CheckpointError(f"{source} has {len(unmapped)} tensor(s) this model does not use: {unmapped[:8]}")
    params: dict = {}
    shape_of = shape_of or (lambda name: np.shape(tensors[name]))
    assemble = getattr(place, "assemble", None)
    for rule in rules:
        want = _get(shapes, rule.path).shape
        # a param the model keeps in float32 whatever its dtype (a sigmoid router's correction bias) stays so
        leaf_dtype = np.dtype(np.float32) if _keeps_float32(_get(shapes, rule.path)) else np_dtype
        layer_shape = tuple(want[rule.stacked_axes:])
        need = tuple(reversed(layer_shape)) if rule.transpose else layer_shape  # as the checkpoint holds it
        need = (*need[:-2], need[-1], need[-2]) if rule.swap_last else need
        if rule.columns:  # the whole tensor, of which the param is every step-th column
            need = (*need[:-1], need[-1] * rule.columns[1])
        if rule.rows:  # the whole fused tensor, of which the param is some rows
            need = (rule.rows.total, *need[1:])
        if rule.path in skip:
            for name in rule.hf_names(num_layers):
                if tuple(shape_of(name)) != need:
                    raise CheckpointError(f"{source}: tensor {name} has shape {tuple(shape_of(name))}, expected {need}")
            continue
        if assemble is not None:  # a sharded load: each device's block read on its own
            read = functools.partial(_read_block, rule, tensors, tuple(want), need, leaf_dtype, num_layers, source)
            _set(params, rule.path, assemble(rule.path, tuple(want), read))
            for name in rule.hf_names(num_layers):
                if progress:
                    progress(name)
            continue
        out = host_arrays.empty(want, leaf_dtype)
        for i, name in enumerate(rule.hf_names(num_layers)):
            value = _oriented(rule, _read_tensor(rule, tensors, name, need, source))
            if rule.per_layer:
                out[rule.index(i)] = value.astype(leaf_dtype)
            else:
                out[...] = value.astype(leaf_dtype)
            if progress:
                progress(name)
        _set(params, rule.path, host_arrays.adopt(out) if place is None else place(rule.path, out))
        del out
    unfilled = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)
                if tuple(k.key for k in p) not in skip and not _has(params, tuple(k.key for k in p))]
    if unfilled:
        raise ValueError(f"name table leaves params unfilled: {unfilled}")
    return params


def _keeps_float32(template) -> bool:
    """Whether a param's template (a ShapeDtypeStruct of `shapes`) is float32: the model keeps it so
    whatever the dtype asked for (`layers.moe.MoE`'s correction bias, as transformers keeps it)."""
    dtype = getattr(template, "dtype", None)
    return dtype is not None and np.dtype(dtype) == np.float32


def _read_block(rule: Rule, tensors, want: tuple, need: tuple, dtype, num_layers: int, source: str,
                index) -> np.ndarray:
    """The block `index` (a tuple of slices over the param's shape `want`) of the param that `rule`
    fills, read from the checkpoint tensors that overlap it and nothing else: a device's shard of
    a stacked weight reads its layers' (and experts') tensors, and of each only its slice."""
    index = tuple(index) + (slice(None),) * (len(want) - len(tuple(index)))
    spans = [range(*s.indices(n)) for s, n in zip(index, want)]
    block = host_arrays.empty(tuple(len(r) for r in spans), dtype)
    lead = rule.stacked_axes
    names = rule.hf_names(num_layers)
    inner = tuple(index[lead:])
    stacked = [spans[0]] + ([spans[1]] if rule.experts else []) if rule.per_layer else []
    for at in itertools.product(*[range(len(r)) for r in stacked]):
        position = tuple(r[i] for r, i in zip(stacked, at))
        name = names[position[0] * rule.experts + position[1] if rule.experts else (position[0] if position else 0)]
        # the first axis cut before the tensor is read (an MXFP4 one's experts)
        if inner and not rule.transpose and rule.rows is None:
            value = _oriented(rule, _read_tensor(rule, tensors, name, need, source, inner[0]))
            block[at] = value[(slice(None), *inner[1:])].astype(dtype)
        else:
            value = _oriented(rule, _read_tensor(rule, tensors, name, need, source))
            block[at] = value[inner].astype(dtype)
    return block


def _oriented(rule: Rule, value) -> np.ndarray:
    """A checkpoint tensor in the param's orientation (`Rule.transpose`, `Rule.swap_last`); the inverse of
    itself."""
    if rule.transpose:
        return value.T
    return np.swapaxes(value, -1, -2) if rule.swap_last else value


def _read_tensor(rule: Rule, tensors, name: str, need: tuple, source: str, first: slice = slice(None)) -> np.ndarray:
    """Checkpoint tensor `name` as `rule` reads it (before any transpose): its shape checked against
    `need` (the whole tensor's), then the rows `first` of its first axis and its columns
    (`Rule.columns`) or rows (`Rule.rows`) picked. A lazy tensor (an MXFP4 one, `loading.mxfp4`) is read only here, and
    only the part asked for."""
    value = tensors[name]
    value = value if hasattr(value, "shape") else np.asarray(value)
    if tuple(value.shape) != need:
        raise CheckpointError(f"{source}: tensor {name} has shape {tuple(value.shape)}, expected {need}")
    if first != slice(None):
        value = value.first_axis(first) if hasattr(value, "first_axis") else np.asarray(value)[first]
    if rule.rows:
        return np.asarray(value)[np.asarray(rule.rows.index)]
    return _columns(value, rule.columns) if rule.columns else np.asarray(value)


def _columns(value, columns: tuple[int, int]) -> np.ndarray:
    """The last-axis columns start::step of a checkpoint tensor: a lazy tensor's own `columns` where
    it has one (an MXFP4 tensor dequantises only those), else a strided copy."""
    if hasattr(value, "columns"):
        return value.columns(*columns)
    start, step = columns
    return np.ascontiguousarray(np.asarray(value)[..., start::step])


def _has(tree, path) -> bool:
    try:
        _get(tree, path)
        return True
    except (KeyError, TypeError):
        return False


def params_to_hf(rules: list[Rule], params: Any, num_layers: int) -> dict[str, np.ndarray]:
    """The inverse of `hf_to_params`: HF name -> numpy array in HF layout, the params' dtype kept."""
    out = {}
    for rule in rules:
        value = np.asarray(jax.device_get(_get(params, rule.path)))
        for i, name in enumerate(rule.hf_names(num_layers)):
            layer = value[rule.index(i)] if rule.per_layer else value
            layer = _oriented(rule, layer)
            if rule.columns:  # interleave into the shared tensor
                start, step = rule.columns
                whole = out.setdefault(name, np.zeros((*layer.shape[:-1], layer.shape[-1] * step), layer.dtype))
                whole[..., start::step] = layer
            elif rule.rows:  # into its rows of the shared fused tensor
                whole = out.setdefault(name, np.zeros((rule.rows.total, *layer.shape[1:]), layer.dtype))
                whole[np.asarray(rule.rows.index)] = layer
            else:
                out[name] = np.ascontiguousarray(layer)
    return out


def drafter_rules(attention_bias: bool = False) -> list[Rule]:
    """The official DFlash drafter layout's backbone (no `model.` prefix, no embeddings, no LM head);
    a drafter generation adds its own tensors' rules (`drafters.generations.Generation.name_rules`)."""
    rules = [Rule("fc.weight", ("fc", "kernel"), transpose=True),
             Rule("hidden_norm.weight", ("hidden_norm", "scale")),
             Rule("norm.weight", ("norm", "scale"))]
    return rules + decoder_layer_rules("layers.{i}", True, attention_bias, False)
