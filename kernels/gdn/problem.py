"""One call's launch geometry (``Problem``) and the precisions and dtypes every stage's launcher
derives from its ``Config``. Host side only: no Triton import."""

from __future__ import annotations

import dataclasses

import torch

from .config import BWD_PATHS, Config, get_config


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a @triton.jit function: ~6 µs of host time per call from Python
    return -(-a // b)


def _num_chunks(B: int, T: int, N: int, varlen: bool, BT: int):
    """Chunks the kernels index (static: an upper bound for packed batches)."""
    return (T + BT - 1) // BT + N if varlen else B * ((T + BT - 1) // BT)


# The last packed batch's tables: every GDN layer of a forward, and their backwards, get the
# same cu_seqlens tensor, so the ~20 small device ops that build the tables (host time on a
# host-bound forward) run once per batch instead of once per layer and pass. The entry holds
# the tensor itself, so its storage cannot be reused while the entry matches it by identity.
# Writes that bypass the version counter (.data, DLPack, a kernel) are not seen, and a CUDA
# graph captured on a hit records no table build: neither happens in HyMo's paths.
_last_tables: list = [None]


def _varlen_tables(cu_seqlens: torch.Tensor, NC: int, BT: int):
    """Per chunk (first token, end of its sequence) and per sequence its first chunk,
    computed on the device without a host sync; chunks past the real count get (0, 0).
    Reused while the same cu_seqlens tensor (unmodified) comes back with the same NC and BT."""
    if cu_seqlens.is_inference():  # no version counter to tell an in-place change
        return _build_varlen_tables(cu_seqlens, NC, BT)
    key = (cu_seqlens._version, NC, BT, cu_seqlens.device)
    last = _last_tables[0]
    if last is not None and last[0] is cu_seqlens and last[1] == key:
        return last[2]
    tables = _build_varlen_tables(cu_seqlens, NC, BT)
    _last_tables[0] = (cu_seqlens, key, tables)
    return tables


def _build_varlen_tables(cu_seqlens: torch.Tensor, NC: int, BT: int):
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


def _common(q, v, cu_seqlens):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # head dims are compile-time constants of the kernels: specialise on them when tracing
    # (and on whether N·H is small, which picks the chunk size)
    cfg = get_config(int(K), int(V), 256 if N * H >= 128 else 1)
    NC = _num_chunks(B, T, N, cu_seqlens is not None, cfg.BT)
    return B, T, H, K, V, N, cfg, NC


@dataclasses.dataclass
class Problem:
    """One call's inputs and launch geometry: what every kernel launcher takes. The
    benchmark's tuner builds one per (shape, BT) and swaps `cfg` per kernel variant."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu_seqlens: torch.Tensor | None
    scale: float
    norm: bool
    cfg: Config
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    NC: int
    spans: torch.Tensor
    offs: torch.Tensor
    # the γβ pack [NC, H, BT/BC, 2, BC] fp32: γ (in-sub-chunk cumsum of g) and β per sub-chunk,
    # contiguous; written by _wy_inverse (forward) and _bwd_prep (backward) for the kernels after
    # them, which would otherwise load g and β as 16 strided values each
    gbp: torch.Tensor | None = None


def _overridden(cfg: Config, dot_bf16: bool | None, t_bf16: bool | None, bwd_path: str | None = None) -> Config:
    """cfg with dot_bf16, t_bf16 and the backward path (BWD_PATHS) replaced where given (not
    None): the op's arguments."""
    given = {n: x for n, x in (("dot_bf16", dot_bf16), ("t_bf16", t_bf16)) if x is not None}
    if bwd_path is not None and bwd_path not in BWD_PATHS:
        raise ValueError(f"unknown bwd_path {bwd_path!r}; choose one of {sorted(BWD_PATHS)} or None (the table's)")
    if bwd_path is not None:
        given.update(BWD_PATHS[bwd_path])
    return dataclasses.replace(cfg, **given) if given else cfg


def make_problem(q, k, v, g, beta, cu_seqlens, scale, norm, cfg: Config | None = None,
                 dot_bf16: bool | None = None, t_bf16: bool | None = None, bwd_path: str | None = None) -> Problem:
    """dot_bf16, t_bf16 and bwd_path (not None) override the config's choices (the op's arguments)."""
    B, T, H, K, V, N, cfg0, _ = _common(q, v, cu_seqlens)
    cfg = _overridden(cfg or cfg0, dot_bf16, t_bf16, bwd_path)
    NC = _num_chunks(B, T, N, cu_seqlens is not None, cfg.BT)
    if cu_seqlens is None:
        spans = offs = torch.empty(2, dtype=torch.int32, device=q.device)
    else:
        spans, offs = _varlen_tables(cu_seqlens, NC, cfg.BT)
    gbp = torch.empty(NC, H, cfg.BT // cfg.BC, 2, cfg.BC, dtype=torch.float32, device=q.device)
    return Problem(q, k, v, g, beta, cu_seqlens, scale, norm, cfg, B, T, H, K, V, N, NC, spans, offs, gbp)


def _kw(kc) -> dict:
    """A KernelCfg as launch keywords (maxnreg only when set)."""
    kw = dict(num_warps=kc.num_warps, num_stages=kc.num_stages)
    if kc.maxnreg:
        kw["maxnreg"] = kc.maxnreg
    return kw


def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs: three-pass tf32 (about fp32 accuracy on the tensor cores; a test/debug mode);
    # 16-bit inputs: tf32 on the fp32 intermediates (bf16 values are exact in tf32)
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _tprec(cfg: Config, dtype: torch.dtype) -> str:
    # the dots with T = (I + A)⁻¹: its entries are sums that cancel when keys collapse (see
    # wy._unit_lower_inverse), so they are rounded to bf16 only with Config.t_bf16
    return "bf16" if cfg.t_bf16 and cfg.dot_bf16 and dtype == torch.bfloat16 else _prec(dtype)


def saved_t_dtype(cfg: Config, dtype: torch.dtype) -> torch.dtype:
    """dtype of the saved T for inputs of this dtype: bf16 where every dot with it rounds it to
    bf16 anyway (t_bf16), which halves the bytes the four kernels reading it load; else fp32."""
    return torch.bfloat16 if _tprec(cfg, dtype) == "bf16" else torch.float32


def saved_states_dtype(cfg: Config, dtype: torch.dtype) -> torch.dtype:
    """dtype of the saved start states for inputs of this dtype: bf16 with Config.states_bf16 where
    every dot on them rounds them to bf16 (bf16 dots); else fp32."""
    bf16 = cfg.states_bf16 and cfg.dot_bf16 and dtype == torch.bfloat16
    return torch.bfloat16 if bf16 else torch.float32


def _geom(p: Problem) -> dict:
    # PREC: the dots on inputs, states and their gradients; TPREC: those with T
    prec = "bf16" if p.cfg.dot_bf16 and p.q.dtype == torch.bfloat16 else _prec(p.q.dtype)
    return dict(H=p.H, K=p.K, BT=p.cfg.BT, BC=p.cfg.BC, IS_VARLEN=p.cu_seqlens is not None,
                NORM_QK=p.norm, PREC=prec, TPREC=_tprec(p.cfg, p.q.dtype))
