import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def fitted():
    """(target, drafter) fitted to a pattern so that speculative decoding accepts long runs."""
    import fitted_models

    target = fitted_models.fit_target()
    return target, fitted_models.fit_drafter(target)
