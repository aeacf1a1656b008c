"""Short causal depthwise conv + SiLU in Triton (forward, and a backward that recomputes it).

y[b, t, c] = silu(Σ_{j<W} w[c, W-1-j] · x[b, t-j, c]), a tap j used only where t-j ≥ 0 and, for
packed rows, where the token's position inside its document is ≥ j (the conv never reaches
across a document start). x may be a strided view (its last dim contiguous): the model hands
the three projections' outputs in as they come.

The backward recomputes the pre-activation from x rather than saving it: the conv's only saved
tensors are x and w, the inputs it already holds. It is one kernel: each program recomputes z
and dz = dy ⊙ silu'(z) once per row of its tile, and gathers dx[t] from the W rows of dz at t..t+W-1
inside the same register tile; tiles overlap by the W - 1 rows that two programs both need, so
dz never makes a round trip through memory (writing it out in fp32 and reading it back in a
second kernel moves four times the bytes of a bf16 x). dw is summed per program in fp32 (a [programs, W, C] slab,
then one sum), so the result does not depend on scheduling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, y_ptr, pos_ptr, T, C, stride_xb, stride_xt, stride_yb, stride_yt,
                     W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr):
    b, it, ic = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
    b, it, ic = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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


# (rows, channels, warps) per program of the forward and of the backward (whose rows include the
# W - 1 it shares with the next program), from sweeps at the 750m shape on an H200; what each
# sweep found: benchmarks/HISTORY.md
FWD_TILE = (32, 128, 4)
BWD_TILE = (64, 32, 4)


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
    BT, BC, warps = FWD_TILE
    y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    pos = positions if positions is not None else x  # a dummy pointer when HAS_POS is off
    grid = (B, triton.cdiv(T, BT), triton.cdiv(C, BC))
    _conv_fwd_kernel[grid](x, w, y, pos, T, C, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                           W=w.shape[1], BT=BT, BC=BC, HAS_POS=positions is not None, num_warps=warps)
    return y


def conv_silu_bwd(x, w, dy, positions=None):
    _check(x, w, positions)
    B, T, C = x.shape
    W = w.shape[1]
    BT, BC, warps = BWD_TILE
    while BT < 2 * W:  # at least W rows per program besides the shared ones
        BT *= 2
    STEP = BT - (W - 1)
    NT = triton.cdiv(T, STEP)
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    dw_part = torch.empty(B * NT, W, C, dtype=torch.float32, device=x.device)
    pos = positions if positions is not None else x
    _conv_bwd_kernel[(B, NT, triton.cdiv(C, BC))](
        x, w, dy, dx, dw_part, pos, T, C, STEP, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dx.stride(0),
        dx.stride(1), W=W, BT=BT, BC=BC, HAS_POS=positions is not None, num_warps=warps)
    return dx, dw_part.sum(0).t().contiguous().to(w.dtype)  # [C, W]
