"""bfloat16 targets against transformers' float32 models (tiny random Qwen3 and Llama models, every
variant of their rows in support/families.py). float32 parity of every family is the conformance
suite's (test_family_conformance.py)."""
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.loading.target_loader import load_target
from support import families

torch = pytest.importorskip("torch")

CASES = [(family, variant) for family in ("qwen3", "llama") for variant in families.FAMILIES[family].variants]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / (np.abs(b).max() + 1e-12)


@pytest.mark.parametrize("family,variant", CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_bf16_close(family, variant, tmp_path):
    hf = families.make_hf(family, tmp_path, variant=variant)
    target = load_target(tmp_path, "bfloat16")
    tokens = np.random.default_rng(1).integers(0, 128, size=(1, 16))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    hidden, _, _ = target.forward(target.params, jnp.asarray(tokens))
    logits = np.asarray(target.logits(target.params, hidden))
    assert rel_err(logits, want) <= 3e-2
