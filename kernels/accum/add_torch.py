"""The reference of hymo_kernels.accum.add: sums[i] += grads[i], one PyTorch add per pair (what
FSDP2's gradient accumulation runs)."""

from __future__ import annotations

import torch


def accumulate_(sums: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """sums[i] += grads[i] for every i, in place (fp32 sums, gradients of any float dtype)."""
    if len(sums) != len(grads):
        raise ValueError(f"accumulate_: {len(sums)} sums and {len(grads)} gradients")
    for s, g in zip(sums, grads):
        s += g
