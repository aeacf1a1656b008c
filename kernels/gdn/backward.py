"""The backward's last stage: every chunk's input gradients from its start state (or its
sub-chunks' saved start states) and its end-state gradient, in one reverse sweep per chunk
(``_bwd_local``), and the sum of the value blocks' partial gradients (DESIGN.md, Backward)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .primitives import (_chunk_tile, _dot, _gb_slot, _gram, _l2norm_rows, _l2norm_rows_pair, _load_packed,
                         _load_rows, _load_tinv)
from .problem import Problem, _cdiv, _geom, _kw


@triton.jit
def _sum_parts_kernel(part, out, N, NV: tl.constexpr, BLOCK: tl.constexpr):
    """out = Σ_j part[j] in one pass: the value blocks' fp32 partial sums of a gradient, cast to
    out's dtype (one pass over the partial sums instead of torch's sum and then a cast)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    acc = tl.load(part + offs, mask=m, other=0.0)
    for j in tl.static_range(1, NV):
        acc += tl.load(part + j * N + offs, mask=m, other=0.0)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=m)


@triton.jit
def _sub_chunk_grads(
    q, k, v, p_gb, tinv, do, dq, dk, dv, dg, db, rows, m_r, i_h, i_v, S, dS, scale, part_qk, part_t,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
    NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr,
    T_PRE=None, HAS_T_PRE: tl.constexpr = False,
):
    """dq, dk, dv, dg, dβ of one sub-chunk (value columns i_v·BV …; partial sums over the
    value blocks at offsets i_v·part_qk / i_v·part_t) from its start state S and the gradient
    dS of its end state (DESIGN.md, Backward); returns the gradient of its start state, the
    next step of _bwd_local's reverse sweep. HAS_T_PRE: the caller loaded the sub-chunk's T
    already (T_PRE, Config.prefetch_t)."""
    o_r = tl.arange(0, BC)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    incl = o_r[:, None] >= o_r[None, :]
    lower = o_r[:, None] > o_r[None, :]
    kb, qb, rk, rq = _l2norm_rows_pair(_load_rows(k, rows, m_r, i_h, H, K, o_k, m_k),
                                       _load_rows(q, rows, m_r, i_h, H, K, o_k, m_k), NORM_QK)
    vb = _load_rows(v, rows, m_r, i_h, H, V, o_v, m_v)
    dob = _load_rows(do, rows, m_r, i_h, H, V, o_v, m_v)
    gam, gL, bb = _load_packed(p_gb, BC)
    if HAS_T_PRE:
        Tm = T_PRE
    else:
        Tm = _load_tinv(tinv, rows, m_r, i_h, H, BC)
    decay, Bkk, A = _gram(kb, gam, bb, BC, PREC)
    eg = tl.exp(gam)
    egL = tl.exp(gL)
    ed = tl.exp(gL - gam)
    X = kb * (bb * eg)[:, None]
    W = _dot(Tm, X, TPREC)
    vn = _dot(Tm, vb * bb[:, None], TPREC) - _dot(W, S, PREC)
    qs = qb * scale
    G_in = tl.where(incl, tl.exp(tl.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
    Pm = _dot(qs, tl.trans(kb), PREC) * G_in
    Qt = qs * eg[:, None]
    Kt = kb * ed[:, None]

    # adjoints of the sub-chunk's intermediates (dS = gradient of its end state)
    dvn = _dot(tl.trans(Pm), dob, PREC) + _dot(Kt, dS, PREC)
    dY = _dot(tl.trans(Tm), dvn, TPREC)
    dX = -_dot(dY, tl.trans(S), PREC)
    dQt = _dot(dob, tl.trans(S), PREC)
    dP = tl.where(incl, _dot(dob, tl.trans(vn), PREC), 0.0)
    dKt = _dot(vn, tl.trans(dS), PREC)
    dA = tl.where(lower, -_dot(dY, tl.trans(vn), PREC), 0.0)
    dgL = egL * tl.sum(tl.sum(dS * S, 1), 0)
    dS = (_dot(tl.trans(Qt), dob, PREC) + egL * dS
          - _dot(tl.trans(W), dvn, PREC))

    # gradients of the inputs
    dPG = dP * G_in
    Gk = dA * decay * bb[:, None]
    dqb = (dQt * eg[:, None] + _dot(dPG, kb, PREC)) * scale
    dkb = (_dot(tl.trans(dPG), qs, PREC) + dKt * ed[:, None] + dX * (bb * eg)[:, None]
           + _dot(Gk, kb, PREC) + _dot(tl.trans(Gk), kb, PREC))
    dvb = dY * bb[:, None]
    E = dP * Pm + dA * A
    # the row sums in pairs of equal widths, one reduction each: ⟨dX_r, k_r⟩ enters dβ_r (times
    # a_r) and dγ_r (times β_r a_r; ⟨dX_r, X_r⟩ = β_r a_r ⟨dX_r, k_r⟩)
    dXk = dX * kb
    if BV == K:
        sK = tl.sum(tl.join(dXk * eg[:, None] + dY * vb, dQt * Qt + dXk * (bb * eg)[:, None]), 1)
        dbK, dgK = tl.split(sK)
    else:
        xk = tl.sum(dXk, 1)
        dbK = eg * xk + tl.sum(dY * vb, 1)
        dgK = tl.sum(dQt * Qt, 1) + bb * eg * xk
    sC = tl.sum(tl.join(dA * Bkk, E), 1)
    dbC, dgC = tl.split(sC)
    dbb = dbK + dbC
    Fk = tl.sum(dKt * Kt, 1)
    dgam = dgK + dgC - tl.sum(E, 0) - Fk
    dgb = tl.cumsum(dgam, axis=0, reverse=True) + dgL + tl.sum(Fk, 0)
    if NORM_QK:
        sq, sk = tl.split(tl.sum(tl.join(qb * dqb, kb * dkb), 1))
        dqb = rq[:, None] * (dqb - qb * sq[:, None])
        dkb = rk[:, None] * (dkb - kb * sk[:, None])

    r64 = rows.to(tl.int64)
    m_rk = m_r[:, None] & m_k[None, :]
    p_qk = (r64 * H + i_h)[:, None] * K + o_k[None, :] + i_v * part_qk
    tl.store(dq + p_qk, dqb.to(dq.dtype.element_ty), mask=m_rk)
    tl.store(dk + p_qk, dkb.to(dk.dtype.element_ty), mask=m_rk)
    p_v = (r64 * H + i_h)[:, None] * V + o_v[None, :]
    tl.store(dv + p_v, dvb.to(dv.dtype.element_ty), mask=m_r[:, None] & m_v[None, :])
    p_t = r64 * H + i_h + i_v * part_t
    tl.store(dg + p_t, dgb.to(dg.dtype.element_ty), mask=m_r)
    tl.store(db + p_t, dbb.to(db.dtype.element_ty), mask=m_r)
    return dS


@triton.jit
def _bwd_local_kernel(
    q, k, v, gbp, tinv, do, states, dstates, scratch, dq, dk, dv, dg, db, chunk_spans, T, scale,
    part_qk, part_t,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    NS: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr,
    SUB_STATES: tl.constexpr = False, PREFETCH_T: tl.constexpr = False,
):
    """Gradients of one chunk (value columns i_v·BV …) from its start state S and the gradient
    dS of its end state. A forward sweep stores the sub-chunk start states (scratch), then a
    reverse sweep runs the adjoint recurrence and emits dq, dk, dv, dg, dβ. With several value
    blocks, dq/dk/dg/dβ are partial sums (offsets part_qk / part_t per block). SUB_STATES
    (Config.local_sub_states): `states` holds every sub-chunk's start state ([NC·NS, H, K, V],
    saved by the forward), which the reverse sweep loads; there is no forward sweep.
    PREFETCH_T (Config.prefetch_t): the reverse sweep loads the next sub-chunk's T one step
    ahead. T is the one load of that loop Triton does not pipeline (sm_90 TTGIR, Triton 3.6: it
    is a dot operand both as is and transposed)."""
    i_c, i_h, i_v, t0, eos, o_r, o_k, o_v, m_v = _chunk_tile(chunk_spans, T, BT, BC, K, BV, V, IS_VARLEN)
    if t0 >= eos:
        return
    m_k = o_k < K
    p_s = ((i_c * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    if SUB_STATES:
        # sub-chunk s of chunk i_c is slot i_c·NS + s of the saved states
        p_sub = states + (((i_c * NS) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    else:
        S = tl.load(states + p_s, mask=m_v[None, :], other=0.0).to(tl.float32)
    dS = tl.load(dstates + p_s, mask=m_v[None, :], other=0.0)
    n_sub = tl.cdiv(tl.minimum(eos - t0, BT), BC)
    if not SUB_STATES:
        # private scratch [NS, K, BV] of this program
        p_scr = scratch + (((i_c * H + i_h) * NV + i_v) * NS * K + o_k[:, None]) * BV + tl.arange(0, BV)[None, :]
        # forward sweep: start state of every sub-chunk (the first is S itself)
        for s in range(n_sub - 1):
            tl.store(p_scr + s * K * BV, S)
            rows = t0 + s * BC + o_r
            m_r = rows < eos
            kb, _ = _l2norm_rows(_load_rows(k, rows, m_r, i_h, H, K, o_k, m_k), NORM_QK)
            vb = _load_rows(v, rows, m_r, i_h, H, V, o_v, m_v)
            gam, gL, bb = _load_packed(_gb_slot(gbp, i_c, i_h, s, H, BT, BC), BC)
            Tm = _load_tinv(tinv, rows, m_r, i_h, H, BC)
            W = _dot(Tm, kb * (bb * tl.exp(gam))[:, None], TPREC)
            vn = _dot(Tm, vb * bb[:, None], TPREC) - _dot(W, S, PREC)
            Kt = kb * tl.exp(gL - gam)[:, None]
            S = tl.exp(gL) * S + _dot(tl.trans(Kt), vn, PREC)
        tl.store(p_scr + (n_sub - 1) * K * BV, S)
        tl.debug_barrier()

    # reverse sweep
    if PREFETCH_T:
        r_next = t0 + (n_sub - 1) * BC + o_r
        T_next = _load_tinv(tinv, r_next, r_next < eos, i_h, H, BC)
    for j in range(n_sub):
        s = n_sub - 1 - j
        if SUB_STATES:
            S = tl.load(p_sub + s * (H * K * V), mask=m_v[None, :], other=0.0).to(tl.float32)
        else:
            S = tl.load(p_scr + s * K * BV)
        rows = t0 + s * BC + o_r
        m_r = rows < eos
        Tm = None  # _sub_chunk_grads loads it
        if PREFETCH_T:
            Tm = T_next
            r_next = t0 + tl.maximum(s - 1, 0) * BC + o_r  # the last step reloads the first sub-chunk's
            T_next = _load_tinv(tinv, r_next, r_next < eos, i_h, H, BC)
        dS = _sub_chunk_grads(q, k, v, _gb_slot(gbp, i_c, i_h, s, H, BT, BC), tinv, do, dq, dk, dv, dg, db, rows,
                              m_r, i_h, i_v, S, dS, scale,
                              part_qk, part_t, H, K, V, BC, BV, NORM_QK, PREC, TPREC, Tm, PREFETCH_T)


def _grad_buffers(p: Problem, NV: int):
    """dq, dk, dv, dg, dβ outputs of the gradient kernel; with several value blocks,
    dq/dk/dg/dβ are fp32 partial sums, one slab per block ([NV, ...])."""
    dev, f32 = p.q.device, torch.float32
    B, T, H, K = p.B, p.T, p.H, p.K
    part_dtype = f32 if NV > 1 else None
    dq = torch.empty(NV, B, T, H, K, dtype=part_dtype or p.q.dtype, device=dev)
    dk = torch.empty(NV, B, T, H, K, dtype=part_dtype or p.k.dtype, device=dev)
    dv = torch.empty(B, T, H, p.V, dtype=p.v.dtype, device=dev)
    dg = torch.empty(NV, B, T, H, dtype=part_dtype or p.g.dtype, device=dev)
    db = torch.empty(NV, B, T, H, dtype=part_dtype or p.beta.dtype, device=dev)
    return dq, dk, dv, dg, db


_SUM_BLOCK = 4096


def _summed(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Σ over the leading (value block) dim of fp32 partial sums, in `dtype`, in one kernel."""
    out = torch.empty(part.shape[1:], dtype=dtype, device=part.device)
    N = out.numel()
    _sum_parts_kernel[(_cdiv(N, _SUM_BLOCK),)](part, out, N, NV=part.shape[0], BLOCK=_SUM_BLOCK, num_warps=4)
    return out


def _sum_parts(p: Problem, dq, dk, dv, dg, db):
    if dq.shape[0] > 1:
        return (_summed(dq, p.q.dtype), _summed(dk, p.k.dtype), dv, _summed(dg, p.g.dtype),
                _summed(db, p.beta.dtype))
    return dq[0], dk[0], dv, dg[0], db[0]


def run_bwd_local(p: Problem, tinv, do, states, dstates):
    """(dq, dk, dv, dg, dβ) from each chunk's start state (or with local_sub_states every
    sub-chunk's) and end-state gradient."""
    BV = p.cfg.tile("bwd_local")
    NV = _cdiv(p.V, BV)
    NS = p.cfg.BT // p.cfg.BC
    B, T, H, K = p.B, p.T, p.H, p.K
    sub = p.cfg.local_sub_states
    # the forward sweep's per-program scratch of sub-chunk start states (none when they were saved)
    scratch = states if sub else torch.empty(p.NC, H, NV, NS, K, BV, dtype=torch.float32, device=p.q.device)
    dq, dk, dv, dg, db = grads = _grad_buffers(p, NV)
    _bwd_local_kernel[(p.NC, H, NV)](
        p.q, p.k, p.v, p.gbp, tinv, do, states, dstates, scratch, dq, dk, dv, dg, db, p.spans, p.T,
        p.scale, B * T * H * K, B * T * H, V=p.V, BV=BV, NV=NV, NS=NS, SUB_STATES=sub,
        PREFETCH_T=p.cfg.prefetch_t, **_geom(p), **_kw(p.cfg.bwd_local))
    return _sum_parts(p, *grads)
