"""Short causal depthwise conv + SiLU in Triton (forward, and a backward that recomputes it).

y[b, t, c] = silu(Σ_{j<W} w[c, W-1-j] · x[b, t-j, c]), a tap j used only where t-j ≥ 0 and, for
packed rows, where the token's position inside its document is ≥ j (the conv never reaches
across a document start). x may be a strided view (its last dim contiguous): the fused mixer
hands in column views of its one q/k/v projection.

The backward recomputes the pre-activation from x rather than saving it: the conv's only saved
tensors are x and w, the inputs it already holds. Each direction is one kernel, and dz = dy ⊙
silu'(z) never makes a round trip through memory (writing it out in fp32 and reading it back
moves four times the bytes of a bf16 x). dw is summed per program in fp32 (a [programs, W, C]
slab, then one sum), so the result does not depend on scheduling.

Two designs, chosen by W:
- W ≤ 4 (HyMo's and fla's conv): the row-walking kernels. A program owns a strip of channels
  and a run of rows and takes one row at a time, the W - 1 neighbouring rows of x (and, in the
  backward, which walks the rows from last to first, the W - 1 later rows of dz) carried in
  registers: every x and dy row is read once, plus W - 1 rows of halo per program.
- W > 4: the tile kernels. The backward forms dz over a [rows, channels] tile and gathers dx[t]
  from its W rows t..t+W-1 inside the same register tile; tiles overlap by the W - 1 rows two
  programs both need. At the 750m shape this backward takes twice the row-walking one's time
  (benchmarks/HISTORY.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, y_ptr, pos_ptr, T, C, stride_xb, stride_xt, stride_yb, stride_yt,
                     W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr):
    b, it, ic = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)  # b · stride may pass 2³¹
    t = it * BT + tl.arange(0, BT)
    c = ic * BC + tl.arange(0, BC)
    tm, cm = t < T, c < C
    if HAS_POS:
        pos = tl.load(pos_ptr + t, mask=tm, other=0)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w_ptr + c * W + (W - 1 - j), mask=cm, other=0.0).to(tl.float32)
        ok = tm & (t >= j)
        if HAS_POS:
            ok = ok & (pos >= j)
        xs = tl.load(x_ptr + b * stride_xb + (t - j)[:, None] * stride_xt + c[None, :],
                     mask=ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
        acc += xs * wj[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + b * stride_yb + t[:, None] * stride_yt + c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])


@triton.jit
def _conv_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, pos_ptr, T, C, STEP, stride_xb, stride_xt, stride_dyb,
                     stride_dyt, stride_dxb, stride_dxt, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     HAS_POS: tl.constexpr):
    """dx and the dw partial of the STEP = BT - (W - 1) rows from it·STEP on, and BC channels.

    dz = dy ⊙ silu'(z) (z recomputed from x) is formed over the BT rows from the first one on,
    so that the W - 1 rows after the last output row are in the tile too: dx[t] = Σ_r
    w[W-1-r] dz[t + r] then reads rows of the same register tile (a gather along the rows)
    and dz never goes to memory. Neighbouring programs overlap by W - 1 rows of dz.
    """
    b, it, ic = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)  # b · stride may pass 2³¹
    i = tl.arange(0, BT)
    t = it * STEP + i
    c = ic * BC + tl.arange(0, BC)
    tm, cm = t < T, c < C
    if HAS_POS:
        pos = tl.load(pos_ptr + t, mask=tm, other=0)
    x_base = x_ptr + b * stride_xb + c[None, :]
    z = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w_ptr + c * W + (W - 1 - j), mask=cm, other=0.0).to(tl.float32)
        ok = tm & (t >= j)
        if HAS_POS:
            ok = ok & (pos >= j)
        xs = tl.load(x_base + (t - j)[:, None] * stride_xt, mask=ok[:, None] & cm[None, :], other=0.0)
        z += xs.to(tl.float32) * wj[None, :]
    sig = tl.sigmoid(z)
    dy = tl.load(dy_ptr + b * stride_dyb + t[:, None] * stride_dyt + c[None, :], mask=tm[:, None] & cm[None, :],
                 other=0.0).to(tl.float32)
    dz = dy * sig * (1.0 + z * (1.0 - sig))  # 0 on rows past T
    own = tm & (i < STEP)
    # dx[t] = Σ_r w[W-1-r] dz[t+r] over the taps r that reach row t from inside its document
    dx = dz * tl.load(w_ptr + c * W + (W - 1), mask=cm, other=0.0).to(tl.float32)[None, :]
    for r in tl.static_range(1, W):
        src = tl.minimum(i + r, BT - 1)  # the own rows read i + r < BT
        dzr = tl.gather(dz, tl.broadcast_to(src[:, None], (BT, BC)), 0)
        if HAS_POS:
            okr = (t + r < T) & (tl.load(pos_ptr + t + r, mask=t + r < T, other=0) >= r)
            dzr = tl.where(okr[:, None], dzr, 0.0)
        wr = tl.load(w_ptr + c * W + (W - 1 - r), mask=cm, other=0.0).to(tl.float32)
        dx += dzr * wr[None, :]
    tl.store(dx_ptr + b * stride_dxb + t[:, None] * stride_dxt + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=own[:, None] & cm[None, :])
    # dw[c, W-1-j] = Σ_t dz[t] x[t-j] over the own rows (the same x tiles, from cache)
    dz = tl.where(own[:, None], dz, 0.0)
    dw_base = dw_ptr + ((b * tl.num_programs(1) + it) * W) * C + c
    for j in tl.static_range(W):
        ok = own & (t >= j)
        if HAS_POS:
            ok = ok & (pos >= j)
        xs = tl.load(x_base + (t - j)[:, None] * stride_xt, mask=ok[:, None] & cm[None, :], other=0.0)
        tl.store(dw_base + (W - 1 - j) * C, tl.sum(dz * xs.to(tl.float32), 0), mask=cm)


@triton.jit
def _tap(w_ptr, c, cm, W: tl.constexpr, j: tl.constexpr):
    """w[:, W-1-j] in fp32 (the weight of x[t - j]), zero for the taps a conv of W < 4 lacks."""
    if j < W:
        return tl.load(w_ptr + c * W + (W - 1 - j), mask=cm, other=0.0).to(tl.float32)
    else:
        return tl.zeros(c.shape, dtype=tl.float32)


@triton.jit
def _taps(w_ptr, c, cm, W: tl.constexpr):
    return _tap(w_ptr, c, cm, W, 0), _tap(w_ptr, c, cm, W, 1), _tap(w_ptr, c, cm, W, 2), _tap(w_ptr, c, cm, W, 3)


@triton.jit
def _fwd_row(x_base, pos_ptr, t, T, stride_xt, cm, ct, HAS_POS: tl.constexpr):
    """x[t] as stored (converted to fp32 where it is used) and the in-document position of t (0
    without positions)."""
    x = tl.load(x_base + t * stride_xt, mask=cm & (ct + t < T), other=0.0)
    if HAS_POS:
        p = tl.load(pos_ptr + t, mask=t < T, other=0).to(tl.int32)
    else:
        p = tl.zeros([], dtype=tl.int32)
    return x, p


@triton.jit
def _fwd_step(x_base, y_base, pos_ptr, t, T, stride_xt, stride_yt, cm, ct, w0, w1, w2, w3, x1, x2, x3,
              xn1, pn1, xn2, pn2, xn3, pn3, xn4, pn4, HAS_POS: tl.constexpr, AHEAD: tl.constexpr,
              LOAD: tl.constexpr):
    """y[t]: its row taken from the rows loaded ahead (xn1) or loaded now (AHEAD 0), the rows
    ahead moved up one and, with LOAD, row t + AHEAD loaded into the last. Returns the carried
    state: x[t], x[t-1], x[t-2] and the rows ahead."""
    if AHEAD == 0:
        x0, p = _fwd_row(x_base, pos_ptr, t, T, stride_xt, cm, ct, HAS_POS)
    else:
        x0, p = xn1, pn1
        xn1, pn1, xn2, pn2, xn3, pn3 = xn2, pn2, xn3, pn3, xn4, pn4
        if LOAD:
            xa, pa = _fwd_row(x_base, pos_ptr, t + AHEAD, T, stride_xt, cm, ct, HAS_POS)
            if AHEAD == 1:
                xn1, pn1 = xa, pa
            elif AHEAD == 2:
                xn2, pn2 = xa, pa
            elif AHEAD == 3:
                xn3, pn3 = xa, pa
            else:
                xn4, pn4 = xa, pa
    x0 = x0.to(tl.float32)
    if HAS_POS:
        z = w0 * x0 + tl.where(p >= 1, w1 * x1, 0.0) + tl.where(p >= 2, w2 * x2, 0.0) + \
            tl.where(p >= 3, w3 * x3, 0.0)
    else:
        z = w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
    tl.store(y_base + t * stride_yt, (z * tl.sigmoid(z)).to(y_base.dtype.element_ty), mask=cm & (ct + t < T))
    return x0, x1, x2, xn1, pn1, xn2, pn2, xn3, pn3, xn4, pn4


@triton.jit
def _conv_fwd_rows(x_ptr, w_ptr, y_ptr, pos_ptr, T, C, stride_xb, stride_xt, stride_yb, stride_yt, b, s, ic,
                   W: tl.constexpr, L: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr,
                   AHEAD: tl.constexpr):
    """y of the L rows from s·L on and channel block ic of row block b, one row at a time (W ≤ 4):
    the W - 1 rows before the current one ride along in registers, so each x row is read once.
    AHEAD (0-4): rows loaded that many steps before they are used, so that a row's loads are
    issued before the previous rows' stores (which the compiler may not move them past: y could
    alias x) and can be in flight during that work; the same outputs for every AHEAD. The walk is
    unrolled: its compile time grows with L."""
    b = b.to(tl.int64)  # b · stride may pass 2³¹
    c = ic * BC + tl.arange(0, BC)
    cm = c < C
    ct = c * 0  # a row index plus ct is a mask over the channels
    w0, w1, w2, w3 = _taps(w_ptr, c, cm, W)
    t0 = s * L
    x_base = x_ptr + b * stride_xb + c
    y_base = y_ptr + b * stride_yb + c
    x1 = tl.load(x_base + (t0 - 1) * stride_xt, mask=cm & (ct + t0 >= 1), other=0.0).to(tl.float32)
    x2 = tl.load(x_base + (t0 - 2) * stride_xt, mask=cm & (ct + t0 >= 2), other=0.0).to(tl.float32)
    x3 = tl.load(x_base + (t0 - 3) * stride_xt, mask=cm & (ct + t0 >= 3), other=0.0).to(tl.float32)
    # xn1 .. xnA: rows t + 1 .. t + A of the step at row t (unused ones stay zero)
    xn1 = tl.zeros([BC], dtype=x_ptr.dtype.element_ty)
    xn2, xn3, xn4 = xn1, xn1, xn1
    pn1 = tl.zeros([], dtype=tl.int32)
    pn2, pn3, pn4 = pn1, pn1, pn1
    if AHEAD >= 1:
        xn1, pn1 = _fwd_row(x_base, pos_ptr, t0, T, stride_xt, cm, ct, HAS_POS)
    if AHEAD >= 2:
        xn2, pn2 = _fwd_row(x_base, pos_ptr, t0 + 1, T, stride_xt, cm, ct, HAS_POS)
    if AHEAD >= 3:
        xn3, pn3 = _fwd_row(x_base, pos_ptr, t0 + 2, T, stride_xt, cm, ct, HAS_POS)
    if AHEAD >= 4:
        xn4, pn4 = _fwd_row(x_base, pos_ptr, t0 + 3, T, stride_xt, cm, ct, HAS_POS)
    for i in tl.static_range(L):
        x1, x2, x3, xn1, pn1, xn2, pn2, xn3, pn3, xn4, pn4 = _fwd_step(
            x_base, y_base, pos_ptr, t0 + i, T, stride_xt, stride_yt, cm, ct, w0, w1, w2, w3, x1, x2, x3, xn1, pn1,
            xn2, pn2, xn3, pn3, xn4, pn4, HAS_POS, AHEAD, i + AHEAD < L)


@triton.jit
def _conv_fwd_rows_kernel(x_ptr, w_ptr, y_ptr, pos_ptr, T, C, stride_xb, stride_xt, stride_yb, stride_yt,
                          W: tl.constexpr, L: tl.constexpr, BC: tl.constexpr,
                          HAS_POS: tl.constexpr, AHEAD: tl.constexpr):
    _conv_fwd_rows(x_ptr, w_ptr, y_ptr, pos_ptr, T, C, stride_xb, stride_xt, stride_yb, stride_yt,
                   tl.program_id(0), tl.program_id(1), tl.program_id(2), W, L, BC, HAS_POS, AHEAD)


@triton.jit
def _conv3_fwd_rows_kernel(x0, w0, y0, x1, w1, y1, x2, w2, y2, pos_ptr, T, C0, C1, C2, NB0, NB1,
                           sxb0, sxt0, syb0, syt0, sxb1, sxt1, syb1, syt1, sxb2, sxt2, syb2, syt2,
                           W: tl.constexpr, L: tl.constexpr, BC: tl.constexpr,
                           HAS_POS: tl.constexpr, AHEAD: tl.constexpr):
    """_conv_fwd_rows_kernel over three tensors in one launch: channel blocks [0, NB0) are the
    first tensor's, [NB0, NB0 + NB1) the second's, the rest the third's."""
    ic = tl.program_id(2)
    if ic < NB0:
        _conv_fwd_rows(x0, w0, y0, pos_ptr, T, C0, sxb0, sxt0, syb0, syt0, tl.program_id(0), tl.program_id(1), ic,
                       W, L, BC, HAS_POS, AHEAD)
    elif ic < NB0 + NB1:
        _conv_fwd_rows(x1, w1, y1, pos_ptr, T, C1, sxb1, sxt1, syb1, syt1, tl.program_id(0), tl.program_id(1),
                       ic - NB0, W, L, BC, HAS_POS, AHEAD)
    else:
        _conv_fwd_rows(x2, w2, y2, pos_ptr, T, C2, sxb2, sxt2, syb2, syt2, tl.program_id(0), tl.program_id(1),
                       ic - NB0 - NB1, W, L, BC, HAS_POS, AHEAD)


@triton.jit
def _bwd_row(x_base, dy_base, pos_ptr, u, lo, T, stride_xt, stride_dyt, cm, ct, HAS_POS: tl.constexpr):
    """What the backward's step at row u reads: x[u - 3] and dy[u] as stored (zero outside [0, T),
    and nothing read for a row u below lo, which no step of the program walks; converted where
    they are used) and the in-document position of u (0 without positions)."""
    xd = tl.load(x_base + (u - 3) * stride_xt, mask=cm & (ct + u >= 3) & (ct + u - 3 < T) & (ct + u >= lo),
                 other=0.0)
    dy = tl.load(dy_base + u * stride_dyt, mask=cm & (ct + u < T) & (ct + u >= 0) & (ct + u >= lo), other=0.0)
    if HAS_POS:
        p = tl.load(pos_ptr + u, mask=(u < T) & (u >= 0) & (u >= lo), other=0).to(tl.int32)
    else:
        p = tl.zeros([], dtype=tl.int32)
    return xd, dy, p


@triton.jit
def _bwd_step(x_base, dy_base, dx_row0, pos_ptr, u, T, stride_xt, stride_dyt, stride_dxt, c, cm, ct, w0, w1, w2, w3,
              xa, xb, xc, dz1, dz2, dz3, p1, p2, p3, dw0, dw1, dw2, dw3, xn1, dyn1, pn1, xn2, dyn2, pn2, xn3, dyn3,
              pn3, xn4, dyn4, pn4, lo, HAS_POS: tl.constexpr, AHEAD: tl.constexpr, OWN: tl.constexpr,
              LOAD: tl.constexpr):
    """The backward's step at row u (see _conv_bwd_rows): dz[u]; for an OWN row dx[u] stored and
    the dw sums advanced. Its rows come from the rows loaded ahead (or now, AHEAD 0), which move
    up one, row u - AHEAD loaded into the last with LOAD (nothing read below row lo). Returns the
    carried state."""
    if AHEAD == 0:
        xd, dy, p = _bwd_row(x_base, dy_base, pos_ptr, u, lo, T, stride_xt, stride_dyt, cm, ct, HAS_POS)
    else:
        xd, dy, p = xn1, dyn1, pn1
        xn1, dyn1, pn1, xn2, dyn2, pn2, xn3, dyn3, pn3 = xn2, dyn2, pn2, xn3, dyn3, pn3, xn4, dyn4, pn4
        if LOAD:
            xl, dyl, pl = _bwd_row(x_base, dy_base, pos_ptr, u - AHEAD, lo, T, stride_xt, stride_dyt, cm, ct,
                                   HAS_POS)
            if AHEAD == 1:
                xn1, dyn1, pn1 = xl, dyl, pl
            elif AHEAD == 2:
                xn2, dyn2, pn2 = xl, dyl, pl
            elif AHEAD == 3:
                xn3, dyn3, pn3 = xl, dyl, pl
            else:
                xn4, dyn4, pn4 = xl, dyl, pl
    xd = xd.to(tl.float32)
    dy = dy.to(tl.float32)
    if HAS_POS:
        t1x = tl.where(p >= 1, xb, 0.0)
        t2x = tl.where(p >= 2, xc, 0.0)
        t3x = tl.where(p >= 3, xd, 0.0)
    else:
        t1x, t2x, t3x = xb, xc, xd
    z = w0 * xa + w1 * t1x + w2 * t2x + w3 * t3x
    sig = tl.sigmoid(z)
    dz = dy * sig * (1.0 + z * (1.0 - sig))  # 0 on rows past T
    if OWN:  # rows past T are masked at the store
        if HAS_POS:
            dx = w0 * dz + tl.where(p1 >= 1, w1 * dz1, 0.0) + tl.where(p2 >= 2, w2 * dz2, 0.0) + \
                tl.where(p3 >= 3, w3 * dz3, 0.0)
        else:
            dx = w0 * dz + w1 * dz1 + w2 * dz2 + w3 * dz3
        tl.store(dx_row0 + u * stride_dxt + c, dx.to(dx_row0.dtype.element_ty), mask=cm & (ct + u < T) & (ct + u >= 0))
        dw0 += dz * xa
        dw1 += dz * t1x
        dw2 += dz * t2x
        dw3 += dz * t3x
    return (xb, xc, xd, dz, dz1, dz2, p, p1, p2, dw0, dw1, dw2, dw3, xn1, dyn1, pn1, xn2, dyn2, pn2, xn3, dyn3, pn3,
            xn4, dyn4, pn4)


@triton.jit
def _conv_bwd_rows(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, pos_ptr, T, C, stride_xb, stride_xt, stride_dyb,
                   stride_dyt, stride_dxb, stride_dxt, stride_dw, b, s, ic, runs, W: tl.constexpr, L: tl.constexpr,
                   BC: tl.constexpr, HAS_POS: tl.constexpr, AHEAD: tl.constexpr, RUN: tl.constexpr):
    """dx and the dw partial of the L rows from s·L on and BC channels (W ≤ 4), walking the rows
    backwards from the last one that reaches into them (s·L + L + 2): at row u, dz[u] = dy[u] ⊙
    silu'(z[u]) and dx[u] = Σ_r w[W-1-r] dz[u + r], the three later dz rows and the three x rows
    z[u] needs besides x[u-3] kept in registers from the rows before, so each x and dy row is read
    once (plus the three rows of halo) and dz never goes to memory. The own rows are walked as a
    loop over ``runs`` = L / RUN runs of RUN unrolled steps, everything carried from run to run
    (one halo and one dw partial per L rows; the unrolled code, and so the compile time, grows
    with RUN only). ``runs`` is a launch argument, not a constant: with a constant trip count
    the compiler unrolls the loop and keeps each step's addresses live across it. The dw partial
    goes to row (b, s) of dw_ptr [rows, W, stride_dw]. AHEAD: as in _conv_fwd_rows."""
    b = b.to(tl.int64)  # b · stride may pass 2³¹
    c = ic * BC + tl.arange(0, BC)
    cm = c < C
    ct = c * 0  # a row index plus ct is a mask over the channels
    w0, w1, w2, w3 = _taps(w_ptr, c, cm, W)
    t0 = s * L
    t1 = t0 + L  # own rows [t0, t1)
    x_base = x_ptr + b * stride_xb + c
    dy_base = dy_ptr + b * stride_dyb + c
    dx_row0 = dx_ptr + b * stride_dxb  # a scalar: the store's address is formed there
    u0 = t1 + 2  # the first row walked: the last one whose taps reach row t1 - 1
    xa = tl.load(x_base + u0 * stride_xt, mask=cm & (ct + u0 < T), other=0.0).to(tl.float32)  # x[u]
    xb = tl.load(x_base + (u0 - 1) * stride_xt, mask=cm & (ct + u0 - 1 < T), other=0.0).to(tl.float32)  # x[u-1]
    xc = tl.load(x_base + (u0 - 2) * stride_xt, mask=cm & (ct + u0 - 2 < T), other=0.0).to(tl.float32)  # x[u-2]
    dz1 = tl.zeros([BC], dtype=tl.float32)  # dz[u+1], dz[u+2], dz[u+3]
    dz2 = tl.zeros([BC], dtype=tl.float32)
    dz3 = tl.zeros([BC], dtype=tl.float32)
    p1 = tl.zeros([], dtype=tl.int32)  # pos[u+1], pos[u+2], pos[u+3]: whether their taps reach back to u
    p2, p3 = p1, p1
    dw0 = tl.zeros([BC], dtype=tl.float32)
    dw1 = tl.zeros([BC], dtype=tl.float32)
    dw2 = tl.zeros([BC], dtype=tl.float32)
    dw3 = tl.zeros([BC], dtype=tl.float32)
    # rows u - 1 .. u - A of the step at row u (unused ones stay zero)
    xn1 = tl.zeros([BC], dtype=x_ptr.dtype.element_ty)
    xn2, xn3, xn4 = xn1, xn1, xn1
    dyn1 = tl.zeros([BC], dtype=dy_ptr.dtype.element_ty)
    dyn2, dyn3, dyn4 = dyn1, dyn1, dyn1
    pn1, pn2, pn3, pn4 = p1, p1, p1, p1
    if AHEAD >= 1:
        xn1, dyn1, pn1 = _bwd_row(x_base, dy_base, pos_ptr, u0, t0, T, stride_xt, stride_dyt, cm, ct, HAS_POS)
    if AHEAD >= 2:
        xn2, dyn2, pn2 = _bwd_row(x_base, dy_base, pos_ptr, u0 - 1, t0, T, stride_xt, stride_dyt, cm, ct, HAS_POS)
    if AHEAD >= 3:
        xn3, dyn3, pn3 = _bwd_row(x_base, dy_base, pos_ptr, u0 - 2, t0, T, stride_xt, stride_dyt, cm, ct, HAS_POS)
    if AHEAD >= 4:
        xn4, dyn4, pn4 = _bwd_row(x_base, dy_base, pos_ptr, u0 - 3, t0, T, stride_xt, stride_dyt, cm, ct, HAS_POS)
    for n in tl.static_range(3):  # the halo: rows after the own ones, whose dz the last own rows read
        (xa, xb, xc, dz1, dz2, dz3, p1, p2, p3, dw0, dw1, dw2, dw3, xn1, dyn1, pn1, xn2, dyn2, pn2, xn3, dyn3, pn3,
         xn4, dyn4, pn4) = _bwd_step(
            x_base, dy_base, dx_row0, pos_ptr, u0 - n, T, stride_xt, stride_dyt, stride_dxt, c, cm, ct, w0, w1, w2, w3,
            xa, xb, xc, dz1, dz2, dz3, p1, p2, p3, dw0, dw1, dw2, dw3, xn1, dyn1, pn1, xn2, dyn2, pn2, xn3, dyn3, pn3,
            xn4, dyn4, pn4, t0, HAS_POS, AHEAD, False, n + AHEAD < L + 3)
    for r in tl.range(runs, num_stages=1):  # the own rows, last first (loaded ahead by hand: not pipelined)
        for i in tl.static_range(RUN):
            (xa, xb, xc, dz1, dz2, dz3, p1, p2, p3, dw0, dw1, dw2, dw3, xn1, dyn1, pn1, xn2, dyn2, pn2, xn3, dyn3,
             pn3, xn4, dyn4, pn4) = _bwd_step(
                x_base, dy_base, dx_row0, pos_ptr, t1 - 1 - r * RUN - i, T, stride_xt, stride_dyt, stride_dxt, c, cm,
                ct, w0, w1, w2, w3, xa, xb, xc, dz1, dz2, dz3, p1, p2, p3, dw0, dw1, dw2, dw3, xn1, dyn1, pn1, xn2,
                dyn2, pn2, xn3, dyn3, pn3, xn4, dyn4, pn4, t0, HAS_POS, AHEAD, True, RUN < L or i + AHEAD < RUN)
    dw_base = dw_ptr + ((b * tl.num_programs(1) + s) * W) * stride_dw + c
    tl.store(dw_base + (W - 1) * stride_dw, dw0, mask=cm)
    if W >= 2:
        tl.store(dw_base + (W - 2) * stride_dw, dw1, mask=cm)
    if W >= 3:
        tl.store(dw_base + (W - 3) * stride_dw, dw2, mask=cm)
    if W >= 4:
        tl.store(dw_base + (W - 4) * stride_dw, dw3, mask=cm)


@triton.jit
def _conv3_bwd_rows_kernel(x0, w0, dy0, dx0, x1, w1, dy1, dx1, x2, w2, dy2, dx2, dw_ptr, pos_ptr, T, C0, C1, C2,
                           NB0, NB1, sxb0, sxt0, sdyb0, sdyt0, sdxb0, sdxt0, sxb1, sxt1, sdyb1, sdyt1, sdxb1, sdxt1,
                           sxb2, sxt2, sdyb2, sdyt2, sdxb2, sdxt2, runs, W: tl.constexpr, L: tl.constexpr,
                           BC: tl.constexpr, HAS_POS: tl.constexpr, AHEAD: tl.constexpr, RUN: tl.constexpr):
    """_conv_bwd_rows over up to three tensors in one launch (channel blocks as in
    _conv3_fwd_rows_kernel; a tensor of width 0 gets none); the dw partials of all three side by
    side in one [rows, W, C0 + C1 + C2]."""
    ic = tl.program_id(2)
    b, s = tl.program_id(0), tl.program_id(1)
    CT = C0 + C1 + C2
    if ic < NB0:
        _conv_bwd_rows(x0, w0, dy0, dx0, dw_ptr, pos_ptr, T, C0, sxb0, sxt0, sdyb0, sdyt0, sdxb0, sdxt0, CT, b, s, ic,
                       runs, W, L, BC, HAS_POS, AHEAD, RUN)
    elif ic < NB0 + NB1:
        _conv_bwd_rows(x1, w1, dy1, dx1, dw_ptr + C0, pos_ptr, T, C1, sxb1, sxt1, sdyb1, sdyt1, sdxb1, sdxt1, CT, b, s,
                       ic - NB0, runs, W, L, BC, HAS_POS, AHEAD, RUN)
    else:
        _conv_bwd_rows(x2, w2, dy2, dx2, dw_ptr + C0 + C1, pos_ptr, T, C2, sxb2, sxt2, sdyb2, sdyt2, sdxb2, sdxt2, CT,
                       b, s, ic - NB0 - NB1, runs, W, L, BC, HAS_POS, AHEAD, RUN)


# (rows, channels, warps) per program of the forward and of the backward (whose rows include the
# W - 1 it shares with the next program), from sweeps at the 750m shape on an H200; what each
# sweep found: benchmarks/HISTORY.md
FWD_TILE = (32, 128, 4)
BWD_TILE = (64, 32, 4)
# (rows, channels, warps, rows loaded ahead) per program of the row-walking kernels, used for
# W <= ROWS_MAX_W (they carry at most three earlier taps in registers); from sweeps at the 750m
# training shape (benchmarks.gdn.conv_bench; what each found: benchmarks/HISTORY.md). The
# backward walks its rows in unrolled runs of at most BWD_RUN (a runtime loop over the runs
# carries everything from one to the next), so its compile time grows with BWD_RUN, not with
# its rows per program (benchmarks.gdn.regs prints each kernel's compile time).
FWD_ROWS = (16, 256, 2, 2)
BWD_ROWS = (64, 256, 4, 4)
BWD_RUN = 8
ROWS_MAX_W = 4


def _row_tile(tile: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """A row tile (rows, channels, warps, rows loaded ahead), checked."""
    L, BC, warps, ahead = tile
    if L < 1 or BC < 1 or BC & (BC - 1) or warps < 1 or warps & (warps - 1) or not 0 <= ahead <= 4:
        raise ValueError(f"short_conv: row tile {tile}: rows positive, channels and warps powers of two, rows loaded "
                         f"ahead 0-4")
    return tile


def _bwd_row_tile() -> tuple[int, int, int, int, int]:
    """BWD_ROWS checked, with the rows of its unrolled runs: (rows, channels, warps, rows loaded
    ahead, rows per run)."""
    L, BC, warps, ahead = _row_tile(BWD_ROWS)
    run = min(L, BWD_RUN)
    if L % run:
        raise ValueError(f"short_conv: backward row tile {BWD_ROWS}: more than {BWD_RUN} rows must be a multiple of "
                         f"{BWD_RUN} (the rows of one unrolled run)")
    return L, BC, warps, ahead, run


def _bwd_rows_launch(xs, ws, dys, dxs, positions) -> torch.Tensor:
    """dx of one to three tensors (W <= ROWS_MAX_W, the same W and [B, T]) into dxs by the
    row-walking backward, in one launch; returns the dw partials [rows, W, ΣC] (fp32) for the
    caller to sum."""
    n = len(xs)
    Cs = [x.shape[2] for x in xs] + [0] * (3 - n)
    xs, ws, dys, dxs = (tuple(a) + (a[0],) * (3 - n) for a in (xs, ws, dys, dxs))
    W = ws[0].shape[1]
    B, T, _ = xs[0].shape
    L, BC, warps, ahead, run = _bwd_row_tile()
    NT = triton.cdiv(T, L)
    nb = [triton.cdiv(c, BC) for c in Cs]
    dw_part = torch.empty(B * NT, W, sum(Cs), dtype=torch.float32, device=xs[0].device)
    strides = [v for x, dy, dx in zip(xs, dys, dxs)
               for v in (x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dx.stride(0), dx.stride(1))]
    _conv3_bwd_rows_kernel[(B, NT, sum(nb))](
        xs[0], ws[0], dys[0], dxs[0], xs[1], ws[1], dys[1], dxs[1], xs[2], ws[2], dys[2], dxs[2], dw_part,
        positions if positions is not None else xs[0], T, *Cs, nb[0], nb[1], *strides, L // run, W=W, L=L, BC=BC,
        HAS_POS=positions is not None, AHEAD=ahead, RUN=run, num_warps=warps)
    return dw_part


def _check(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor | None):
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"short_conv: x must be [B, T, C] with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if w.dim() != 2 or w.shape[0] != x.shape[-1] or not w.is_contiguous():
        raise ValueError(f"short_conv: w must be a contiguous [C, W] = [{x.shape[-1]}, W], got {tuple(w.shape)}")
    if positions is not None and (positions.shape != (x.shape[1],) or x.shape[0] != 1):
        raise ValueError("short_conv: positions must be [T] for a packed batch of B = 1")


def conv_silu_fwd(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    _check(x, w, positions)
    B, T, C = x.shape
    y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    pos = positions if positions is not None else x  # a dummy pointer when HAS_POS is off
    if w.shape[1] <= ROWS_MAX_W:
        L, BC, warps, ahead = _row_tile(FWD_ROWS)
        _conv_fwd_rows_kernel[(B, triton.cdiv(T, L), triton.cdiv(C, BC))](
            x, w, y, pos, T, C, x.stride(0), x.stride(1), y.stride(0), y.stride(1), W=w.shape[1], L=L, BC=BC,
            HAS_POS=positions is not None, AHEAD=ahead, num_warps=warps)
        return y
    BT, BC, warps = FWD_TILE
    grid = (B, triton.cdiv(T, BT), triton.cdiv(C, BC))
    _conv_fwd_kernel[grid](x, w, y, pos, T, C, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                           W=w.shape[1], BT=BT, BC=BC, HAS_POS=positions is not None, num_warps=warps)
    return y


def conv_silu_bwd(x, w, dy, positions=None):
    _check(x, w, positions)
    B, T, C = x.shape
    W = w.shape[1]
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    pos = positions if positions is not None else x
    if W <= ROWS_MAX_W:
        dw_part = _bwd_rows_launch((x,), (w,), (dy,), (dx,), positions)
        return dx, dw_part.sum(0).t().contiguous().to(w.dtype)
    BT, BC, warps = BWD_TILE
    while BT < 2 * W:  # at least W rows per program besides the shared ones
        BT *= 2
    STEP = BT - (W - 1)
    NT = triton.cdiv(T, STEP)
    dw_part = torch.empty(B * NT, W, C, dtype=torch.float32, device=x.device)
    _conv_bwd_kernel[(B, NT, triton.cdiv(C, BC))](
        x, w, dy, dx, dw_part, pos, T, C, STEP, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dx.stride(0),
        dx.stride(1), W=W, BT=BT, BC=BC, HAS_POS=positions is not None, num_warps=warps)
    return dx, dw_part.sum(0).t().contiguous().to(w.dtype)  # [C, W]


def _one_launch(xs, ws, positions) -> bool:
    """Checks the three (x, w) pairs; whether one row-walking launch can take them (W ≤ 4, the
    same W and the same [B, T] for all three)."""
    for x, w in zip(xs, ws):
        _check(x, w, positions)
    W = ws[0].shape[1]
    return W <= ROWS_MAX_W and all(w.shape[1] == W for w in ws) and all(x.shape[:2] == xs[0].shape[:2] for x in xs)


def conv_silu_qkv_fwd(q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor, wq: torch.Tensor,
                      wk: torch.Tensor, wv: torch.Tensor, positions: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """conv_silu_fwd of the three projections with their own weights, in one launch (W ≤ 4; for
    a wider conv, one launch each). Bitwise what three conv_silu_fwd calls give."""
    xs, ws = (q_in, k_in, v_in), (wq, wk, wv)
    if not _one_launch(xs, ws, positions):
        return tuple(conv_silu_fwd(x, w, positions) for x, w in zip(xs, ws))
    W = wq.shape[1]
    B, T, _ = q_in.shape
    ys = tuple(torch.empty(B, T, x.shape[2], dtype=x.dtype, device=x.device) for x in xs)
    L, BC, warps, ahead = _row_tile(FWD_ROWS)
    nb = [triton.cdiv(x.shape[2], BC) for x in xs]
    strides = [v for x, y in zip(xs, ys) for v in (x.stride(0), x.stride(1), y.stride(0), y.stride(1))]
    _conv3_fwd_rows_kernel[(B, triton.cdiv(T, L), sum(nb))](
        q_in, wq, ys[0], k_in, wk, ys[1], v_in, wv, ys[2], positions if positions is not None else q_in, T,
        *(x.shape[2] for x in xs), nb[0], nb[1], *strides, W=W, L=L, BC=BC, HAS_POS=positions is not None,
        AHEAD=ahead, num_warps=warps)
    return ys


def conv_silu_qkv_bwd(q_in, k_in, v_in, wq, wk, wv, dq, dk, dv, positions=None, out=None):
    """conv_silu_bwd of the three projections in one launch and one dw sum (W ≤ 4; for a wider
    conv, one call each): (dq_in, dk_in, dv_in, dwq, dwk, dwv). dx is bitwise what three
    conv_silu_bwd calls give; dw equal up to the order of the fp32 sum over the partials.
    ``out``: three [B, T, C] tensors with a contiguous last dim (e.g. views into one buffer, not
    the inputs' memory) that receive dq_in, dk_in, dv_in and are returned as them."""
    xs, ws, dys = (q_in, k_in, v_in), (wq, wk, wv), (dq, dk, dv)
    if out is not None:
        for o, x in zip(out, xs):
            if (o.shape != x.shape or o.dtype != x.dtype or o.device != x.device or o.stride(-1) != 1
                    or any(o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in xs + dys)):
                raise ValueError(f"conv_silu_qkv_bwd: out must be like the inputs ({tuple(x.shape)} {x.dtype} on "
                                 f"{x.device}) with a contiguous last dim and memory of its own, got "
                                 f"{tuple(o.shape)} {o.dtype} on {o.device} strides {o.stride()}")
    if not _one_launch(xs, ws, positions):
        grads = [conv_silu_bwd(x, w, dy, positions) for x, w, dy in zip(xs, ws, dys)]
        dxs = tuple(g[0] for g in grads) if out is None else tuple(o.copy_(g[0]) for o, g in zip(out, grads))
        return (*dxs, *(g[1] for g in grads))
    B, T, _ = q_in.shape
    dys = tuple(dy if dy.stride(-1) == 1 else dy.contiguous() for dy in dys)
    dxs = tuple(out) if out is not None else tuple(
        torch.empty(B, T, x.shape[2], dtype=x.dtype, device=x.device) for x in xs)
    dw_part = _bwd_rows_launch(xs, ws, dys, dxs, positions)
    Cs = [x.shape[2] for x in xs]
    # one sum over the partials, then each weight's [C, W] its own contiguous tensor (the op's
    # outputs may not alias one another)
    dw = dw_part.sum(0).split(Cs, dim=1)
    return (*dxs, *(d.t().contiguous().to(w.dtype) for d, w in zip(dw, ws)))
