"""One recurrent Gated DeltaNet step in plain PyTorch: the decode path's reference (and its CPU path).

Decoding feeds one token per sequence at a time, so instead of a chunked pass the state is
carried explicitly. Same math and layout as ``naive.py`` (whose inner loop this is, batched over
sequences); per head, with state h ∈ R^{K×V} (h = Sᵀ of DESIGN.md §2)::

    h ← exp(g) · h
    h ← h + k (β (v − hᵀ k))ᵀ
    o = hᵀ (scale · q)

A chunked prefill (``chunk_torch.py`` or the Triton kernel with ``output_final_state=True``)
hands its final state to the first step; the steps after it equal the recurrence over the whole
sequence (tests/model/test_decode.py checks it token by token against ``naive.py``).
"""

from __future__ import annotations

import torch


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch of sequences.

    Args:
        q, k: [B, H, K] read and write keys (L2-normalised by the caller).
        v: [B, H, V] values.
        g: [B, H] log decay (≤ 0).
        beta: [B, H] write strength in (0, 1).
        state: [B, H, K, V] state before this token (float32; float64 for float64 inputs).
        scale: multiplies q. Default: K ** -0.5.

    Returns:
        o: [B, H, V] in v's dtype; the new state [B, H, K, V] (float32, float64 for float64
        inputs). The input state is not modified.
    """
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, H, K = q.shape
    V = v.shape[-1]
    if v.shape != (B, H, V):
        raise ValueError(f"v must be [B, H, V] with B, H = {B, H}, got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, H):
            raise ValueError(f"{name} must be [B, H] = {(B, H)}, got {tuple(x.shape)}")
    if state.shape != (B, H, K, V):
        raise ValueError(f"state must be [B, H, K, V] = {(B, H, K, V)}, got {tuple(state.shape)}")
    scale = K**-0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = v.dtype
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    h = state.to(acc) * g.exp()[..., None, None]
    v_new = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", h, k))
    h = h + k[..., :, None] * v_new[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", h, q * scale)
    return o.to(out_dtype), h
