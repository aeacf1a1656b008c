"""Parameter counts (stored and active per token) and training FLOPs per token.

FLOPs follow TorchTitan's conventions so MFU numbers compare with its models: 6 FLOPs per
active matmul weight per token (forward 2, backward 4), plus attention at the full sequence
length (no causal discount). HyMo adds:
- the tied output head, run once by the main head and once per MTP head (the embedding
  lookup itself costs nothing);
- the GDN recurrence as the chunked algorithm executes it (chunk C, dense C×C tiles), per
  token and head, forward: K Kᵀ 2CK, (I + A)⁻¹ ≈ 2C²/3, W 2CK, U 2CV, V_new = U − W S 2KV,
  Q S 2KV, Q Kᵀ 2CK, (Q Kᵀ ⊙ Γ) V_new 2CV, state update 2KV; training = 3 × forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hymo_kernels.gdn.chunk_torch import CHUNK_SIZE

from .args import HymoModelArgs


@dataclass(frozen=True)
class ParamCounts:
    stored: int  # every parameter once (the tied embedding / head once)
    active: int  # used per token: all but the routed experts, which count top_k / n_experts
    embedding: int
    routed_experts: int  # stored routed-expert weights
    mtp: int


def count_params(model: nn.Module, args: HymoModelArgs) -> ParamCounts:
    stored = embedding = routed = mtp = 0
    for name, p in model.named_parameters():  # deduplicated: a tied tensor counts once
        n = p.numel()
        stored += n
        if name.startswith("tok_embeddings."):
            embedding += n
        elif ".moe.experts." in name:
            routed += n
        elif name.startswith("mtp_heads."):
            mtp += n
    active = stored - routed + routed * args.moe_top_k // args.moe_num_experts
    return ParamCounts(stored=stored, active=active, embedding=embedding, routed_experts=routed, mtp=mtp)


def gdn_forward_flops_per_token_head(K: int, V: int, C: int = CHUNK_SIZE) -> float:
    """Forward FLOPs of the chunked gated delta rule for one token of one head (module docstring)."""
    return 6 * C * K + 4 * C * V + 6 * K * V + 2 * C * C / 3


def training_flops_per_token(args: HymoModelArgs, counts: ParamCounts, seq_len: int) -> int:
    n_mla = len(args.mla_layers)
    n_gdn = args.n_layers - n_mla
    head_uses = 1 + args.mtp_depth
    matmul = 6 * (counts.active - counts.embedding) + 6 * head_uses * args.vocab_size * args.dim
    attention = 6 * n_mla * args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim) * seq_len
    gdn = 3 * n_gdn * args.gdn_n_heads * gdn_forward_flops_per_token_head(args.gdn_head_dim, args.gdn_v_head_dim)
    return int(matmul + attention + gdn)
