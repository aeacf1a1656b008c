"""NorMuon's passes over a batch of same-shape matrices, one Triton launch each
(hymo_kernels.normuon.fused_torch is the reference and says what each pass computes).

Why: the PyTorch step makes ~15 passes over the update besides the orthogonalisation's GEMMs
(the momentum, the Nesterov input, the stack and the cast; the neuron norm; the rescale, the
cautious decay and the update on a stacked copy of the weights, then the copy back): ~140
bytes per parameter. These read and write each tensor once where it lives: the gradient and
the momentum (12 bytes per parameter in fp32) into the orthogonalisation's input (2 in bf16);
its output once for the row norms and once more, with the weight (8), for the update.

The members' tensors are reached through a table of their addresses (one row per matrix of
the batch: an expert stack gives one per expert), so nothing is stacked or copied back. Each
program walks one block of rows of one matrix across all its columns, so every sum (the
Frobenius norms of the momentum pass, the row norms) is formed in one fixed order: the
results do not depend on the launch and are the same run to run.
"""

from __future__ import annotations

import contextlib
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
BLOCK_ROWS = 32  # rows of a matrix per program
BLOCK_COLS = 128  # columns per step of a program's walk along its rows

if _TRITON_ERROR is None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _lerp(a, b, w):
        # torch.lerp's formula (its two branches keep the result exact at w = 0 and w = 1)
        return tl.where(w < 0.5, a + w * (b - a), b - (b - a) * (1.0 - w))

    @triton.jit
    def _x_offsets(i, rows, cols, m, k, TRANS: tl.constexpr):
        # element [row, col] of matrix i in X: [B, m, k], or [B, k, m] when transposed
        base = i * m * k
        if TRANS:
            return base + cols[None, :].to(tl.int64) * m + rows[:, None]
        return base + rows[:, None].to(tl.int64) * k + cols[None, :]

    @triton.jit
    def _if_go(mask, go, HAS_GO: tl.constexpr):
        # a store's mask for a parameter or state: empty where the skip flag holds False
        if HAS_GO:
            mask = tl.where(tl.load(go) != 0, mask, False)
        return mask

    @triton.jit
    def _momentum_pack_kernel(g_tab, m_tab, X, partial, go, m, k, n_rb, beta1, one_minus_beta1,
                              NESTEROV: tl.constexpr, TRANS: tl.constexpr, G_DTYPE: tl.constexpr,
                              HAS_GO: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        rb = tl.program_id(1)
        g = tl.load(g_tab + i).to(tl.pointer_type(G_DTYPE))
        mo = tl.load(m_tab + i).to(tl.pointer_type(tl.float32))
        rows = rb * BR + tl.arange(0, BR)
        acc = tl.zeros([BR, BK], dtype=tl.float32)
        for c0 in range(0, k, BK):
            cols = c0 + tl.arange(0, BK)
            mask = (rows[:, None] < m) & (cols[None, :] < k)
            offs = rows[:, None].to(tl.int64) * k + cols[None, :]
            gv = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
            mv = _lerp(tl.load(mo + offs, mask=mask, other=0.0), gv, one_minus_beta1)
            tl.store(mo + offs, mv, mask=_if_go(mask, go, HAS_GO))
            u = _lerp(gv, mv, beta1) if NESTEROV else mv
            acc += u * u
            tl.store(X + _x_offsets(i, rows, cols, m, k, TRANS), u.to(X.dtype.element_ty), mask=mask)
        tl.store(partial + i * n_rb + rb, tl.sum(tl.sum(acc, 1), 0))

    @triton.jit
    def _row_sumsq_kernel(X, out, m, k, TRANS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BR + tl.arange(0, BR)
        acc = tl.zeros([BR, BK], dtype=tl.float32)
        for c0 in range(0, k, BK):
            cols = c0 + tl.arange(0, BK)
            mask = (rows[:, None] < m) & (cols[None, :] < k)
            o = tl.load(X + _x_offsets(i, rows, cols, m, k, TRANS), mask=mask, other=0.0).to(tl.float32)
            acc += o * o
        tl.store(out + i * m + rows, tl.sum(acc, 1), mask=rows < m)

    @triton.jit
    def _neuron_factor_kernel(rowsq, v_tab, factor, go, m, inv_cols, one_minus_beta2, eps, HAS_GO: tl.constexpr,
                              BM: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, BM)
        mask = rows < m
        v_ptr = tl.load(v_tab + i).to(tl.pointer_type(tl.float32))
        r = tl.load(rowsq + i * m + rows, mask=mask, other=0.0)
        v = _lerp(tl.load(v_ptr + rows, mask=mask, other=0.0), r * inv_cols, one_minus_beta2)
        tl.store(v_ptr + rows, v, mask=_if_go(mask, go, HAS_GO))
        d = tl.sqrt(v) + eps
        ratio = tl.sqrt(tl.sum(r, 0) / tl.maximum(tl.sum(tl.where(mask, r / (d * d), 0.0), 0), 1e-30))
        tl.store(factor + i * m + rows, ratio / d, mask=mask)

    @triton.jit
    def _apply_kernel(X, factor, w_tab, lr_s, lr_wd, go, m, k, HAS_FACTOR: tl.constexpr, APPLY_WD: tl.constexpr,
                      CAUTIOUS: tl.constexpr, TRANS: tl.constexpr, W_DTYPE: tl.constexpr, HAS_GO: tl.constexpr,
                      BR: tl.constexpr, BK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BR + tl.arange(0, BR)
        w = tl.load(w_tab + i).to(tl.pointer_type(W_DTYPE))
        s = tl.load(lr_s)
        if HAS_FACTOR:
            f = tl.load(factor + i * m + rows, mask=rows < m, other=0.0)
        if APPLY_WD:
            wd = tl.load(lr_wd)
        for c0 in range(0, k, BK):
            cols = c0 + tl.arange(0, BK)
            mask = (rows[:, None] < m) & (cols[None, :] < k)
            u = tl.load(X + _x_offsets(i, rows, cols, m, k, TRANS), mask=mask, other=0.0).to(tl.float32)
            if HAS_FACTOR:
                u = u * f[:, None]
            offs = rows[:, None].to(tl.int64) * k + cols[None, :]
            wv = tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
            delta = u * s
            if APPLY_WD:
                decay = wv * wd
                if CAUTIOUS:
                    decay = tl.where(u * wv >= 0, decay, 0.0)
                delta += decay
            # W − delta with delta rounded to W's dtype first, as W.sub_(delta.to(W.dtype))
            tl.store(w + offs, (wv - delta.to(W_DTYPE).to(tl.float32)).to(W_DTYPE), mask=_if_go(mask, go, HAS_GO))


def _check(name: str, device: torch.device) -> None:
    why = unavailable_reason(device.type, _TRITON_ERROR, _INTERPRET)
    if why is not None:
        raise RuntimeError(f"hymo_kernels.normuon.{name} {why}")


def address_table(members: list[torch.Tensor], m: int, k: int, device: torch.device,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """[B] int64 on ``device``: the address of every [m, k] matrix of the members (an [c, m, k]
    member gives c), in member order. Each member must be contiguous. ``out``: an earlier table
    of the same length, rewritten in place (a CUDA graph that reads it then reads the new
    addresses) and returned."""
    ptrs = []
    for t in members:
        if not t.is_contiguous():
            raise ValueError(f"hymo_kernels.normuon: a member of shape {tuple(t.shape)} is not contiguous")
        if t.numel() % (m * k):
            raise ValueError(f"hymo_kernels.normuon: a member of shape {tuple(t.shape)} is not [.., {m}, {k}]")
        step = m * k * t.element_size()
        ptrs += [t.data_ptr() + j * step for j in range(t.numel() // (m * k))]
    host = torch.tensor(ptrs, dtype=torch.int64, pin_memory=device.type == "cuda")
    if out is None:
        return host.to(device, non_blocking=True)
    if out.shape != host.shape or out.dtype != torch.int64 or out.device != device:
        raise ValueError(f"hymo_kernels.normuon: a table of {len(ptrs)} addresses on {device} cannot be rewritten into "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out.copy_(host, non_blocking=True)


def _reached(tensors):
    """In the interpreter, the tensors the launch reaches through its address table are in bounds."""
    if _INTERPRET:
        from ..gdn.interpret_bounds import indirect

        return indirect(tensors)
    return contextlib.nullcontext()


def _flag(go: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    """The skip flag the kernels load: a 0-d bool on ``other``'s device (``other`` stands in for
    the unused pointer when there is none)."""
    if go is None:
        return other
    if go.numel() != 1 or go.dtype != torch.bool or go.device != other.device:
        raise TypeError(f"hymo_kernels.normuon: go must be a 0-d bool tensor on {other.device}, got "
                        f"{tuple(go.shape)} {go.dtype} on {go.device}")
    return go


def _shape(X: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    if X.ndim != 3 or not X.is_contiguous() or X.dtype not in _TL_DTYPES:
        raise ValueError(f"hymo_kernels.normuon: X must be a contiguous [B, rows, cols] tensor in fp32, bf16 or fp16, "
                         f"got {tuple(X.shape)} {X.dtype}")
    B, a, b = X.shape
    return (B, b, a) if transposed else (B, a, b)


def momentum_pack_(grads: list[torch.Tensor], moms: list[torch.Tensor], X: torch.Tensor, beta1: float,
                   nesterov: bool, transposed: bool, tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                   go: torch.Tensor | None = None) -> torch.Tensor:
    """As fused_torch.momentum_pack_, in one launch. ``tables``: the gradients' and momentum
    buffers' address tables when the caller keeps them (else built here); ``go``: as there."""
    _check("momentum_pack_", X.device)
    B, m, k = _shape(X, transposed)
    gdt = grads[0].dtype
    if any(g.dtype != gdt for g in grads) or gdt not in _TL_DTYPES or any(mo.dtype != torch.float32 for mo in moms):
        raise TypeError("hymo_kernels.normuon.momentum_pack_: gradients of one dtype (fp32, bf16 or fp16) "
                        "and fp32 momentum buffers")
    g_tab, m_tab = tables if tables is not None else (address_table(grads, m, k, X.device),
                                                       address_table(moms, m, k, X.device))
    n_rb = triton.cdiv(m, BLOCK_ROWS)
    partial = torch.empty(B, n_rb, dtype=torch.float32, device=X.device)
    with _reached(list(grads) + list(moms)):
        _momentum_pack_kernel[(B, n_rb)](g_tab, m_tab, X, partial, _flag(go, X), m, k, n_rb, float(beta1),
                                         1.0 - beta1, NESTEROV=nesterov, TRANS=transposed, G_DTYPE=_TL_DTYPES[gdt],
                                         HAS_GO=go is not None, BR=BLOCK_ROWS, BK=BLOCK_COLS, num_warps=4)
    return partial.sum(dim=1)


def row_sumsq(X: torch.Tensor, transposed: bool) -> torch.Tensor:
    """As fused_torch.row_sumsq, in one launch."""
    _check("row_sumsq", X.device)
    B, m, k = _shape(X, transposed)
    out = torch.empty(B, m, dtype=torch.float32, device=X.device)
    _row_sumsq_kernel[(B, triton.cdiv(m, BLOCK_ROWS))](X, out, m, k, TRANS=transposed, BR=BLOCK_ROWS,
                                                       BK=BLOCK_COLS, num_warps=4)
    return out


def neuron_factor_(rowsq: torch.Tensor, vs: list[torch.Tensor], beta2: float, eps: float, cols: int,
                   v_table: torch.Tensor | None = None, go: torch.Tensor | None = None) -> torch.Tensor:
    """As fused_torch.neuron_factor_, in one launch (one program per matrix). ``v_table``: the
    second moments' address table when the caller keeps it; ``go``: as there."""
    _check("neuron_factor_", rowsq.device)
    if rowsq.ndim != 2 or not rowsq.is_contiguous() or rowsq.dtype != torch.float32:
        raise ValueError(f"hymo_kernels.normuon.neuron_factor_: rowsq must be contiguous fp32 [B, m], got "
                         f"{tuple(rowsq.shape)} {rowsq.dtype}")
    if any(v.dtype != torch.float32 for v in vs):
        raise TypeError("hymo_kernels.normuon.neuron_factor_: fp32 second moments")
    B, m = rowsq.shape
    v_tab = v_table if v_table is not None else address_table(vs, 1, m, rowsq.device)
    factor = torch.empty(B, m, dtype=torch.float32, device=rowsq.device)
    with _reached(vs):
        _neuron_factor_kernel[(B,)](rowsq, v_tab, factor, _flag(go, rowsq), m, 1.0 / cols, 1.0 - beta2, float(eps),
                                    HAS_GO=go is not None, BM=triton.next_power_of_2(m), num_warps=4)
    return factor


def apply_update_(X: torch.Tensor, factor: torch.Tensor | None, params: list[torch.Tensor], lr_s: torch.Tensor,
                  lr_wd: torch.Tensor, apply_wd: bool, cautious_wd: bool, transposed: bool,
                  w_table: torch.Tensor | None = None, go: torch.Tensor | None = None) -> None:
    """As fused_torch.apply_update_, in one launch. ``lr_s``, ``lr_wd``: 0-d fp32 tensors on X's
    device (read by the kernel, so a CUDA graph replays whatever they hold); ``factor``: [B, m]
    fp32 or None. ``w_table``: the weights' address table when the caller keeps it; ``go``: as
    there."""
    _check("apply_update_", X.device)
    B, m, k = _shape(X, transposed)
    wdt = params[0].dtype
    if any(w.dtype != wdt for w in params) or wdt not in _TL_DTYPES:
        raise TypeError("hymo_kernels.normuon.apply_update_: weights of one dtype (fp32, bf16 or fp16)")
    for name, t in (("lr_s", lr_s), ("lr_wd", lr_wd)):
        if t.numel() != 1 or t.dtype != torch.float32 or t.device != X.device:
            raise TypeError(f"hymo_kernels.normuon.apply_update_: {name} must be a 0-d fp32 tensor on {X.device}")
    if factor is not None and (factor.shape != (B, m) or factor.dtype != torch.float32 or not factor.is_contiguous()):
        raise ValueError(f"hymo_kernels.normuon.apply_update_: factor must be contiguous fp32 [{B}, {m}]")
    w_tab = w_table if w_table is not None else address_table(params, m, k, X.device)
    with _reached(params):
        _apply_kernel[(B, triton.cdiv(m, BLOCK_ROWS))](
            X, factor if factor is not None else X, w_tab, lr_s, lr_wd, _flag(go, X), m, k,
            HAS_FACTOR=factor is not None, APPLY_WD=apply_wd, CAUTIOUS=cautious_wd, TRANS=transposed,
            W_DTYPE=_TL_DTYPES[wdt], HAS_GO=go is not None, BR=BLOCK_ROWS, BK=BLOCK_COLS, num_warps=4)
