"""The per-chunk cross-entropy as one Triton kernel (the reference: ``chunk_torch.ce_chunk``).

One program per row of logits: its log-sum-exp, its loss, and with ``want_grad`` its gradient
softmax − one-hot (zero on an ignored target), in fp32 and stored in the logits' dtype. A row of
up to ``ROW_MAX`` entries is loaded once and kept in registers, so the logits are read once and
the gradient written once, the least the work can move; longer rows are read twice (an online
log-sum-exp over tiles, then the gradient tile by tile). Inductor's code for the reference reads
the logits in two kernels, a reduction and then a pointwise one.

No silent fallback: on CPU tensors outside Triton's interpreter (``TRITON_INTERPRET=1`` set
before this module is imported), or without Triton, the call raises.
"""

from __future__ import annotations

import os

import torch

from ..runtime import unavailable_reason
from .chunk_torch import IGNORE_INDEX

try:
    import triton
    import triton.language as tl

    _TRITON_ERROR: Exception | None = None
except Exception as e:  # noqa: BLE001 - any import failure means "no Triton kernel"
    _TRITON_ERROR = e

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

ROW_MAX = 8192  # longest row kept whole in registers (8 warps: 32 fp32 values per thread)
TILE = 4096  # the tile of a longer row
NUM_WARPS = 8

if _TRITON_ERROR is None:

    @triton.jit
    def _ce_kernel(logits, targets, loss, grad, V, stride_l, stride_g, IGNORE: tl.constexpr, BLOCK: tl.constexpr,
                   WHOLE: tl.constexpr, WANT_GRAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = tl.load(targets + row)
        valid = t != IGNORE
        tt = tl.where(valid, t, 0)
        inside = (tt >= 0) & (tt < V)
        base = logits + row * stride_l
        gbase = grad + row * stride_g
        offs = tl.arange(0, BLOCK)
        if WHOLE:
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            mx = tl.max(x, 0)
            lse = mx + tl.log(tl.sum(tl.exp(x - mx), 0))
        else:
            m_run = tl.full([], float("-inf"), tl.float32)
            s_run = tl.zeros([], tl.float32)
            for start in range(0, V, BLOCK):
                xs = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m_run, tl.max(xs, 0))
                s_run = s_run * tl.exp(m_run - m_new) + tl.sum(tl.exp(xs - m_new), 0)
                m_run = m_new
            lse = m_run + tl.log(s_run)
        xt = tl.load(base + tt, mask=inside, other=float("nan")).to(tl.float32)  # a target outside [0, V): NaN
        tl.store(loss + row, tl.where(valid, lse - xt, 0.0))
        if WANT_GRAD:
            keep = tl.where(valid, 1.0, 0.0)
            if WHOLE:
                g = tl.exp(x - lse) - tl.where(offs == tt, 1.0, 0.0)
                tl.store(gbase + offs, (g * keep).to(grad.dtype.element_ty), mask=offs < V)
            else:
                for start in range(0, V, BLOCK):
                    cols = start + offs
                    xs = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                    g = tl.exp(xs - lse) - tl.where(cols == tt, 1.0, 0.0)
                    tl.store(gbase + cols, (g * keep).to(grad.dtype.element_ty), mask=cols < V)


def unavailable(device_type: str) -> str | None:
    """Why the kernel cannot run on tensors of this device type here (None: it can)."""
    return unavailable_reason(device_type, _TRITON_ERROR, _INTERPRET)


def ce_chunk(logits: torch.Tensor, targets: torch.Tensor, want_grad: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``chunk_torch.ce_chunk`` in one kernel: (sum of the chunk's CE over targets !=
    IGNORE_INDEX as fp32, d sum / d logits in logits' dtype or None); logits [c, V], targets [c]
    integer class indices in [0, V) or IGNORE_INDEX. A target outside both makes the loss NaN
    (checked on the device: the reference's ``gather`` fails there instead), which the trainer's
    non-finite guard then reports."""
    if why := unavailable(logits.device.type):
        raise RuntimeError(f"the Triton cross-entropy kernel {why}")
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"ce_chunk: expected logits [c, V] and targets [c], got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    c, V = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format) if want_grad else loss
    if c:
        block = triton.next_power_of_2(V)
        whole = block <= ROW_MAX
        _ce_kernel[(c,)](logits, targets, loss, grad, V, logits.stride(0), grad.stride(0) if want_grad else 0,
                         IGNORE=IGNORE_INDEX, BLOCK=block if whole else TILE, WHOLE=whole, WANT_GRAD=want_grad,
                         num_warps=NUM_WARPS)
    return loss.sum(), grad if want_grad else None
