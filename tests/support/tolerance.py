"""Tolerances for float32 parity tests that follow from the computation, not from a fixed 1e-5.

Two float32 programs that compute the same function (ours and transformers', two CPUs, two versions of
a BLAS) sum the same products in different orders. One sum of n terms rounded in another order
differs by about eps * sqrt(n) times the size of its terms (a random walk of n roundings; the worst
case is eps * n), and a network chains `depth` such products, each adding its share relative to the
size of what flows through it. The outputs' own magnitude scales the whole: a logit of 8 carries 8
times the absolute error of a logit of 1.
"""
from __future__ import annotations

import math

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)
SAFETY = 8.0  # how far past the expected random-walk error a difference may go before it is a bug


def float32_atol(reference, summation_length: int, depth: int = 1, safety: float = SAFETY) -> float:
    """The absolute tolerance for float32 results of magnitude max|reference| computed through
    `depth` chained products whose longest sum has `summation_length` terms."""
    if summation_length < 1 or depth < 1:
        raise ValueError(f"summation_length and depth must be >= 1, got {summation_length} and {depth}")
    scale = max(float(np.max(np.abs(np.asarray(reference, np.float64)))), 1.0)
    return safety * EPS32 * math.sqrt(summation_length) * depth * scale


def model_depth(config) -> int:
    """The chained products of a decoder stack's forward: four per layer (q/k/v, attention, o_proj,
    the MLP's two) plus the LM head."""
    return 4 * config.num_layers + 1


def model_summation_length(config, tokens: int = 1) -> int:
    """The longest sum of a decoder's forward over `tokens` positions: the hidden size, a head, the
    MLP's width, or the positions an attention (or a recurrence) sums over."""
    widths = [config.hidden_size, config.head_dim, config.intermediate_size, tokens]
    widths.append(getattr(config, "moe_intermediate_size", 0) or 0)
    return max(widths)


def assert_float32_close(got, want, *, summation_length: int, depth: int = 1, err_msg: str = "") -> None:
    """np.testing.assert_allclose with `float32_atol` of `want` (rtol 0)."""
    atol = float32_atol(want, summation_length, depth)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=0,
                               err_msg=f"{err_msg} (float32 atol {atol:.3g})".strip())


def assert_model_close(got, want, config, tokens: int = 1, err_msg: str = "") -> None:
    """`assert_float32_close` for a whole decoder's outputs (logits, captured layers) over `tokens`
    positions."""
    assert_float32_close(got, want, summation_length=model_summation_length(config, tokens),
                         depth=model_depth(config), err_msg=err_msg)
