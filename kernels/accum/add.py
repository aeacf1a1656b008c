"""fp32 sums += bf16, fp16 or fp32 gradients, every pair of a list in one Triton launch.

The tensors are found through a table of their addresses: program p adds block p - first[i] of
pair i, where first holds the pairs' first blocks (a prefix sum; p finds i by binary search).
Each element's sum is the same fp32 add as ``sum += grad`` (the gradient widened to fp32, one
rounding), so the result is bitwise that of the PyTorch loop (hymo_kernels.accum.add_torch).
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
BLOCK = 4096  # elements per program
ALIGN = 16  # bytes: what the wide loads and stores ask of every address

if _TRITON_ERROR is None:
    @triton.jit
    def _accumulate_kernel(sums, grads, first, numel, n, LOG2: tl.constexpr, BLOCK: tl.constexpr,
                           GRAD_DTYPE: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        # the pair whose blocks hold pid: the last i with first[i] <= pid
        lo = pid * 0
        hi = lo + n
        for _ in tl.static_range(LOG2):
            mid = (lo + hi) // 2
            go = tl.load(first + mid) <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        s = tl.multiple_of(tl.load(sums + lo).to(tl.pointer_type(tl.float32)), 16)
        g = tl.multiple_of(tl.load(grads + lo).to(tl.pointer_type(GRAD_DTYPE)), 16)
        start = (pid - tl.load(first + lo)) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        left = tl.load(numel + lo) - start
        if left >= BLOCK:  # a whole block: no mask, so the loads and stores are 16 bytes wide
            tl.store(s + offs, tl.load(s + offs) + tl.load(g + offs).to(tl.float32))
        else:  # the pair's last block
            m = tl.arange(0, BLOCK) < left
            tl.store(s + offs, tl.load(s + offs, mask=m) + tl.load(g + offs, mask=m).to(tl.float32), mask=m)

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def pair_refused(total: torch.Tensor, grad: torch.Tensor) -> str | None:
    """Why the kernel cannot add ``grad`` into ``total`` (None: it can): it takes an fp32 sum and
    a bf16, fp16 or fp32 gradient of as many elements on the sum's device, both contiguous and
    16-byte aligned."""
    if (total.dtype != torch.float32 or grad.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or total.numel() != grad.numel() or total.device != grad.device):
        return _not_fp32_pair(total, grad, grad.dtype)
    if not (total.is_contiguous() and grad.is_contiguous()) or total.data_ptr() % ALIGN or grad.data_ptr() % ALIGN:
        return "not contiguous and 16-byte aligned (add_torch takes such pairs)"
    return None


def _not_fp32_pair(total: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype) -> str:
    return (f"not fp32 += {dtype} of one size on one device: {total.dtype} += {grad.dtype}, shapes "
            f"{tuple(total.shape)} and {tuple(grad.shape)}, on {total.device} and {grad.device}")


def accumulate_(sums: list[torch.Tensor], grads: list[torch.Tensor], *, checked: bool = False) -> None:
    """sums[i] += grads[i] for every i, in place, in one launch.

    Args:
        sums: fp32 tensors, contiguous, on one CUDA device (or any device in the interpreter).
        grads: tensors of one dtype (bf16, fp16 or fp32), each contiguous and of its sum's number of elements.
        checked: the caller has passed every pair through ``pair_refused`` (and the gradients
            share one dtype, the sums one device), so the pairs are not checked again here.
            Default: False.
    """
    if len(sums) != len(grads):
        raise ValueError(f"accumulate_: {len(sums)} sums and {len(grads)} gradients")
    if not sums:
        return
    why = unavailable_reason(sums[0].device.type, _TRITON_ERROR, _INTERPRET)
    if why is not None:
        raise RuntimeError(f"hymo_kernels.accum.accumulate_ {why}")
    dtype = grads[0].dtype
    if dtype not in _TL_DTYPES:
        raise TypeError(f"accumulate_: gradients in {dtype}: bf16, fp16 or fp32")
    for s, g in ([] if checked else zip(sums, grads)):
        same = g.dtype == dtype and s.device == sums[0].device  # one dtype, one device for the launch
        if why := (pair_refused(s, g) if same else _not_fp32_pair(s, g, dtype)):
            raise ValueError(f"accumulate_: a pair that is {why}")
    numel = [s.numel() for s in sums]
    blocks = [-(-k // BLOCK) for k in numel]
    first = [0]
    for b in blocks[:-1]:
        first.append(first[-1] + b)
    n = len(sums)
    if first[-1] + blocks[-1] == 0:  # every tensor empty: nothing to launch
        return
    table = torch.tensor([[s.data_ptr() for s in sums], [g.data_ptr() for g in grads], first, numel],
                         dtype=torch.int64, pin_memory=sums[0].is_cuda)
    table = table.to(sums[0].device, non_blocking=True)
    with _reached(sums + grads):
        _accumulate_kernel[(first[-1] + blocks[-1],)](table[0], table[1], table[2], table[3], n,
                                                     LOG2=max(1, (n - 1).bit_length()), BLOCK=BLOCK,
                                                     GRAD_DTYPE=_TL_DTYPES[dtype], num_warps=8)


def _reached(tensors):
    """In the interpreter, the tensors the launch reaches through its address table are in bounds."""
    if _INTERPRET:
        from ..gdn.interpret_bounds import indirect

        return indirect(tensors)
    return contextlib.nullcontext()
