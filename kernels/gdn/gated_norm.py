"""Gated RMSNorm in Triton: y = RMSNorm(o) ⊙ w ⊙ SiLU(gate) per row of V values (fla's FusedRMSNormGated).

Math in fp32, one program per block of rows. The backward recomputes each row's 1/rms from o,
which it loads anyway, so nothing but the inputs is kept for it; it gives do, dgate and dw (dw as
fp32 per-program partial sums, then one sum: no atomics, so results do not depend on scheduling).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rstd(o, eps, V: tl.constexpr):
    """1/rms of each row of the fp32 tile o: the forward's and the backward's, the same expression."""
    return 1.0 / tl.sqrt(tl.sum(o * o, 1) / V + eps)


@triton.jit
def _gnorm_fwd_kernel(o_ptr, g_ptr, w_ptr, y_ptr, N, eps, V: tl.constexpr, BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, V)
    m = (r < N)[:, None]
    off = r[:, None] * V + c[None, :]
    o = tl.load(o_ptr + off, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + off, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c).to(tl.float32)
    y = o * _rstd(o, eps, V)[:, None] * w[None, :] * (g * tl.sigmoid(g))
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gnorm_bwd_kernel(o_ptr, g_ptr, w_ptr, dy_ptr, do_ptr, dg_ptr, dw_ptr, N, eps, V: tl.constexpr,
                      BR: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BR + tl.arange(0, BR)
    c = tl.arange(0, V)
    m = (r < N)[:, None]
    off = r[:, None] * V + c[None, :]
    o = tl.load(o_ptr + off, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + off, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + off, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c).to(tl.float32)
    rstd = _rstd(o, eps, V)  # rows past N: o = 0, so rstd = 1/√eps, finite, and nothing is stored
    sig = tl.sigmoid(g)
    s = g * sig
    n = o * rstd[:, None]
    dg = dy * n * w[None, :] * sig * (1.0 + g * (1.0 - sig))
    dn = dy * w[None, :] * s
    do = rstd[:, None] * (dn - n * (tl.sum(dn * n, 1) / V)[:, None])
    tl.store(do_ptr + off, do.to(do_ptr.dtype.element_ty), mask=m)
    tl.store(dg_ptr + off, dg.to(dg_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + pid * V + c, tl.sum(dy * n * s, 0))


_BR = 128


def _rows(o: torch.Tensor, gate: torch.Tensor, w: torch.Tensor):
    V = w.shape[0]
    if o.shape[-1] != V or gate.numel() != o.numel() or not (o.is_contiguous() and gate.is_contiguous()):
        raise ValueError(f"gated_norm: o [..., V = {V}] and gate (same number of elements), both contiguous, "
                         f"got {tuple(o.shape)} and {tuple(gate.shape)}")
    if V & (V - 1):
        raise ValueError(f"gated_norm: V = {V} must be a power of two")
    return o.numel() // V, V


def gated_norm_fwd(o, gate, w, eps: float):
    """y = RMSNorm(o) ⊙ w ⊙ SiLU(gate), in o's dtype."""
    N, V = _rows(o, gate, w)
    y = torch.empty_like(o)
    _gnorm_fwd_kernel[(triton.cdiv(N, _BR),)](o, gate, w, y, N, eps, V=V, BR=_BR, num_warps=4)
    return y


def gated_norm_bwd(o, gate, w, eps: float, dy):
    """(do, dgate, dw) for the forward's inputs and eps and the output gradient dy."""
    N, V = _rows(o, gate, w)
    dy = dy.contiguous()
    do, dg = torch.empty_like(o), torch.empty_like(gate)
    P = triton.cdiv(N, _BR)
    dw = torch.empty(P, V, dtype=torch.float32, device=o.device)
    _gnorm_bwd_kernel[(P,)](o, gate, w, dy, do, dg, dw, N, eps, V=V, BR=_BR, num_warps=4)
    return do, dg, dw.sum(0).to(w.dtype)
