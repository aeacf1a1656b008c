"""The chunk maps: [M | N] of every chunk for the forward state pass (``_fwd_prep``) and
[Mᵀ | R] for the reverse one (``_bwd_prep``), all chunks in parallel (DESIGN.md, Forward and
Backward)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .primitives import (_chunk_span, _dot, _gb_slot, _l2norm_rows, _load_gam_beta, _load_packed, _load_rows,
                         _load_tinv, _store_gam_beta)
from .problem import Problem, _cdiv, _geom, _kw


@triton.jit
def _fwd_prep_kernel(
    k, v, gbp, tinv, mn, chunk_spans, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BZ: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr,
):
    """[M | N] of one chunk (columns i_z·BZ …): the sub-chunk recurrence
    Z ← e^{γ_L} Z + K̃ᵀ (T [0 | βV] − W Z) run from Z = [I | 0]."""
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_z = tl.program_id(2)
    t0, eos = _chunk_span(i_c, chunk_spans, T, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_r = tl.arange(0, BC)
    o_k = tl.arange(0, K)
    o_z = i_z * BZ + tl.arange(0, BZ)
    m_z = o_z < K + V
    m_zv = (o_z >= K) & m_z
    m_k = o_k < K
    Z = tl.where(o_k[:, None] == o_z[None, :], 1.0, 0.0)
    n_sub = tl.cdiv(tl.minimum(eos - t0, BT), BC)
    for s in range(n_sub):
        rows = t0 + s * BC + o_r
        m_r = rows < eos
        kb, _ = _l2norm_rows(_load_rows(k, rows, m_r, i_h, H, K, o_k, m_k), NORM_QK)
        gam, gL, bb = _load_packed(_gb_slot(gbp, i_c, i_h, s, H, BT, BC), BC)
        yb = _load_rows(v, rows, m_r, i_h, H, V, o_z - K, m_zv) * bb[:, None]
        Tm = _load_tinv(tinv, rows, m_r, i_h, H, BC)
        W = _dot(Tm, kb * (bb * tl.exp(gam))[:, None], TPREC)
        vn = _dot(Tm, yb, TPREC) - _dot(W, Z, PREC)
        Kt = kb * tl.exp(gL - gam)[:, None]
        Z = tl.exp(gL) * Z + _dot(tl.trans(Kt), vn, PREC)
    p = mn + ((i_c * H + i_h) * K + o_k[:, None]) * (K + V) + o_z[None, :]
    tl.store(p, Z, mask=m_z[None, :])


@triton.jit
def _adjoint_step(qb, kb, gam, gL, bb, Tm, dob, dZ, scale, BC: tl.constexpr, PREC: tl.constexpr,
                  TPREC: tl.constexpr):
    """Gradient of a sub-chunk's start state from the gradient dZ of its end state and dO
    (only the state path: dv' = Pᵀ dO + K̃ dZ; dZ ← (Q ⊙ e^γ)ᵀ dO + e^{γ_L} dZ − Wᵀ dv')."""
    o_r = tl.arange(0, BC)
    incl = o_r[:, None] >= o_r[None, :]
    eg = tl.exp(gam)
    W = _dot(Tm, kb * (bb * eg)[:, None], TPREC)
    qs = qb * scale
    G_in = tl.where(incl, tl.exp(tl.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
    Pm = _dot(qs, tl.trans(kb), PREC) * G_in
    Kt = kb * tl.exp(gL - gam)[:, None]
    dvn = _dot(tl.trans(Pm), dob, PREC) + _dot(Kt, dZ, PREC)
    return (_dot(tl.trans(qs * eg[:, None]), dob, PREC) + tl.exp(gL) * dZ
            - _dot(tl.trans(W), dvn, PREC))


@triton.jit
def _bwd_prep_kernel(
    q, k, g, beta, tinv, do, mr, gbp, chunk_spans, T, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BZ: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr,
):
    """[Mᵀ | R] of one chunk: the adjoint sub-chunk recurrence, last sub-chunk first,
    dv' = Pᵀ dO' + K̃ dZ; dZ ← (Q ⊙ e^γ)ᵀ dO' + e^{γ_L} dZ − Wᵀ dv', from dZ = [I | 0]
    with dO' = [0 | dO]. R is the gradient of the chunk's start state from its own outputs.
    The first column block's programs also write the γβ pack for the backward's later kernels."""
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_z = tl.program_id(2)
    t0, eos = _chunk_span(i_c, chunk_spans, T, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_r = tl.arange(0, BC)
    o_k = tl.arange(0, K)
    o_z = i_z * BZ + tl.arange(0, BZ)
    m_z = o_z < K + V
    m_zv = (o_z >= K) & m_z
    m_k = o_k < K
    dZ = tl.where(o_k[:, None] == o_z[None, :], 1.0, 0.0)
    n_sub = tl.cdiv(tl.minimum(eos - t0, BT), BC)
    for j in range(n_sub):
        s = n_sub - 1 - j
        rows = t0 + s * BC + o_r
        m_r = rows < eos
        kb, _ = _l2norm_rows(_load_rows(k, rows, m_r, i_h, H, K, o_k, m_k), NORM_QK)
        qb, _ = _l2norm_rows(_load_rows(q, rows, m_r, i_h, H, K, o_k, m_k), NORM_QK)
        dob = _load_rows(do, rows, m_r, i_h, H, V, o_z - K, m_zv)
        gam, gL, bb = _load_gam_beta(g, beta, rows, m_r, i_h, H)
        if i_z == 0:
            _store_gam_beta(_gb_slot(gbp, i_c, i_h, s, H, BT, BC), gam, bb, BC)
        Tm = _load_tinv(tinv, rows, m_r, i_h, H, BC)
        dZ = _adjoint_step(qb, kb, gam, gL, bb, Tm, dob, dZ, scale, BC, PREC, TPREC)
    p = mr + ((i_c * H + i_h) * K + o_k[:, None]) * (K + V) + o_z[None, :]
    tl.store(p, dZ, mask=m_z[None, :])


def run_fwd_prep(p: Problem, tinv: torch.Tensor) -> torch.Tensor:
    """[M | N] of every chunk ([NC, H, K, K + V] fp32)."""
    BZ = p.cfg.tile("fwd_prep")
    mn = torch.empty(p.NC, p.H, p.K, p.K + p.V, dtype=torch.float32, device=p.q.device)
    _fwd_prep_kernel[(p.NC, p.H, _cdiv(p.K + p.V, BZ))](
        p.k, p.v, p.gbp, tinv, mn, p.spans, p.T, V=p.V, BZ=BZ, **_geom(p), **_kw(p.cfg.fwd_prep))
    return mn


def run_bwd_prep(p: Problem, tinv: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """[Mᵀ | R] of every chunk ([NC, H, K, K + V] fp32)."""
    BZ = p.cfg.tile("bwd_prep")
    mr = torch.empty(p.NC, p.H, p.K, p.K + p.V, dtype=torch.float32, device=p.q.device)
    _bwd_prep_kernel[(p.NC, p.H, _cdiv(p.K + p.V, BZ))](
        p.q, p.k, p.g, p.beta, tinv, do, mr, p.gbp, p.spans, p.T, p.scale, V=p.V, BZ=BZ, **_geom(p),
        **_kw(p.cfg.bwd_prep))
    return mr
