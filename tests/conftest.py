import hashlib
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


def _shared_dir(tmp_path_factory, worker_id: str) -> Path:
    """A directory every test process of this run shares (pytest-xdist workers have their own
    base temp directories under one parent)."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


def _fitted_once(shared: Path, name: str, fit):
    """fit() computed by the first test process that asks, then read from `shared` by the others
    (a file lock makes the rest wait rather than fit the same weights again)."""
    import pickle

    from filelock import FileLock

    import fitted_models

    key = hashlib.sha256(Path(fitted_models.__file__).read_bytes()).hexdigest()[:12]
    path = shared / f"fitted-{name}-{key}.pkl"
    with FileLock(str(path) + ".lock"):
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = jax.device_get(fit())
        path.write_bytes(pickle.dumps(value))
        return value


@pytest.fixture(scope="session")
def fitted_target(tmp_path_factory, worker_id):
    """The tiny target fitted to the pattern (`fitted_models.fit_target`), fitted once per test run."""
    import fitted_models

    from dflash_jax.target import Target

    params = _fitted_once(_shared_dir(tmp_path_factory, worker_id), "target",
                          lambda: fitted_models.fit_target().params)
    return Target(fitted_models.TARGET_CONFIG, jax.tree.map(jnp.asarray, params))


@pytest.fixture(scope="session")
def fitted(fitted_target, tmp_path_factory, worker_id):
    """(target, drafter) fitted to a pattern so that speculative decoding accepts long runs."""
    import fitted_models

    from dflash_jax.drafter import Drafter

    params = _fitted_once(_shared_dir(tmp_path_factory, worker_id), "drafter",
                          lambda: fitted_models.fit_drafter(fitted_target).params)
    return fitted_target, Drafter(fitted_models.drafter_config(), jax.tree.map(jnp.asarray, params))
