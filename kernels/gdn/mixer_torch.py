"""Pure-PyTorch references of the GDN token mixer's elementwise parts: the model's path on CPU
(the naive and torch_chunk backends) and the references of the fused Triton ops (mixer.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def short_causal_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv over time, not reaching across document starts.

    Args:
        x: [B, T, C] input.
        weight: [C, 1, W] depthwise kernel; weight[..., W-1] multiplies the current token
            (the layout of a left-padded nn.Conv1d and of fla's ShortConvolution).
        positions: [T] position of each token inside its document for packed batches
            (tap j is used only where positions >= j); None when every row is one sequence.

    Returns:
        [B, T, C] in x's dtype.
    """
    T, W = x.shape[1], weight.shape[-1]
    w = weight[:, 0, :].to(x.dtype)  # [C, W]
    out = x * w[:, W - 1]
    for j in range(1, min(W, T + 1)):
        # x[t - j], zero before the start of the row
        shifted = F.pad(x[:, : T - j], (0, 0, j, 0))
        if positions is not None:
            shifted = shifted * (positions >= j).to(x.dtype)[None, :, None]
        out = out + shifted * w[:, W - 1 - j]
    return out


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim, computed in fp32 (fla's l2norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) ⊙ weight ⊙ SiLU(gate) over the last dim (fla's FusedRMSNormGated), math in fp32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(gate.float())).to(x.dtype)


def split_qkv(qkv: torch.Tensor, head_k: int, head_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GDN mixer's q, k, v projection in one tensor qkv [..., H·(2K + V)] as views (q_in, k_in,
    v_in): [..., H·K], [..., H·K], [..., H·V], in that order."""
    H, rest = divmod(qkv.shape[-1], 2 * head_k + head_v)
    if rest or H == 0:
        raise ValueError(f"GDN q/k/v projection: width {qkv.shape[-1]} is not H·(2K + V) for K = {head_k}, "
                         f"V = {head_v}")
    return qkv.split([H * head_k, H * head_k, H * head_v], dim=-1)
