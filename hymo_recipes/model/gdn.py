"""Gated DeltaNet token mixer (Yang, Kautz, Hatamizadeh, arXiv 2412.06464; DESIGN.md §2).

Per head, state S ∈ R^{K×V}: S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ, o_t = S_tᵀ q_t / √K,
with log α_t = g_t = −exp(A_log) · softplus(a_t + dt_bias) and β_t = sigmoid(b_t). q, k, v go
through a short causal depthwise conv and SiLU; q and k are L2-normalised. The output is
o_proj(RMSNorm(o) ⊙ SiLU(g_proj(x))). There is no D skip term (GDN has none). The recurrence
itself is one call into ``hymo_kernels.gdn`` with the configured backend.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hymo_kernels.gdn import GDN_DOT_PRECISIONS, GDN_MIXER_SAVES, get_backend
from hymo_kernels.gdn.mixer_torch import gated_rms_norm, l2_normalize, short_causal_conv

try:  # the fused ops need Triton; only the Triton backend uses them
    from hymo_kernels.gdn.mixer import conv_gated_delta_rule, gated_norm_linear
except ImportError:  # the Triton backend then fails at get_backend with its own message
    conv_gated_delta_rule = gated_norm_linear = None

from .init import trunc_normal_
from .args import HymoModelArgs


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) ⊙ SiLU(gate) per head (fla's FusedRMSNormGated), math in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    """The token mixer of a GDN block (``layers.<i>.attn``).

    Args:
        args: model arguments (``gdn_*`` fields, dim, norm_eps, init_std).
    """

    def __init__(self, args: HymoModelArgs):
        super().__init__()
        self.n_heads = args.gdn_n_heads
        self.head_dim = args.gdn_head_dim
        self.v_head_dim = args.gdn_v_head_dim
        key_dim = self.n_heads * self.head_dim
        value_dim = self.n_heads * self.v_head_dim
        self.q_proj = nn.Linear(args.dim, key_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, key_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, value_dim, bias=False)
        self.a_proj = nn.Linear(args.dim, self.n_heads, bias=False)  # decay input
        self.b_proj = nn.Linear(args.dim, self.n_heads, bias=False)  # β input
        self.g_proj = nn.Linear(args.dim, value_dim, bias=False)  # output gate
        self.o_proj = nn.Linear(value_dim, args.dim, bias=False)
        # nn.Conv1d only as a parameter holder (weight [C, 1, W]); the conv itself is
        # short_causal_conv, which also handles document boundaries.
        self.q_conv1d = nn.Conv1d(key_dim, key_dim, args.gdn_conv_size, groups=key_dim, bias=False)
        self.k_conv1d = nn.Conv1d(key_dim, key_dim, args.gdn_conv_size, groups=key_dim, bias=False)
        self.v_conv1d = nn.Conv1d(value_dim, value_dim, args.gdn_conv_size, groups=value_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32))
        self.o_norm = GatedRMSNorm(self.v_head_dim, eps=args.norm_eps)

        self.backend = args.gdn_backend
        # Resolved now so that a backend that cannot load fails at construction, not mid-run.
        self._rule = get_backend(args.gdn_backend)
        # the Triton kernel's dot operands and backward; {} keeps its table's choices (and suits every backend)
        self._rule_kwargs = dict(GDN_DOT_PRECISIONS[args.gdn_dot_precision])
        if args.gdn_bwd_path != "table":
            self._rule_kwargs["bwd_path"] = args.gdn_bwd_path
        # fused Triton ops around the kernel (hymo_kernels.gdn.mixer): the Triton backend's path
        self.fused = args.gdn_backend == "triton" and args.gdn_fused_mixer
        self.keep = GDN_MIXER_SAVES[args.gdn_mixer_saves]  # the fused ops' saved tensors
        self.A_init_range = args.gdn_A_init_range
        self.dt_init = (args.gdn_dt_min, args.gdn_dt_max, args.gdn_dt_init_floor)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]; cu_seqlens [N+1] and positions [T] for packed rows (B = 1)."""
        B, T, _ = x.shape
        if self.fused:
            beta, g = self._gates(x)
            # the Triton backend: q, k, v from one GEMM; conv, SiLU, the q/k L2 norm and the
            # recurrence in one op that keeps only that projection for its backward and returns
            # its gradient as one tensor; gated norm and o_proj in another
            qkv = F.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
            o = conv_gated_delta_rule(
                qkv, self.q_conv1d.weight[:, 0], self.k_conv1d.weight[:, 0], self.v_conv1d.weight[:, 0], g, beta,
                head_k=self.head_dim, head_v=self.v_head_dim, cu_seqlens=cu_seqlens, positions=positions,
                keep=self.keep, **self._rule_kwargs)
            return gated_norm_linear(o, self.g_proj(x), self.o_norm.weight, self.o_proj.weight, self.o_norm.eps,
                                     keep=self.keep)
        q = F.silu(short_causal_conv(self.q_proj(x), self.q_conv1d.weight, positions))
        k = F.silu(short_causal_conv(self.k_proj(x), self.k_conv1d.weight, positions))
        v = F.silu(short_causal_conv(self.v_proj(x), self.v_conv1d.weight, positions))
        # -1 instead of n_heads: tensor parallelism may shard the heads
        q = l2_normalize(q.view(B, T, -1, self.head_dim))
        k = l2_normalize(k.view(B, T, -1, self.head_dim))
        v = v.view(B, T, -1, self.v_head_dim)
        beta, g = self._gates(x)

        o, _ = self._rule(q, k, v, g, beta, cu_seqlens=cu_seqlens, **self._rule_kwargs)
        gate = self.g_proj(x).view(B, T, -1, self.v_head_dim)
        o = self.o_norm(o, gate).reshape(B, T, -1)
        return self.o_proj(o)

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """β = sigmoid(b_proj(x)) in x's dtype and g = log α = −exp(A_log)·softplus(a_proj(x) + dt_bias) in fp32.

        a_proj and b_proj run as one GEMM (their weights side by side; the parameters stay
        separate): each alone is a launch-bound product a few heads wide, and each adds an
        input-gradient term that the block's norm backward reads."""
        a, b = F.linear(x, torch.cat([self.a_proj.weight, self.b_proj.weight])).float().split(
            [self.a_proj.out_features, self.b_proj.out_features], dim=-1)
        beta = torch.sigmoid(b).to(x.dtype)
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        return beta, g

    @torch.no_grad()
    def init_weights(self, init_std: float, out_std: float) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.g_proj):
            trunc_normal_(linear.weight, mean=0.0, std=init_std)
        trunc_normal_(self.o_proj.weight, mean=0.0, std=out_std)
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.reset_parameters()  # U(±1/√W), the nn.Conv1d default that fla keeps
        self.o_norm.reset_parameters()
        # fla's init, moved out of __init__ so that meta-device construction works.
        # A ~ U(lo, hi); the clamp only keeps log A finite for a draw of exactly 0.
        lo, hi = self.A_init_range
        A = torch.empty_like(self.A_log, dtype=torch.float32).uniform_(lo, hi).clamp_(min=1e-4)
        self.A_log.copy_(A.log())
        # dt ~ logU(dt_min, dt_max); dt_bias = softplus⁻¹(dt) = dt + log(1 − e^{−dt})
        dt_min, dt_max, dt_floor = self.dt_init
        u = torch.rand_like(self.dt_bias, dtype=torch.float32)
        dt = (u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).exp().clamp(min=dt_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
