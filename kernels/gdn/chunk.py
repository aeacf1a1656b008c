"""Chunked Gated DeltaNet in Triton: the public op, its torch.library registration and launchers.

``chunk_gated_delta_rule`` takes flash-linear-attention's arguments in the same order and
returns ``(o, final_state)``; the kernels are in ``chunk_kernels.py`` and the derivation of
the forward and the hand-written backward in ``README.md``.

The op is two ``torch.library.custom_op``s (forward, backward) with fake implementations and
``register_autograd``, so ``torch.compile(fullgraph=True)`` traces a model that calls it
without a graph break (fla's entry point is ``@torch.compiler.disable``).

No silent fallback: on a machine without Triton, or with CPU tensors outside Triton's
interpreter (``TRITON_INTERPRET=1``, used by the CPU tests), the call raises a RuntimeError
that says to pick ``gdn_backend = "torch_chunk"`` (or ``"naive"``) instead.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from .naive import check_gdn_inputs

try:  # Triton is optional for the package: only this backend needs it
    import triton

    from . import chunk_kernels as _kern

    _TRITON_ERROR: Exception | None = None
except Exception as e:  # noqa: BLE001 - any import failure means "no Triton backend"
    _kern = None
    _TRITON_ERROR = e

# Whether the kernels were built for Triton's CPU interpreter (decided when triton.jit ran).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_HINT = 'set the model arg gdn_backend = "torch_chunk" (or "naive") to run the PyTorch reference'


@dataclasses.dataclass(frozen=True)
class KernelCfg:
    """Per-kernel launch choice: warps and software-pipelining stages."""

    num_warps: int = 2
    num_stages: int = 1


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiling. BT: tokens per chunk, the unit of the sequential state pass (a multiple of BC);
    BC: tokens per sub-chunk, the unit of the WY algebra (16 or 32; T = (I + A)⁻¹ is BC×BC);
    BZ: augmented columns per program in the prep kernels; BV: value columns per program in
    the output and gradient kernels (V > BV makes dq/dk/dg/dβ partial sums); BV_PASS: value
    columns per program in the state pass."""

    BT: int = 64
    BC: int = 16
    BZ: int = 64
    BV: int = 64
    BV_PASS: int = 16
    wy_inverse: KernelCfg = KernelCfg(1)
    fwd_prep: KernelCfg = KernelCfg()
    fwd_out: KernelCfg = KernelCfg()
    bwd_prep: KernelCfg = KernelCfg()
    bwd_local: KernelCfg = KernelCfg()
    num_warps_pass: int = 4


# Overrides for benchmarking/tuning, keyed by (K, V); read by both the real and the fake
# implementations, so change it only between whole forward/backward calls.
TUNING: dict[tuple[int, int], Config] = {}


def get_config(K: int, V: int, NH: int = 160) -> Config:
    """Tiling for head dims K, V with NH = (number of sequences) × heads. Chosen by the sweep in
    bench.py on an H200 (BENCHMARKS.md): one warp for the small-tile kernels, chunks of 128
    tokens, 256 when few (sequence, head) pairs leave the state pass short of programs."""
    if (K, V) in TUNING:
        return TUNING[(K, V)]
    if max(K, V) <= 32:
        return Config(BT=256 if NH < 128 else 128, BC=16, BZ=min(64, triton_next_pow2(K + V)), BV=V,
                      BV_PASS=16, wy_inverse=KernelCfg(1), fwd_prep=KernelCfg(1), fwd_out=KernelCfg(1),
                      bwd_prep=KernelCfg(1), bwd_local=KernelCfg(2), num_warps_pass=4)
    return Config(BT=64, BC=16, BZ=64, BV=min(V, 64), BV_PASS=16 if V <= 64 else 32)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _num_chunks(B: int, T: int, N: int, varlen: bool, BT: int):
    """Chunks the kernels index (static: an upper bound for packed batches)."""
    return (T + BT - 1) // BT + N if varlen else B * ((T + BT - 1) // BT)


def _varlen_tables(cu_seqlens: torch.Tensor, NC: int, BT: int):
    """Per chunk (first token, end of its sequence) and per sequence its first chunk,
    computed on the device without a host sync; chunks past the real count get (0, 0)."""
    cu = cu_seqlens.to(torch.int64)
    N = cu.numel() - 1
    nch = (cu[1:] - cu[:-1] + BT - 1) // BT
    offs = torch.cat([cu.new_zeros(1), torch.cumsum(nch, 0)])
    ids = torch.arange(NC, device=cu.device)
    seq = torch.searchsorted(offs[1:].contiguous(), ids, right=True).clamp_(max=N - 1)
    t0 = cu[seq] + (ids - offs[seq]) * BT
    valid = ids < offs[-1]
    spans = torch.stack([torch.where(valid, t0, 0), torch.where(valid, cu[seq + 1], 0)], 1)
    return spans.to(torch.int32).contiguous(), offs.to(torch.int32)


def _kw(kc: KernelCfg) -> dict:
    return dict(num_warps=kc.num_warps, num_stages=kc.num_stages)


def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs: three-pass tf32 (about fp32 accuracy on the tensor cores; a test/debug mode);
    # 16-bit inputs: tf32 on the fp32 intermediates (bf16 values are exact in tf32)
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _common(q, v, cu_seqlens):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # head dims are compile-time constants of the kernels: specialise on them when tracing
    # (and on whether N·H is small, which picks the chunk size)
    cfg = get_config(int(K), int(V), 256 if N * H >= 128 else 1)
    NC = _num_chunks(B, T, N, cu_seqlens is not None, cfg.BT)
    return B, T, H, K, V, N, cfg, NC


def _tables(cu_seqlens, NC, BT, device):
    if cu_seqlens is None:
        dummy = torch.empty(2, dtype=torch.int32, device=device)
        return dummy, dummy
    return _varlen_tables(cu_seqlens, NC, BT)


def _forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm):
    B, T, H, K, V, N, cfg, NC = _common(q, v, cu_seqlens)
    dev = q.device
    varlen = cu_seqlens is not None
    spans, offs = _tables(cu_seqlens, NC, cfg.BT, dev)
    prec = _prec(q.dtype)
    f32 = torch.float32

    # T = (I + A)⁻¹ of every sub-chunk, row by row beside its tokens; saved for the backward
    tinv = torch.empty(B, T, H, cfg.BC, dtype=f32, device=dev)
    _kern._wy_inverse_kernel[(NC, H, cfg.BT // cfg.BC)](
        k, g, beta, tinv, spans, T, H=H, K=K, BT=cfg.BT, BC=cfg.BC, LOG2_BC=int(math.log2(cfg.BC)),
        IS_VARLEN=varlen, NORM_QK=use_qk_l2norm, PREC=prec, **_kw(cfg.wy_inverse))

    mn = torch.empty(NC, H, K, K + V, dtype=f32, device=dev)
    _kern._fwd_prep_kernel[(NC, H, triton.cdiv(K + V, cfg.BZ))](
        k, v, g, beta, tinv, mn, spans, T, H=H, K=K, V=V, BT=cfg.BT, BC=cfg.BC, BZ=cfg.BZ,
        IS_VARLEN=varlen, NORM_QK=use_qk_l2norm, PREC=prec, **_kw(cfg.fwd_prep))

    states = torch.empty(NC, H, K, V, dtype=f32, device=dev)
    final_state = torch.empty(N, H, K, V, dtype=f32, device=dev)
    h0 = initial_state if initial_state is not None else final_state
    _kern._state_pass_kernel[(N, H, triton.cdiv(V, cfg.BV_PASS))](
        mn, states, h0, final_state, offs, T, H=H, K=K, V=V, BT=cfg.BT, BV=cfg.BV_PASS, REVERSE=False,
        HAS_X0=initial_state is not None, IS_VARLEN=varlen, PREC=prec, num_warps=cfg.num_warps_pass)

    o = torch.empty(B, T, H, V, dtype=v.dtype, device=dev)
    _kern._fwd_out_kernel[(NC, H, triton.cdiv(V, cfg.BV))](
        q, k, v, g, beta, tinv, o, states, spans, T, scale, H=H, K=K, V=V, BT=cfg.BT, BC=cfg.BC,
        BV=cfg.BV, IS_VARLEN=varlen, NORM_QK=use_qk_l2norm, PREC=prec, **_kw(cfg.fwd_out))
    return o, final_state, states, tinv


def _backward(q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, scale, use_qk_l2norm):
    B, T, H, K, V, N, cfg, NC = _common(q, v, cu_seqlens)
    dev = q.device
    varlen = cu_seqlens is not None
    spans, offs = _tables(cu_seqlens, NC, cfg.BT, dev)
    prec = _prec(q.dtype)
    f32 = torch.float32

    mr = torch.empty(NC, H, K, K + V, dtype=f32, device=dev)
    _kern._bwd_prep_kernel[(NC, H, triton.cdiv(K + V, cfg.BZ))](
        q, k, g, beta, tinv, do, mr, spans, T, scale, H=H, K=K, V=V, BT=cfg.BT, BC=cfg.BC,
        BZ=cfg.BZ, IS_VARLEN=varlen, NORM_QK=use_qk_l2norm, PREC=prec, **_kw(cfg.bwd_prep))

    dstates = torch.empty(NC, H, K, V, dtype=f32, device=dev)
    dh0 = torch.empty(N, H, K, V, dtype=f32, device=dev)
    _kern._state_pass_kernel[(N, H, triton.cdiv(V, cfg.BV_PASS))](
        mr, dstates, dht if dht is not None else dh0, dh0, offs, T, H=H, K=K, V=V, BT=cfg.BT,
        BV=cfg.BV_PASS, REVERSE=True, HAS_X0=dht is not None, IS_VARLEN=varlen, PREC=prec,
        num_warps=cfg.num_warps_pass)

    NV = triton.cdiv(V, cfg.BV)
    NS = cfg.BT // cfg.BC
    scratch = torch.empty(NC, H, NV, NS, K, cfg.BV, dtype=f32, device=dev)
    # with several value blocks, dq/dk/dg/dβ are fp32 partial sums, one slab per block
    part_dtype = f32 if NV > 1 else None
    dq = torch.empty(NV, B, T, H, K, dtype=part_dtype or q.dtype, device=dev)
    dk = torch.empty(NV, B, T, H, K, dtype=part_dtype or k.dtype, device=dev)
    dg = torch.empty(NV, B, T, H, dtype=part_dtype or g.dtype, device=dev)
    db = torch.empty(NV, B, T, H, dtype=part_dtype or beta.dtype, device=dev)
    dv = torch.empty(B, T, H, V, dtype=v.dtype, device=dev)
    _kern._bwd_local_kernel[(NC, H, NV)](
        q, k, v, g, beta, tinv, do, states, dstates, scratch, dq, dk, dv, dg, db, spans, T, scale,
        B * T * H * K, B * T * H, H=H, K=K, V=V, BT=cfg.BT, BC=cfg.BC, BV=cfg.BV,
        NV=NV, NS=NS, IS_VARLEN=varlen, NORM_QK=use_qk_l2norm, PREC=prec, **_kw(cfg.bwd_local))
    if NV > 1:
        dq, dk = dq.sum(0).to(q.dtype), dk.sum(0).to(k.dtype)
        dg, db = dg.sum(0).to(g.dtype), db.sum(0).to(beta.dtype)
    else:
        dq, dk, dg, db = dq[0], dk[0], dg[0], db[0]
    return dq, dk, dv, dg, db, dh0


# ---------------------------------------------------------------------------------------------
# torch.library registration
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("hymo_kernels::gdn_chunk_fwd", mutates_args=())
def gdn_chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (o, final_state, and for the backward: chunk start states, sub-chunk inverses)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    return _forward(q, k, v, g, beta, h0, cu_seqlens, scale, use_qk_l2norm)


@gdn_chunk_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm):
    B, T, H, K, V, N, cfg, NC = _common(q, v, cu_seqlens)
    return (
        v.new_empty(B, T, H, V),
        q.new_empty(N, H, K, V, dtype=torch.float32),
        q.new_empty(NC, H, K, V, dtype=torch.float32),
        q.new_empty(B, T, H, cfg.BC, dtype=torch.float32),
    )


@torch.library.custom_op("hymo_kernels::gdn_chunk_bwd", mutates_args=())
def gdn_chunk_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    states: torch.Tensor,
    tinv: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv, dg, dbeta, dh0); dh0 is computed whether or not h0 was given."""
    # gradients of a .sum() arrive as stride-0 expands
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None
    return _backward(q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, scale, use_qk_l2norm)


@gdn_chunk_bwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, scale, use_qk_l2norm):
    B, T, H, K, V, N, cfg, NC = _common(q, v, cu_seqlens)
    return (
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
        torch.empty_like(beta), q.new_empty(N, H, K, V, dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, output[2], output[3])
    ctx.scale = scale
    ctx.use_qk_l2norm = use_qk_l2norm


def _autograd_backward(ctx, do, dht, _dstates, _dtinv):
    q, k, v, g, beta, initial_state, cu_seqlens, states, tinv = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    dq, dk, dv, dg, db, dh0 = gdn_chunk_bwd(
        q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, ctx.scale, ctx.use_qk_l2norm)
    return dq, dk, dv, dg, db, (dh0 if initial_state is not None else None), None, None, None


gdn_chunk_fwd.register_autograd(_autograd_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------------


def _check_runnable(q: torch.Tensor) -> None:
    if _kern is None:
        raise RuntimeError(f"the Triton GDN backend needs Triton, which failed to import ({_TRITON_ERROR!r}); {_HINT}")
    if q.device.type != "cuda" and not _INTERPRET:
        raise RuntimeError(
            f"the Triton GDN backend needs CUDA tensors (got {q.device.type}); {_HINT}, "
            "or set TRITON_INTERPRET=1 before importing hymo_kernels to run the kernels in "
            "Triton's (slow) CPU interpreter")


def _check_shapes_traced(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    """Shape-only validation while torch.compile traces (cu_seqlens values are not readable)."""
    B, T, H, K = q.shape
    if k.shape != q.shape or v.shape[:3] != (B, T, H) or g.shape != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError("expected q, k [B, T, H, K], v [B, T, H, V], g and beta [B, T, H]")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into B = 1, got B = {B}")
    N = cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape != (N, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, v.shape[-1])}")


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunked Triton kernels with a hand-written backward.

    Args:
        q, k: [B, T, H, K] read and write keys, bf16/fp16/fp32 (K and V powers of two, 16..256).
        v: [B, T, H, V] values.
        g: [B, T, H] log decay (≤ 0).
        beta: [B, T, H] write strength in (0, 1).
        scale: multiplies q.
            Default: K ** -0.5.
        initial_state: [N, H, K, V] state before the first token of each sequence (fp32 math).
            Default: None (zeros).
        output_final_state: also return the [N, H, K, V] fp32 state after each sequence.
            Default: False.
        cu_seqlens: [N + 1] cumulative document lengths of a packed batch (B must be 1).
            Default: None.
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6) inside the kernels.
            Default: False.

    Returns:
        o: [B, T, H, V] in v's dtype; final_state: [N, H, K, V] fp32, or None.
    """
    _check_runnable(q)
    if cu_seqlens is not None and torch.compiler.is_compiling():
        _check_shapes_traced(q, k, v, g, beta, initial_state, cu_seqlens)
    else:
        check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    K, V = q.shape[-1], v.shape[-1]
    for name, d in (("K", K), ("V", V)):
        if d not in (16, 32, 64, 128, 256):
            raise ValueError(f"{name} = {d}: the Triton GDN kernels need a power of two in 16..256")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {q.dtype}: use float32, bfloat16 or float16")
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32)
    scale = K**-0.5 if scale is None else float(scale)
    o, final_state, _, _ = gdn_chunk_fwd(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel)
    return o, (final_state if output_final_state else None)


__all__ = ["Config", "KernelCfg", "TUNING", "chunk_gated_delta_rule", "gdn_chunk_bwd", "gdn_chunk_fwd", "get_config"]
