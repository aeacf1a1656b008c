"""The routed experts' SwiGLU as three ``torch._grouped_mm`` calls (CUDA, bf16).

``torch._grouped_mm`` needs every expert's group of rows to start at a multiple of
``ALIGN`` rows, so the tokens (sorted by expert) are gathered into a padded layout: expert e's
group takes max(n_e, ALIGN) rows rounded up to a multiple of ALIGN, where n_e counts only the
assignments the capacity keeps (a dropped one takes no row and no work). Every shape is fixed by
the number of tokens and experts (no host sync).
The layout and the maths are TorchTitan's (``indices_padding_wrapper`` with
``_run_experts_grouped_mm``, one expert-parallel rank), so the valid rows' numbers are the same.

The row gathers around the experts (tokens into the padded layout, outputs back to their tokens)
go through ``gather_rows``, whose backward is a gather too: each source row sums the gradients
of the rows that read it, found through the inverse map, instead of a scatter-add with atomics
into a zeroed buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .recompute import keep_matmuls

ALIGN = 8  # rows per alignment unit of a group (TorchTitan's TOKEN_GROUP_ALIGN_SIZE_M)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, readers):
        ctx.save_for_backward(readers)
        ctx.dtype = x.dtype
        return torch.where((src >= 0)[:, None], x[src.clamp_min(0)], 0)

    @staticmethod
    def backward(ctx, dout):
        (readers,) = ctx.saved_tensors
        acc = torch.promote_types(dout.dtype, torch.float32)  # 16-bit gradients summed in fp32
        # eagerly this makes an [R, m, dim] tensor; compiled, the gather, cast and sum are one kernel
        parts = torch.where((readers >= 0)[..., None], dout[readers.clamp_min(0)].to(acc), 0)
        return parts.sum(1).to(ctx.dtype), None, None


def gather_rows(x: torch.Tensor, src: torch.Tensor, readers: torch.Tensor | None) -> torch.Tensor:
    """out[i] = x[src[i]], zero where src[i] < 0 ([len(src), dim] from x [R, dim]), whose backward
    is a gather: dx[r] = the sum of dout[readers[r, j]] over readers[r, j] >= 0 (at least fp32).

    Args:
        x: [R, dim] the rows read.
        src: [M] the row of x each output row reads; -1 for a zero row.
        readers: [R, m] the output rows that read each row of x, -1 padding: exactly the i with
            src[i] = r, which the caller knows from its layout (it is not checked here); None:
            autograd's own backward (a scatter-add).
    """
    if readers is None:
        return torch.where((src >= 0)[:, None], x[src.clamp_min(0)], 0)
    return _GatherRows.apply(x, src, readers)


def padded_indices(num_tokens_per_expert: torch.Tensor, num_rows: int, capacity: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index of the input row for each padded row, -1 for padding; padded group sizes [E];
    the padded row of each input row [num_rows], -1 for a dropped one).

    Args:
        num_tokens_per_expert: [E] integer counts summing to ``num_rows``.
        num_rows: rows of the sorted input.
        capacity: with a value, only the first ``capacity`` rows of each expert's group take a
            place in the layout (the others are dropped: no row, no work); None keeps every row.
    """
    n = num_tokens_per_expert
    E = n.shape[0]
    kept = n if capacity is None else n.clamp(max=capacity)
    sizes = (kept.clamp_min(ALIGN) + ALIGN - 1) // ALIGN * ALIGN
    ends = sizes.cumsum(0)
    out_start = ends - sizes
    in_ends = n.cumsum(0)
    in_start = in_ends - n
    length = (num_rows + E * ALIGN + ALIGN - 1) // ALIGN * ALIGN  # an upper bound of sizes.sum()
    pos = torch.arange(length, device=n.device)
    e = torch.searchsorted(ends, pos, right=True).clamp_max(E - 1)
    j = pos - out_start[e]
    index = torch.where((j < kept[e]) & (pos < ends[-1]), in_start[e] + j, -1)
    row = torch.arange(num_rows, device=n.device)
    e_row = torch.searchsorted(in_ends, row, right=True)  # the expert of each sorted input row
    rank = row - in_start[e_row]
    return index, sizes, torch.where(rank < kept[e_row], out_start[e_row] + rank, -1)


def grouped_swiglu(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, rows: torch.Tensor,
                   num_tokens_per_expert: torch.Tensor, capacity: int | None = None,
                   recompute_products: bool = True, assignments: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts on the rows ``rows`` [M] of x [N, dim] (sorted by expert) -> (out [L, dim] in
    x's dtype, at [M]): out[at[s]] is the output of x[rows[s]] through its expert, and at[s] = -1
    for an assignment past its expert's ``capacity`` (dropped, never computed). bf16 matmuls
    (weights [E, out, in]); ``recompute_products``: the SwiGLU product recomputed in the
    backward (recompute.py).

    The padded layout is gathered from x in one copy and the outputs stay in it (the caller
    reads them through ``at``). The padding rows are zeros, selected inside the same gather: the
    rows past the last group belong to no group, and ``torch._grouped_mm``'s backward leaves their
    input gradient undefined, which must not reach x. ``assignments`` [N, k]: the positions in
    ``rows`` of each row of x's assignments (a row of x is read by those k alone); given, x's
    gradient is gathered from the layout's rows through it (``gather_rows``) instead of
    scatter-added into them."""
    index, sizes, at = padded_indices(num_tokens_per_expert, rows.shape[0], capacity)
    src = torch.where(index >= 0, rows[index.clamp_min(0)], -1)
    # each row of x: the layout rows of its kept assignments
    xp = gather_rows(x, src, None if assignments is None else at[assignments]).bfloat16()
    offsets = torch.cumsum(sizes, dim=0, dtype=torch.int32)
    # the product recomputed in the backward, the projections kept (recompute.py)
    out = keep_matmuls(_grouped, xp, w1.bfloat16(), w2.bfloat16(), w3.bfloat16(), offsets,
                       enabled=recompute_products)
    return out.type_as(x), at


def _grouped(xp: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, offsets: torch.Tensor
             ) -> torch.Tensor:
    h = F.silu(torch._grouped_mm(xp, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(xp, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
