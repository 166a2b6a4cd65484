"""Helpers for the Pallas kernels' tests."""
from __future__ import annotations

import jax


def abstract_gpu():
    """A context in which Pallas lowers for an abstract GPU (an H100: Triton needs a compute
    capability) without one: newer jax (0.11+) asks the abstract mesh's device, where older jax
    lowered for CUDA without any device; both accept it."""
    import contextlib

    sharding = jax.sharding
    if not hasattr(sharding, "AbstractDevice") or not hasattr(sharding, "use_abstract_mesh"):
        return contextlib.nullcontext()
    device = sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    mesh = sharding.AbstractMesh((1,), ("x",), (sharding.AxisType.Auto,), abstract_device=device)
    return sharding.use_abstract_mesh(mesh)
