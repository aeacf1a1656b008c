"""Triton kernels of the large-head path (``Config.large_head``; meant for K ≥ 64).

The chunk algebra of README.md ("Forward", "Backward") with the sub-chunk as large as the
chunk (c = BT, 64 by default), split the way ``chunk_torch._chunk_rows_backward`` is split:

- ``_lh_inverse``: T = (I + A)⁻¹ of every chunk ([B, T, H, BT] fp32, row by row beside the
  tokens), by block forward substitution over its 16-token diagonal blocks:
  T_i = T_ii (E_i − Σ_{m<i} A_im T_m), with T_ii from ``_unit_lower_inverse``.
- ``_lh_fwd_h``: the sequential pass over a sequence's chunks, one K × BV tile per program
  (W = T X, U = T Y, v_new = U − W S, S ← e^{γ_L} S + K̃ᵀ v_new); stores every chunk's start
  state. No [M | N] chunk maps: they cost O(K²) per chunk, more than the chunk's tokens at
  K = 128 (README, next step 5).
- ``_lh_fwd_o``: o = Q̃ S + P v_new per chunk, in parallel.
- ``_lh_bwd_dh``: the reverse pass; stores every chunk's end-state gradient dS'
  (dv_new = Pᵀ dO + K̃ dS', dS ← Q̃ᵀ dO + e^{γ_L} dS' − Wᵀ dv_new) and returns dh0.
- ``_lh_bwd_grads``: every chunk's input gradients from its S and dS' in parallel, looping
  over the value blocks for the sums over V.
- With ``Config.lh_split``, instead: ``_lh_bwd_dv`` (the dots that need all K columns, and dv),
  ``_lh_bwd_dqk`` (one key block per program, as fla splits its dq/dk kernel) and
  ``_lh_bwd_finish`` (the key blocks' shares summed, dg, the l2norm backward). The same stage
  also ends the default path's backward when large_head is off.

Every dot has BT rows (64: warpgroup MMAs on Hopper at ≥ 4 warps) instead of the 16 of the
default path. On an H200 with Triton 3.6 (seventh session, README.md) launches with ≥ 4 warps
mostly fault, and the path is slower than the default one (`_lh_bwd_grads` spills): off in the table.
The kernels launch at 2 warps with a 255-register cap: without it Triton 3.6's ptxas gives some
of them 32 registers (tenth session).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_kernels import (_chunk_span, _chunk_tile, _dot, _gram, _l2norm_rows, _load_rows, _load_vec,
                            _pass_tile, _unit_lower_inverse)


@triton.jit
def _operand(x, PREC: tl.constexpr):
    """x as _dot will take it: rounded to bf16 now with bf16 dots (half the registers while it waits)."""
    if PREC == "bf16":
        x = x.to(tl.bfloat16)
    return x


@triton.jit
def _lh_chunk(chunk_spans, i_c, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First token, sequence end, the chunk's token rows and their mask."""
    t0, eos = _chunk_span(i_c, chunk_spans, T, BT, IS_VARLEN)
    rows = t0 + tl.arange(0, BT)
    return t0, eos, rows, rows < eos


@triton.jit
def _lh_decays(gb, BT: tl.constexpr):
    """γ (in-chunk cumsum), γ_L, Γ ⊙ causal and Γ ⊙ strict (exp only of arguments ≤ 0)."""
    o_t = tl.arange(0, BT)
    gam = tl.cumsum(gb, axis=0)
    gL = tl.sum(gb, 0)
    incl = o_t[:, None] >= o_t[None, :]
    lower = o_t[:, None] > o_t[None, :]
    g_in = tl.where(incl, tl.exp(tl.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
    return gam, gL, g_in, tl.where(lower, g_in, 0.0)


@triton.jit
def _lh_inverse_kernel(
    k, g, beta, tinv, gcum, chunk_spans, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, LOG2_BC: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, TPREC: tl.constexpr, INV_PREC: tl.constexpr,
):
    """T = (I + A)⁻¹ of one chunk by 16-row blocks; gcum is scratch for the chunk's γ."""
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, eos = _chunk_span(i_c, chunk_spans, T, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_r = tl.arange(0, BC)
    o_k = tl.arange(0, K)
    o_t = tl.arange(0, BT)
    off = tl.sum(tl.zeros([BC], dtype=tl.float32), 0)  # γ at the end of the previous blocks
    for i in tl.static_range(BT // BC):
        rows = t0 + i * BC + o_r
        m_r = rows < eos
        kb, _ = _l2norm_rows(_load_rows(k, rows, m_r, i_h, H, K, o_k, o_k < K), NORM_QK)
        gb = _load_vec(g, rows, m_r, i_h, H)
        bb = _load_vec(beta, rows, m_r, i_h, H)
        gam_i = tl.cumsum(gb, axis=0)
        gam = gam_i + off
        off = off + tl.sum(gb, 0)
        tl.store(gcum + rows.to(tl.int64) * H + i_h, gam, mask=m_r)
        _, _, A = _gram(kb, gam_i, bb, BC, TPREC)
        Tii = _unit_lower_inverse(A, BC, LOG2_BC, INV_PREC)
        R = tl.where(o_r[:, None] + i * BC == o_t[None, :], 1.0, 0.0)
        tl.debug_barrier()  # the earlier blocks' rows of T and γ are in memory
        for m in tl.static_range(i):
            rows_m = t0 + m * BC + o_r
            m_m = rows_m < eos
            km, _ = _l2norm_rows(_load_rows(k, rows_m, m_m, i_h, H, K, o_k, o_k < K), NORM_QK)
            gm = _load_vec(gcum, rows_m, m_m, i_h, H)
            # rows of block i come after those of block m: every exponent is ≤ 0
            Aim = _dot(kb, tl.trans(km), TPREC) * tl.exp(gam[:, None] - gm[None, :]) * bb[:, None]
            Tm = _load_rows(tinv, rows_m, m_m, i_h, H, BT, o_t, o_t < BT)
            R = R - _dot(Aim, Tm, INV_PREC)
        Ti = _dot(Tii, R, INV_PREC)
        p = (rows.to(tl.int64) * H + i_h)[:, None] * BT + o_t[None, :]
        tl.store(tinv + p, Ti, mask=m_r[:, None])


@triton.jit
def _lh_wu_kernel(
    k, v, g, beta, tinv, w, u, chunk_spans, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, TPREC: tl.constexpr,
):
    """W = T X and U = T Y of one chunk (U's columns i_v·BV …; the first value block stores W),
    in fp32, so that the sequential passes need not compute them (Config.lh_wu)."""
    i_c, i_h, i_v, t0, eos, o_t, o_k, o_v, m_v = _chunk_tile(chunk_spans, T, BT, BT, K, BV, V, IS_VARLEN)
    if t0 >= eos:
        return
    rows = t0 + o_t
    m_r = rows < eos
    kb, _ = _l2norm_rows(_load_rows(k, rows, m_r, i_h, H, K, o_k, o_k < K), NORM_QK)
    vb = _load_rows(v, rows, m_r, i_h, H, V, o_v, m_v)
    bb = _load_vec(beta, rows, m_r, i_h, H)
    Tm = _load_rows(tinv, rows, m_r, i_h, H, BT, o_t, o_t < BT)
    r64 = rows.to(tl.int64)
    U = _dot(Tm, vb * bb[:, None], TPREC)
    tl.store(u + (r64 * H + i_h)[:, None] * V + o_v[None, :], U, mask=m_r[:, None] & m_v[None, :])
    if i_v == 0:
        eg = tl.exp(tl.cumsum(_load_vec(g, rows, m_r, i_h, H), axis=0))
        W = _dot(Tm, kb * (bb * eg)[:, None], TPREC)
        tl.store(w + (r64 * H + i_h)[:, None] * K + o_k[None, :], W, mask=m_r[:, None])


@triton.jit
def _lh_load_chunk(q, k, v, g, beta, tinv, w, u, rows, m_r, i_h, o_v, m_v, scale,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   NORM_QK: tl.constexpr, TPREC: tl.constexpr, HAS_WU: tl.constexpr):
    """A chunk's inputs and the state-free tensors of its algebra (value columns o_v); with
    HAS_WU, W and U come from _lh_wu's output instead of two dots with T."""
    o_k = tl.arange(0, K)
    o_t = tl.arange(0, BT)
    kb, rk = _l2norm_rows(_load_rows(k, rows, m_r, i_h, H, K, o_k, o_k < K), NORM_QK)
    qb, rq = _l2norm_rows(_load_rows(q, rows, m_r, i_h, H, K, o_k, o_k < K), NORM_QK)
    vb = _load_rows(v, rows, m_r, i_h, H, V, o_v, m_v)
    gb = _load_vec(g, rows, m_r, i_h, H)
    bb = _load_vec(beta, rows, m_r, i_h, H)
    Tm = _load_rows(tinv, rows, m_r, i_h, H, BT, o_t, o_t < BT)
    gam, gL, g_in, g_lo = _lh_decays(gb, BT)
    eg = tl.exp(gam)
    X = kb * (bb * eg)[:, None]
    if HAS_WU:
        W = _load_rows(w, rows, m_r, i_h, H, K, o_k, o_k < K)
        U = _load_rows(u, rows, m_r, i_h, H, V, o_v, m_v)
    else:
        W = _dot(Tm, X, TPREC)
        U = _dot(Tm, vb * bb[:, None], TPREC)
    qs = qb * scale
    Kt = kb * tl.exp(gL - gam)[:, None]
    return kb, rk, qb, rq, vb, bb, Tm, gam, gL, g_in, g_lo, eg, X, W, U, qs, Kt


@triton.jit
def _lh_fwd_h_kernel(
    q, k, v, g, beta, tinv, w, u, states, x0, xT, chunk_spans, chunk_offsets, T, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    HAS_X0: tl.constexpr, IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr,
    TPREC: tl.constexpr, HAS_WU: tl.constexpr = False,
):
    """The forward pass over one sequence's chunks (value columns i_v·BV …): stores each
    chunk's start state, returns the final state."""
    i_h, c0, c1, o_k, o_v, m_v, p_x, S = _pass_tile(x0, chunk_offsets, T, H, K, V, BT, BV, HAS_X0, IS_VARLEN)
    for j in range(c1 - c0):
        c = c0 + j
        t0, eos, rows, m_r = _lh_chunk(chunk_spans, c.to(tl.int64), T, BT, IS_VARLEN)
        p_s = ((c.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        tl.store(states + p_s, S, mask=m_v[None, :])
        kb, rk, qb, rq, vb, bb, Tm, gam, gL, g_in, g_lo, eg, X, W, U, qs, Kt = _lh_load_chunk(
            q, k, v, g, beta, tinv, w, u, rows, m_r, i_h, o_v, m_v, scale, H, K, V, BT, NORM_QK, TPREC, HAS_WU)
        vn = U - _dot(W, S, PREC)
        S = tl.exp(gL) * S + _dot(tl.trans(Kt), vn, PREC)
    tl.store(xT + p_x, S, mask=m_v[None, :])


@triton.jit
def _lh_fwd_o_kernel(
    q, k, v, g, beta, tinv, w, u, states, o, chunk_spans, T, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr,
    HAS_WU: tl.constexpr = False,
):
    """o of one chunk (value columns i_v·BV …) from its start state."""
    i_c, i_h, i_v, t0, eos, o_t, o_k, o_v, m_v = _chunk_tile(chunk_spans, T, BT, BT, K, BV, V, IS_VARLEN)
    if t0 >= eos:
        return
    rows = t0 + o_t
    m_r = rows < eos
    S = tl.load(states + ((i_c * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    kb, rk, qb, rq, vb, bb, Tm, gam, gL, g_in, g_lo, eg, X, W, U, qs, Kt = _lh_load_chunk(
        q, k, v, g, beta, tinv, w, u, rows, m_r, i_h, o_v, m_v, scale, H, K, V, BT, NORM_QK, TPREC, HAS_WU)
    vn = U - _dot(W, S, PREC)
    P = _dot(qs, tl.trans(kb), PREC) * g_in
    ob = _dot(qs * eg[:, None], S, PREC) + _dot(P, vn, PREC)
    p_o = (rows.to(tl.int64) * H + i_h)[:, None] * V + o_v[None, :]
    tl.store(o + p_o, ob.to(o.dtype.element_ty), mask=m_r[:, None] & m_v[None, :])


@triton.jit
def _lh_bwd_dh_kernel(
    q, k, v, g, beta, tinv, w, u, do, dstates, dht, dh0, chunk_spans, chunk_offsets, T, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr,
    TPREC: tl.constexpr, HAS_WU: tl.constexpr = False,
):
    """The reverse pass over one sequence's chunks (value columns i_v·BV …): stores each
    chunk's end-state gradient dS', returns the gradient of the initial state."""
    i_h, c0, c1, o_k, o_v, m_v, p_x, dS = _pass_tile(dht, chunk_offsets, T, H, K, V, BT, BV, HAS_DHT, IS_VARLEN)
    for j in range(c1 - c0):
        c = c1 - 1 - j
        t0, eos, rows, m_r = _lh_chunk(chunk_spans, c.to(tl.int64), T, BT, IS_VARLEN)
        p_s = ((c.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        tl.store(dstates + p_s, dS, mask=m_v[None, :])
        kb, rk, qb, rq, vb, bb, Tm, gam, gL, g_in, g_lo, eg, X, W, U, qs, Kt = _lh_load_chunk(
            q, k, v, g, beta, tinv, w, u, rows, m_r, i_h, o_v, m_v, scale, H, K, V, BT, NORM_QK, TPREC, HAS_WU)
        dob = _load_rows(do, rows, m_r, i_h, H, V, o_v, m_v)
        P = _dot(qs, tl.trans(kb), PREC) * g_in
        dvn = _dot(tl.trans(P), dob, PREC) + _dot(Kt, dS, PREC)
        dS = (_dot(tl.trans(qs * eg[:, None]), dob, PREC) + tl.exp(gL) * dS
              - _dot(tl.trans(W), dvn, PREC))
    tl.store(dh0 + p_x, dS, mask=m_v[None, :])


@triton.jit
def _lh_sums_init(BT: tl.constexpr, BK: tl.constexpr):
    """The gradient kernels' sums over V (README, Backward, with c = BT) for BK key columns:
    dQ̃, diag(d) dK̃ + diag(βa) dX, dP, dA, ⟨dY_r, v_r⟩, ⟨dX_r, k_r⟩, ⟨dK̃_r, k_r⟩, ⟨dS', S⟩."""
    zr = tl.zeros([BT], dtype=tl.float32)
    return (tl.zeros([BT, BK], dtype=tl.float32), tl.zeros([BT, BK], dtype=tl.float32),
            tl.zeros([BT, BT], dtype=tl.float32), tl.zeros([BT, BT], dtype=tl.float32), zr, zr, zr, tl.sum(zr, 0))


@triton.jit
def _lh_sums_step(dQt, dKX, dP, dA, xk, tk, dgL, S, dS, vn, dY, dob, kb, ed, be, PREC: tl.constexpr):
    """One value block's terms of the sums (S, dS' restricted to the program's key columns).
    dX and dK̃ enter the results only through diag(βa) dX + diag(d) dK̃ and the row sums, so
    only those are kept, not both BT × K sums (registers: README, large-head path)."""
    dXj = -_dot(dY, tl.trans(S), PREC)
    dKtj = _dot(vn, tl.trans(dS), PREC)
    dQt += _dot(dob, tl.trans(S), PREC)
    dP += _dot(dob, tl.trans(vn), PREC)
    dA -= _dot(dY, tl.trans(vn), PREC)
    dKX += dKtj * ed[:, None] + dXj * be[:, None]
    xk += tl.sum(dXj * kb, 1)
    tk += tl.sum(dKtj * kb, 1)
    dgL += tl.sum(tl.sum(dS * S, 1), 0)
    return dQt, dKX, dP, dA, xk, tk, dgL


@triton.jit
def _lh_sums_close(dQt, dP, dA, xk, tk, dgL, qs, kb, bb, eg, ed, gL, g_in, g_lo, BT: tl.constexpr,
                   PREC: tl.constexpr):
    """From the sums: dγ per row, dγ_L, dβ less Σ⟨dY_r, v_r⟩, and dP ⊙ Γ and G for the dq / dk
    dots (as _sub_chunk_grads, with ⟨dK̃_r, K̃_r⟩ = d_r ⟨dK̃_r, k_r⟩ and ⟨dX_r, X_r⟩ =
    β_r a_r ⟨dX_r, k_r⟩). Every term is linear in P and in the key Gram matrix, so on a key
    block (_lh_bwd_dqk) each result is that block's share."""
    o_t = tl.arange(0, BT)
    dP = tl.where(o_t[:, None] >= o_t[None, :], dP, 0.0)
    dA = tl.where(o_t[:, None] > o_t[None, :], dA, 0.0)
    P = _dot(qs, tl.trans(kb), PREC) * g_in
    Bkk = _dot(kb, tl.trans(kb), PREC) * g_lo
    E = dP * P + dA * (Bkk * bb[:, None])
    Fk = ed * tk
    dgam = tl.sum(dQt * (qs * eg[:, None]), 1) + tl.sum(E, 1) - tl.sum(E, 0) - Fk + bb * eg * xk
    dgL = tl.exp(gL) * dgL + tl.sum(Fk, 0)
    return dgam, dgL, eg * xk + tl.sum(dA * Bkk, 1), dP * g_in, dA * g_lo * bb[:, None]


@triton.jit
def _lh_bwd_grads_kernel(
    q, k, v, g, beta, tinv, w, u, do, states, dstates, dq, dk, dv, dg, db, chunk_spans, T, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr,
    HAS_WU: tl.constexpr = False,
):
    """dq, dk, dv, dg, dβ of one chunk from its start state S and end-state gradient dS'
    (README, Backward, with c = BT); the sums over V run over the value blocks in a loop."""
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, eos, rows, m_r = _lh_chunk(chunk_spans, i_c, T, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_k = tl.arange(0, K)
    m_k = o_k < K
    o_v0 = tl.arange(0, BV)
    kb, rk, qb, rq, vb, bb, Tm, gam, gL, g_in, g_lo, eg, X, W, U, qs, Kt = _lh_load_chunk(
        q, k, v, g, beta, tinv, w, u, rows, m_r, i_h, o_v0, o_v0 < V, scale, H, K, V, BT, NORM_QK, TPREC, HAS_WU)
    Pt = tl.trans(_dot(qs, tl.trans(kb), PREC) * g_in)
    ed = tl.exp(gL - gam)
    be = bb * eg
    dQt, dKX, dP, dA, dbb, xk, tk, dgL = _lh_sums_init(BT, K)
    p_c = (i_c * H + i_h) * K * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + o_v0
        m_v = o_v < V
        p_s = p_c + o_k[:, None] * V + o_v[None, :]
        S = tl.load(states + p_s, mask=m_v[None, :], other=0.0)
        dS = tl.load(dstates + p_s, mask=m_v[None, :], other=0.0)
        vb = _load_rows(v, rows, m_r, i_h, H, V, o_v, m_v)
        dob = _load_rows(do, rows, m_r, i_h, H, V, o_v, m_v)
        if HAS_WU:
            Uj = _load_rows(u, rows, m_r, i_h, H, V, o_v, m_v)
        else:
            Uj = _dot(Tm, vb * bb[:, None], TPREC)
        vn = Uj - _dot(W, S, PREC)
        dvn = _dot(Pt, dob, PREC) + _dot(Kt, dS, PREC)
        dY = _dot(tl.trans(Tm), dvn, TPREC)
        dQt, dKX, dP, dA, xk, tk, dgL = _lh_sums_step(dQt, dKX, dP, dA, xk, tk, dgL, S, dS, vn, dY, dob, kb, ed, be,
                                                       PREC)
        dbb += tl.sum(dY * vb, 1)
        p_v = (rows.to(tl.int64) * H + i_h)[:, None] * V + o_v[None, :]
        tl.store(dv + p_v, (dY * bb[:, None]).to(dv.dtype.element_ty), mask=m_r[:, None] & m_v[None, :])
    # Γ again rather than kept through the loop: BT × BT fp32 tiles are 32 registers per thread
    # each at 4 warps
    _, _, g_in, g_lo = _lh_decays(_load_vec(g, rows, m_r, i_h, H), BT)
    dgam, dgL, dbx, dPG, Gk = _lh_sums_close(dQt, dP, dA, xk, tk, dgL, qs, kb, bb, eg, ed, gL, g_in, g_lo, BT, PREC)
    dgb = tl.sum(dgam, 0) - tl.cumsum(dgam, axis=0) + dgam + dgL
    dbb = dbb + dbx
    r64 = rows.to(tl.int64)
    tl.store(dg + r64 * H + i_h, dgb.to(dg.dtype.element_ty), mask=m_r)
    tl.store(db + r64 * H + i_h, dbb.to(db.dtype.element_ty), mask=m_r)
    # dq before dk, so that the two BT × K results are not live together
    p_qk = (r64 * H + i_h)[:, None] * K + o_k[None, :]
    m_rk = m_r[:, None] & m_k[None, :]
    dqb = (dQt * eg[:, None] + _dot(dPG, kb, PREC)) * scale
    if NORM_QK:
        dqb = rq[:, None] * (dqb - qb * tl.sum(qb * dqb, 1)[:, None])
    tl.store(dq + p_qk, dqb.to(dq.dtype.element_ty), mask=m_rk)
    dkb = _dot(tl.trans(dPG), qs, PREC) + dKX + _dot(Gk, kb, PREC) + _dot(tl.trans(Gk), kb, PREC)
    if NORM_QK:
        dkb = rk[:, None] * (dkb - kb * tl.sum(kb * dkb, 1)[:, None])
    tl.store(dk + p_qk, dkb.to(dk.dtype.element_ty), mask=m_rk)


@triton.jit
def _lh_bwd_dv_kernel(
    q, k, v, g, beta, tinv, w, u, do, states, dstates, dv, vnb, dyb, rqk, chunk_spans, T, scale, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr,
    HAS_WU: tl.constexpr = False,
):
    """Config.lh_split, first kernel, one chunk's value columns i_v·BV …: v_new = U − W S,
    dv_new = Pᵀ dO + K̃ dS' and dY = Tᵀ dv_new (the dots that need all K columns); stores
    dv = β dY, and v_new and dY (fp32) for _lh_bwd_dqk. The first value block also stores the
    rows' l2norm factors of k and q ([2, B·T·H]), which _lh_bwd_dqk cannot compute from its
    key block alone."""
    i_c, i_h, i_v, t0, eos, o_t, o_k, o_v, m_v = _chunk_tile(chunk_spans, T, BT, BT, K, BV, V, IS_VARLEN)
    if t0 >= eos:
        return
    rows = t0 + o_t
    m_r = rows < eos
    r64 = rows.to(tl.int64)
    # not _lh_load_chunk: each BT × K tile is made where it is used and kept as a dot operand
    # (bf16 with bf16 dots), so that fewer of them are live at once (registers: README)
    kb, rk = _l2norm_rows(_load_rows(k, rows, m_r, i_h, H, K, o_k, o_k < K), NORM_QK)
    qb, rq = _l2norm_rows(_load_rows(q, rows, m_r, i_h, H, K, o_k, o_k < K), NORM_QK)
    if NORM_QK:
        if i_v == 0:
            tl.store(rqk + r64 * H + i_h, rk, mask=m_r)
            tl.store(rqk + NBH + r64 * H + i_h, rq, mask=m_r)
    bb = _load_vec(beta, rows, m_r, i_h, H)
    gam, gL, g_in, g_lo = _lh_decays(_load_vec(g, rows, m_r, i_h, H), BT)
    eg = tl.exp(gam)
    P = _operand(_dot(qb * scale, tl.trans(kb), PREC) * g_in, PREC)
    Tm = _operand(_load_rows(tinv, rows, m_r, i_h, H, BT, o_t, o_t < BT), TPREC)
    if HAS_WU:
        W = _operand(_load_rows(w, rows, m_r, i_h, H, K, o_k, o_k < K), PREC)
        U = _load_rows(u, rows, m_r, i_h, H, V, o_v, m_v)
    else:
        W = _operand(_dot(Tm, kb * (bb * eg)[:, None], TPREC), PREC)
        U = _dot(Tm, _load_rows(v, rows, m_r, i_h, H, V, o_v, m_v) * bb[:, None], TPREC)
    p_s = ((i_c * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    vn = U - _dot(W, tl.load(states + p_s, mask=m_v[None, :], other=0.0), PREC)
    dob = _load_rows(do, rows, m_r, i_h, H, V, o_v, m_v)
    Kt = _operand(kb * tl.exp(gL - gam)[:, None], PREC)
    dvn = _dot(tl.trans(P), dob, PREC) + _dot(Kt, tl.load(dstates + p_s, mask=m_v[None, :], other=0.0), PREC)
    dY = _dot(tl.trans(Tm), dvn, TPREC)
    p_v = (r64 * H + i_h)[:, None] * V + o_v[None, :]
    m_rv = m_r[:, None] & m_v[None, :]
    tl.store(dv + p_v, (dY * bb[:, None]).to(dv.dtype.element_ty), mask=m_rv)
    tl.store(vnb + p_v, vn, mask=m_rv)
    tl.store(dyb + p_v, dY, mask=m_rv)


@triton.jit
def _lh_bwd_dqk_kernel(
    q, k, v, g, beta, rqk, do, states, dstates, vnb, dyb, dq, dk, dgp, dbp, dglp, chunk_spans, T, scale, NBH, NC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr,
):
    """Config.lh_split, second kernel, one chunk's key columns i_k·BK … (fla's split of its
    dq/dk kernel): the gradients with respect to the normalised q and k in those columns (fp32,
    l2norm backward in _lh_bwd_finish), and this key block's share of every sum over K that dγ
    and dβ need (fp32, [NK, B·T·H] and dγ_L per chunk [NK, NC, H]). dP and dA (sums over V) are
    recomputed by every key block: two BT × BT tiles instead of the two BT × K sums of
    _lh_bwd_grads, which spilled."""
    i_k = tl.program_id(0)
    i_c = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2)
    t0, eos, rows, m_r = _lh_chunk(chunk_spans, i_c, T, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_v0 = tl.arange(0, BV)
    r64 = rows.to(tl.int64)
    kb = _load_rows(k, rows, m_r, i_h, H, K, o_k, m_k)
    qb = _load_rows(q, rows, m_r, i_h, H, K, o_k, m_k)
    if NORM_QK:
        kb = kb * tl.load(rqk + r64 * H + i_h, mask=m_r, other=0.0)[:, None]
        qb = qb * tl.load(rqk + NBH + r64 * H + i_h, mask=m_r, other=0.0)[:, None]
    bb = _load_vec(beta, rows, m_r, i_h, H)
    gam, gL, g_in, g_lo = _lh_decays(_load_vec(g, rows, m_r, i_h, H), BT)
    eg = tl.exp(gam)
    ed = tl.exp(gL - gam)
    be = bb * eg
    qs = qb * scale
    dQt, dKX, dP, dA, dyv, xk, tk, dgL = _lh_sums_init(BT, BK)  # dyv: in the first key block only
    p_c = (i_c * H + i_h) * K * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + o_v0
        m_v = o_v < V
        p_s = p_c + o_k[:, None] * V + o_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        S = tl.load(states + p_s, mask=m_kv, other=0.0)
        dS = tl.load(dstates + p_s, mask=m_kv, other=0.0)
        vn = _load_rows(vnb, rows, m_r, i_h, H, V, o_v, m_v)
        dY = _load_rows(dyb, rows, m_r, i_h, H, V, o_v, m_v)
        dob = _load_rows(do, rows, m_r, i_h, H, V, o_v, m_v)
        dQt, dKX, dP, dA, xk, tk, dgL = _lh_sums_step(dQt, dKX, dP, dA, xk, tk, dgL, S, dS, vn, dY, dob, kb, ed, be,
                                                       PREC)
        if i_k == 0:
            dyv += tl.sum(dY * _load_rows(v, rows, m_r, i_h, H, V, o_v, m_v), 1)
    dgam, dgL, dbx, dPG, Gk = _lh_sums_close(dQt, dP, dA, xk, tk, dgL, qs, kb, bb, eg, ed, gL, g_in, g_lo, BT, PREC)
    p_part = i_k * NBH + r64 * H + i_h
    tl.store(dgp + p_part, dgam, mask=m_r)
    tl.store(dbp + p_part, dyv + dbx, mask=m_r)
    tl.store(dglp + (i_k * NC + i_c) * H + i_h, dgL)
    p_qk = (r64 * H + i_h)[:, None] * K + o_k[None, :]
    m_rk = m_r[:, None] & m_k[None, :]
    tl.store(dq + p_qk, (dQt * eg[:, None] + _dot(dPG, kb, PREC)) * scale, mask=m_rk)
    dkb = _dot(tl.trans(dPG), qs, PREC) + dKX + _dot(Gk, kb, PREC) + _dot(tl.trans(Gk), kb, PREC)
    tl.store(dk + p_qk, dkb, mask=m_rk)


@triton.jit
def _lh_bwd_finish_kernel(
    q, k, dq32, dk32, dgp, dbp, dglp, dq, dk, dg, db, chunk_spans, T, NBH, NC,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, NK: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr,
):
    """Config.lh_split, last kernel, one chunk: sums the key blocks' shares, dg = the reverse
    in-chunk cumsum of dγ plus dγ_L, and the l2norm backward of dq and dk (full rows)."""
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, eos, rows, m_r = _lh_chunk(chunk_spans, i_c, T, BT, IS_VARLEN)
    if t0 >= eos:
        return
    r64 = rows.to(tl.int64)
    dgam = tl.zeros([BT], dtype=tl.float32)
    dbb = tl.zeros([BT], dtype=tl.float32)
    dgL = tl.sum(tl.zeros([BT], dtype=tl.float32), 0)
    for i_k in tl.static_range(NK):
        p_part = i_k * NBH + r64 * H + i_h
        dgam += tl.load(dgp + p_part, mask=m_r, other=0.0)
        dbb += tl.load(dbp + p_part, mask=m_r, other=0.0)
        dgL += tl.load(dglp + (i_k * NC + i_c) * H + i_h)
    dgb = tl.sum(dgam, 0) - tl.cumsum(dgam, axis=0) + dgam + dgL
    tl.store(dg + r64 * H + i_h, dgb.to(dg.dtype.element_ty), mask=m_r)
    tl.store(db + r64 * H + i_h, dbb.to(db.dtype.element_ty), mask=m_r)
    o_k = tl.arange(0, K)
    p_qk = (r64 * H + i_h)[:, None] * K + o_k[None, :]
    m_rk = m_r[:, None] & (o_k < K)[None, :]
    dqb = tl.load(dq32 + p_qk, mask=m_rk, other=0.0)
    dkb = tl.load(dk32 + p_qk, mask=m_rk, other=0.0)
    if NORM_QK:
        qb, rq = _l2norm_rows(tl.load(q + p_qk, mask=m_rk, other=0.0).to(tl.float32), NORM_QK)
        dqb = rq[:, None] * (dqb - qb * tl.sum(qb * dqb, 1)[:, None])
        kb, rk = _l2norm_rows(tl.load(k + p_qk, mask=m_rk, other=0.0).to(tl.float32), NORM_QK)
        dkb = rk[:, None] * (dkb - kb * tl.sum(kb * dkb, 1)[:, None])
    tl.store(dq + p_qk, dqb.to(dq.dtype.element_ty), mask=m_rk)
    tl.store(dk + p_qk, dkb.to(dk.dtype.element_ty), mask=m_rk)
