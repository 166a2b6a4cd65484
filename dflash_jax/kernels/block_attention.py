"""Block-masked attention as Pallas GPU kernels (Triton lowering), forward and backward.

The mask is the project's `KeyRanges` language: query ``t`` sees key ``k`` iff ``k`` lies in
``[start[t, 0], end[t, 0])`` or ``[start[t, 1], end[t, 1])``. The kernels never materialise it:

Layout (GQA without repeating K/V). The ``G = Hq // Hkv`` query heads that share a kv head are
folded into the row axis: for kv head ``h`` the kernel sees rows ``r = t * G + g`` (query ``t``,
head ``h * G + g``), i.e. ``q`` becomes ``[B, Hkv, Tq * G, D]``. One program owns one tile of
``block_q`` such rows and reads each K/V tile once for all ``G`` heads; K and V stay in their
``[B, Tk, Hkv, D]`` layout and are read in place (strided by ``Hkv * D``).

Tile sizes. `BlockSizes` (frozen) holds the forward and backward tiles and the Triton launch
parameters; `KEY_TILE` is its default forward key tile (caches sized in multiples of it are read in
place, without a padding copy).

Tiles to visit (`dflash_jax.kernels.tile_plan`, plain jnp outside the kernels). For every row tile,
the smallest start and largest end of each of the two ranges over the tile's non-empty rows are
turned into key-TILE intervals ``[lo0, hi0)`` and ``[lo1, hi1)`` (merged into one when they
intersect, so no tile is visited twice). The kernel loops over ``hi0 - lo0`` tiles of range 0 and
then ``hi1 - lo1`` tiles of range 1, nothing else; inside a tile the exact per-row, per-key mask is
applied. The dK/dV kernel goes the other way: for every key tile, a compacted list of the row tiles
whose intervals contain it.

Forward: online softmax in base 2 with float32 statistics and accumulation; writes the
log-sum-exp (the backward's residual). When there are few row tiles and many key tiles (drafting a
block against a long context, decoding), the visited tiles of each row tile are split over
``num_splits`` programs (flash-decoding) and the partial results merged with their log-sum-exps.

Backward: dQ (row-tile programs over the same two intervals) and dK/dV (key-tile programs over
their row-tile lists; the folded rows sum the G heads of a group for free), recomputing the
probabilities from the saved log-sum-exp, under `jax.custom_vjp`. ``backward="reference"`` uses
the VJP of the dense reference (`dflash_jax.kernels.reference`) instead (debugging).

Attention sinks (gpt-oss; ``sinks`` [Hq], optional): one logit per query head that joins every
row's softmax and carries no value. The forward starts each row's online softmax from it (running
max = sink, denominator 1, accumulator 0; in the first split only), so the saved log-sum-exp
includes it and the backward kernels, which recompute the probabilities from that log-sum-exp,
need no change; d(sinks) = -sum over rows of p_sink * rowsum(dO * O) is plain jnp. Without sinks
the kernels are the same as before they existed (no extra operand, no extra instruction).

Fully masked rows (padding blocks) produce zeros and zero gradients. Lengths that are not
multiples of the tile sizes are padded in the wrapper (zeros; padded keys lie outside every range
because the ranges are clipped to ``[0, Tk)``), as are head dims that are not powers of two.
Kernel tests run on CPU with ``interpret=True``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dflash_jax.kernels.reference import check_gqa, reference_attention
from dflash_jax.kernels.tile_plan import (
    clip_ranges,
    key_tile_lists,
    round_up,
    row_bounds,
    row_tile_plan,
)
from dflash_jax.kernels.masks import KeyRanges

# A finite stand-in for -inf: masked scores and the running max of a row that has seen nothing.
# exp2(NEG - m) == 0 for any real m, and NEG - NEG == 0 never produces NaN.
NEG = -1e30
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_SEEN = NEG / 2  # a base-2 log-sum-exp above this means the row saw at least one key

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256
BACKWARDS = ("pallas", "reference")
# The default forward key tile (`BlockSizes.block_k`): key lengths in multiples of it need no padding.
KEY_TILE = 64


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles and Triton launch parameters of the block-attention kernels.

    block_q x block_k: folded rows (query x head-in-group) by keys per forward program;
    block_q_bwd x block_k_bwd: the same in both backward kernels. Powers of two >= 16, shrunk for
    small inputs and capped for head dims above 128 (shared memory). num_splits: programs that
    share one row tile's key tiles in the forward (flash-decoding; None: chosen from the shape).
    num_warps (None: chosen from the tile) and num_stages go to Triton.
    """

    block_q: int = 128
    block_k: int = KEY_TILE
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):  # 16: Triton's minimum dot size
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {value}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"BlockSizes.num_splits must be None or >= 1, got {self.num_splits}")
        warps = self.num_warps
        if warps is not None and (warps < 1 or warps & (warps - 1)):
            raise ValueError(f"BlockSizes.num_warps must be None or a power of two, got {warps}")
        if self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages must be >= 1, got {self.num_stages}")


# ----------------------------------------------------------------------------------------------
# Small helpers


def _compiler_params(num_warps: int, num_stages: int):
    """Triton compiler params; passing them also pins the Triton backend (not Mosaic GPU)."""
    cls = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _fit_block(block: int, n: int) -> int:
    """The power-of-two tile ``block`` (a `BlockSizes` field) shrunk to n, at least 16."""
    return max(16, min(block, _next_pow2(n)))


def _padded_head_dim(d: int) -> int:
    return max(16, _next_pow2(d))


def _num_sms() -> int:
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(getattr(dev, "core_count", 0)) or 132
    except Exception:  # pragma: no cover - best effort only
        pass
    return 132


def _mm(a, b, contract_a: int, contract_b: int, precision):
    """2-D matmul contracting a's axis ``contract_a`` with b's ``contract_b``, float32 result."""
    return lax.dot_general(
        a,
        b,
        (((contract_a,), (contract_b,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def _tile_mask(kpos, s0, e0, s1, e1):
    """[rows, keys] visibility of keys ``kpos`` ([keys]) for rows with bounds s*/e* ([rows])."""
    kk = kpos[None, :]
    in0 = (kk >= s0[:, None]) & (kk < e0[:, None])
    in1 = (kk >= s1[:, None]) & (kk < e1[:, None])
    return in0 | in1


# ----------------------------------------------------------------------------------------------
# Layout (plain jnp, outside the kernels)


def _fold_rows(x, num_kv_heads: int, rows_padded: int, dim_padded: int | None):
    """[B, Tq, Hq, (D)] -> [B, Hkv, Tq * G (padded), (D padded)], row r = t * G + g."""
    b, tq, hq = x.shape[:3]
    g = hq // num_kv_heads
    x = x.reshape(b, tq, num_kv_heads, g, *x.shape[3:])
    x = jnp.swapaxes(x, 1, 2).reshape(b, num_kv_heads, tq * g, *x.shape[4:])
    pad = [(0, 0), (0, 0), (0, rows_padded - tq * g)]
    if dim_padded is not None:
        pad.append((0, dim_padded - x.shape[-1]))
    return jnp.pad(x, pad)


def _unfold_rows(x, tq: int, num_q_heads: int, dim: int | None):
    """Inverse of `_fold_rows`: [B, Hkv, R_pad, (Dp)] -> [B, Tq, Hq, (D)]."""
    b, hkv = x.shape[:2]
    g = num_q_heads // hkv
    x = x[:, :, : tq * g]
    if dim is not None:
        x = x[..., :dim]
    x = x.reshape(b, hkv, tq, g, *x.shape[3:])
    return jnp.swapaxes(x, 1, 2).reshape(b, tq, num_q_heads, *x.shape[4:])


def _pad_kv(x, keys_padded: int, dim_padded: int):
    return jnp.pad(x, [(0, 0), (0, keys_padded - x.shape[1]), (0, 0), (0, dim_padded - x.shape[3])])


# ----------------------------------------------------------------------------------------------
# Kernels


def _tile_index(j, n0, lo0, lo1):
    """The j-th visited key tile: the tiles of range 0, then those of range 1."""
    return jnp.where(j < n0, lo0 + j, lo1 + (j - n0))


def _fwd_kernel(
    plan_ref, bounds_ref, *refs, scale, block_k, num_splits, precision, has_sinks,
):
    # plan_ref [4]; bounds_ref [4, bq]; (sink_ref [bq]); q_ref [bq, Dp]; k_ref, v_ref [Tk_pad, Dp]
    # o_ref [bq, Dp]; lse_ref [bq]
    if has_sinks:
        sink_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    lo0, hi0, lo1, hi1 = plan_ref[0], plan_ref[1], plan_ref[2], plan_ref[3]
    n0 = hi0 - lo0
    n = n0 + (hi1 - lo1)
    if num_splits > 1:
        split = pl.program_id(0)
        per = lax.div(n + (num_splits - 1), num_splits)
        j_lo = jnp.minimum(split * per, n)
        j_hi = jnp.minimum(j_lo + per, n)
    else:
        j_lo, j_hi = 0, n

    s0, e0 = bounds_ref[0, :], bounds_ref[1, :]
    s1, e1 = bounds_ref[2, :], bounds_ref[3, :]
    q = q_ref[...]
    block_q, dim = q.shape
    qk_scale = scale * _LOG2E

    def body(j, carry):
        acc, m_prev, l_prev = carry
        kt = _tile_index(j, n0, lo0, lo1)
        k_start = pl.multiple_of(kt * block_k, block_k)
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        s = _mm(q, k, 1, 1, precision) * qk_scale  # [bq, bk], base-2 logits
        kpos = k_start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        s = jnp.where(_tile_mask(kpos, s0, e0, s1, e1), s, NEG)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        # A row that has seen no key keeps m == NEG and accumulates junk (exp2(0) == 1) that the
        # first visible key wipes out (correction == exp2(NEG - m) == 0); rows that never see a
        # key are zeroed at the end.
        correction = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l_next = l_prev * correction + jnp.sum(p, axis=1)
        acc = acc * correction[:, None] + _mm(p.astype(v.dtype), v, 1, 0, precision)
        return acc, m_next, l_next

    if has_sinks:
        # The sink is one more logit (base 2) with no value: the softmax starts from it (m = sink,
        # l = 1, acc = 0), in the first split only. A row that sees no key ends with out 0 and
        # lse = sink.
        m0, l0 = sink_ref[...], jnp.ones((block_q,), jnp.float32)
        if num_splits > 1:
            first = pl.program_id(0) == 0
            m0, l0 = jnp.where(first, m0, NEG), jnp.where(first, l0, 0.0)
        init = (jnp.zeros((block_q, dim), jnp.float32), m0, l0)
    else:
        init = (
            jnp.zeros((block_q, dim), jnp.float32),
            jnp.full((block_q,), NEG, jnp.float32),
            jnp.zeros((block_q,), jnp.float32),
        )
    acc, m, denom = lax.fori_loop(j_lo, j_hi, body, init)
    seen = m > _SEEN
    l_safe = jnp.where(seen, denom, 1.0)
    out = jnp.where(seen[:, None], acc / l_safe[:, None], 0.0)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(l_safe), NEG)


def _dq_kernel(
    plan_ref, bounds_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref,
    *, scale, block_k, precision,
):
    # plan_ref [4]; bounds_ref [4, bq]; q_ref, do_ref [bq, Dp]; lse_ref, delta_ref [bq]
    # k_ref, v_ref [Tk_pad, Dp]; dq_ref [bq, Dp]
    lo0, hi0, lo1, hi1 = plan_ref[0], plan_ref[1], plan_ref[2], plan_ref[3]
    n0 = hi0 - lo0
    n = n0 + (hi1 - lo1)
    s0, e0 = bounds_ref[0, :], bounds_ref[1, :]
    s1, e1 = bounds_ref[2, :], bounds_ref[3, :]
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    qk_scale = scale * _LOG2E

    def body(j, dq):
        kt = _tile_index(j, n0, lo0, lo1)
        k_start = pl.multiple_of(kt * block_k, block_k)
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        s = _mm(q, k, 1, 1, precision) * qk_scale
        kpos = k_start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        s = jnp.where(_tile_mask(kpos, s0, e0, s1, e1), s, NEG)
        p = jnp.exp2(s - lse[:, None])  # masked entries: exp2(NEG - lse) == 0
        dp = _mm(do, v, 1, 1, precision)
        ds = p * (dp - delta[:, None])
        return dq + _mm(ds.astype(k.dtype), k, 1, 0, precision)

    dq = lax.fori_loop(0, n, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkdv_kernel(
    list_ref, bounds_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dk_ref, dv_ref,
    *, scale, block_q, block_k, precision,
):
    # list_ref [1 + nRt]; bounds_ref [4, R_pad]; q_ref, do_ref [R_pad, Dp]; lse_ref, delta_ref [R_pad]
    # k_ref, v_ref [bk, Dp]; dk_ref, dv_ref [bk, Dp]
    count = list_ref[0]
    k = k_ref[...]
    v = v_ref[...]
    k_start = pl.program_id(0) * block_k
    kpos = k_start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    qk_scale = scale * _LOG2E

    def body(i, carry):
        dk, dv = carry
        rt = list_ref[1 + i]
        r_start = pl.multiple_of(rt * block_q, block_q)
        rows = pl.ds(r_start, block_q)
        q = q_ref[rows, :]
        do = do_ref[rows, :]
        lse = lse_ref[rows]
        delta = delta_ref[rows]
        s0, e0 = bounds_ref[0, rows], bounds_ref[1, rows]
        s1, e1 = bounds_ref[2, rows], bounds_ref[3, rows]
        s = _mm(q, k, 1, 1, precision) * qk_scale  # [bq, bk]
        s = jnp.where(_tile_mask(kpos, s0, e0, s1, e1), s, NEG)
        p = jnp.exp2(s - lse[:, None])
        dv = dv + _mm(p.astype(do.dtype), do, 0, 0, precision)
        dp = _mm(do, v, 1, 1, precision)
        ds = p * (dp - delta[:, None])
        dk = dk + _mm(ds.astype(q.dtype), q, 0, 0, precision)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, count, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers


def _precision(dtype):
    # float32 inputs: exact fp32 products (Triton would use TF32 by default); 16-bit: native MMA.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _tiling(q, k, block_q: int, block_k: int, wide_block_q: int):
    """(group size G, padded head dim, row tile, key tile, padded rows, padded keys). Head dims
    above 128 cap the row tile at `wide_block_q` and the key tile at 32 (shared memory)."""
    tq, hq, d = q.shape[1:]
    tk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    dp = _padded_head_dim(d)
    bq = _fit_block(block_q if dp <= 128 else min(block_q, wide_block_q), tq * g)
    bk = _fit_block(block_k if dp <= 128 else min(block_k, 32), tk)
    return g, dp, bq, bk, round_up(tq * g, bq), round_up(tk, bk)


def _fold_sinks(sinks, tq: int, num_kv_heads: int, rows_padded: int):
    """sinks [Hq] -> base-2 logits [Hkv, R_pad] float32 in the folded row order (row r = t * G + g
    of kv head h: query head h * G + g); -inf (no sink) becomes NEG, padded rows 0."""
    s2 = jnp.maximum(sinks.astype(jnp.float32) * _LOG2E, NEG).reshape(num_kv_heads, -1)
    s2 = jnp.tile(s2, (1, tq))
    return jnp.pad(s2, [(0, 0), (0, rows_padded - s2.shape[1])])


def _forward(q, k, v, start, end, scale: float, blocks: BlockSizes, interpret: bool, sinks=None):
    """Returns (out [B, Tq, Hq, D] in q.dtype, lse2 [B, Tq, Hq] float32 base-2, NEG if empty).
    sinks [Hq] (or None): one more logit per query head in every row's softmax; lse2 includes it."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g, dp, bq, bk, r_pad, tk_pad = _tiling(q, k, blocks.block_q, blocks.block_k, wide_block_q=64)
    n_rt, n_kt = r_pad // bq, tk_pad // bk

    qf = _fold_rows(q, hkv, r_pad, dp)
    kp = _pad_kv(k, tk_pad, dp)
    vp = _pad_kv(v, tk_pad, dp)
    bounds = row_bounds(start, end, g, r_pad)
    plan = row_tile_plan(bounds, bq, bk)

    splits = blocks.num_splits
    if splits is None:
        programs = n_rt * b * hkv
        target = 2 * _num_sms()
        if programs >= target or n_kt < 8:
            splits = 1
        else:
            splits = int(min(16, -(-target // programs), n_kt // 4))
    splits = min(splits, n_kt)
    num_warps = blocks.num_warps or (8 if bq * dp >= 128 * 128 else 4)

    kernel = functools.partial(
        _fwd_kernel, scale=scale, block_k=bk, num_splits=splits, precision=_precision(q.dtype),
        has_sinks=sinks is not None,
    )
    out_dtype = q.dtype if splits == 1 else jnp.float32
    # Row tiles run in reverse (x-major launch order): with causal-like masks the last row tiles
    # visit the most key tiles, and starting them first shortens the tail.
    def rt(i):
        return n_rt - 1 - i

    in_specs = [
        pl.BlockSpec((None, None, 4), lambda s, i, bb, h: (bb, rt(i), 0)),  # plan
        pl.BlockSpec((None, 4, bq), lambda s, i, bb, h: (bb, 0, rt(i))),  # row bounds
        pl.BlockSpec((None, None, bq, dp), lambda s, i, bb, h: (bb, h, rt(i), 0)),  # q (folded)
        pl.BlockSpec((None, tk_pad, None, dp), lambda s, i, bb, h: (bb, 0, h, 0)),  # k
        pl.BlockSpec((None, tk_pad, None, dp), lambda s, i, bb, h: (bb, 0, h, 0)),  # v
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, bq, dp), lambda s, i, bb, h: (s, bb, h, rt(i), 0)),
        pl.BlockSpec((None, None, None, bq), lambda s, i, bb, h: (s, bb, h, rt(i))),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((splits, b, hkv, r_pad, dp), out_dtype),
        jax.ShapeDtypeStruct((splits, b, hkv, r_pad), jnp.float32),
    ]
    operands = [plan, bounds, qf, kp, vp]
    if sinks is not None:
        in_specs.insert(2, pl.BlockSpec((None, bq), lambda s, i, bb, h: (h, rt(i))))  # sinks
        operands.insert(2, _fold_sinks(sinks, tq, hkv, r_pad))
    o, lse = pl.pallas_call(
        kernel,
        grid=(splits, n_rt, b, hkv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(num_warps, blocks.num_stages),
        interpret=interpret,
        name="block_attention_fwd",
    )(*operands)

    if splits == 1:
        o, lse = o[0], lse[0]
    else:  # merge the partial softmaxes; rows no split saw stay zero with lse ~ NEG
        m = jnp.max(lse, axis=0)
        w = jnp.exp2(lse - m[None])
        total = jnp.sum(w, axis=0)
        o = (jnp.sum(w[..., None] * o, axis=0) / total[..., None]).astype(q.dtype)
        lse = m + jnp.log2(total)
    out = _unfold_rows(o, tq, hq, d)
    lse = _unfold_rows(lse, tq, hq, None)
    return out, lse


def _backward_pallas(q, k, v, start, end, out, lse2, do, scale: float, blocks: BlockSizes,
                     interpret: bool):
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g, dp, bq, bk, r_pad, tk_pad = _tiling(q, k, blocks.block_q_bwd, blocks.block_k_bwd, wide_block_q=32)
    n_rt, n_kt = r_pad // bq, tk_pad // bk
    precision = _precision(q.dtype)
    num_warps = blocks.num_warps or (8 if dp >= 128 else 4)
    params = _compiler_params(num_warps, blocks.num_stages)

    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, Tq, Hq]
    # Rows that saw nothing: lse 0 makes every (masked, NEG) probability exactly 0.
    lse2 = jnp.where(lse2 > _SEEN, lse2, 0.0)
    qf = _fold_rows(q, hkv, r_pad, dp)
    dof = _fold_rows(do.astype(q.dtype), hkv, r_pad, dp)
    lsef = _fold_rows(lse2, hkv, r_pad, None)
    deltaf = _fold_rows(delta, hkv, r_pad, None)
    kp = _pad_kv(k, tk_pad, dp)
    vp = _pad_kv(v, tk_pad, dp)
    bounds = row_bounds(start, end, g, r_pad)
    plan = row_tile_plan(bounds, bq, bk)
    lists = key_tile_lists(plan, n_kt)

    def rt(i):  # row tiles in reverse, as in the forward
        return n_rt - 1 - i

    row_tile = pl.BlockSpec((None, None, bq, dp), lambda i, bb, h: (bb, h, rt(i), 0))
    row_vec = pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, rt(i)))
    all_keys = pl.BlockSpec((None, tk_pad, None, dp), lambda i, bb, h: (bb, 0, h, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_k=bk, precision=precision),
        grid=(n_rt, b, hkv),
        in_specs=[
            pl.BlockSpec((None, None, 4), lambda i, bb, h: (bb, rt(i), 0)),
            pl.BlockSpec((None, 4, bq), lambda i, bb, h: (bb, 0, rt(i))),
            row_tile, row_tile, row_vec, row_vec, all_keys, all_keys,
        ],
        out_specs=row_tile,
        out_shape=jax.ShapeDtypeStruct((b, hkv, r_pad, dp), q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="block_attention_dq",
    )(plan, bounds, qf, dof, lsef, deltaf, kp, vp)

    all_rows = pl.BlockSpec((None, None, r_pad, dp), lambda j, bb, h: (bb, h, 0, 0))
    all_rows_vec = pl.BlockSpec((None, None, r_pad), lambda j, bb, h: (bb, h, 0))
    key_tile = pl.BlockSpec((None, bk, None, dp), lambda j, bb, h: (bb, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, scale=scale, block_q=bq, block_k=bk, precision=precision),
        grid=(n_kt, b, hkv),
        in_specs=[
            pl.BlockSpec((None, None, 1 + n_rt), lambda j, bb, h: (bb, j, 0)),
            pl.BlockSpec((None, 4, r_pad), lambda j, bb, h: (bb, 0, 0)),
            all_rows, all_rows, all_rows_vec, all_rows_vec, key_tile, key_tile,
        ],
        out_specs=[key_tile, key_tile],
        out_shape=[
            jax.ShapeDtypeStruct((b, tk_pad, hkv, dp), k.dtype),
            jax.ShapeDtypeStruct((b, tk_pad, hkv, dp), v.dtype),
        ],
        compiler_params=params,
        interpret=interpret,
        name="block_attention_dkdv",
    )(lists, bounds, qf, dof, lsef, deltaf, kp, vp)

    dq = _unfold_rows(dq, tq, hq, d)
    return dq, dk[:, :tk, :, :d], dv[:, :tk, :, :d]


def _sink_grad(sinks, out, lse2, do):
    """d(sinks) [Hq]: the sink's probability p = exp(sink - lse) times its score's gradient
    p * (dO . v_sink - delta) = -p * delta (the sink has no value), delta = rowsum(dO * O),
    summed over batch and queries."""
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, Tq, Hq]
    s2 = jnp.maximum(sinks.astype(jnp.float32) * _LOG2E, NEG)
    p_sink = jnp.exp2(jnp.minimum(s2 - lse2, 0.0))  # lse includes the sink: p <= 1
    return (-jnp.sum(p_sink * delta, axis=(0, 1))).astype(sinks.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _block_attention(q, k, v, start, end, sinks, scale: float, blocks: BlockSizes, interpret: bool,
                     backward: str):
    return _forward(q, k, v, start, end, scale, blocks, interpret, sinks)[0]


def _block_attention_fwd(q, k, v, start, end, sinks, scale, blocks, interpret, backward):
    out, lse2 = _forward(q, k, v, start, end, scale, blocks, interpret, sinks)
    return out, (q, k, v, start, end, sinks, out, lse2)


def _block_attention_bwd(scale, blocks, interpret, backward, res, do):
    q, k, v, start, end, sinks, out, lse2 = res
    if backward == "reference":
        def ref(q_, k_, v_, sinks_):
            return reference_attention(q_, k_, v_, KeyRanges(start, end), scale=scale, sinks=sinks_)

        dq, dk, dv, dsinks = jax.vjp(ref, q, k, v, sinks)[1](do)
    else:
        # The saved lse includes the sink, so the recomputed probabilities of the keys (and dq,
        # dk, dv) already carry it; the sink itself only needs its own gradient.
        dq, dk, dv = _backward_pallas(q, k, v, start, end, out, lse2, do, scale, blocks, interpret)
        dsinks = None if sinks is None else _sink_grad(sinks, out, lse2, do)
    return dq, dk, dv, None, None, dsinks


_block_attention.defvjp(_block_attention_fwd, _block_attention_bwd)


# ----------------------------------------------------------------------------------------------
# Public API


def unsupported_reason(q, k, v, ranges: KeyRanges, scale=None) -> str | None:
    """Why `block_attention` cannot take these arguments, or None if it can."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return f"expected q, k, v of rank 4, got {q.ndim}, {k.ndim}, {v.ndim}"
    b, tq, hq, d = q.shape
    if k.shape != v.shape:
        return f"k {k.shape} and v {v.shape} differ in shape"
    if k.shape[0] != b or k.shape[3] != d:
        return f"k {k.shape} does not match q {q.shape} in batch or head_dim"
    try:
        check_gqa(hq, k.shape[2])
    except ValueError as e:
        return str(e)
    if tq == 0 or k.shape[1] == 0:
        return "empty query or key axis"
    if d > MAX_HEAD_DIM:
        return f"head_dim {d} > {MAX_HEAD_DIM}"
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1:
        return f"mixed dtypes {sorted(str(t) for t in dtypes)}"
    if dtypes.pop() not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} not in {[str(t) for t in SUPPORTED_DTYPES]}"
    if scale is not None and not isinstance(scale, (int, float)):
        try:
            float(scale)
        except Exception:
            return "scale is traced (the kernels need a static scale)"
    rs = getattr(ranges, "start", None)
    if rs is None or rs.ndim != 3 or rs.shape[1:] != (tq, 2) or rs.shape[0] not in (1, b):
        return f"ranges of shape {getattr(rs, 'shape', None)} do not match [B={b}, Tq={tq}, 2]"
    return None


def _static_scale_and_bounds(q, k, v, ranges: KeyRanges, scale):
    """Validates the inputs -> (scale as a Python float, start, end [B, Tq, 2] clipped to [0, Tk))."""
    reason = unsupported_reason(q, k, v, ranges, scale)
    if reason is not None:
        raise ValueError(f"block_attention cannot take these inputs: {reason}")
    b, tq, _, d = q.shape
    start, end = clip_ranges(ranges, b, tq, k.shape[1])
    return float(d**-0.5 if scale is None else scale), start, end


def block_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ranges: KeyRanges,
    *,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    backward: str = "pallas",
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of q [B, Tq, Hq, D] over k, v [B, Tk, Hkv, D] where each query sees its `ranges`.

    Same semantics as `dflash_jax.kernels.reference.reference_attention`: scale defaults to
    D**-0.5, float32 softmax and accumulation, output in q's dtype, zeros for queries that see no
    key. ``sinks`` [Hq] (attention sinks, `reference.with_sinks`): one learned logit per query head
    that joins every query's softmax denominator inside the kernel and carries no value.
    Differentiable (dq, dk, dv and d(sinks)) with Pallas backward kernels, or the reference's VJP
    when ``backward="reference"``. ``block_sizes``: tiles and launch parameters (None:
    `BlockSizes()`). ``interpret=True`` runs the kernels in Pallas interpret mode (CPU tests).
    """
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    scale, start, end = _static_scale_and_bounds(q, k, v, ranges, scale)
    _check_sinks(sinks, q.shape[2])
    blocks = BlockSizes() if block_sizes is None else block_sizes
    return _block_attention(q, k, v, start, end, sinks, scale, blocks, bool(interpret), backward)


def _check_sinks(sinks, num_q_heads: int):
    if sinks is not None and tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(f"sinks must have shape [Hq={num_q_heads}], got {tuple(sinks.shape)}")


def block_attention_with_lse(q, k, v, ranges: KeyRanges, *, scale: float | None = None,
                             block_sizes: BlockSizes | None = None, interpret: bool = False,
                             sinks: jax.Array | None = None):
    """Forward only: (out [B, Tq, Hq, D] in q's dtype, lse [B, Tq, Hq] float32 natural
    log-sum-exp, -inf where the query sees no key); arguments as in `block_attention` (only the
    forward fields of ``block_sizes`` matter). With ``sinks`` the lse includes the sink (a query
    that sees no key: out 0, lse = its head's sink)."""
    scale, start, end = _static_scale_and_bounds(q, k, v, ranges, scale)
    _check_sinks(sinks, q.shape[2])
    blocks = BlockSizes() if block_sizes is None else block_sizes
    out, lse2 = _forward(q, k, v, start, end, scale, blocks, bool(interpret), sinks)
    return out, jnp.where(lse2 > _SEEN, lse2 * _LN2, -jnp.inf)
