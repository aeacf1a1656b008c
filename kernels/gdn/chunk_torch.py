"""Chunked (WY) Gated DeltaNet in plain PyTorch: the CPU backend and the Triton kernel's blueprint.

Same contract as ``naive.py`` and flash-linear-attention's ``chunk_gated_delta_rule``; the math
runs in float32 (float64 for float64 inputs) whatever the input dtype. Instead of T sequential
rank-1 updates it does T / C sequential state updates with C×C matmuls in between (C = 64), as
the Triton kernel does, so the two can be compared block by block. Per chunk (DESIGN.md, Forward),
with γ the in-chunk inclusive cumsum of g and Γ[r, i] = exp(γ_r − γ_i)::

    T     = (I + strictly_lower(diag(β) (K Kᵀ ⊙ Γ)))⁻¹
    W     = T diag(β e^γ) K,   U = T diag(β) V
    V_new = U − W S
    O     = scale · ((Q ⊙ e^γ) S + (Q Kᵀ ⊙ Γ ⊙ causal) V_new)
    S     ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ V_new

Ragged inputs are padded with tokens that have k = v = 0, β = 0 and g = 0: such a token
neither writes to nor decays the state, so padding changes nothing. Rows of T tokens are padded
to a whole number of chunks; packed documents (cu_seqlens) are laid end to end in one row, each
padded to a whole number of chunks, and the state restarts (from the document's initial state)
at each document's first chunk, so the work is the tokens' plus under one chunk per document.

The backward is hand-written (``_chunk_rows_backward``: DESIGN.md's "Backward" with the
sub-chunk c = C): a reverse pass over the chunk ends' state gradients that carries one K×V
tile, then every chunk's input gradients in parallel. The reference tests check it against the
float64 recurrence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    C = chunk_size

    if cu_seqlens is None:
        L = max(C, -(-T // C) * C)  # padded length: a whole number of chunks
        layout = None

        def rows(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, *], zero-padded at the end
            x = x.to(acc)
            return x if T == L else F.pad(x, (0, 0) * (x.dim() - 2) + (0, L - T))
    else:
        spans = sequence_spans(B, T, cu_seqlens)
        n_chunks = [-(-(end - start) // C) for _, start, end in spans]
        first = [0]
        for c in n_chunks[:-1]:
            first.append(first[-1] + c)
        layout = (first, n_chunks)  # per document: its first chunk and its number of chunks
        # token t of document d (starting at s_d) goes to position C·first_d + t − s_d of the row
        lengths = cu_seqlens.diff().to(torch.long)
        shift = torch.tensor(first, device=q.device) * C - cu_seqlens[:-1].to(device=q.device, dtype=torch.long)
        dest = torch.arange(T, device=q.device) + shift.repeat_interleave(lengths.to(q.device), output_size=T)
        P = max(C, C * sum(n_chunks))

        def rows(x: torch.Tensor) -> torch.Tensor:  # [1, P, H, *]: the documents end to end
            return x.new_zeros((1, P) + x.shape[2:], dtype=acc).index_copy(1, dest, x.to(acc))

    qr, kr, vr, gr, br = (rows(x) for x in (q, k, v, g, beta))
    h0 = None if initial_state is None else initial_state.to(acc)
    o, h = _ChunkRowsFn.apply(qr, kr, vr, gr, br, h0, scale, C, layout)
    o = o[:, :T] if cu_seqlens is None else o[:, dest]
    return o.to(v.dtype), (h if output_final_state else None)


class _Chunks:
    """Per-chunk tensors of the algebra on [N, L, H, *] rows, as [N, H, nc, C, *] (DESIGN.md,
    "Forward", with the sub-chunk c = C): everything that does not depend on the state."""

    def __init__(self, q, k, v, g, beta, scale, C):
        N, L, H, K = q.shape
        nc = L // C

        def chunks(x):
            return x.reshape(N, nc, C, H, -1).permute(0, 3, 1, 2, 4)

        self.q, self.k, self.v = chunks(q), chunks(k), chunks(v)
        self.beta = beta.reshape(N, nc, C, H).permute(0, 3, 1, 2)
        self.gam = g.reshape(N, nc, C, H).permute(0, 3, 1, 2).cumsum(-1)  # γ, [N, H, nc, C]
        idx = torch.arange(C, device=q.device)
        self.causal = idx[:, None] >= idx[None, :]
        self.strict = idx[:, None] > idx[None, :]
        # Γ ⊙ causal: fill before exp so that γ_r − γ_i > 0 (above the diagonal) never overflows
        self.decay = (self.gam[..., :, None] - self.gam[..., None, :]).masked_fill(~self.causal, float("-inf")).exp()
        self.bkk = (self.k @ self.k.transpose(-1, -2) * self.decay).masked_fill(~self.strict, 0.0)  # B
        self.a = self.beta[..., None] * self.bkk  # A = diag(β) B
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        self.t_inv = torch.linalg.solve_triangular(eye + self.a, eye.expand_as(self.a), upper=False,
                                                   unitriangular=True)
        self.eg = self.gam.exp()  # a_r = e^{γ_r}
        self.x = (self.beta * self.eg)[..., None] * self.k  # X = diag(β a) K
        self.w = self.t_inv @ self.x  # W, [N, H, nc, C, K]
        self.u = self.t_inv @ (self.beta[..., None] * self.v)  # U = T diag(β) V
        self.qs = scale * self.q
        self.q_decayed = self.qs * self.eg[..., None]  # Q̃
        self.p = (self.qs @ self.k.transpose(-1, -2)) * self.decay  # P = (q' Kᵀ) ⊙ Γ ⊙ causal
        self.e_end = (self.gam[..., -1:] - self.gam).exp()  # d_r = e^{γ_L − γ_r}
        self.k_to_end = self.k * self.e_end[..., None]  # K̃: each key decayed to the chunk end
        self.g_end = self.gam[..., -1].exp()  # e^{γ_L}, [N, H, nc]

    @staticmethod
    def rows(x):
        """[N, H, nc, C, D] back to [N, L, H, D]."""
        N, H, nc, C, D = x.shape
        return x.permute(0, 2, 3, 1, 4).reshape(N, nc * C, H, D)


def _segments(layout):
    """{first chunk: document} and {last chunk: document} of a one-row layout of documents
    (empty documents own no chunk); both empty for plain rows (``layout`` None)."""
    if layout is None:
        return {}, {}
    first, n_chunks = layout
    starts = {f: d for d, (f, n) in enumerate(zip(first, n_chunks)) if n}
    ends = {f + n - 1: d for d, (f, n) in enumerate(zip(first, n_chunks)) if n}
    return starts, ends


def _per_sequence(x: torch.Tensor | None, layout, zero: torch.Tensor) -> list[torch.Tensor]:
    """One [1, H, K, V] state per document of the layout: x's rows, or zeros when x is None."""
    return [zero if x is None else x[d : d + 1] for d in range(len(layout[0]))]


def _chunk_rows(q, k, v, g, beta, scale, h0, C, layout=None):
    """The chunked recurrence on [N, L, H, *] rows with L a multiple of C; returns (o, S_final,
    per-chunk start states [N, H, nc, K, V], the chunk tensors). With a ``layout`` (documents
    end to end in one row, see chunk_gated_delta_rule_torch) the state restarts at each
    document's first chunk from its initial state and S_final holds each document's last state."""
    ch = _Chunks(q, k, v, g, beta, scale, C)
    N, H, nc = ch.gam.shape[:3]
    zero = q.new_zeros(N, H, q.shape[-1], v.shape[-1])
    s = zero if h0 is None or layout is not None else h0
    doc_starts, doc_ends = _segments(layout)
    if layout is not None:
        init = _per_sequence(h0, layout, zero)
        finals = list(init)  # an empty document ends in its initial state
    outs, starts = [], []
    # the only sequential part: nc state hand-offs between chunks
    for c in range(nc):
        if c in doc_starts:
            s = init[doc_starts[c]]
        starts.append(s)
        v_new = ch.u[:, :, c] - ch.w[:, :, c] @ s
        outs.append(ch.q_decayed[:, :, c] @ s + ch.p[:, :, c] @ v_new)
        s = s * ch.g_end[:, :, c, None, None] + ch.k_to_end[:, :, c].transpose(-1, -2) @ v_new
        if c in doc_ends:
            finals[doc_ends[c]] = s
    if layout is not None:
        s = torch.cat(finals)
    return ch.rows(torch.stack(outs, dim=2)), s, torch.stack(starts, dim=2), ch


def _transpose(x):
    return x.transpose(-1, -2)


def _chunk_rows_backward(ch: _Chunks, scale, starts, do, dht, layout=None):
    """Hand-written backward of _chunk_rows (DESIGN.md, "Backward", with the sub-chunk c = C):
    gradients of q, k, v, g, beta and the initial state from those of o and the final state.
    In three steps: the state-free chunk tensors (in parallel), the reverse pass over the chunk
    ends' state gradients dS' (sequential, carries one K×V tile), then every chunk's input
    gradients from its S and dS' (in parallel)."""
    nc, C = ch.gam.shape[2:]
    do = do.reshape(do.shape[0], nc, C, do.shape[2], -1).permute(0, 3, 1, 2, 4)
    s = starts  # [N, H, nc, K, V]
    v_new = ch.u - ch.w @ s
    # reverse pass: dS' of every chunk (the gradient of its end state)
    # (with a layout: a document's last chunk hands its state to nobody but its final state, and
    # its first chunk's start-state gradient is that of the document's initial state)
    ds_end = torch.empty_like(s)
    zero = torch.zeros_like(s[:, :, 0])
    doc_starts, doc_ends = _segments(layout)
    if layout is not None:
        d_final = _per_sequence(dht, layout, zero)
        d_init = list(d_final)  # an empty document passes its final state's gradient through
    ds = zero if dht is None or layout is not None else dht
    for c in reversed(range(nc)):
        if c in doc_ends:
            ds = d_final[doc_ends[c]]
        ds_end[:, :, c] = ds
        dvn = ch.p[:, :, c].transpose(-1, -2) @ do[:, :, c] + ch.k_to_end[:, :, c] @ ds
        ds = (ch.q_decayed[:, :, c].transpose(-1, -2) @ do[:, :, c] + ch.g_end[:, :, c, None, None] * ds
              - ch.w[:, :, c].transpose(-1, -2) @ dvn)
        if c in doc_starts:
            d_init[doc_starts[c]] = ds
    dh0 = ds if layout is None else torch.cat(d_init)
    # every chunk in parallel
    mT = _transpose
    dvn = mT(ch.p) @ do + ch.k_to_end @ ds_end
    dy = mT(ch.t_inv) @ dvn  # dU = dv_new, U = T Y
    dx = -dy @ mT(s)  # dW = −dv_new Sᵀ, W = T X
    da = -(dy @ mT(v_new)).masked_fill(~ch.strict, 0.0)
    dq_dec = do @ mT(s)  # dQ̃
    dp = (do @ mT(v_new)).masked_fill(~ch.causal, 0.0)
    dk_end = v_new @ mT(ds_end)  # dK̃
    dpg = dp * ch.decay
    gk = da * ch.decay * ch.beta[..., None]  # G = dA ⊙ diag(β) Γ
    dq = scale * (dq_dec * ch.eg[..., None] + dpg @ ch.k)
    dk = (mT(dpg) @ ch.qs + dk_end * ch.e_end[..., None] + dx * (ch.beta * ch.eg)[..., None]
          + (gk + mT(gk)) @ ch.k)
    dv = dy * ch.beta[..., None]
    dbeta = ch.eg * (dx * ch.k).sum(-1) + (dy * ch.v).sum(-1) + (da * ch.bkk).sum(-1)
    e = dp * ch.p + da * ch.a
    f = (dk_end * ch.k_to_end).sum(-1)
    dgam = (dq_dec * ch.q_decayed).sum(-1) + e.sum(-1) - e.sum(-2) - f + (dx * ch.x).sum(-1)
    dg_end = ch.g_end * (ds_end * s).sum((-1, -2)) + f.sum(-1)  # dγ_L, [N, H, nc]
    # γ is an in-chunk cumsum and γ_L involves every g of the chunk
    dg = dgam.flip(-1).cumsum(-1).flip(-1) + dg_end[..., None]
    rows = _Chunks.rows
    return rows(dq), rows(dk), rows(dv), rows(dg[..., None])[..., 0], rows(dbeta[..., None])[..., 0], dh0


class _ChunkRowsFn(torch.autograd.Function):
    """_chunk_rows with its hand-written backward. It keeps the forward's chunk tensors (as
    autograd would) instead of recomputing them: recomputing made the CPU backward 2x slower."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, C, layout):
        o, s, starts, ch = _chunk_rows(q, k, v, g, beta, scale, h0, C, layout)
        ctx.save_for_backward(starts)
        # tensors made here from the inputs, referenced nowhere else: nothing can modify them
        ctx.chunks, ctx.scale, ctx.has_h0, ctx.layout = ch, scale, h0 is not None, layout
        ctx.set_materialize_grads(False)
        return o, s

    @staticmethod
    def backward(ctx, do, dht):
        (starts,) = ctx.saved_tensors
        ch = ctx.chunks
        if do is None:
            N, H, nc, C, V = ch.v.shape
            do = ch.v.new_zeros(N, nc * C, H, V)
        dq, dk, dv, dg, dbeta, dh0 = _chunk_rows_backward(ch, ctx.scale, starts, do, dht, ctx.layout)
        return dq, dk, dv, dg, dbeta, (dh0 if ctx.has_h0 else None), None, None, None
