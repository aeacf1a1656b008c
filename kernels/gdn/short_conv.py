"""Short causal depthwise conv + SiLU in Triton (forward, and a backward that recomputes it).

y[b, t, c] = silu(Σ_{j<W} w[c, W-1-j] · x[b, t-j, c]), a tap j used only where t-j ≥ 0 and, for
packed rows, where the token's position inside its document is ≥ j (the conv never reaches
across a document start). x may be a strided view (its last dim contiguous): the model hands
the three projections' outputs in as they come.

The backward recomputes the pre-activation from x rather than saving it: the conv's only saved
tensors are x and w, the inputs it already holds. dw is summed per program in fp32 (a
[programs, W, C] slab, then one sum), so the result does not depend on scheduling.
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
def _conv_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, pos_ptr, T, C, NT, stride_xb, stride_xt,
                     stride_dyb, stride_dyt, stride_dxb, stride_dxt,
                     W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr):
    b, it, ic = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = it * BT + tl.arange(0, BT)
    c = ic * BC + tl.arange(0, BC)
    cm = c < C
    x_base = x_ptr + b * stride_xb + c[None, :]
    dx = tl.zeros([BT, BC], dtype=tl.float32)
    # dw partial for this program: W taps, kept as W vectors
    dw_base = dw_ptr + ((b * NT + it) * W) * C + c
    for r in tl.static_range(W):
        # rows s = t + r: their pre-activation (recomputed), dz = dy ⊙ silu'(z), and what they
        # send back to row t through tap r
        s = t + r
        sm = s < T
        if HAS_POS:
            pos_s = tl.load(pos_ptr + s, mask=sm, other=0)
        z = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            wj = tl.load(w_ptr + c * W + (W - 1 - j), mask=cm, other=0.0).to(tl.float32)
            ok = sm & (s >= j)
            if HAS_POS:
                ok = ok & (pos_s >= j)
            xs = tl.load(x_base + (s - j)[:, None] * stride_xt, mask=ok[:, None] & cm[None, :], other=0.0)
            z += xs.to(tl.float32) * wj[None, :]
        sig = tl.sigmoid(z)
        dyv = tl.load(dy_ptr + b * stride_dyb + s[:, None] * stride_dyt + c[None, :],
                      mask=sm[:, None] & cm[None, :], other=0.0).to(tl.float32)
        dz = dyv * sig * (1.0 + z * (1.0 - sig))
        okr = sm & (s >= r)
        if HAS_POS:
            okr = okr & (pos_s >= r)
        dz = tl.where(okr[:, None], dz, 0.0)
        wr = tl.load(w_ptr + c * W + (W - 1 - r), mask=cm, other=0.0).to(tl.float32)
        dx += dz * wr[None, :]
        if r == 0:
            # dw[c, W-1-j] = Σ_t dz[t] x[t-j] over this program's rows t (r = 0: s = t)
            for j in tl.static_range(W):
                ok = (t < T) & (t >= j)
                if HAS_POS:
                    ok = ok & (pos_s >= j)
                xs = tl.load(x_base + (t - j)[:, None] * stride_xt, mask=ok[:, None] & cm[None, :], other=0.0)
                tl.store(dw_base + (W - 1 - j) * C, tl.sum(dz * xs.to(tl.float32), 0), mask=cm)
    tm = t < T
    tl.store(dx_ptr + b * stride_dxb + t[:, None] * stride_dxt + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])


_BT, _BC = 64, 64


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
    grid = (B, triton.cdiv(T, _BT), triton.cdiv(C, _BC))
    _conv_fwd_kernel[grid](x, w, y, pos, T, C, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                           W=w.shape[1], BT=_BT, BC=_BC, HAS_POS=positions is not None, num_warps=4)
    return y


def conv_silu_bwd(x, w, dy, positions=None):
    _check(x, w, positions)
    B, T, C = x.shape
    W = w.shape[1]
    NT = triton.cdiv(T, _BT)
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    dw_part = torch.empty(B * NT, W, C, dtype=torch.float32, device=x.device)
    pos = positions if positions is not None else x
    _conv_bwd_kernel[(B, NT, triton.cdiv(C, _BC))](
        x, w, dy, dx, dw_part, pos, T, C, NT, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
        dx.stride(0), dx.stride(1), W=W, BT=_BT, BC=_BC, HAS_POS=positions is not None, num_warps=4)
    return dx, dw_part.sum(0).t().contiguous().to(w.dtype)  # [C, W]
