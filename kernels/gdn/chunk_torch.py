"""Chunked (WY) Gated DeltaNet in plain PyTorch: the CPU backend and the Triton kernel's blueprint.

Same contract as ``naive.py`` and flash-linear-attention's ``chunk_gated_delta_rule``; the math
runs in float32 (float64 for float64 inputs) whatever the input dtype. Instead of T sequential
rank-1 updates it does T / C sequential state updates with C×C matmuls in between (C = 64), as
the Triton kernel does, so the two can be compared block by block. Per chunk (KERNEL_NOTES.md),
with γ the in-chunk inclusive cumsum of g and Γ[r, i] = exp(γ_r − γ_i)::

    T     = (I + strictly_lower(diag(β) (K Kᵀ ⊙ Γ)))⁻¹
    W     = T diag(β e^γ) K,   U = T diag(β) V
    V_new = U − W S
    O     = scale · ((Q ⊙ e^γ) S + (Q Kᵀ ⊙ Γ ⊙ causal) V_new)
    S     ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ V_new

Ragged inputs (T not a multiple of C, or packed documents) are padded with tokens that have
k = v = 0, β = 0 and g = 0: such a token neither writes to nor decays the state, so padding
changes nothing and every document runs as one row of a padded batch.
"""

from __future__ import annotations

import torch

from .naive import check_gdn_inputs, sequence_spans

CHUNK_SIZE = 64


# Runs eagerly inside torch.compile'd blocks: tracing would unroll the chunk loop T/C times
# into the graph, and on CPU (torch 2.13) AOT autograd's compiled backward of this function
# fails ("view size is not compatible with input tensor's size and stride").
@torch.compiler.disable
def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunk by chunk (differentiable through autograd).

    Args:
        q, k: [B, T, H, K] read and write keys (L2-normalised by the caller).
        v: [B, T, H, V] values.
        g: [B, T, H] log decay (≤ 0).
        beta: [B, T, H] write strength in (0, 1).
        scale: multiplies q.
            Default: K ** -0.5.
        initial_state: [N, H, K, V] state before the first token of each sequence.
        output_final_state: also return the [N, H, K, V] state after each sequence.
        cu_seqlens: [N + 1] cumulative document lengths of a packed batch (B must be 1);
            the state restarts at every document boundary.
        chunk_size: tokens per chunk.
            Default: 64.

    Returns:
        o: [B, T, H, V] in v's dtype; final_state: [N, H, K, V] (float32, float64 for
        float64 inputs) or None.
    """
    n = check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    C = chunk_size

    spans = sequence_spans(B, T, cu_seqlens)
    longest = max([0] + [end - start for _, start, end in spans])
    L = max(C, -(-longest // C) * C)  # padded length: a whole number of chunks

    # [N, L, H, *]: one row per sequence, zero-padded at the end
    def rows(x: torch.Tensor) -> torch.Tensor:
        x = x.to(acc)
        if cu_seqlens is None and T == L:
            return x
        out = x.new_zeros(n, L, *x.shape[2:])
        for i, (b, start, end) in enumerate(spans):
            out[i, : end - start] = x[b, start:end]
        return out

    qr, kr, vr, gr, br = (rows(x) for x in (q, k, v, g, beta))
    h0 = None if initial_state is None else initial_state.to(acc)
    o, h = _chunk_rows(qr, kr, vr, gr, br, scale, h0, C)

    if cu_seqlens is None:
        o = o[:, :T]
    else:
        o = torch.cat([o[i, : end - start] for i, (_, start, end) in enumerate(spans)])[None]
    return o.to(v.dtype), (h if output_final_state else None)


def _chunk_rows(q, k, v, g, beta, scale, h0, C):
    """The chunked recurrence on [N, L, H, *] rows with L a multiple of C; returns (o, S_final)."""
    N, L, H, K = q.shape
    V = v.shape[-1]
    nc = L // C

    # [N, H, nc, C, *] so that every chunk of every head is one batch entry of the matmuls
    def chunks(x):
        return x.reshape(N, nc, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g = g.reshape(N, nc, C, H).permute(0, 3, 1, 2)
    beta = beta.reshape(N, nc, C, H).permute(0, 3, 1, 2)

    gam = g.cumsum(-1)  # γ, [N, H, nc, C]
    idx = torch.arange(C, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    # Γ ⊙ causal: fill before exp so that γ_r − γ_i > 0 (above the diagonal) never overflows
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    a = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    t_inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    w = t_inv @ ((beta * gam.exp())[..., None] * k)  # [N, H, nc, C, K]
    u = t_inv @ (beta[..., None] * v)  # [N, H, nc, C, V]
    q_decayed = q * gam.exp()[..., None]
    qk = (q @ k.transpose(-1, -2)) * decay  # [N, H, nc, C, C]
    k_to_end = k * (gam[..., -1:] - gam).exp()[..., None]  # each key decayed to the chunk end

    s = q.new_zeros(N, H, K, V) if h0 is None else h0
    outs = []
    # the only sequential part: nc state hand-offs between chunks
    for c in range(nc):
        v_new = u[:, :, c] - w[:, :, c] @ s
        outs.append(scale * (q_decayed[:, :, c] @ s + qk[:, :, c] @ v_new))
        s = s * gam[:, :, c, -1].exp()[..., None, None] + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2)  # [N, H, nc, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(N, L, H, V), s
