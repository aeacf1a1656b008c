"""Multi-token prediction heads (DESIGN.md §2).

Head k (1-based) maps the trunk's last hidden state h (the residual stream before the final
norm; each head brings its own RMSNorm) through RMSNorm → Linear → SiLU → Linear and then the
shared (tied) output head. At position t the main head predicts token t+1 and
head k predicts token t+1+k, so its logits line up with the labels shifted by k more:
``mtp_logits[k-1][:, :T-k]`` against ``labels[:, k:]`` (``shift_for_head``). The heads read h
and never write it, so the main head's logits do not depend on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .init import trunc_normal_


class MTPHead(nn.Module):
    """One auxiliary head up to (not including) the shared output projection."""

    def __init__(self, dim: int, inter_dim: int, norm_eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.w_in = nn.Linear(dim, inter_dim, bias=False)
        self.w_out = nn.Linear(inter_dim, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, T, dim] -> [B, T, dim] for the shared output head."""
        # SiLU between the two Linears: without it they collapse into one (seed erratum)
        return self.w_out(F.silu(self.w_in(self.norm(h))))

    @torch.no_grad()
    def init_weights(self, init_std: float, out_std: float) -> None:
        self.norm.reset_parameters()
        trunc_normal_(self.w_in.weight, mean=0.0, std=init_std)
        trunc_normal_(self.w_out.weight, mean=0.0, std=out_std)


def shift_for_head(logits: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Aligns head k's logits [B, T, V] with its targets: (logits[:, :T-k], labels[:, k:]).

    ``labels`` are the main head's labels (tokens shifted by one); k = 0 is the main head.
    """
    if k < 0 or k >= labels.shape[1]:
        raise ValueError(f"head offset k must lie in [0, T = {labels.shape[1]}), got {k}")
    T = labels.shape[1]
    return logits[:, : T - k], labels[:, k:]
