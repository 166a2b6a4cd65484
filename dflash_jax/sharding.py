"""Device meshes and the rules that place every weight, cache and batch on one.

One `jax.sharding.Mesh` with axes named for what they shard:
- `data`: the batch (rows of a generation batch, examples of a training batch);
- `fsdp`: training's parameter sharding (each kernel of rank >= 2 split along its largest divisible
  axis, the optimizer state alike: `fsdp_spec`); generation leaves it at 1;
- `expert`: a mixture-of-experts target's experts (expert parallelism for generation);
- `tensor`: Megatron tensor parallelism for generation (`param_spec`).

`make_mesh(data, tensor, fsdp, expert)` lays the devices out with `tensor` innermost (the devices of
one tensor group are adjacent: on a GPU host, the ones joined by the fastest links), `expert` next.

Generation's rules over parameter paths (the stacked "xla" layout; the CPU backend's packed
layout is for one device and is never sharded), for the target and the drafter alike:
- attention q_proj / k_proj / v_proj and MLP gate_proj / up_proj: split over `tensor` on their output
  columns (whole heads; whole MLP columns), their biases alike;
- o_proj and down_proj: split over `tensor` on their input rows (XLA's partitioner adds the
  all-reduce after them); their biases replicated;
- the embedding table [V, D] and an untied lm_head [D, V], and a reduced draft vocabulary's head
  [D, Vd]: split over `tensor` on the vocabulary axis where the axis size divides it, else
  replicated;
- the drafter's fc [n*D, D]: split over `tensor` on its output;
- an MoE layer's experts (params of an "mlp" module stacked [L, E, ...]: gate_proj / up_proj
  [L, E, D, I], down_proj [L, E, I, D], and their biases [L, E, I] / [L, E, D]): the expert axis E
  over `expert`, and within each expert the Megatron split over `tensor` (gate / up columns, down
  rows; the biases of gate / up alike, down's replicated). The router and a shared expert's
  gate are replicated; a shared expert's products follow the dense rules;
- norms and every other small vector: replicated. The stacked layer axis [L, ...] is never split.
A split whose dimension the tensor axis does not divide (the kv-head count for k_proj / v_proj, the
head count for q_proj, the MLP width, the drafter's hidden size) raises a ValueError naming the
weight, its shape and the axis size (the expert count for the `expert` axis too): a layout that
cannot be split is refused, never replicated silently. Dense weights are replicated over `expert`
(and the batch is split over `data` only). KV caches (`KVCache` k / v [L, B, S, Hkv, D], lengths [B]) split over `data`
on B (where it divides, else replicated) and over `tensor` on Hkv (which must divide, as for k_proj).

No collective is written by hand: programs are jitted with these shardings and XLA's SPMD
partitioner inserts the collectives. The same code runs on 1 device, 8 simulated CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`), a GPU host and, after
`initialize_distributed`, many hosts.
"""
from __future__ import annotations

import os
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "expert", "tensor")  # the mesh's axes, outermost first
TRAIN_BATCH_AXES = ("data", "fsdp")  # a training batch is split over both
DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")

# Generation's rules: the last path names of a weight -> the axis (from the end of its shape)
# split over `tensor`, and what must divide the tensor axis ("heads", "kv_heads" or None: the
# dimension itself).
_COLUMN = {"q_proj": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads", "gate_proj": None,
           "up_proj": None, "fc": None}  # split on the output columns (kernel [.., in, out], bias [.., out])
_ROW = ("o_proj", "down_proj")  # kernel split on its input rows; bias replicated
_VOCAB = {("embed_tokens", "embedding"): -2, ("lm_head", "kernel"): -1, ("draft_head", "kernel"): -1}
# An MoE block's stacked experts (leaves of an "mlp" module, [L, E, ...]): leaf -> the axis (from
# the end) split over `tensor` (None: not split), and the expert axis (from the end).
_EXPERTS = {"gate_proj": (-1, -3), "up_proj": (-1, -3), "down_proj": (-2, -3),
            "gate_bias": (-1, -2), "up_bias": (-1, -2), "down_bias": (None, -2)}


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
# Generation: Megatron tensor parallelism over `tensor`


def _expert_spec(names, shape, tensor: int, expert: int) -> P:
    """An MoE expert leaf's PartitionSpec (`_EXPERTS`): E over `expert`, the Megatron axis over
    `tensor`; ValueError naming the weight where a split does not divide."""
    tensor_axis, expert_axis = _EXPERTS[names[-1]]
    entries = [None] * len(shape)
    for axis, name, size, what in ((expert_axis, "expert", expert, "experts"),
                                   (tensor_axis, "tensor", tensor, "columns" if tensor_axis == -1 else "rows")):
        if axis is None or size <= 1:
            continue
        if shape[axis] % size:
            raise ValueError(f"{'/'.join(names)} of shape {list(shape)}: its {shape[axis]} {what} do not divide "
                             f"the mesh's {name} axis of size {size}")
        entries[axis % len(shape)] = name
    return P(*entries)


def param_spec(path, shape: Sequence[int], config, tensor: int, expert: int = 1) -> P:
    """The PartitionSpec of one target or drafter weight (path: its param path, e.g.
    ("layers", "self_attn", "k_proj", "kernel"); config: its ModelConfig or DrafterConfig, for the
    head counts) on a tensor axis of size `tensor` and an expert axis of size `expert` (the rules:
    the module docstring). ValueError naming the weight, its shape and the axis size where a split
    dimension does not divide."""
    names, shape = _names(path), tuple(int(s) for s in shape)
    rank = len(shape)
    if (tensor <= 1 and expert <= 1) or rank == 0:
        return P(*([None] * rank))
    if len(names) >= 2 and names[-2] == "mlp" and names[-1] in _EXPERTS and rank >= 2:
        return _expert_spec(names, shape, tensor, expert)
    if tensor <= 1:
        return P(*([None] * rank))
    for key, axis in _VOCAB.items():
        if names[-2:] == key:  # the vocabulary axis, split only where it divides
            return _spec(rank, axis, "tensor" if shape[axis] % tensor == 0 else None)
    module, leaf = (names[-2], names[-1]) if rank and len(names) >= 2 else (None, None)
    if module in _COLUMN and leaf in ("kernel", "bias"):
        unit = _COLUMN[module]  # what must divide: heads, kv-heads, or the columns themselves
        count = {"heads": config.num_heads, "kv_heads": config.num_kv_heads}[unit] if unit else shape[-1]
        if count % tensor or shape[-1] % tensor:
            what = f"{count} {unit.replace('_', '-')}" if unit else f"its {shape[-1]} output columns"
            raise ValueError(f"{'/'.join(names)} of shape {list(shape)}: {what} do not divide the mesh's "
                             f"tensor axis of size {tensor}; choose a tensor size that divides {count}")
        return _spec(rank, -1, "tensor")
    if module in _ROW and leaf == "kernel":
        if shape[-2] % tensor:
            raise ValueError(f"{'/'.join(names)} of shape {list(shape)}: its {shape[-2]} input rows do not "
                             f"divide the mesh's tensor axis of size {tensor}")
        return _spec(rank, -2, "tensor")
    return P(*([None] * rank))  # norms, biases of row-split products, small tables


def param_shardings(mesh: Mesh, params, config):
    """NamedShardings (by `param_spec`) for every leaf of a target's params or a drafter's
    `loop_params` (arrays or ShapeDtypeStructs) on `mesh`."""
    tensor, expert = axis_size(mesh, "tensor"), axis_size(mesh, "expert")
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, param_spec(path, np.shape(leaf), config, tensor, expert)), params)


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
    """A `KVCache` (of arrays or ShapeDtypeStructs) of NamedShardings: k / v [L, B, S, Hkv, D] over
    `data` on B (where it divides) and `tensor` on Hkv, lengths [B] over `data`. ValueError when
    the tensor axis does not divide Hkv. A hybrid target's `HybridCache`: its KV cache so, its conv
    tails and delta-rule states over `data` on B (the linear layers' weights are replicated)."""
    if hasattr(cache, "kv"):
        rows = batch_spec(mesh, cache.conv.shape[1], 1)[0]
        return cache.replace(kv=cache_shardings(mesh, cache.kv),
                             conv=NamedSharding(mesh, P(None, rows, None, None)),
                             state=NamedSharding(mesh, P(None, rows, None, None, None)))
    layers, batch, _, kv_heads, _ = cache.k.shape
    tensor = axis_size(mesh, "tensor")
    if kv_heads % tensor:
        raise ValueError(f"KV cache of shape {list(cache.k.shape)}: its {kv_heads} kv-heads do not divide the "
                         f"mesh's tensor axis of size {tensor}")
    rows = batch_spec(mesh, batch, 1)[0]
    kv = NamedSharding(mesh, P(None, rows, None, "tensor" if tensor > 1 else None, None))
    return cache.replace(k=kv, v=kv, lengths=NamedSharding(mesh, P(rows)))


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
    first = 1 if "layers" in _names(path) and len(shape) >= 3 else 0  # [L, ...] stacked layers
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

