"""The only sequential loop: the state pass over each sequence's chunks, forward on [M | N]
(states) and in reverse on [Mᵀ | R] (their gradients) (DESIGN.md, Forward)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .primitives import _dot
from .problem import Problem, _cdiv, _kw, _prec, saved_states_dtype


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
    SLOTS > 1 (the forward with Config.local_sub_states): states has one slot per sub-chunk,
    [NC·SLOTS, H, K, V], and the pass fills the first slot of each chunk; _fwd_out the rest."""
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


def run_state_pass(p: Problem, ab: torch.Tensor, x0: torch.Tensor | None, reverse: bool):
    """The sequential pass over chunks: (per-chunk states [NC·slots, H, K, V], last state
    [N, H, K, V]); with slots > 1 (the forward of the local_sub path) it fills the first slot
    of each chunk and _fwd_out the others."""
    BV = p.cfg.tile("state_pass")
    slots = p.cfg.slots if not reverse else 1
    dtype = torch.float32 if reverse else saved_states_dtype(p.cfg, p.q.dtype)
    states = torch.empty(p.NC * slots, p.H, p.K, p.V, dtype=dtype, device=p.q.device)
    xT = torch.empty(p.N, p.H, p.K, p.V, dtype=torch.float32, device=p.q.device)
    _state_pass_kernel[(p.N, p.H, _cdiv(p.V, BV))](
        ab, states, x0 if x0 is not None else xT, xT, p.offs, p.T, H=p.H, K=p.K, V=p.V, BT=p.cfg.BT, BV=BV,
        REVERSE=reverse, HAS_X0=x0 is not None, IS_VARLEN=p.cu_seqlens is not None, PREC=_prec(p.q.dtype),
        SLOTS=slots, **_kw(p.cfg.state_pass))
    return states, xT
