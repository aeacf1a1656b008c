"""The PyTorch reference of NorMuon's four passes over a batch of B same-shape [m, k] matrices.

The members of a batch are tensors of shape [m, k] or [c, m, k] (c matrices each, an expert
stack); in member order they are the batch's B matrices. ``X`` is the batch in the
orthogonalisation's orientation, [B, m, k] or, ``transposed``, [B, k, m] (the iteration runs
on the wide orientation).

1. ``momentum_pack_``: M ← lerp(M, G, 1 − β1); U = lerp(G, M, β1) (Nesterov) or M; X ← U in
   X's dtype; the squared Frobenius norm of each U (fp32, before the cast).
2. ``row_sumsq``: Σ_j O_ij² per output row i of each matrix, O = X (or Xᵀ).
3. ``neuron_factor_``: from those row sums r (O has k columns), the neuron second moments
   V ← lerp(V, r / k, 1 − β2) in place, d = √V + eps, and each row's factor
   f = √(Σ r / max(Σ r / d², 1e-30)) / d: Ô = O · f is O / d rescaled to ‖O‖_F (an all-zero O
   stays zero).
4. ``apply_update_``: Ô = O · f (one factor per row, or none); W ← W − lr·wd·[Ô ⊙ W ≥ 0]·W
   (or without the mask, or no decay) − lr·s·Ô.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _matrices(members: list[Tensor], m: int, k: int) -> list[Tensor]:
    return [x.reshape(-1, m, k) for x in members]


def _write(dst: Tensor, src: Tensor, go: Tensor | None) -> None:
    dst.copy_(src if go is None else torch.where(go, src, dst))


def momentum_pack_(grads: list[Tensor], moms: list[Tensor], X: Tensor, beta1: float, nesterov: bool,
                   transposed: bool, go: Tensor | None = None) -> Tensor:
    """Updates the momentum buffers in place, writes U into X; returns ‖U‖_F² per matrix [B] fp32.
    ``go`` (each pass): a 0-d bool; where it holds False, no parameter or state is written (X and
    the returned values are computed all the same)."""
    m, k = (X.shape[-1], X.shape[-2]) if transposed else X.shape[-2:]
    us = []
    for g, mo in zip(_matrices(grads, m, k), _matrices(moms, m, k)):
        g = g.to(mo.dtype)
        new = mo.lerp(g, 1.0 - beta1)
        _write(mo, new, go)
        us.append(g.lerp(new, beta1) if nesterov else new)
    U = torch.cat(us)
    X.copy_(U.mT if transposed else U)
    return U.float().square().sum(dim=(-2, -1))


def row_sumsq(X: Tensor, transposed: bool) -> Tensor:
    """Σ over each output row of O², [B, m] fp32 (O = Xᵀ per matrix when ``transposed``)."""
    return X.float().square().sum(dim=-2 if transposed else -1)


def neuron_factor_(rowsq: Tensor, vs: list[Tensor], beta2: float, eps: float, cols: int,
                   go: Tensor | None = None) -> Tensor:
    """Updates the members' neuron second moments ([m] or [c, m], fp32) in place (not where
    ``go`` holds False); returns the per-row factors [B, m] fp32."""
    m = rowsq.shape[-1]
    V = torch.cat([v.reshape(-1, m) for v in vs])
    V = V.lerp(rowsq / cols, 1.0 - beta2)
    start = 0
    for v in vs:
        n = v.numel() // m
        _write(v, V[start:start + n].view_as(v), go)
        start += n
    d = V.sqrt() + eps
    ratio = (rowsq.sum(dim=-1) / (rowsq / d.square()).sum(dim=-1).clamp_min(1e-30)).sqrt()
    return ratio.unsqueeze(-1) / d


def apply_update_(X: Tensor, factor: Tensor | None, params: list[Tensor], lr_s: Tensor, lr_wd: Tensor,
                  apply_wd: bool, cautious_wd: bool, transposed: bool, go: Tensor | None = None) -> None:
    """W of every member updated in place from O (fp32 maths, one rounding to W's dtype); not
    where ``go`` holds False."""
    O = X.float().mT if transposed else X.float()
    m, k = O.shape[-2:]
    U = O * factor.unsqueeze(-1) if factor is not None else O
    start = 0
    for w in params:
        W = w.view(-1, m, k)
        n = W.shape[0]
        Ub = U[start:start + n]
        start += n
        Wf = W.float()
        delta = Ub * lr_s
        if apply_wd:
            decay = Wf * lr_wd
            if cautious_wd:
                decay = decay * (Ub * Wf >= 0)
            delta = delta + decay
        _write(W, W - delta.to(W.dtype), go)
