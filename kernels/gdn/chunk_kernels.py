"""Triton kernels of the chunked Gated DeltaNet (forward and hand-written backward).

Derivation, naming and measurements: README.md beside this file. Layout is fla's:
q, k [B, T, H, K]; v, o [B, T, H, V]; g, beta [B, T, H]; states [*, H, K, V] in fp32 (the saved
forward states in bf16 with Config.states_bf16).

What this replaces: fla's pipeline (about 5 forward and 8 backward kernels) materialises the
inverted 64×64 block, w, u, v_new and every chunk state in HBM, pads K = V = 32 to 64-wide
tiles, and walks one (batch, head) per program through all chunks. Here:

- Chunks of BT tokens are the unit of the sequential state pass. They are made of
  *sub-chunks* of BC = 16 tokens, the unit of the WY algebra. A sub-chunk's (I + A)⁻¹ is a
  product of log2(BC) factors (A is nilpotent). ``_wy_inverse`` computes it once per
  sub-chunk at full occupancy and stores it beside the tokens (BC floats per token and head).
- A chunk's effect on the state is affine, S_end = M S_start + N (M ∈ R^{K×K}, N ∈ R^{K×V}).
  ``_fwd_prep`` computes [M | N] for every chunk in parallel by running the sub-chunk
  recurrence on the augmented state [I | 0]. The only sequential loop left is
  ``_state_pass``: one K×K @ K×V product per chunk. The backward does the same with [Mᵀ | R].
- ``_fwd_out`` and ``_bwd_local`` recompute inside a chunk from q, k, v, T, the γβ pack and
  the chunk's boundary state (with ``Config.local_sub_states``, the table's backward, the
  saved start state of every sub-chunk, in bf16 with ``Config.states_bf16``), so no w, u or
  v_new tensor reaches HBM. The γβ pack holds
  each sub-chunk's γ (cumsum of g) and β as two contiguous rows; ``_wy_inverse`` writes it for
  the forward, ``_bwd_prep`` for the backward.
- Every tile is exactly K or V wide (no padding of 32 to 64). V can be split across
  programs.
- Split backward (``Config.bwd_split``, an alternative to ``_bwd_local``; measured slower,
  off in the table): ``_fwd_out`` saves every sub-chunk's start state, ``_bwd_dstate`` walks each
  chunk's sub-chunks in reverse carrying only dS and saves each sub-chunk's end-state
  gradient, and ``_bwd_sub`` computes the input gradients with one program per sub-chunk.

For K ≥ 64 there is a second path (``Config.large_head``, ``large_head_kernels.py``): whole
64-token chunks, a sequential pass per value block and parallel gradient kernels, as fla does
for large heads; built in the sixth session, timed in the seventh: slower, off in the table.

Measured on an H200 (README.md beside this file, Performance: the current table against
fla-core 0.6): faster than fla at K = V = 32 (2.0× by GPU time at HyMo's shape), well short of
the 8× goal, and 2× slower at K = V = 128. Each sub-chunk is a chain of tiny
dependent dots, reductions and layout conversions at 1-2 warps per program, so the kernels
are latency-bound, not bandwidth- or FLOP-bound. README.md lists the next steps.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_span(i_c, chunk_spans, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First token of chunk i_c and the end (exclusive) of its sequence, both int32."""
    if IS_VARLEN:
        t0 = tl.load(chunk_spans + 2 * i_c)
        eos = tl.load(chunk_spans + 2 * i_c + 1)
    else:
        nt = tl.cdiv(T, BT)
        i_n = (i_c // nt).to(tl.int32)
        t0 = i_n * T + (i_c % nt).to(tl.int32) * BT
        eos = i_n * T + T
    return t0, eos


@triton.jit
def _chunk_tile(chunk_spans, T, BT: tl.constexpr, BC: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                V: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A (chunk, head, value block) program: its ids, its chunk's token span and the index
    vectors of sub-chunk rows, keys and its value columns (with their mask)."""
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    t0, eos = _chunk_span(i_c, chunk_spans, T, BT, IS_VARLEN)
    o_v = i_v * BV + tl.arange(0, BV)
    return i_c, i_h, i_v, t0, eos, tl.arange(0, BC), tl.arange(0, K), o_v, o_v < V


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b with fp32 accumulation. PREC is tl.dot's input_precision ("tf32", "tf32x3", "ieee")
    on the fp32 operands, or "bf16": both operands rounded to bf16 first (Config.dot_bf16), half
    the registers and shared-memory traffic per operand and twice the tensor-core rate of tf32."""
    if PREC == "bf16":
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        c = tl.dot(a, b, input_precision=PREC)
    return c


@triton.jit
def _gram(kb, gam, bb, BC: tl.constexpr, PREC: tl.constexpr):
    """From γ (the in-sub-chunk cumsum of g): Γ strictly lower, B = (K Kᵀ) ⊙ Γ and A = diag(β) B."""
    o_r = tl.arange(0, BC)
    lower = o_r[:, None] > o_r[None, :]
    # exp only of differences that are ≤ 0: the masked ones could overflow to inf
    decay = tl.where(lower, tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.0)), 0.0)
    Bkk = _dot(kb, tl.trans(kb), PREC) * decay
    return decay, Bkk, Bkk * bb[:, None]


@triton.jit
def _unit_lower_inverse(A, BC: tl.constexpr, LOG2_BC: tl.constexpr, PREC: tl.constexpr):
    """(I + A)⁻¹ for strictly lower triangular A: A^BC = 0, so the inverse is the product
    (I − A)(I + A²)(I + A⁴)…(I + A^(BC/2)), log2(BC) − 1 squarings and as many products.
    PREC must not be "tf32": the products sum Neumann terms A^j whose entries reach
    C(BC−2, j−1) (3,432 for BC = 16) when a sub-chunk's keys are nearly parallel and β, Γ ≈ 1,
    and they cancel to an O(1) inverse. tf32's 10-bit mantissa leaves O(1) errors in T; the
    chunk map then stops being a contraction and the state grows until it overflows. "ieee" is
    safe; "tf32x3" (~2⁻²¹, the tuned entries' choice) measured the same error as "ieee" in
    bench.py's collapsed-keys rows on an H200."""
    o_r = tl.arange(0, BC)
    Tm = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0) - A
    P = A
    for _ in tl.static_range(LOG2_BC - 1):
        P = _dot(P, P, PREC)
        Tm = Tm + _dot(Tm, P, PREC)
    return Tm


@triton.jit
def _load_tinv(tinv, rows, m_r, i_h, H: tl.constexpr, BC: tl.constexpr):
    """The sub-chunk's T = (I + A)⁻¹ saved by _wy_inverse_kernel (rows past the sequence end
    read as 0 instead of identity rows: harmless, their X, Y, dv' rows are 0)."""
    return _load_rows(tinv, rows, m_r, i_h, H, BC, tl.arange(0, BC), tl.arange(0, BC) < BC)


@triton.jit
def _load_rows(ptr, rows, m_r, i_h, H: tl.constexpr, D: tl.constexpr, cols, m_c):
    """[len(rows), len(cols)] tile of a [*, H, D] tensor as fp32 (zeros where masked)."""
    offs = (rows.to(tl.int64) * H + i_h)[:, None] * D + cols[None, :]
    return tl.load(ptr + offs, mask=m_r[:, None] & m_c[None, :], other=0.0).to(tl.float32)


@triton.jit
def _load_vec(ptr, rows, m_r, i_h, H: tl.constexpr):
    return tl.load(ptr + rows.to(tl.int64) * H + i_h, mask=m_r, other=0.0).to(tl.float32)


@triton.jit
def _gb_slot(gbp, i_c, i_h, s, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Sub-chunk s of chunk i_c in the γβ pack [NC, H, BT/BC, 2, BC] (fp32): γ (the in-sub-chunk
    cumsum of g, continued with g = 0 past the sequence end) then β (0 there)."""
    return gbp + (((i_c * H + i_h) * (BT // BC) + s) * 2) * BC


@triton.jit
def _load_gam_beta(g, beta, rows, m_r, i_h, H: tl.constexpr):
    """γ, γ_L and β of a sub-chunk from the inputs (g and β are [*, H]: 16 strided loads each)."""
    gb = _load_vec(g, rows, m_r, i_h, H)
    return tl.cumsum(gb, axis=0), tl.sum(gb, 0), _load_vec(beta, rows, m_r, i_h, H)


@triton.jit
def _store_gam_beta(p, gam, bb, BC: tl.constexpr):
    o_r = tl.arange(0, BC)
    tl.store(p + o_r, gam)
    tl.store(p + BC + o_r, bb)


@triton.jit
def _load_packed(p, BC: tl.constexpr):
    """γ, γ_L and β of a sub-chunk from its γβ pack slot (two contiguous 64-byte rows)."""
    o_r = tl.arange(0, BC)
    return tl.load(p + o_r), tl.load(p + BC - 1), tl.load(p + BC + o_r)


@triton.jit
def _l2norm_rows(x, NORM: tl.constexpr):
    """Rows divided by sqrt(Σx² + 1e-6) when NORM (fla's l2norm); also returns the factor."""
    if NORM:
        r = 1.0 / tl.sqrt(tl.sum(x * x, 1) + 1e-6)
        x = x * r[:, None]
    else:
        r = tl.sum(x * 0.0, 1) + 1.0
    return x, r


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _sum_parts_kernel(part, out, N, NV: tl.constexpr, BLOCK: tl.constexpr):
    """out = Σ_j part[j] in one pass: the value blocks' fp32 partial sums of a gradient, cast to
    out's dtype (torch's sum over a leading dim of 2 then a cast took 0.39 ms at K = 128)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    acc = tl.load(part + offs, mask=m, other=0.0)
    for j in tl.static_range(1, NV):
        acc += tl.load(part + j * N + offs, mask=m, other=0.0)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=m)


@triton.jit
def _wy_inverse_kernel(
    k, g, beta, tinv, gbp, chunk_spans, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, LOG2_BC: tl.constexpr,
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
    Tm = _unit_lower_inverse(A, BC, LOG2_BC, INV_PREC)
    p = (rows.to(tl.int64) * H + i_h)[:, None] * BC + o_r[None, :]
    tl.store(tinv + p, Tm.to(tinv.dtype.element_ty), mask=m_r[:, None])


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
def _pass_tile(x0, chunk_offsets, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
               BV: tl.constexpr, HAS_X0: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A (sequence, head, value block) program of a pass over chunks: its head, its sequence's
    chunks [c0, c1), the state tile's indices and offset p_x in [N, H, K, V], and the tile
    loaded from x0 (fp32) or zeros."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    if IS_VARLEN:
        c0 = tl.load(chunk_offsets + i_n)
        c1 = tl.load(chunk_offsets + i_n + 1)
    else:
        nt = tl.cdiv(T, BT)
        c0 = i_n * nt
        c1 = c0 + nt
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_x = ((i_n.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    if HAS_X0:
        X = tl.load(x0 + p_x, mask=m_v[None, :], other=0.0).to(tl.float32)
    else:
        X = tl.zeros([K, BV], dtype=tl.float32)
    return i_h, c0, c1, o_k, o_v, m_v, p_x, X


@triton.jit
def _state_pass_kernel(
    ab, states, x0, xT, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    REVERSE: tl.constexpr, HAS_X0: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
    SLOTS: tl.constexpr = 1,
):
    """The only sequential loop: X ← A_c X + B_c over the chunks of one sequence, with
    ab[c] = [A_c | B_c] ([K, K + V]); stores X *before* each chunk into states[c·SLOTS].
    Forward: [M | N], X = S, chunks in order. Backward: [Mᵀ | R], X = dS, reverse order.
    SLOTS > 1 (the split backward): states has one slot per sub-chunk, [NC·SLOTS, H, K, V],
    and the pass fills the first slot of each chunk; the other kernels fill the rest."""
    i_h, c0, c1, o_k, o_v, m_v, p_x, X = _pass_tile(x0, chunk_offsets, T, H, K, V, BT, BV, HAS_X0, IS_VARLEN)
    step = -1 if REVERSE else 1
    c = c1 - 1 if REVERSE else c0
    # Triton's pipeliner prefetches only loads that feed a dot (A_c's), so B_c is loaded one
    # chunk ahead by hand: otherwise every step waits for a global load. The chunk index is
    # clamped into the sequence: the last step's prefetch reloads the last chunk
    Bn = tl.zeros([K, BV], dtype=tl.float32)
    if c1 > c0:  # an empty sequence has no chunk to read (T = 0 has none at all)
        Bn = _pass_b(ab, c, c0, c1, i_h, o_k, o_v, m_v, H, K, V)
    for j in range(c1 - c0):
        base = _pass_row(c, i_h, H, K) + o_k[:, None]
        p_st = ((c.to(tl.int64) * SLOTS * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        tl.store(states + p_st, X.to(states.dtype.element_ty), mask=m_v[None, :])
        Ac = tl.load(ab + base * (K + V) + o_k[None, :])
        Bc = Bn
        c += step
        Bn = _pass_b(ab, c, c0, c1, i_h, o_k, o_v, m_v, H, K, V)
        X = _dot(Ac, X, PREC) + Bc
    tl.store(xT + p_x, X, mask=m_v[None, :])


@triton.jit
def _pass_row(c, i_h, H: tl.constexpr, K: tl.constexpr):
    """Row offset of chunk c's head i_h in a [NC, H, K, …] tensor (int64)."""
    return (c.to(tl.int64) * H + i_h) * K


@triton.jit
def _pass_b(ab, c, c0, c1, i_h, o_k, o_v, m_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """B_c of chunk c clamped into [c0, c1) (c1 > c0): the state pass's prefetch."""
    c = tl.maximum(tl.minimum(c, c1 - 1), c0)
    return tl.load(ab + (_pass_row(c, i_h, H, K) + o_k[:, None]) * (K + V) + K + o_v[None, :],
                   mask=m_v[None, :], other=0.0)


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
    SAVE_SUB (the split backward): states is [NC·NS, H, K, V], one slot per sub-chunk, whose
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


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------


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
def _sub_chunk_grads(
    q, k, v, p_gb, tinv, do, dq, dk, dv, dg, db, rows, m_r, i_h, i_v, S, dS, scale, part_qk, part_t,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
    NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr, WANT_DS: tl.constexpr,
    T_PRE=None, HAS_T_PRE: tl.constexpr = False,
):
    """dq, dk, dv, dg, dβ of one sub-chunk (value columns i_v·BV …; partial sums over the
    value blocks at offsets i_v·part_qk / i_v·part_t) from its start state S and the gradient
    dS of its end state (README, Backward). Returns the gradient of its start state when
    WANT_DS (the sequential sweep of _bwd_local), else dS unchanged (_bwd_sub). HAS_T_PRE: the
    caller loaded the sub-chunk's T already (T_PRE, Config.prefetch_t)."""
    o_r = tl.arange(0, BC)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    incl = o_r[:, None] >= o_r[None, :]
    lower = o_r[:, None] > o_r[None, :]
    kb, rk = _l2norm_rows(_load_rows(k, rows, m_r, i_h, H, K, o_k, m_k), NORM_QK)
    qb, rq = _l2norm_rows(_load_rows(q, rows, m_r, i_h, H, K, o_k, m_k), NORM_QK)
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
    if WANT_DS:
        dS = (_dot(tl.trans(Qt), dob, PREC) + egL * dS
              - _dot(tl.trans(W), dvn, PREC))

    # gradients of the inputs
    dPG = dP * G_in
    Gk = dA * decay * bb[:, None]
    dqb = (dQt * eg[:, None] + _dot(dPG, kb, PREC)) * scale
    dkb = (_dot(tl.trans(dPG), qs, PREC) + dKt * ed[:, None] + dX * (bb * eg)[:, None]
           + _dot(Gk, kb, PREC) + _dot(tl.trans(Gk), kb, PREC))
    dvb = dY * bb[:, None]
    xk = tl.sum(dX * kb, 1)  # ⟨dX_r, k_r⟩; ⟨dX_r, X_r⟩ = β_r a_r ⟨dX_r, k_r⟩
    dbb = eg * xk + tl.sum(dY * vb, 1) + tl.sum(dA * Bkk, 1)
    E = dP * Pm + dA * A
    Fk = tl.sum(dKt * Kt, 1)
    dgam = tl.sum(dQt * Qt, 1) + tl.sum(E, 1) - tl.sum(E, 0) - Fk + bb * eg * xk
    dgb = tl.cumsum(dgam, axis=0, reverse=True) + dgL + tl.sum(Fk, 0)
    if NORM_QK:
        dqb = rq[:, None] * (dqb - qb * tl.sum(qb * dqb, 1)[:, None])
        dkb = rk[:, None] * (dkb - kb * tl.sum(kb * dkb, 1)[:, None])

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
                              part_qk, part_t, H, K, V, BC, BV, NORM_QK, PREC, TPREC, True, Tm, PREFETCH_T)


@triton.jit
def _bwd_dstate_kernel(
    q, k, gbp, tinv, do, dsub, chunk_spans, T, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr,
):
    """Split backward, sequential part: the end-state gradient dS' of every sub-chunk of one
    chunk (value columns i_v·BV …). dsub is [NC·NS, H, K, V], one slot per sub-chunk; the
    reverse state pass left the chunk's end-state gradient in its first slot. The reverse
    sweep carries only dS (_adjoint_step) and writes each sub-chunk's dS' into its slot."""
    i_c, i_h, i_v, t0, eos, o_r, o_k, o_v, m_v = _chunk_tile(chunk_spans, T, BT, BC, K, BV, V, IS_VARLEN)
    if t0 >= eos:
        return
    m_k = o_k < K
    p_s = (((i_c * NS) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    dS = tl.load(dsub + p_s, mask=m_v[None, :], other=0.0)
    n_sub = tl.cdiv(tl.minimum(eos - t0, BT), BC)
    # sub-chunks n_sub - 1 … 1: store dS' of sub-chunk s, step to its start (= dS' of s − 1)
    for j in range(n_sub - 1):
        s = n_sub - 1 - j
        tl.store(dsub + p_s + s * (H * K * V), dS, mask=m_v[None, :])
        rows = t0 + s * BC + o_r
        m_r = rows < eos
        kb, _ = _l2norm_rows(_load_rows(k, rows, m_r, i_h, H, K, o_k, m_k), NORM_QK)
        qb, _ = _l2norm_rows(_load_rows(q, rows, m_r, i_h, H, K, o_k, m_k), NORM_QK)
        dob = _load_rows(do, rows, m_r, i_h, H, V, o_v, m_v)
        gam, gL, bb = _load_packed(_gb_slot(gbp, i_c, i_h, s, H, BT, BC), BC)
        Tm = _load_tinv(tinv, rows, m_r, i_h, H, BC)
        dS = _adjoint_step(qb, kb, gam, gL, bb, Tm, dob, dS, scale, BC, PREC, TPREC)
    tl.store(dsub + p_s, dS, mask=m_v[None, :])


@triton.jit
def _bwd_sub_kernel(
    q, k, v, gbp, tinv, do, sub_states, dsub, dq, dk, dv, dg, db, chunk_spans, T, scale,
    part_qk, part_t,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
    IS_VARLEN: tl.constexpr, NORM_QK: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr,
):
    """Split backward, parallel part: the gradients of one sub-chunk (value columns i_v·BV …)
    from its saved start state S (_fwd_out) and end-state gradient dS' (_bwd_dstate); no loop.
    With several value blocks, dq/dk/dg/dβ are partial sums (offsets part_qk / part_t)."""
    i_cs = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_c = i_cs // NS
    t0, eos = _chunk_span(i_c, chunk_spans, T, BT, IS_VARLEN)
    r0 = t0 + (i_cs % NS).to(tl.int32) * BC
    if r0 >= eos:
        return
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_s = ((i_cs * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    S = tl.load(sub_states + p_s, mask=m_v[None, :], other=0.0).to(tl.float32)
    dS = tl.load(dsub + p_s, mask=m_v[None, :], other=0.0)
    rows = r0 + tl.arange(0, BC)
    _sub_chunk_grads(q, k, v, _gb_slot(gbp, i_c, i_h, i_cs % NS, H, BT, BC), tinv, do, dq, dk, dv, dg, db, rows,
                     rows < eos, i_h, i_v, S, dS, scale,
                     part_qk, part_t, H, K, V, BC, BV, NORM_QK, PREC, TPREC, False)
