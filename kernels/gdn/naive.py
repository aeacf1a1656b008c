"""Pure-PyTorch reference for the Gated DeltaNet recurrence (one token at a time).

Layout and argument order follow flash-linear-attention's ``chunk_gated_delta_rule`` so that
every backend (this one, the chunked torch version, the Triton kernel) is called the same way.
Per head, with state h ∈ R^{K×V} (h = Sᵀ of DESIGN.md §2)::

    h_t = exp(g_t) · h_{t-1}
    h_t = h_t + k_t (β_t (v_t − h_tᵀ k_t))ᵀ        # delta-rule write after the decay
    o_t = h_tᵀ (scale · q_t)

The math runs in float64 when the inputs are float64 and in float32 otherwise; outputs come
back in the dtype of ``v``; the final state is float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch


def check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> int:
    """Validates shapes shared by every backend and returns N, the number of sequences."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {B, T, H}, got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, H):
            raise ValueError(f"{name} must be [B, T, H] = {(B, T, H)}, got {tuple(x.shape)}")
    if cu_seqlens is None:
        n = B
    else:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B = 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor [N + 1] of cumulative lengths")
        # one device-to-host sync per call (eager calls check every layer), the details only on failure
        bad = (cu_seqlens[0] != 0) | (cu_seqlens[-1] != T) | (cu_seqlens[1:] < cu_seqlens[:-1]).any()
        if bool(bad):
            if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
                raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {cu_seqlens.tolist()}")
            raise ValueError("cu_seqlens must be non-decreasing")
        n = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (n, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = {(n, H, K, v.shape[-1])}, got {tuple(initial_state.shape)}"
        )
    return n


def sequence_spans(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence: whole rows, or the packed documents."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, one token at a time (differentiable, slow: tests and references only).

    Args:
        q, k: [B, T, H, K] read and write keys (L2-normalised by the caller).
        v: [B, T, H, V] values.
        g: [B, T, H] log decay (≤ 0).
        beta: [B, T, H] write strength in (0, 1).
        scale: multiplies q. Default: K ** -0.5.
        initial_state: [N, H, K, V] state before the first token of each sequence.
        output_final_state: also return the [N, H, K, V] state after each sequence.
        cu_seqlens: [N + 1] cumulative document lengths of a packed batch (B must be 1);
            the state restarts at every document boundary.

    Returns:
        o: [B, T, H, V] in v's dtype; final_state: [N, H, K, V] or None.
    """
    n = check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))

    rows: list[list[torch.Tensor]] = [[] for _ in range(B)]
    finals = []
    for i, (b, start, end) in enumerate(sequence_spans(B, T, cu_seqlens)):
        h = q.new_zeros(H, K, V) if initial_state is None else initial_state[i].to(acc)
        for t in range(start, end):
            h = h * g[b, t].exp()[:, None, None]
            v_new = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", h, k[b, t]))
            h = h + k[b, t][:, :, None] * v_new[:, None, :]
            rows[b].append(torch.einsum("hkv,hk->hv", h, q[b, t] * scale))
        finals.append(h)
    o = torch.stack([torch.stack(r) if r else q.new_zeros(0, H, V) for r in rows])
    final_state = torch.stack(finals) if output_final_state else None
    return o.to(v.dtype), final_state
