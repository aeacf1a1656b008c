"""The routed experts' SwiGLU as three ``torch._grouped_mm`` calls (CUDA, bf16).

``torch._grouped_mm`` needs every expert's group of rows to start at a multiple of
``ALIGN`` rows, so the tokens (sorted by expert) are gathered into a padded layout: expert e's
group takes max(n_e, ALIGN) rows rounded up to a multiple of ALIGN. Every shape is fixed by the
number of tokens and experts (no host sync).
The layout and the maths are TorchTitan's (``indices_padding_wrapper`` with
``_run_experts_grouped_mm``, one expert-parallel rank), so the valid rows' numbers are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALIGN = 8  # rows per alignment unit of a group (TorchTitan's TOKEN_GROUP_ALIGN_SIZE_M)


def padded_indices(num_tokens_per_expert: torch.Tensor, num_rows: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index of the input row for each padded row, -1 for padding; padded group sizes [E];
    the padded row of each input row [num_rows]).

    Args:
        num_tokens_per_expert: [E] integer counts summing to ``num_rows``.
        num_rows: rows of the sorted input.
    """
    n = num_tokens_per_expert
    E = n.shape[0]
    sizes = (n.clamp_min(ALIGN) + ALIGN - 1) // ALIGN * ALIGN
    ends = sizes.cumsum(0)
    out_start = ends - sizes
    in_ends = n.cumsum(0)
    in_start = in_ends - n
    length = (num_rows + E * ALIGN + ALIGN - 1) // ALIGN * ALIGN  # an upper bound of sizes.sum()
    pos = torch.arange(length, device=n.device)
    e = torch.searchsorted(ends, pos, right=True).clamp_max(E - 1)
    j = pos - out_start[e]
    index = torch.where((j < n[e]) & (pos < ends[-1]), in_start[e] + j, -1)
    row = torch.arange(num_rows, device=n.device)
    e_row = torch.searchsorted(in_ends, row, right=True)  # the expert of each sorted input row
    return index, sizes, out_start[e_row] + row - in_start[e_row]


def grouped_swiglu(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, rows: torch.Tensor,
                   num_tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts on the rows ``rows`` [M] of x [N, dim] (sorted by expert) -> (out [L, dim] in
    x's dtype, at [M]): out[at[s]] is the output of x[rows[s]] through its expert. bf16 matmuls
    (weights [E, out, in]).

    The padded layout is gathered from x in one copy and the outputs stay in it (the caller
    reads them through ``at``). The padding rows are zeros, selected inside the same gather: the
    rows past the last group belong to no group, and ``torch._grouped_mm``'s backward leaves their
    input gradient undefined, which must not reach x."""
    index, sizes, at = padded_indices(num_tokens_per_expert, rows.shape[0])
    real = index >= 0
    xp = torch.where(real[:, None], x[rows[index.clamp_min(0)]], 0).bfloat16()
    offsets = torch.cumsum(sizes, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(xp, w1.bfloat16().transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(xp, w3.bfloat16().transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x), at
