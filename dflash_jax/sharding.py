"""Device meshes and the rules that place every weight, cache and batch on one.

One `jax.sharding.Mesh` with axes named for what they shard:
- `data`: the batch (rows of a generation batch, examples of a training batch);
- `fsdp`: training's parameter sharding (each kernel of rank >= 2 split along its largest divisible
  axis, the optimizer state alike: `fsdp_spec`); generation leaves it at 1;
- `expert`: a mixture-of-experts target's experts (expert parallelism for generation);
- `tensor`: Megatron tensor parallelism for generation (`param_spec`).

`make_mesh(data, tensor, fsdp, expert)` lays the devices out with `tensor` innermost (the devices of
one tensor group are adjacent: on a GPU host, the ones joined by the fastest links), `expert` next.

Generation's parameter rules are declared in two parts, as MaxText and tpu-inference do:
1. each parameter kind names the LOGICAL axes of its trailing dims (`PARAM_AXES`, filled by
   `declare_param_axes`, keyed by the last names of a param path; the longest declared suffix of a
   path wins, so a family module can declare its own kinds beside these). The leading axes a
   declaration leaves out are stacked axes ([L, ...] layers, a hybrid's [groups, ...]) and are never
   split;
2. one table maps each logical axis to a mesh axis (`LOGICAL_AXIS_RULES`), with what must divide for
   the split (`_mesh_axis`).
An array of rank >= 2 that no declaration covers is a ValueError naming its path and shape (never
replicated silently); an undeclared vector (rank <= 1) is replicated. The rules (the stacked "xla"
layout; the CPU backend's packed layout is for one device and is never sharded), for the target
and the drafter alike:
- "q_heads" (q_proj columns and bias, o_proj rows; Qwen3.5's q_proj holds each head's query and
  gate side by side, whole heads still): over `tensor`, which must divide the query heads, else a
  ValueError naming the weight and both numbers;
- "kv_heads" (k_proj / v_proj columns and biases): over `tensor` where it divides the kv heads. Where
  the kv heads are fewer and the tensor axis is a multiple of them (a 4-kv-head Qwen3.5-27B on
  tensor=8), k_proj / v_proj are replicated (they are small) and the attention repeats each projected
  kv head `kv_replicas` = tensor / kv_heads times (consecutive copies, so query head h still reads
  kv head h // (heads / kv_heads)) before it writes the cache and attends: the KV cache holds
  `tensor` heads, head j a copy of kv head j // kv_replicas, split over `tensor`, one per device,
  and each device attends its own query heads over its own copy (vLLM's and MaxText's kv-head
  replication). `spec_for_mesh` sets `kv_replicas` on the target's and the drafter's specs for a
  mesh (the Generator does). A target whose layers differ in kv heads (Gemma 4: sliding and full
  layers, `ModelConfig.kv_groups`) gets each group's copies (`group_kv_replicas`, a tuple where they
  differ), and a k/v projection is split or replicated by its own group's count. A tensor axis
  that neither divides nor is a multiple of the kv heads is a ValueError naming the weight and both
  numbers;
- "mlp" (gate_proj / up_proj columns and biases, down_proj rows; dense, a shared expert's, and each
  routed expert's) and "draft_hidden" (the drafter's fc output): over `tensor`, which must divide
  them (ValueError naming the weight, its shape and the axis size);
- "vocab" (the embedding table [V, D], an untied lm_head [D, V], a reduced draft head [D, Vd]): over
  `tensor` where it divides the vocabulary, else replicated;
- "expert" (an MoE layer's experts stacked [L, E, ...] directly under its "mlp" module): over
  `expert`, which must divide E; within each expert the "mlp" split over `tensor`;
- Gated DeltaNet (Qwen3.5's linear_attn): "linear_qkv" (in_proj_qkv's columns, conv1d's channels),
  "linear_v" (in_proj_z's columns, out_proj's rows: value heads x Dv) and "linear_heads" (in_proj_b /
  in_proj_a columns, A_log, dt_bias: one per value head) over `tensor` where it divides the key
  heads (and so the value heads, a multiple of them), else all replicated. in_proj_qkv's columns
  are [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)] in the checkpoint, so a contiguous split of them would give
  a device parts of other devices' heads (XLA would then move the conv output between devices in
  every layer of every step). On a mesh these columns, and conv1d's channels, are regrouped once when
  the Generator places the params (`place_params`, `linear_channel_order`): `tensor` groups
  [q heads of shard s | k heads of s | v heads of s], so a contiguous split gives each device its own
  heads' weights, and its projection, conv, delta rule and gated norm run on them alone until
  out_proj's all-reduce; no weight moves in the compiled programs (vLLM's loader takes the same
  per-shard slices). The model reads this layout from `TargetSpec.linear_groups` (also set by
  `spec_for_mesh`); one device's params, a loaded Target's and exported ones keep the checkpoint
  order;
- norms ("norm"), the router and a shared expert's gate ("router"), attention sinks ("sinks"), the
  conv's taps ("conv"), the model width ("embed") and the fc's input ("features"): replicated.
Dense weights are replicated over `expert` (and the batch is split over `data` only).

Caches (`cache_shardings`): a `KVCache`'s k / v [L, B, S, Hc, D] over `data` on B (where it divides,
else replicated) and over `tensor` on its Hc heads (kv_heads x kv_replicas; the tensor axis must
divide them); lengths [B] over `data`. A `HybridCache`: its KV cache so, and its conv tails
[Nl, B, K-1, C] (channels) and delta-rule states [Nl, B, Hv, Dk, Dv] (value heads) over `data` on B
and over `tensor` where the cache's channel groups (`HybridCache.groups`, its `linear_groups`) are a
multiple of the tensor axis, else replicated over it, as the linear layers' weights are.

No collective is written by hand: programs are jitted with these shardings and XLA's SPMD
partitioner inserts the collectives. The same code runs on 1 device, 8 simulated CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`), a GPU host and, after
`initialize_distributed`, many hosts.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


AXES = ("data", "fsdp", "expert", "tensor")  # the mesh's axes, outermost first
TRAIN_BATCH_AXES = ("data", "fsdp")  # a training batch is split over both
DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


# ----------------------------------------------------------------------------------------------
# The mesh


def make_mesh(data: int = -1, tensor: int = 1, fsdp: int = 1, devices: Sequence | None = None,
              expert: int = 1) -> Mesh:
    """A ('data', 'fsdp', 'expert', 'tensor') mesh over `devices` (None: all of `jax.devices()`);
    data=-1 takes what the other axes leave. ValueError when the sizes do not fit the devices."""
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("tensor", tensor), ("fsdp", fsdp), ("expert", expert)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"make_mesh: {name} must be an int >= 1, got {size!r}")
    others = tensor * fsdp * expert
    if data == -1:
        if len(devices) % others:
            raise ValueError(f"make_mesh: tensor={tensor} x fsdp={fsdp} x expert={expert} does not divide the "
                             f"{len(devices)} devices")
        data = len(devices) // others
    if not isinstance(data, int) or data < 1:
        raise ValueError(f"make_mesh: data must be -1 or an int >= 1, got {data!r}")
    if data * others != len(devices):
        sizes = f"data={data} x fsdp={fsdp}" + (f" x expert={expert}" if expert > 1 else "") + f" x tensor={tensor}"
        raise ValueError(f"make_mesh: {sizes} needs {data * others} devices, found {len(devices)}")
    return Mesh(np.asarray(devices, dtype=object).reshape(data, fsdp, expert, tensor), AXES)


def parse_mesh(text: str) -> dict[str, int]:
    """"tensor=4,data=2" -> {"tensor": 4, "data": 2} (make_mesh's keywords); ValueError naming
    the bad part."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in AXES or not value.lstrip("-").isdigit():
            raise ValueError(f"mesh: {part!r} is not AXIS=SIZE with AXIS one of {', '.join(AXES)}")
        sizes[name] = int(value)
    return sizes


def axis_size(mesh: Mesh | None, axis: str) -> int:
    """The size of `axis` in `mesh` (1 when there is no mesh or it lacks the axis)."""
    return 1 if mesh is None or axis not in mesh.shape else int(mesh.shape[axis])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _names(path) -> tuple[str, ...]:
    """A pytree key path (or a tuple of names) as names."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _spec(rank: int, axis: int, name: str | None) -> P:
    """A PartitionSpec of `rank` dims with dim `axis` (negative: from the end) on mesh axis `name`."""
    entries = [None] * rank
    if name is not None:
        entries[axis % rank] = name
    return P(*entries)


# ----------------------------------------------------------------------------------------------
# Generation: logical axes, one table to the mesh


# The one table: logical axis -> the mesh axis it is split over (None: never split). What must
# divide for a split, and what happens where it does not, is `_mesh_axis`'s (module docstring).
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "embed": None,  # the model width D
    "features": None,  # the drafter fc's input: the target's captured layers side by side
    "norm": None,  # a norm's scale
    "router": None,  # a router's expert logits, a shared expert's gate
    "sinks": None,  # attention sinks, one per query head (a small vector)
    "conv": None,  # a Gated DeltaNet conv kernel's taps and its one input channel
    "vocab": "tensor",  # where the tensor axis divides the vocabulary, else replicated
    "q_heads": "tensor",  # query heads (x head_dim): the tensor axis must divide the heads
    "kv_heads": "tensor",  # kv heads: split where the tensor axis divides them, replicated where a multiple
    "mlp": "tensor",  # an MLP's (or an expert's) hidden width
    "draft_hidden": "tensor",  # the drafter fc's output
    "linear_qkv": "tensor",  # Gated DeltaNet's q | k | v channels, grouped per shard (`linear_channel_order`)
    "linear_v": "tensor",  # Gated DeltaNet value heads x Dv
    "linear_heads": "tensor",  # Gated DeltaNet value heads
    "expert": "expert",  # an MoE layer's experts
    "conv_dynamic": None,  # a DFlash2 drafter's projected conv kernel: 2 x taps x channel groups
    "selector_rank": None,  # a DFlash2 drafter's candidate-selector rank
    "latent": None,  # multi-head latent attention's low-rank q and kv latents (DeepSeek-V3)
    "markov_rank": None,  # a DSpark drafter's Markov-head rank
    "confidence": None,  # a DSpark drafter's confidence head (inputs D + r, one output)
}
_LINEAR = ("linear_qkv", "linear_v", "linear_heads")
_UNITS = {"mlp": "MLP channels", "draft_hidden": "output columns", "expert": "experts"}

# A param path's last names -> the logical axes of its trailing dims (`declare_param_axes`).
PARAM_AXES: dict[tuple[str, ...], tuple[str, ...]] = {}


def declare_param_axes(declarations: Mapping[tuple[str, ...], tuple[str, ...]]) -> None:
    """Declare parameter kinds: (the last names of a param path, e.g. ("self_attn", "k_proj",
    "kernel")) -> the logical axes (`LOGICAL_AXIS_RULES`) of its trailing dims; the leading dims left
    out are stacked axes, never split. The longest declared suffix of a path wins. A family module
    declares its own kinds here. ValueError for an unknown logical axis or a kind already declared
    otherwise."""
    for suffix, axes in declarations.items():
        suffix, axes = tuple(suffix), tuple(axes)
        unknown = [a for a in axes if a not in LOGICAL_AXIS_RULES]
        if unknown:
            raise ValueError(f"declare_param_axes: {'/'.join(suffix)}: unknown logical axes {unknown}; "
                             f"known: {sorted(LOGICAL_AXIS_RULES)}")
        if PARAM_AXES.get(suffix, axes) != axes:
            raise ValueError(f"declare_param_axes: {'/'.join(suffix)} is declared {PARAM_AXES[suffix]} already, "
                             f"not {axes}")
        PARAM_AXES[suffix] = axes


declare_param_axes({
    # attention (target and drafter; gpt-oss's biases and sinks)
    ("q_proj", "kernel"): ("embed", "q_heads"), ("q_proj", "bias"): ("q_heads",),
    ("k_proj", "kernel"): ("embed", "kv_heads"), ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("embed", "kv_heads"), ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("q_heads", "embed"), ("o_proj", "bias"): ("embed",),
    ("self_attn", "sinks"): ("sinks",),
    ("scale",): ("norm",),  # every RMSNorm (layer norms, q/k norms, the final and hidden norms)
    # a dense MLP, a shared expert's alike
    ("gate_proj", "kernel"): ("embed", "mlp"), ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "kernel"): ("embed", "mlp"), ("up_proj", "bias"): ("mlp",),
    ("down_proj", "kernel"): ("mlp", "embed"), ("down_proj", "bias"): ("embed",),
    # an MoE block: experts stacked [E, ...] directly under "mlp", the router, a shared expert's gate
    ("mlp", "gate_proj"): ("expert", "embed", "mlp"), ("mlp", "up_proj"): ("expert", "embed", "mlp"),
    ("mlp", "down_proj"): ("expert", "mlp", "embed"),
    ("mlp", "gate_bias"): ("expert", "mlp"), ("mlp", "up_bias"): ("expert", "mlp"),
    ("mlp", "down_bias"): ("expert", "embed"),
    ("router", "kernel"): ("embed", "router"), ("router", "bias"): ("router",),
    ("shared_expert_gate", "kernel"): ("embed", "router"),
    ("e_score_correction_bias",): ("router",),  # the sigmoid router's correction bias [E] (DeepSeek-V3, GLM, MiniMax)
    # vocabulary tables, the drafter's fc
    ("embed_tokens", "embedding"): ("vocab", "embed"), ("lm_head", "kernel"): ("embed", "vocab"),
    ("draft_head", "kernel"): ("embed", "vocab"),
    ("fc", "kernel"): ("features", "draft_hidden"),
    # Gated DeltaNet (Qwen3.5's linear attention)
    ("linear_attn", "in_proj_qkv", "kernel"): ("embed", "linear_qkv"),
    ("linear_attn", "in_proj_z", "kernel"): ("embed", "linear_v"),
    ("linear_attn", "in_proj_b", "kernel"): ("embed", "linear_heads"),
    ("linear_attn", "in_proj_a", "kernel"): ("embed", "linear_heads"),
    ("linear_attn", "conv1d"): ("conv", "conv", "linear_qkv"),  # [K, 1, C]
    ("linear_attn", "A_log"): ("linear_heads",), ("linear_attn", "dt_bias"): ("linear_heads",),
    ("linear_attn", "out_proj", "kernel"): ("linear_v", "embed"),
})


def _stacked(names) -> bool:
    """A param of the stacked layers: under "layers", or a segment's "layers_{s}" (`dflash_jax.models.stack`)."""
    return any(name == "layers" or name.startswith("layers_") for name in names)


def param_axes(path, shape: Sequence[int]) -> tuple[str | None, ...]:
    """The logical axis of each dim of a weight (None for its stacked leading axes and for an
    undeclared vector); ValueError naming it where no declaration covers an array of rank >= 2 or
    its declaration does not fit its shape."""
    names, rank = _names(path), len(shape)
    declared = max((suffix for suffix in PARAM_AXES if names[-len(suffix):] == suffix), key=len, default=None)
    where = f"{'/'.join(names)} of shape {list(shape)}"
    if declared is None:
        if rank >= 2:
            raise ValueError(f"{where}: no sharding rule declares this weight's axes; declare them with "
                             "dflash_jax.sharding.declare_param_axes")
        return (None,) * rank
    axes = PARAM_AXES[declared]
    stacked = rank - len(axes)
    if stacked not in (0, 1) or (stacked and not _stacked(names)):
        raise ValueError(f"{where}: its declared axes {axes} (as {'/'.join(declared)}) do not fit its rank")
    return (None,) * stacked + axes


def kv_replicas(num_heads: int, num_kv_heads: int, tensor: int, what: str = "attention") -> int:
    """The copies of each kv head a tensor axis of size `tensor` needs (module docstring): 1 where it
    divides the kv heads, tensor / kv_heads where it is a multiple of them. ValueError naming both
    numbers (and `what`) where it does not divide the query heads, or neither divides nor is a
    multiple of the kv heads."""
    if tensor <= 1:
        return 1
    if num_heads % tensor:
        raise ValueError(f"{what}: its {num_heads} query heads are not a multiple of the mesh's tensor axis of "
                         f"size {tensor}; choose a tensor size that divides {num_heads}")
    if num_kv_heads % tensor == 0:
        return 1
    if tensor % num_kv_heads:
        raise ValueError(f"{what}: its {num_kv_heads} kv-heads are neither a multiple nor a divisor of the mesh's "
                         f"tensor axis of size {tensor}; choose a tensor size that divides {num_kv_heads} or "
                         f"is a multiple of it")
    return tensor // num_kv_heads


def group_kv_replicas(config, tensor: int) -> int | tuple[int, ...]:
    """The copies of each kv head a target (or drafter) needs on a tensor axis of size `tensor`: `kv_replicas`
    of its kv heads. For a target whose attention layers keep keys of different kv-head counts
    (`ModelConfig.kv_groups`: Gemma 4's sliding and full layers) each group's own, a tuple in the groups'
    order where they differ (the layers and `models.cache.GroupedKVCache` read their group's)."""
    groups = getattr(config, "kv_groups", ())
    if not groups:
        return kv_replicas(config.num_heads, config.num_kv_heads, tensor)
    each = tuple(kv_replicas(config.num_heads, heads, tensor, f"attention layers of {heads} kv heads")
                 for (heads, _), _ in groups)
    return each[0] if len(set(each)) == 1 else each


def replicas_of_group(replicas: int | tuple[int, ...], group: int) -> int:
    """Kv group `group`'s copies of each kv head, of a `group_kv_replicas` value."""
    return replicas[group] if isinstance(replicas, tuple) else replicas


def _kv_weight_replicas(config, dim: int, tensor: int, where: str) -> int:
    """The copies of its kv heads a k/v projection of `dim` columns needs on a tensor axis of size `tensor`:
    those of the kv groups (`ModelConfig.kv_groups`) whose heads x head dim is `dim` (the largest where several
    match), else of the config's kv heads."""
    groups = [heads for (heads, d), _ in getattr(config, "kv_groups", ()) if heads * d == dim]
    return max((kv_replicas(config.num_heads, heads, tensor, where) for heads in groups),
               default=kv_replicas(config.num_heads, config.num_kv_heads, tensor, where))


def linear_groups(config, tensor: int) -> int:
    """The groups a Gated DeltaNet's q | k | v channels are laid out in on a tensor axis of size
    `tensor` (module docstring): `tensor` where it divides the key heads (and so the value heads),
    else 1 (the checkpoint's order; the linear layers replicated). 1 for a config without them."""
    linear = getattr(config, "linear", None)
    if (tensor > 1 and linear is not None and linear.num_key_heads % tensor == 0
            and linear.num_value_heads % tensor == 0):
        return tensor
    return 1


def linear_channel_order(config, groups: int) -> np.ndarray:
    """int [C]: the checkpoint channel (of [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]) at each channel of
    the layout in `groups` groups [q heads of group s | k heads of s | v heads of s] (identity for 1)."""
    qk = config.linear.num_key_heads * config.linear.key_head_dim
    v = config.linear.num_value_heads * config.linear.value_head_dim
    qk_part, v_part = qk // groups, v // groups
    return np.concatenate([np.arange(start + s * size, start + (s + 1) * size) for s in range(groups)
                           for start, size in ((0, qk_part), (qk, qk_part), (2 * qk, v_part))])


def regroup_linear(params, config, groups: int, shardings=None):
    """`params` (a hybrid target's, stacked) with each Gated DeltaNet's in_proj_qkv kernel columns and
    conv1d channels in the `groups` layout (`linear_channel_order`), put on `shardings` (the rules')
    where given; other leaves as they are."""
    if groups == 1:
        return params
    order = linear_channel_order(config, groups)
    shardings = jax.tree_util.tree_map(lambda _: None, params) if shardings is None else shardings

    def regroup(path, leaf, placed):
        names = _names(path)
        if names[-3:] != ("linear_attn", "in_proj_qkv", "kernel") and names[-2:] != ("linear_attn", "conv1d"):
            return leaf
        take = lambda x: jnp.take(x, order, axis=-1)  # noqa: E731
        return jax.jit(take, out_shardings=placed)(leaf)

    return jax.tree_util.tree_map_with_path(regroup, params, shardings)


def spec_for_mesh(spec, mesh: Mesh | None):
    """A `TargetSpec` or `DrafterSpec` (None passes through) with the layout `mesh` needs:
    `kv_replicas` (`kv_replicas`) and, for a target, `linear_groups`; as it is off a mesh."""
    if spec is None or mesh is None:
        return spec
    tensor, config = axis_size(mesh, "tensor"), spec.config
    layout = {"kv_replicas": group_kv_replicas(config, tensor)}
    if "linear_groups" in {f.name for f in dataclasses.fields(spec)}:
        layout["linear_groups"] = linear_groups(config, tensor)
    return dataclasses.replace(spec, **layout)


def _mesh_axis(logical: str | None, dim: int, where: str, config, tensor: int, expert: int) -> str | None:
    """The mesh axis one dim (of logical axis `logical`, size `dim`) is split over, or None; ValueError
    naming the weight (`where`) where a split it needs does not divide (module docstring)."""
    axis = LOGICAL_AXIS_RULES.get(logical) if logical is not None else None
    size = {"tensor": tensor, "expert": expert}.get(axis, 1)
    if axis is None or size <= 1:
        return None
    if logical == "vocab":
        return axis if dim % size == 0 else None
    if logical in ("q_heads", "kv_heads"):
        replicas = kv_replicas(config.num_heads, config.num_kv_heads, size, where) if logical == "q_heads" \
            else _kv_weight_replicas(config, dim, size, where)
        return axis if logical == "q_heads" or replicas == 1 else None
    if logical in _LINEAR:
        return axis if linear_groups(config, size) > 1 else None
    if dim % size:
        raise ValueError(f"{where}: its {dim} {_UNITS.get(logical, logical)} are not a multiple of the mesh's "
                         f"{axis} axis of size {size}")
    return axis


def param_spec(path, shape: Sequence[int], config, tensor: int, expert: int = 1) -> P:
    """The PartitionSpec of one target or drafter weight (path: its param path, e.g.
    ("layers", "self_attn", "k_proj", "kernel"); config: its ModelConfig or DrafterConfig, for the
    head counts) on a tensor axis of size `tensor` and an expert axis of size `expert`: its declared
    logical axes (`param_axes`) through `LOGICAL_AXIS_RULES` (module docstring). ValueError naming
    the weight and its shape where no declaration covers it (rank >= 2), and where a split dimension
    does not divide (with the numbers)."""
    shape = tuple(int(s) for s in shape)
    axes = param_axes(path, shape)
    where = f"{'/'.join(_names(path))} of shape {list(shape)}"
    return P(*(_mesh_axis(logical, dim, where, config, tensor, expert) for logical, dim in zip(axes, shape)))


def param_shardings(mesh: Mesh, params, config):
    """NamedShardings (by `param_spec`) for every leaf of a target's params or a drafter's
    `loop_params` (arrays or ShapeDtypeStructs) on `mesh`."""
    tensor, expert = axis_size(mesh, "tensor"), axis_size(mesh, "expert")
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, param_spec(path, np.shape(leaf), config, tensor, expert)), params)


def place_params(mesh: Mesh, params, config):
    """(params on `mesh` by the rules, their shardings): what a Generator generates from. A hybrid
    target's Gated DeltaNet q | k | v channels are regrouped for the mesh's tensor axis on the way
    (`linear_groups`, `regroup_linear`), the layout `spec_for_mesh` gives its spec."""
    shardings = param_shardings(mesh, params, config)
    params = regroup_linear(params, config, linear_groups(config, axis_size(mesh, "tensor")), shardings)
    return jax.device_put(params, shardings), shardings


def placer(mesh: Mesh, shapes, config) -> "Placer":
    """The `Placer` of a loader that reads params of `shapes` onto `mesh` by the rules."""
    return Placer(mesh, shapes, config)


class Placer:
    """How a loader (`names.hf_to_params`) puts each weight on the shards the rules give it
    (`param_shardings` of the expected param `shapes`, computed here, so a split that does not
    divide raises before any tensor is read).

    `assemble(path, shape, read)`: the weight built shard by shard: `read(index)` returns the host
    block of one device's index (a tuple of slices), each distinct block is read once, put on the
    devices that hold it and dropped, so the host never holds more than one shard of a weight (a
    30B MoE target's experts go to their devices a shard at a time). `place(path, host_array)`
    (calling the placer) puts a whole host array on its shards."""

    def __init__(self, mesh: Mesh, shapes, config):
        self.shardings = param_shardings(mesh, shapes, config)

    def sharding_of(self, path) -> NamedSharding:
        target = self.shardings
        for key in path:
            target = target[key]
        return target

    def __call__(self, path, array):
        return jax.device_put(array, self.sharding_of(path))

    def assemble(self, path, shape, read):
        target = self.sharding_of(path)
        devices_of: dict = {}  # a distinct block (its bounds) -> (index, the devices that hold it)
        for device, index in target.addressable_devices_indices_map(tuple(shape)).items():
            bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
            devices_of.setdefault(bounds, (index, []))[1].append(device)
        on_device = {}
        for index, devices in devices_of.values():
            block = read(index)
            for device in devices:
                on_device[device] = jax.device_put(block, device)
            del block
        arrays = [on_device[d] for d in target.addressable_devices_indices_map(tuple(shape))]
        return jax.make_array_from_single_device_arrays(tuple(shape), target, arrays)


def batch_spec(mesh: Mesh | None, batch: int, rank: int) -> P:
    """A generation batch array [B, ...]: B over `data` where the data axis divides it, else
    replicated."""
    data = axis_size(mesh, "data")
    return _spec(rank, 0, "data" if data > 1 and batch % data == 0 else None)


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """NamedSharding of a generation batch array of `shape` (`batch_spec`)."""
    return NamedSharding(mesh, batch_spec(mesh, shape[0], len(shape)))


def cache_shardings(mesh: Mesh, cache):
    """A decode cache (`dflash_jax.models.cache.Cache`: a `KVCache` or `HybridCache`, of arrays or
    ShapeDtypeStructs) of NamedShardings: the cache's own `shardings` (module docstring). ValueError
    when the tensor axis does not divide a KV cache's heads."""
    return cache.shardings(mesh)


def put(tree, shardings):
    """`jax.device_put` of a pytree onto its shardings (arrays already there are not copied)."""
    return jax.device_put(tree, shardings)


# ----------------------------------------------------------------------------------------------
# Training: parameter sharding over `fsdp`, the batch over ('data', 'fsdp')


def fsdp_spec(path, shape, fsdp_size: int) -> P:
    """PartitionSpec of one training param / optimizer-state leaf from its path and shape: with
    fsdp > 1, a kernel of rank >= 2 is split over 'fsdp' along its largest divisible axis (the
    stacked-layer axis of scanned layers is never split); everything else is replicated."""
    if fsdp_size <= 1 or len(shape) < 2:
        return P()
    first = 1 if _stacked(_names(path)) and len(shape) >= 3 else 0  # [L, ...] stacked layers
    axes = [a for a in range(first, len(shape)) if shape[a] % fsdp_size == 0]
    if not axes:
        return P()
    split = max(axes, key=lambda a: shape[a])
    return P(*[("fsdp" if a == split else None) for a in range(len(shape))])


def fsdp_shardings(mesh: Mesh, tree, shard: bool = True):
    """NamedShardings (`fsdp_spec`) for every leaf of `tree` (arrays or ShapeDtypeStructs);
    shard=False replicates."""
    fsdp_size = axis_size(mesh, "fsdp") if shard else 1
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, fsdp_spec(path, np.shape(leaf), fsdp_size)), tree)


def train_batch_sharding(mesh: Mesh) -> NamedSharding:
    """A training batch: its leading axis over ('data', 'fsdp')."""
    return NamedSharding(mesh, P(TRAIN_BATCH_AXES))


def global_batch(mesh: Mesh, local_batch: dict, sharding: NamedSharding | None = None) -> dict:
    """Per-process numpy arrays (leading axis = this process's rows) -> global jax arrays on
    `sharding` (default: a training batch's, `train_batch_sharding`)."""
    sharding = train_batch_sharding(mesh) if sharding is None else sharding
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """`jax.distributed.initialize` when the arguments or the JAX_* environment variables ask for
    it. Call before any other JAX work. CPU collectives go through gloo. Returns whether it ran."""
    if coordinator is None and num_processes is None and not any(v in os.environ for v in DISTRIBUTED_ENV):
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # used by CPU devices only
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    return True

