"""The WY inverse: T = (I + A)⁻¹ of every sub-chunk, once per sub-chunk at full occupancy, and
the forward's γβ pack (DESIGN.md, Forward)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .primitives import (_chunk_span, _dot, _gb_slot, _gram, _l2norm_rows, _load_gam_beta, _load_rows,
                         _store_gam_beta)
from .problem import Problem, _geom, _kw, saved_t_dtype


@triton.jit
def _neumann_inverse(A, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + A)⁻¹ for A with A¹⁶ = 0 (strictly lower triangular 16 × 16 blocks on the diagonal):
    the product (I − A)(I + A²)(I + A⁴)(I + A⁸), three squarings and three products."""
    o_r = tl.arange(0, BC)
    Tm = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0) - A
    P = A
    for _ in tl.static_range(3):
        P = _dot(P, P, PREC)
        Tm = Tm + _dot(Tm, P, PREC)
    return Tm


@triton.jit
def _unit_lower_inverse(A, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + A)⁻¹ for strictly lower triangular A, BC = 16 or 32. PREC must not be "tf32": within
    a 16-token block the Neumann terms A^j reach C(14, j−1) (3,432) when the keys are nearly
    parallel and β, Γ ≈ 1, and they cancel to an O(1) inverse; tf32's 10-bit mantissa leaves O(1)
    errors in T, the chunk map then stops being a contraction and the state grows until it
    overflows. "ieee" is safe; "tf32x3" (~2⁻²¹, the tuned entries' choice) measured the same
    error as "ieee" in the benchmark's collapsed-keys check on an H200.

    BC = 32 never runs the Neumann product over all 32 rows (its terms would reach C(30, 15),
    ~1.6e8, beyond even fp32): the two diagonal 16-blocks D are inverted as above (Td), and with
    O = A − D (the block below them), (I + D + O)⁻¹ = (I + Td O)⁻¹ Td = Td − Td O Td, since
    (Td O)² = 0."""
    if BC == 16:
        Tm = _neumann_inverse(A, BC, PREC)
    else:
        o_r = tl.arange(0, BC)
        diag = (o_r[:, None] // 16) == (o_r[None, :] // 16)
        Td = _neumann_inverse(tl.where(diag, A, 0.0), BC, PREC)
        Tm = Td - _dot(Td, _dot(tl.where(diag, 0.0, A), Td, PREC), PREC)
    return Tm


@triton.jit
def _wy_inverse_kernel(
    k, g, beta, tinv, gbp, chunk_spans, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr,
    INV_PREC: tl.constexpr,
):
    """T = (I + A)⁻¹ of one sub-chunk, stored row by row beside its tokens ([B, T, H, BC]), and
    its γβ pack slot for the forward kernels. One sub-chunk per program: the only long
    dependency chain of the WY algebra runs at full occupancy here, once per training step,
    instead of inside every other kernel."""
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    t0, eos = _chunk_span(i_c, chunk_spans, T, BT, IS_VARLEN)
    r0 = t0 + i_s * BC
    if r0 >= eos:
        return
    o_r = tl.arange(0, BC)
    o_k = tl.arange(0, K)
    rows = r0 + o_r
    m_r = rows < eos
    kb, _ = _l2norm_rows(_load_rows(k, rows, m_r, i_h, H, K, o_k, o_k < K), NORM_QK)
    gam, _, bb = _load_gam_beta(g, beta, rows, m_r, i_h, H)
    _store_gam_beta(_gb_slot(gbp, i_c, i_h, i_s, H, BT, BC), gam, bb, BC)
    _, _, A = _gram(kb, gam, bb, BC, TPREC)
    Tm = _unit_lower_inverse(A, BC, INV_PREC)
    p = (rows.to(tl.int64) * H + i_h)[:, None] * BC + o_r[None, :]
    tl.store(tinv + p, Tm.to(tinv.dtype.element_ty), mask=m_r[:, None])


def run_wy_inverse(p: Problem) -> torch.Tensor:
    """T = (I + A)⁻¹ of every sub-chunk, row by row beside its tokens ([B, T, H, BC]; bf16 or
    fp32, saved_t_dtype)."""
    c = p.cfg
    tinv = torch.empty(p.B, p.T, p.H, c.BC, dtype=saved_t_dtype(c, p.q.dtype), device=p.q.device)
    _wy_inverse_kernel[(p.NC, p.H, c.BT // c.BC)](
        p.k, p.g, p.beta, tinv, p.gbp, p.spans, p.T, INV_PREC=c.inverse_prec,
        **_geom(p), **_kw(c.wy_inverse))
    return tinv
