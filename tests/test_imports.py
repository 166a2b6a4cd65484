"""Imports point down: each package of `dflash_jax` imports only the layers below it (`LAYERS`, the
one table of what may import what), the modules import each other without a cycle, no library
module imports a CLI or training entry point (the `infer` and `train` packages), nothing outside the
CPU backend imports it, no module but the backends and the CLI asks which platform runs it
(`jax.default_backend`, `jax.lax.platform_dependent`), and `import dflash_jax` loads no heavy package
before a name is used.

Every `import` / `from ... import` statement counts, at module level or inside a function (a lazy
import hides a cycle from Python, not from this test). ``from package import name`` is an edge to
``package.name`` when that is a module, else to ``package`` (its ``__init__``). A module loaded by
name (``importlib.import_module("dflash_jax....")``, or an f-string with a constant prefix) is a load:
the one upward dependency the table allows is the family registry loading the family modules
(`PLUGIN_LOADS`), at the first lookup rather than at import.
"""
from __future__ import annotations

import ast
import importlib.util
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import dflash_jax

ROOT = "dflash_jax"
ENTRY_POINTS = ("infer", "train")  # CLI / training packages beside the library

# The layers of the package, bottom up: a module may import its own package's modules (the cycle
# check keeps those acyclic) and the packages of the layers below its own, nothing above or beside.
# A unit is a package (`dflash_jax.models` and everything in it) or a flat module of the top.
LAYERS = (
    ("_errors", "_resources", "_host_arrays", "sharding"),  # leaves
    ("_compilation_cache",),
    ("kernels",),  # the mask language, the Pallas kernels and their references, per platform
    ("backends",),  # the operations a backend may replace (the CPU backend)
    ("layers",),  # attention seam, norms, rotary, MLPs, MoE
    ("models",),  # configs, the family registry, caches, the stack, the target
    ("formats",),  # name tables and checkpoint formats
    ("families",),  # one module (or package) per target family
    ("decode",),  # sampling, lookup, the decode loop
    ("drafters",),  # the drafter, its generations, vocabulary, objective
    ("loading",),  # target, drafter and Orbax loaders
    ("engine",),  # the host side: options, Generator, the batch engine
    ("cli", "convert"),  # the command-line programs
    ("",),  # dflash_jax/__init__.py: the public names
)
# Upward loads by name that the table allows: (loader module, loaded package).
PLUGIN_LOADS = {("dflash_jax.models.registry", "dflash_jax.families")}


def unit(module: str) -> str:
    """The LAYERS unit of a module: the top-level package or flat module it sits in ("" for the root)."""
    return module.split(".")[1] if "." in module else ""


RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> source file."""
    names = [ROOT] + [info.name for info in pkgutil.walk_packages(dflash_jax.__path__, ROOT + ".")]
    return {name: Path(importlib.util.find_spec(name).origin) for name in names}


def _imports(module: str, is_package: bool, source: str) -> list[tuple[str, tuple[str, ...], int]]:
    """(base, names, line) of every import statement in `source`: ``import a.b`` -> ("a.b", ()),
    ``from X import a, b`` -> ("X", ("a", "b")), relative bases resolved against `module`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:  # relative to the importing module's package
                package = (module if is_package else module.rpartition(".")[0]).split(".")
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.append((base, tuple(alias.name for alias in node.names), node.lineno))
    return found


def _loads(source: str) -> list[tuple[str, int]]:
    """(module, line) of every `importlib.import_module(...)` of a constant name, or of an f-string
    whose constant prefix names a package (`f"dflash_jax.families.{name}"` -> dflash_jax.families)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                and node.args):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((arg.value, node.lineno))
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                found.append((arg.values[0].value.rstrip("."), node.lineno))
    return found


def load_edges(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """{module: {module it loads by name: line}} over the package."""
    return {module: {target: line for target, line in _loads(path.read_text()) if target in modules}
            for module, path in modules.items()}


def layer_violations(edges, loads=None) -> list[str]:
    """Each import (and load by name outside `PLUGIN_LOADS`) that points to a unit not below the
    importer's in `LAYERS`."""
    bad = []
    for kind, graph in (("imports", edges), ("loads", loads or {})):
        for module, targets in sorted(graph.items()):
            for target, line in sorted(targets.items()):
                a, b = unit(module), unit(target)
                if a == b or (kind == "loads" and (module, target) in PLUGIN_LOADS):
                    continue
                if a not in RANK or b not in RANK:
                    bad.append(f"  {module}:{line} {kind} {target}: a unit missing from LAYERS ({a or b!r})")
                elif RANK[b] >= RANK[a]:
                    below = f"{b or 'dflash_jax'} is not below {a or 'dflash_jax'}"
                    bad.append(f"  {module}:{line} {kind} {target}: {below}")
    return bad


def _graph(modules: dict[str, Path]):
    """-> (edges {module: {imported module: line}}, entry-point imports [(module, name, line)])."""
    edges, entry_imports = {}, []
    for module, path in modules.items():
        out = edges.setdefault(module, {})
        for base, names, line in _imports(module, path.name == "__init__.py", path.read_text()):
            if base.split(".")[0] in ENTRY_POINTS:
                entry_imports.append((module, base, line))
            # `from X import a` imports the module X.a when there is one, else X's attribute a.
            targets = [f"{base}.{name}" if f"{base}.{name}" in modules else base for name in names]
            for target in targets or [base]:
                if target in modules:
                    out.setdefault(target, line)
    return edges, entry_imports


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """A cycle [m0, m1, ..., m0] in the graph, or None (depth-first search)."""
    state = {}  # module -> 1 on the current path, 2 done
    path = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def _describe(cycle, edges, modules) -> str:
    return "\n".join(f"  {modules[a].relative_to(Path(dflash_jax.__file__).parents[1])}:{edges[a][b]} "
                     f"{a} imports {b}" for a, b in zip(cycle, cycle[1:]))


def test_find_cycle_finds_and_clears():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) is None
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"b": 1}}) == ["b", "c", "b"]
    assert find_cycle({"a": {"a": 1}}) == ["a", "a"]


def test_imports_resolve_submodules_relative_and_lazy():
    source = "import os\nfrom . import sibling\nfrom ..pkg import name\ndef f():\n    import dflash_jax.x\n"
    assert _imports("dflash_jax.sub.mod", False, source) == [
        ("os", (), 1), ("dflash_jax.sub", ("sibling",), 2), ("dflash_jax.pkg", ("name",), 3),
        ("dflash_jax.x", (), 5)]
    assert _imports("dflash_jax.sub", True, "from .mod import f\n") == [("dflash_jax.sub.mod", ("f",), 1)]


def test_package_imports_have_no_cycle():
    modules = _modules()
    assert "dflash_jax.layers.attention" in modules and "dflash_jax.kernels.block_attention" in modules
    edges, _ = _graph(modules)
    assert "dflash_jax.kernels.masks" in edges["dflash_jax.layers.attention"]  # the parse sees the imports
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle:\n" + _describe(cycle, edges, modules)


def test_every_import_points_down_the_layers():
    modules = _modules()
    assert {unit(m) for m in modules} <= set(RANK), sorted({unit(m) for m in modules} - set(RANK))
    edges, _ = _graph(modules)
    loads = load_edges(modules)
    assert "dflash_jax.families" in loads["dflash_jax.models.registry"]  # the parse sees the registry's loads
    bad = layer_violations(edges, loads)
    assert not bad, "imports against the layers (tests/test_imports.py LAYERS):\n" + "\n".join(bad)


def test_a_planted_wrong_way_import_is_caught():
    """A lazy import of the engine from inside a kernel module, and a load by name of a model module
    from a layer module, are each reported; the real graph with them added fails the check."""
    source = "def f():\n    from dflash_jax.engine import generator\n"
    assert _imports("dflash_jax.kernels.masks", False, source) == [("dflash_jax.engine", ("generator",), 2)]
    assert _loads("import importlib\nimportlib.import_module('dflash_jax.models.target')\n") == [
        ("dflash_jax.models.target", 2)]
    modules = _modules()
    edges, _ = _graph(modules)
    planted = {**edges, "dflash_jax.kernels.masks": {**edges["dflash_jax.kernels.masks"],
                                                     "dflash_jax.engine.generator": 2}}
    bad = layer_violations(planted, {"dflash_jax.layers.moe": {"dflash_jax.models.target": 7}})
    bad = [line for line in bad if line not in layer_violations(edges, load_edges(modules))]
    assert bad == ["  dflash_jax.kernels.masks:2 imports dflash_jax.engine.generator: engine is not below kernels",
                   "  dflash_jax.layers.moe:7 loads dflash_jax.models.target: models is not below layers"], bad


def test_library_imports_no_entry_point():
    _, entry_imports = _graph(_modules())
    assert not entry_imports, "library modules import CLI/training entry points:\n" + "\n".join(
        f"  {module} imports {name} (line {line})" for module, name, line in entry_imports)


CPU_BACKEND = "dflash_jax.backends.cpu"
REGISTRY = "dflash_jax.backends"  # the one module outside the CPU backend that may import it (lazily, by name)
# The packages that may ask which platform runs them: the backends (the one place that answers for the
# models: `backends.platform`, `resolve`, `Backend.expert_form`) and the command-line programs (they
# report the device and pick what to measure). Every other module of the package is written once for
# every platform.
PLATFORM_ASKERS = ("dflash_jax.backends", "dflash_jax.cli")
PLATFORM_QUESTIONS = ("default_backend", "platform_dependent")  # jax.default_backend, jax.lax.platform_dependent


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _in_cpu_backend(module: str) -> bool:
    return _in_package(module, CPU_BACKEND)


def model_modules(modules: dict[str, Path]) -> list[str]:
    """The modules written once for every platform: all of `dflash_jax` but `PLATFORM_ASKERS`
    (the models, the attention seam, the kernels, the decode loop, the loaders, sharding, ...)."""
    return sorted(m for m in modules if not any(_in_package(m, p) for p in PLATFORM_ASKERS))


def test_nothing_outside_the_cpu_backend_imports_it():
    modules = _modules()
    assert CPU_BACKEND in modules and f"{CPU_BACKEND}.matmul" in modules
    edges, _ = _graph(modules)
    assert CPU_BACKEND in edges[REGISTRY]  # the parse sees the registry's lazy import
    offenders = [f"  {module} imports {target} (line {line})"
                 for module, targets in sorted(edges.items()) if not _in_cpu_backend(module) and module != REGISTRY
                 for target, line in sorted(targets.items()) if _in_cpu_backend(target)]
    assert not offenders, "modules outside the CPU backend import it:\n" + "\n".join(offenders)


def _asks_the_platform(source: str) -> list[int]:
    """Lines that name `default_backend` or `platform_dependent` (jax.default_backend(),
    jax.lax.platform_dependent(...), or either name imported)."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source))
                   if (isinstance(node, ast.Attribute) and node.attr in PLATFORM_QUESTIONS)
                   or (isinstance(node, ast.Name) and node.id in PLATFORM_QUESTIONS)
                   or (isinstance(node, ast.alias) and node.name.rpartition(".")[2] in PLATFORM_QUESTIONS)})


def test_default_backend_check_sees_calls():
    assert _asks_the_platform("import jax\nif jax.default_backend() == 'cpu':\n    pass\n") == [2]
    assert _asks_the_platform("import jax\nx = jax.devices()\n") == []
    assert _asks_the_platform("from jax import default_backend\n") == [1]
    assert _asks_the_platform("import jax\ny = jax.lax.platform_dependent(x, cpu=f, default=g)\n") == [2]
    assert _asks_the_platform("from jax import lax\ny = lax.platform_dependent(x, cpu=f, default=g)\n") == [2]
    assert _asks_the_platform("from jax.lax import platform_dependent as pd\n") == [1]
    assert _asks_the_platform("platform = 'cpu'\nlax.cond(p, f, g)\n") == []


def test_the_check_covers_every_model_module():
    """Every module of the package but the backends and the CLI is checked: the models (and a family
    package, when there is one), the attention seam and kernels, the decode loop, the loaders."""
    modules = _modules()
    covered = model_modules(modules)
    for name in ("dflash_jax.models.target", "dflash_jax.families.qwen3_5", "dflash_jax.layers.moe",
                 "dflash_jax.drafters.drafter", "dflash_jax.layers.common", "dflash_jax.layers.attention",
                 "dflash_jax.decode.loop", "dflash_jax.engine.generator", "dflash_jax.models.cache",
                 "dflash_jax.families.qwen3_5.gated_delta", "dflash_jax.kernels.block_attention",
                 "dflash_jax.loading.target_loader", "dflash_jax.sharding"):
        assert name in covered, name
    assert not [m for m in covered if _in_package(m, "dflash_jax.backends") or _in_package(m, "dflash_jax.cli")]
    assert len(covered) + sum(any(_in_package(m, p) for p in PLATFORM_ASKERS) for m in modules) == len(modules)


def test_the_models_do_not_branch_on_the_jax_backend():
    """The models and the decode loop are written once: which backend runs them is the registry's
    choice (`backends.resolve`), and a choice that depends on the platform is a backend's
    (`backends.platform`, `Backend.expert_form`), never a `jax.default_backend()` test or a
    `jax.lax.platform_dependent` of their own."""
    modules = _modules()
    found = {name: _asks_the_platform(modules[name].read_text()) for name in model_modules(modules)}
    offenders = {name: lines for name, lines in found.items() if lines}
    assert not offenders, f"the platform asked outside the backends (module: lines): {offenders}"


def test_import_loads_no_heavy_package_until_a_name_is_used():
    """`import dflash_jax` imports its public names on first use: jax, flax, orbax, grain and
    transformers are not loaded by the import itself (the quick import a notebook or CLI --help
    sees), and a name, once used, is the module's own object."""
    heavy = ("jax", "flax", "orbax", "grain", "transformers", "torch")
    code = ("import sys, dflash_jax; print(sorted(m for m in %r if m in sys.modules)); "
            "from dflash_jax.engine.generator import generate; print(dflash_jax.generate is generate)") % (heavy,)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout
    assert set(dflash_jax.__all__) <= set(dir(dflash_jax))
    assert callable(dflash_jax.sharding.make_mesh) and dflash_jax.backends.resolve() in dflash_jax.backends.NAMES
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        dflash_jax.nonexistent


def test_the_top_keeps_four_private_modules_and_every_package_has_a_layer():
    """The package's top holds the leaves only (at most 4 private modules: errors, shipped files, host
    arrays, the compilation cache); the rest lives in packages whose names say what they are, each a
    unit of `LAYERS`."""
    top = Path(dflash_jax.__file__).parent
    private = sorted(p.name for p in top.glob("_*.py") if p.name != "__init__.py")
    assert len(private) <= 4, private
    packages = {p.parent.name for p in top.glob("*/__init__.py")}
    assert packages <= set(RANK), sorted(packages - set(RANK))
