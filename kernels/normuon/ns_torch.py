"""The PyTorch reference of the orthogonalisation's iteration as hymo_kernels.normuon.ns runs it.

X is a batch [B, m, n] (m ≤ n) in the iteration's dtype, ``inv`` [B] fp32 the inverse of each
matrix's starting scale (1 / (‖U‖_F · margin + eps)); ``coeffs`` one (a, b, c) per step. Each
step is three products, each rounded once to X's dtype from fp32 (fp64 for fp64 X, an exact reference):

1. A = s² · X Xᵀ
2. B = c · A A + b · A
3. X ← s · (B X) + a · s · X

with s = ``inv`` in the first step and 1 after it: the first step iterates on X · inv without
that product ever being formed (the scale rides on the products' fp32 results).
"""

from __future__ import annotations

import torch
from torch import Tensor


def iterate(X: Tensor, inv: Tensor, coeffs: list[tuple[float, float, float]]) -> Tensor:
    """The iteration from the unscaled X; returns a new [B, m, n] tensor of X's dtype."""
    dt = X.dtype
    acc = torch.float64 if dt == torch.float64 else torch.float32  # fp64 for an exact reference
    s = inv.to(acc).view(-1, 1, 1)
    for a, b, c in coeffs:
        Xf = X.to(acc)
        A = (s * s * (Xf @ Xf.mT)).to(dt).to(acc)
        B = (c * (A @ A) + b * A).to(dt).to(acc)
        X = (s * (B @ Xf) + (a * s) * Xf).to(dt)
        s = torch.ones_like(s)
    return X
