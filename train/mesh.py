"""Device mesh and sharding rules for drafter training.

One `Mesh` with axes ('data', 'fsdp'). Params (and the optimizer state, whose moments have the
same paths and shapes) are sharded by one rule over their paths: with fsdp > 1, a kernel of rank
>= 2 is split over 'fsdp' along its largest divisible axis (the stacked-layer axis of scanned
layers is never split); everything else is replicated. The batch is split over ('data', 'fsdp').
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp")
BATCH_AXES = ("data", "fsdp")
DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def make_mesh(data: int = -1, fsdp: int = 1) -> Mesh:
    """A ('data', 'fsdp') mesh over all devices; data=-1 takes what fsdp leaves."""
    devices = jax.devices()
    if data == -1:
        if len(devices) % fsdp:
            raise ValueError(f"run.mesh_fsdp={fsdp} does not divide the {len(devices)} devices")
        data = len(devices) // fsdp
    if data * fsdp != len(devices):
        raise ValueError(f"mesh {data} (data) x {fsdp} (fsdp) needs {data * fsdp} devices, "
                         f"found {len(devices)}")
    return Mesh(np.asarray(devices).reshape(data, fsdp), AXES)


def _path_names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def leaf_spec(path, shape, fsdp_size: int) -> P:
    """PartitionSpec of one param/optimizer-state leaf from its path and shape."""
    if fsdp_size <= 1 or len(shape) < 2:
        return P()
    first = 1 if "layers" in _path_names(path) and len(shape) >= 3 else 0  # [L, ...] stacked layers
    axes = [a for a in range(first, len(shape)) if shape[a] % fsdp_size == 0]
    if not axes:
        return P()
    split = max(axes, key=lambda a: shape[a])
    return P(*[("fsdp" if a == split else None) for a in range(len(shape))])


def tree_shardings(mesh: Mesh, tree, shard: bool = True):
    """NamedShardings for every leaf of `tree` (arrays or ShapeDtypeStructs); shard=False replicates."""
    fsdp_size = mesh.shape["fsdp"] if shard else 1
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, leaf_spec(path, np.shape(leaf), fsdp_size)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_batch(mesh: Mesh, local_batch: dict) -> dict:
    """Per-process numpy batch (leading axis = this process's rows) -> global jax arrays sharded
    over ('data', 'fsdp')."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """`jax.distributed.initialize` when flags or the JAX_* environment variables ask for it.
    Call before any other JAX work. CPU collectives go through gloo. Returns whether it ran."""
    if coordinator is None and num_processes is None and not any(v in os.environ for v in DISTRIBUTED_ENV):
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # used by CPU devices only
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    return True
