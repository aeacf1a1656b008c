"""The orthogonalisation's iteration (hymo_kernels.normuon.ns_torch is the reference and says
what it computes) as three batched-GEMM launches per step.

Why not torch's ``baddbmm``: cuBLAS writes αPQ + βC over C itself, so torch's out-of-place
``baddbmm`` first copies C into the output: an X-sized and an A-sized copy per step, and the
first step's X / scale is one more pass (BENCHMARKS.md has what they cost). Here the addend is
read in the GEMM's epilogue, the per-matrix scale is applied to the fp32 results, and the two symmetric products (A = X Xᵀ and B = cA² + bA) compute only the
tiles on and above the diagonal, writing each off-diagonal tile twice (itself and its
transpose): about a quarter fewer MMA FLOPs for a wide [m, ~2m] matrix at the shipped tiles.
"""

from __future__ import annotations

import os

import torch

from ..runtime import unavailable_reason

try:
    import triton
    import triton.language as tl
    _TRITON_ERROR = None
except ImportError as e:  # the GPU path needs Triton; the reference does not
    _TRITON_ERROR = e

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (BM, BN, BK, num_warps, num_stages) by the product's output side: the square products' tiles
# are square (the mirrored write needs BM == BN). "large" chosen on an H100 by
# `benchmarks/ns_bench.py --sweep`; "small" and "mid" not tuned (their batches timed the host).
TILES = {
    "small": (32, 64, 64, 4, 3),  # m ≤ 32
    "mid": (64, 64, 64, 4, 3),  # m ≤ 128
    "large": (128, 128, 64, 8, 3),
}

if _TRITON_ERROR is None:
    @triton.jit
    def _ns_mm_kernel(P, Q, D, OUT, inv, M, N, K,
                      s_pb, s_pm, s_pk, s_qb, s_qk, s_qn, s_db, s_dm, s_dn, s_ob, s_om, s_on,
                      alpha, beta, ALPHA_POW: tl.constexpr, BETA_POW: tl.constexpr, HAS_D: tl.constexpr,
                      SYM: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr):
        # OUT[i] = alpha · inv[i]^ALPHA_POW · P[i] Q[i] + beta · inv[i]^BETA_POW · D[i]
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if SYM and pid_m > pid_n:
            return  # the tile below the diagonal is its mirror's transpose
        i = tl.program_id(2).to(tl.int64)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        p_ptr = P + i * s_pb + rm[:, None].to(tl.int64) * s_pm + rk[None, :] * s_pk
        q_ptr = Q + i * s_qb + rk[:, None].to(tl.int64) * s_qk + rn[None, :] * s_qn
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k_in = (k0 + rk) < K
            p = tl.load(p_ptr, mask=(rm[:, None] < M) & k_in[None, :], other=0.0)
            q = tl.load(q_ptr, mask=k_in[:, None] & (rn[None, :] < N), other=0.0)
            if IEEE:
                acc = tl.dot(p, q, acc, input_precision="ieee")
            else:
                acc = tl.dot(p, q, acc)
            p_ptr += BK * s_pk
            q_ptr += BK * s_qk
        scale = alpha
        if ALPHA_POW > 0 or BETA_POW > 0:
            v = tl.load(inv + i)
        if ALPHA_POW == 1:
            scale = scale * v
        if ALPHA_POW == 2:
            scale = scale * v * v
        out = acc * scale
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if HAS_D:
            d_scale = beta
            if BETA_POW == 1:
                d_scale = d_scale * v
            d = tl.load(D + i * s_db + rm[:, None].to(tl.int64) * s_dm + rn[None, :] * s_dn, mask=mask,
                        other=0.0)
            out += d.to(tl.float32) * d_scale
        out = out.to(OUT.dtype.element_ty)
        tl.store(OUT + i * s_ob + rm[:, None].to(tl.int64) * s_om + rn[None, :] * s_on, out, mask=mask)
        if SYM and pid_m != pid_n:
            tl.store(OUT + i * s_ob + rn[:, None].to(tl.int64) * s_om + rm[None, :] * s_on, tl.trans(out),
                     mask=(rn[:, None] < N) & (rm[None, :] < M))


def _tiles(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    if _INTERPRET:  # the CPU interpreter computes whole tiles, padding included: fit them to the shape
        fit = [min(max(triton.next_power_of_2(x), 16), 64) for x in (m, n, k)]
        return (*fit, 4, 1)
    return TILES["small" if m <= 32 else "mid" if m <= 128 else "large"]


def _mm(P: torch.Tensor, Q: torch.Tensor, out: torch.Tensor, inv: torch.Tensor, alpha: float, alpha_pow: int,
        D: torch.Tensor | None = None, beta: float = 0.0, beta_pow: int = 0, symmetric: bool = False) -> None:
    B, M, K = P.shape
    N = Q.shape[2]
    BM, BN, BK, warps, stages = _tiles(M, N, K)
    if P.dtype == torch.float32:  # fp32 tiles take twice the shared memory per stage
        stages = min(stages, 2)
    if symmetric:
        BN = BM
    Dt = D if D is not None else out
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN), B)
    _ns_mm_kernel[grid](P, Q, Dt, out, inv, M, N, K, *P.stride(), *Q.stride(), *Dt.stride(), *out.stride(),
                        float(alpha), float(beta), ALPHA_POW=alpha_pow, BETA_POW=beta_pow, HAS_D=D is not None,
                        SYM=symmetric, IEEE=P.dtype == torch.float32, BM=BM, BN=BN, BK=BK, num_warps=warps,
                        num_stages=stages)


def iterate(X: torch.Tensor, inv: torch.Tensor, coeffs: list[tuple[float, float, float]]) -> torch.Tensor:
    """As ns_torch.iterate: X [B, m, n] contiguous, m ≤ n, in fp32, bf16 or fp16; ``inv`` [B]
    fp32 on X's device. Returns a new [B, m, n] tensor of X's dtype (X is left as it was)."""
    why = unavailable_reason(X.device.type, _TRITON_ERROR, _INTERPRET)
    if why is not None:
        raise RuntimeError(f"hymo_kernels.normuon.ns.iterate {why}")
    if X.ndim != 3 or not X.is_contiguous() or X.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"hymo_kernels.normuon.ns.iterate: X must be a contiguous [B, m, n] tensor in fp32, bf16 "
                         f"or fp16, got {tuple(X.shape)} {X.dtype}")
    B, m, n = X.shape
    if m > n:
        raise ValueError(f"hymo_kernels.normuon.ns.iterate: X must be wide (m ≤ n), got [{B}, {m}, {n}]")
    if inv.shape != (B,) or inv.dtype != torch.float32 or inv.device != X.device:
        raise ValueError(f"hymo_kernels.normuon.ns.iterate: inv must be fp32 [{B}] on {X.device}")
    A = torch.empty(B, m, m, dtype=X.dtype, device=X.device)
    Bm = torch.empty_like(A)
    bufs = [torch.empty_like(X), torch.empty_like(X)]
    for step, (a, b, c) in enumerate(coeffs):
        pw = 1 if step == 0 else 0  # the first step carries the scale
        _mm(X, X.mT, A, inv, 1.0, 2 * pw, symmetric=True)
        _mm(A, A, Bm, inv, c, 0, D=A, beta=b, symmetric=True)
        out = bufs[step % 2]
        _mm(Bm, X, out, inv, 1.0, pw, D=X, beta=a, beta_pow=pw)
        X = out
    return X
