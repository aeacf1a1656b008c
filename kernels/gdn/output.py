"""The forward's outputs: each chunk recomputed from its start state, sub-chunk by sub-chunk
(DESIGN.md, Forward)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .primitives import _chunk_tile, _dot, _gb_slot, _l2norm_rows, _load_packed, _load_rows, _load_tinv
from .problem import Problem, _cdiv, _geom, _kw


@triton.jit
def _fwd_out_kernel(
    q, k, v, gbp, tinv, o, states, chunk_spans, T, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr,
    SAVE_SUB: tl.constexpr = False, NS: tl.constexpr = 1,
):
    """Outputs of one chunk (value columns i_v·BV …) from its start state, sub-chunk by
    sub-chunk: v_new = U − W S; O = (Q ⊙ e^γ) S + P v_new; S ← e^{γ_L} S + K̃ᵀ v_new.
    SAVE_SUB (Config.local_sub_states): states is [NC·NS, H, K, V], one slot per sub-chunk, whose
    first slot per chunk the state pass filled; this kernel stores every sub-chunk's start
    state in its slot (slots past the end of the sequence get zeros)."""
    i_c, i_h, i_v, t0, eos, o_r, o_k, o_v, m_v = _chunk_tile(chunk_spans, T, BT, BC, K, BV, V, IS_VARLEN)
    m_k = o_k < K
    n_sub = tl.maximum(tl.cdiv(tl.minimum(eos - t0, BT), BC), 0)
    if SAVE_SUB:
        p_s = (((i_c * NS) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        for s in range(n_sub, NS):  # the saved tensor is defined everywhere
            tl.store(states + p_s + s * (H * K * V), tl.zeros([K, BV], dtype=states.dtype.element_ty),
                     mask=m_v[None, :])
    else:
        p_s = ((i_c * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    if t0 >= eos:
        return
    incl = o_r[:, None] >= o_r[None, :]
    S = tl.load(states + p_s, mask=m_v[None, :], other=0.0).to(tl.float32)
    for s in range(n_sub):
        if SAVE_SUB:
            if s > 0:
                tl.store(states + p_s + s * (H * K * V), S.to(states.dtype.element_ty), mask=m_v[None, :])
        rows = t0 + s * BC + o_r
        m_r = rows < eos
        kb, _ = _l2norm_rows(_load_rows(k, rows, m_r, i_h, H, K, o_k, m_k), NORM_QK)
        qb, _ = _l2norm_rows(_load_rows(q, rows, m_r, i_h, H, K, o_k, m_k), NORM_QK)
        vb = _load_rows(v, rows, m_r, i_h, H, V, o_v, m_v)
        gam, gL, bb = _load_packed(_gb_slot(gbp, i_c, i_h, s, H, BT, BC), BC)
        Tm = _load_tinv(tinv, rows, m_r, i_h, H, BC)
        eg = tl.exp(gam)
        W = _dot(Tm, kb * (bb * eg)[:, None], TPREC)
        vn = _dot(Tm, vb * bb[:, None], TPREC) - _dot(W, S, PREC)
        qs = qb * scale
        G_in = tl.where(incl, tl.exp(tl.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
        Pm = _dot(qs, tl.trans(kb), PREC) * G_in
        ob = _dot(qs * eg[:, None], S, PREC) + _dot(Pm, vn, PREC)
        p_o = (rows.to(tl.int64) * H + i_h)[:, None] * V + o_v[None, :]
        tl.store(o + p_o, ob.to(o.dtype.element_ty), mask=m_r[:, None] & m_v[None, :])
        Kt = kb * tl.exp(gL - gam)[:, None]
        S = tl.exp(gL) * S + _dot(tl.trans(Kt), vn, PREC)


def run_fwd_out(p: Problem, tinv: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """o; with slots > 1 it also fills the other sub-chunk slots of `states` in place."""
    BV = p.cfg.tile("fwd_out")
    o = torch.empty(p.B, p.T, p.H, p.V, dtype=p.v.dtype, device=p.q.device)
    save = dict(SAVE_SUB=True, NS=p.cfg.slots) if p.cfg.slots > 1 else {}
    _fwd_out_kernel[(p.NC, p.H, _cdiv(p.V, BV))](
        p.q, p.k, p.v, p.gbp, tinv, o, states, p.spans, p.T, p.scale, V=p.V, BV=BV, **_geom(p),
        **save, **_kw(p.cfg.fwd_out))
    return o
