"""Backends: the one place that knows which operations run where (the interface: `backends.base`).

Two backends:
- "xla" (`base.Backend`): XLA's products and the layers' `nn.scan` over stacked params, with the
  attention seam's Pallas kernels on GPUs. Training, sharding, conversion, GPUs and TPUs use it.
- "cpu" (`backends.cpu`): C++ kernels through XLA's FFI for the products of a few rows and the
  KV-cache read, over weights packed in panels (a GGUF file's quantized blocks kept as stored),
  the layers read in place inside their stacks. What a CPU decodes with; imported on first use.

`resolve("auto")` names the backend a decode uses on this process's default JAX device ("cpu" on a
CPU, "xla" elsewhere), and `decode_backend(config)` the one a target of that config decodes with
(XLA's where the resolved backend's layout does not hold it: `Backend.supports`). Params carry
their layout: a backend's own is a `BackendLayout` tagged with its name, and `of_target_params` /
`of_drafter_params` read the tag ("xla" for untagged, stacked params). Layouts by their
user-facing names (`load_target(..., layout=...)`): "stacked" is the XLA backend's, "packed" the
CPU backend's, "auto" the one `resolve` picks. `platform()` is the platform programs compile for:
the models never ask it themselves.
"""
from __future__ import annotations

import functools

from dflash_jax.backends.base import ACTIVATIONS, Backend, BackendLayout, EXPERT_FORMS, platform

__all__ = ["ACTIVATIONS", "EXPERT_FORMS", "Backend", "BackendLayout", "NAMES", "LAYOUTS", "get", "resolve",
           "platform", "decode_backend", "of_target_params", "of_drafter_params", "check_layout",
           "layout_backend", "params_in_layout"]

def _cpu() -> Backend:
    from dflash_jax.backends.cpu import CpuBackend  # imported on first use: the one import of it

    return CpuBackend()


FACTORIES = {"xla": Backend, "cpu": _cpu}  # backend name -> what builds it
NAMES = tuple(FACTORIES)
LAYOUTS = {"stacked": "xla", "packed": "cpu"}  # user-facing layout name -> backend
PLATFORM_BACKENDS = {"cpu": "cpu"}  # the backend "auto" picks on a platform ("xla" on the others)


@functools.cache
def get(name: str) -> Backend:
    """The backend called `name` (one of `NAMES`), built once."""
    try:
        factory = FACTORIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(NAMES)}") from None
    return factory()


def resolve(name: str = "auto") -> str:
    """A backend name, "auto" resolved: the platform's (`PLATFORM_BACKENDS`: "cpu" where JAX's default
    backend is the CPU), else "xla"."""
    if name == "auto":
        return PLATFORM_BACKENDS.get(platform(), "xla")
    get(name)  # validates
    return name


def decode_backend(config, name: str = "auto") -> str:
    """The backend a target of `config` (a `ModelConfig`) decodes with when `name` is asked for:
    `resolve(name)`, or "xla" (the stacked layout) where that backend's layout does not hold this
    target (`Backend.supports`: the CPU backend's packed layout holds Qwen3 / Llama layers only)."""
    name = resolve(name)
    return name if get(name).supports(config) else "xla"


def _layout_of(params) -> str:
    return params.backend if isinstance(params, BackendLayout) else "xla"


def of_target_params(params) -> str:
    """The backend whose decode layout target `params` are in: their `BackendLayout` tag, "xla"
    for stacked params (untagged)."""
    return _layout_of(params)


def of_drafter_params(module_params) -> str:
    """The backend whose decode layout drafter module params are in: their `BackendLayout` tag,
    "xla" for stacked params (untagged)."""
    return _layout_of(module_params)


def check_layout(layout: str) -> None:
    if layout != "auto" and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of auto, {', '.join(LAYOUTS)}, not {layout!r}")


def layout_backend(layout: str) -> str:
    """The backend of a user-facing layout name ("auto": `resolve("auto")`)."""
    check_layout(layout)
    return resolve("auto") if layout == "auto" else LAYOUTS[layout]


def params_in_layout(params, layout: str = "auto", *, release: bool = False):
    """Stacked target params in the layout asked for: "stacked" as they are (what training,
    sharding and GPUs use), "packed" the CPU backend's (what a CPU decodes with), "auto" the one
    `resolve` picks. release: the caller gives `params` up (see `Backend.target_params`)."""
    backend = layout_backend(layout)
    if backend == "xla" and of_target_params(params) != "xla":
        raise ValueError("these params are packed for a CPU decode; the stacked layout is made at load "
                         "time: load_target(..., layout=\"stacked\")")
    return get(backend).target_params(params, release=release)
