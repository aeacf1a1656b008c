"""One decoding step of a GDN token mixer in Triton: short conv, SiLU, q/k L2 norm and the
recurrent state update of every head in one kernel, the layer's cache updated in place.

Per sequence b and head h, from the token's projections xs = [x_q | x_k | x_v] and the cache
(conv: the W − 1 previous projections, oldest first; state h ∈ R^{K×V}, fp32)::

    y = silu(Σ_s w[:, s] · window[s])      window = [conv rows 0..W−2, xs]  (per channel)
    q, k = l2norm(y_q), l2norm(y_k);  v = y_v
    h ← exp(g) · h;  h ← h + k (β (v − hᵀ k))ᵀ;  o = hᵀ (scale · q)

and the window moves one token on (conv rows 1..W−2 down one, xs into the last row). A
program owns one (sequence, head): its q, k and v channels and its K × V state, so it reads
and writes nothing another program touches. Conv sizes 2-4 (HyMo's and fla's is 4). The math runs in fp32 throughout (the PyTorch
step, hymo_recipes/model/decode.py with ``recurrent_torch.py``, rounds the conv output and the
normalised q and k to the input dtype); tests/kernels/test_gdn_recurrent.py checks the two
against each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _window_row(row, s: tl.constexpr, cm, stride_ct, W: tl.constexpr):
    """Cached row s of the window (zeros for the rows a conv of W < 4 lacks)."""
    if s < W - 1:
        return tl.load(row + s * stride_ct, mask=cm, other=0.0)
    else:
        return tl.zeros(cm.shape, dtype=row.dtype.element_ty)


@triton.jit
def _conv_silu(xs_ptr, conv_ptr, w_ptr, b, ch, cm, stride_xs, stride_cb, stride_ct, W: tl.constexpr):
    """silu of the conv over the window for channels ch (fp32); moves the cached window on.
    A channel vector may be held by several warps at once, so every row is read before any
    is written, with a barrier between (2 ≤ W ≤ 4: the rows ride in registers)."""
    x_now = tl.load(xs_ptr + b * stride_xs + ch, mask=cm, other=0.0)
    row = conv_ptr + b * stride_cb + ch
    r0 = _window_row(row, 0, cm, stride_ct, W)
    r1 = _window_row(row, 1, cm, stride_ct, W)
    r2 = _window_row(row, 2, cm, stride_ct, W)
    y = x_now.to(tl.float32) * tl.load(w_ptr + ch * W + (W - 1), mask=cm, other=0.0).to(tl.float32)
    y += r0.to(tl.float32) * tl.load(w_ptr + ch * W, mask=cm, other=0.0).to(tl.float32)
    if W >= 3:
        y += r1.to(tl.float32) * tl.load(w_ptr + ch * W + 1, mask=cm, other=0.0).to(tl.float32)
    if W >= 4:
        y += r2.to(tl.float32) * tl.load(w_ptr + ch * W + 2, mask=cm, other=0.0).to(tl.float32)
    tl.debug_barrier()
    if W >= 3:
        tl.store(row, r1, mask=cm)
    if W >= 4:
        tl.store(row + stride_ct, r2, mask=cm)
    tl.store(row + (W - 2) * stride_ct, x_now.to(conv_ptr.dtype.element_ty), mask=cm)
    return y * tl.sigmoid(y)


@triton.jit
def _gdn_step_kernel(xs_ptr, conv_ptr, w_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, H, KEY, stride_xs, stride_cb,
                     stride_ct, scale, eps, W: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    kk, vv = tl.arange(0, BK), tl.arange(0, BV)
    km, vm = kk < K, vv < V
    q = _conv_silu(xs_ptr, conv_ptr, w_ptr, b, h * K + kk, km, stride_xs, stride_cb, stride_ct, W)
    k = _conv_silu(xs_ptr, conv_ptr, w_ptr, b, KEY + h * K + kk, km, stride_xs, stride_cb, stride_ct, W)
    v = _conv_silu(xs_ptr, conv_ptr, w_ptr, b, 2 * KEY + h * V + vv, vm, stride_xs, stride_cb, stride_ct, W)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    g = tl.load(g_ptr + b * H + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * H + h).to(tl.float32)
    s_ptrs = state_ptr + ((b * H + h) * K + kk[:, None]) * V + vv[None, :]
    sm = km[:, None] & vm[None, :]
    s = tl.load(s_ptrs, mask=sm, other=0.0) * tl.exp(g)
    v_new = beta * (v - tl.sum(s * k[:, None], 0))
    s += k[:, None] * v_new[None, :]
    tl.store(s_ptrs, s, mask=sm)
    o = tl.sum(s * q[:, None], 0)
    tl.store(o_ptr + (b * H + h) * V + vv, o.to(o_ptr.dtype.element_ty), mask=vm)


MAX_W = 4  # the window rows ride in three register vectors


def gdn_decode_step(xs: torch.Tensor, conv: torch.Tensor, w: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, head_k: int, head_v: int, scale: float | None = None,
                    eps: float = 1e-6) -> torch.Tensor:
    """One token per sequence through the conv, the norms and the recurrence (see the module
    docstring); ``conv`` and ``state`` are updated in place.

    Args:
        xs: [B, 2·H·K + H·V] the token's q, k and v projections side by side.
        conv: [B, W − 1, 2·H·K + H·V] the previous W − 1 projections, oldest first (its last
            dim contiguous).
        w: [2·H·K + H·V, W] depthwise conv weights; w[:, W − 1] multiplies the current token.
        g, beta: [B, H] log decay and write strength.
        state: [B, H, K, V] float32, contiguous.
        head_k, head_v: K and V.
        scale: multiplies q. Default: K ** -0.5.
        eps: of the L2 norms (the model's l2_normalize).

    Returns:
        o: [B, H, V] in xs's dtype.
    """
    B, C = xs.shape
    H = g.shape[-1]
    key = H * head_k
    W = w.shape[-1]
    if C != 2 * key + H * head_v:
        raise ValueError(f"xs must be [B, 2·H·K + H·V] = [{B}, {2 * key + H * head_v}], got {tuple(xs.shape)}")
    if not 2 <= W <= MAX_W:
        raise ValueError(f"the fused decode step takes conv sizes 2-{MAX_W}, got {W}")
    if conv.shape != (B, W - 1, C) or w.shape != (C, W):
        raise ValueError(f"conv must be [B, W - 1, C] = {(B, W - 1, C)} and w [C, W] = {(C, W)}, got "
                         f"{tuple(conv.shape)} and {tuple(w.shape)}")
    if g.shape != (B, H) or beta.shape != (B, H):
        raise ValueError(f"g and beta must be [B, H] = {(B, H)}, got {tuple(g.shape)} and {tuple(beta.shape)}")
    if state.shape != (B, H, head_k, head_v) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous float32 [B, H, K, V] = {(B, H, head_k, head_v)}, got "
                         f"{state.dtype} {tuple(state.shape)}")
    if xs.stride(-1) != 1 or conv.stride(-1) != 1:
        raise ValueError("xs and conv need a contiguous last dim")
    o = xs.new_empty(B, H, head_v)
    _gdn_step_kernel[(B, H)](
        xs, conv, w.contiguous(), g.contiguous(), beta.contiguous(), state, o, H, key, xs.stride(0),
        conv.stride(0), conv.stride(1), head_k**-0.5 if scale is None else scale, eps, W=W, K=head_k, V=head_v,
        BK=triton.next_power_of_2(head_k), BV=triton.next_power_of_2(head_v))
    return o
