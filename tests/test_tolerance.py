"""The float32 tolerance of the parity tests (tests/support/tolerance.py) admits a reordered sum and
refuses a real difference."""
import numpy as np
import pytest

from support.tolerance import assert_float32_close, float32_atol


def test_a_reordered_float32_sum_passes_and_a_wrong_term_fails():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(64, 4096)).astype(np.float32), rng.normal(size=4096).astype(np.float32)
    forward = np.stack([np.sum(row * b, dtype=np.float32) for row in a])
    backward = np.stack([np.sum((row * b)[::-1], dtype=np.float32) for row in a])
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(forward - backward)) > 0  # the orders do round differently
    assert_float32_close(forward, backward, summation_length=4096)
    assert_float32_close(forward, exact, summation_length=4096)
    wrong = backward.copy()
    wrong[3] += 1e-3 * np.max(np.abs(backward))  # one term of a thousandth of the scale
    with pytest.raises(AssertionError, match="float32 atol"):
        assert_float32_close(forward, wrong, summation_length=4096)


def test_the_tolerance_grows_with_magnitude_length_and_depth():
    base = float32_atol(np.ones(3), 16)
    assert float32_atol(8 * np.ones(3), 16) == 8 * base
    assert float32_atol(np.ones(3), 64) == 2 * base
    assert float32_atol(np.ones(3), 16, depth=3) == 3 * base
    assert float32_atol(1e-3 * np.ones(3), 16) == base  # small outputs are compared at the scale of 1
    with pytest.raises(ValueError):
        float32_atol(np.ones(3), 0)
