"""Multi-head Latent Attention with grouped KV (DeepSeek-V2/V3 MLA; DESIGN.md §2).

q = wq_b(RMSNorm(wq_a(x))); [c_kv, k_rope] = wkv_a(x); [k_nope, v] = wkv_b(RMSNorm(c_kv)) per
KV group. RoPE rotates only the qk_rope_head_dim slices (k_rope is one slice per token, shared
by every head); causal SDPA with GQA (query head h reads KV group h // (n_heads / n_kv_heads)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .init import trunc_normal_
from .args import HymoModelArgs, parse_flex_options


def precompute_rope_cache(rope_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """[max_seq_len, rope_dim // 2, 2] table of (cos, sin) of position · theta^(−2i / rope_dim)."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """Rotates consecutive pairs of the last dim of x [B, T, heads, D] by their position's angles.

    positions [T] gives each token's position (restarting per packed document); None = 0..T-1.
    """
    T = x.shape[1]
    cs = rope_cache[:T] if positions is None else rope_cache[positions]  # [T, D/2, 2]
    cos, sin = cs[None, :, None, :, 0], cs[None, :, None, :, 1]
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """[T, T] bool mask, True where query i may attend key j: j ≤ i inside i's document.

    Token i's document started positions[i] tokens ago, so its keys are i − positions[i] .. i.
    """
    idx = torch.arange(positions.shape[0], device=positions.device)
    j, i = idx[None, :], idx[:, None]
    return (j <= i) & (j >= i - positions[:, None])


def document_attention_mask(positions: torch.Tensor):
    """The mask of causal attention inside documents, for every MLA layer of one forward: on
    the GPU a flex-attention BlockMask (blocks outside every document skipped, no T × T tensor);
    elsewhere the dense ``document_causal_mask`` for SDPA (flex attention has no CPU backward)."""
    if positions.device.type != "cuda":
        return document_causal_mask(positions)
    return document_block_mask(positions)


FLEX_BLOCK = 128  # flex attention's default sparse block, rows and columns


def document_block_mask(positions: torch.Tensor, block: int = FLEX_BLOCK):
    """``document_causal_mask`` as a flex-attention BlockMask, built from the document starts
    at block granularity: O((T / block)²) work, where ``create_block_mask`` evaluates the mask
    at every one of the T² (query, key) pairs.

    Token i sees keys s_i .. i, s_i = i − positions[i] its document's start; s is
    non-decreasing in i, so a query block [a, e) sees the keys of one interval, s_a .. e − 1. A
    (query block, key block) pair is skipped where the two do not meet, full where every key of
    a whole key block lies in s_{e−1} .. a (and both blocks are whole), partial otherwise: the
    BlockMask ``create_block_mask(causal_in_document, ...)`` builds, entry for entry (a test
    compares them).
    """
    from torch.nn.attention.flex_attention import BlockMask

    def causal_in_document(b, h, q, kv):
        return (kv <= q) & (kv >= q - positions[q])

    T = positions.shape[0]
    n = -(-T // block)
    first = torch.arange(n, device=positions.device) * block  # each block's first row (or column)
    last = (first + block).clamp(max=T) - 1
    starts = torch.arange(T, device=positions.device) - positions  # each token's document start
    whole = first + block <= T
    # [query block, key block]
    meets = (first[None, :] <= last[:, None]) & (last[None, :] >= starts[first][:, None])
    full = ((first[None, :] >= starts[last][:, None]) & (last[None, :] <= first[:, None])
            & whole[:, None] & whole[None, :])
    partial = meets & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # create_block_mask's layout: [1, 1, rows] counts, [1, 1, rows, cols] column indices
        # with the marked columns first, ascending
        dense = dense.to(torch.int32)[None, None]
        order = torch.argsort(dense, dim=-1, descending=True, stable=True)
        return dense.sum(-1).to(torch.int32), order.to(torch.int32)

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block,
                                    mask_mod=causal_in_document, seq_lengths=(T, T))


_compiled_flex = None


def _flex_attention(q, k, v, block_mask, scale, kernel_options: dict | None = None):
    """flex_attention compiled (eager flex runs an unfused O(T²) reference); inside a compiled
    block the call is traced into the block's graph. ``kernel_options``: flex attention's tile
    and launch choices (None: Inductor's defaults for the GPU)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=kernel_options)


class MLA(nn.Module):
    """The token mixer of an MLA block (``layers.<i>.attn``).

    Args:
        args: model arguments (MLA fields, dim, norm_eps).
        use_rope: rotate the rope slices; False for the NoPE-hybrid ablation (the slices stay,
            unrotated, so both variants have the same parameters).
    """

    def __init__(self, args: HymoModelArgs, use_rope: bool = True):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim
        self.use_rope = use_rope
        self.flex_options = parse_flex_options(args.mla_flex_options) or None  # the GPU's packed path
        # 1/√d; muP (hymo_recipes/mup.py): 1/d, as q·k grows like d once q and k correlate
        self.softmax_scale = 1.0 / self.qk_head_dim if args.mup_base_width else self.qk_head_dim**-0.5

        self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(
            self.kv_lora_rank, self.n_kv_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.wo = nn.Linear(self.n_heads * self.v_head_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask=None,
    ) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]; positions [T] marks packed documents (B = 1), attention
        then restricted to each document by ``attn_mask``: the model's one
        ``document_attention_mask(positions)`` for all its MLA layers, or, if not given, the
        dense ``document_causal_mask``."""
        B, T, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, T, -1, self.qk_head_dim)

        c_kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(c_kv)).view(B, T, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rope = k_rope[:, :, None, :]  # [B, T, 1, rope]: one slice shared by all heads

        if self.use_rope:
            # q's rope slice rotated in place: the nope part is never copied (torch.compile
            # writes the slice into the projection's output; a concatenation would copy all of q)
            q[..., self.qk_nope_head_dim:] = apply_rope(q[..., self.qk_nope_head_dim:], rope_cache, positions)
            k_rope = apply_rope(k_rope, rope_cache, positions)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)

        # [B, heads, T, d]; SDPA's enable_gqa maps query head h to KV head h // (H / G)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if positions is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=True)
        else:
            mask = document_causal_mask(positions) if attn_mask is None else attn_mask
            if isinstance(mask, torch.Tensor):
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale, enable_gqa=True)
            else:
                o = _flex_attention(q, k, v, mask, self.softmax_scale, self.flex_options)
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))

    @torch.no_grad()
    def init_weights(self, init_std: float, out_std: float) -> None:
        for linear in (self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            trunc_normal_(linear.weight, mean=0.0, std=init_std)
        trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        self.q_norm.reset_parameters()
        self.kv_norm.reset_parameters()
