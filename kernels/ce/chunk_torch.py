"""The per-chunk cross-entropy in PyTorch: the reference of ``chunk.py``'s kernel."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # TorchTitan's (a target that counts for nothing)


def ce_chunk(logits: torch.Tensor, targets: torch.Tensor, want_grad: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sum of the chunk's CE over targets != IGNORE_INDEX as fp32, d sum / d logits in logits'
    dtype or None); logits [c, V], targets [c]."""
    x = logits.float()
    valid = targets != IGNORE_INDEX
    t = torch.where(valid, targets, 0)[:, None]
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    loss = torch.where(valid, (lse - x.gather(1, t)).squeeze(1), 0.0).sum()
    if not want_grad:
        return loss, None
    # in place: eager, one fp32 [c, V] buffer besides x
    grad = x.sub_(lse).exp_()
    grad.scatter_add_(1, t, torch.full_like(t, -1, dtype=grad.dtype))
    return loss, grad.mul_(valid[:, None]).to(logits.dtype)
