"""The routed experts' SwiGLU as three ``torch._grouped_mm`` calls (CUDA, bf16).

``torch._grouped_mm`` needs every expert's group of rows to start at a multiple of
``ALIGN`` rows, so the tokens (sorted by expert) are first spread into a padded layout: expert
e's group takes max(n_e, ALIGN) rows rounded up to a multiple of ALIGN, and the padding rows
read a row of zeros. Every shape is fixed by the number of tokens and experts (no host sync).
The layout and the maths are TorchTitan's (``indices_padding_wrapper`` with
``_run_experts_grouped_mm``, one expert-parallel rank), so the numbers are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALIGN = 8  # rows per alignment unit of a group (TorchTitan's TOKEN_GROUP_ALIGN_SIZE_M)


def padded_indices(num_tokens_per_expert: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the input row for each padded row, -1 for padding; padded group sizes [E]).

    Args:
        num_tokens_per_expert: [E] integer counts summing to ``num_rows``.
        num_rows: rows of the sorted input.
    """
    n = num_tokens_per_expert
    E = n.shape[0]
    sizes = (n.clamp_min(ALIGN) + ALIGN - 1) // ALIGN * ALIGN
    ends = sizes.cumsum(0)
    out_start = ends - sizes
    in_start = n.cumsum(0) - n
    length = (num_rows + E * ALIGN + ALIGN - 1) // ALIGN * ALIGN  # an upper bound of sizes.sum()
    pos = torch.arange(length, device=n.device)
    e = torch.searchsorted(ends, pos, right=True).clamp_max(E - 1)
    j = pos - out_start[e]
    index = torch.where((j < n[e]) & (pos < ends[-1]), in_start[e] + j, -1)
    return index, sizes


def grouped_swiglu(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                   num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """x [M, dim] sorted by expert -> [M, dim] in x's dtype; bf16 matmuls (weights [E, out, in])."""
    index, sizes = padded_indices(num_tokens_per_expert, x.shape[0])
    x = torch.vstack((x, x.new_zeros(x.shape[-1])))  # the last row: zeros, read by the padding
    xp = x[index].bfloat16()
    offsets = torch.cumsum(sizes, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(xp, w1.bfloat16().transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(xp, w3.bfloat16().transpose(-2, -1), offs=offsets)
    out = torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)
    unpadded = out.new_empty(x.shape)
    unpadded[index] = out  # padding rows all land on the zero row, which is dropped
    return unpadded[:-1]
