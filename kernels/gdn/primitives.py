"""Triton helpers shared by the GDN kernels: chunk spans, loads of a sub-chunk's rows and of
the γβ pack, the dot with its precision switch, the Gram matrix of A and the l2norm of q, k."""

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


@triton.jit
def _l2norm_rows_pair(a, b, NORM: tl.constexpr):
    """_l2norm_rows of two same-shape tiles (a sub-chunk's k and q), their row sums in one
    reduction."""
    if NORM:
        sa, sb = tl.split(tl.sum(tl.join(a * a, b * b), 1))
        ra = 1.0 / tl.sqrt(sa + 1e-6)
        rb = 1.0 / tl.sqrt(sb + 1e-6)
        a = a * ra[:, None]
        b = b * rb[:, None]
    else:
        ra = tl.sum(a * 0.0, 1) + 1.0
        rb = ra
    return a, b, ra, rb
