"""DeepSeekMoE feed-forward for MLA blocks (DESIGN.md §2).

Routed experts (softmax top-k from an FP32 router) plus always-on shared experts. Load is
balanced without an auxiliary loss (DeepSeek-V3): a bias buffer is added to the scores for
expert *selection* only, while gate weights come from the unbiased scores; the trainer calls
``update_expert_biases`` after each optimizer step with the step's per-expert loads. A capacity
factor caps every expert at ceil(cf · tokens · top_k / n_experts) assignments (0 = dropless).

Parameter and buffer names follow TorchTitan's MoE (``router.gate``, ``experts.w1/w2/w3``,
``shared_experts``, ``expert_bias``, ``tokens_per_expert``), and the experts module takes
(tokens sorted by expert, tokens per expert), so TorchTitan's expert-parallel wrapper fits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .args import HymoModelArgs
from .grouped_mm import gather_rows, grouped_swiglu
from .init import trunc_normal_
from .recompute import ProductRecompute, keep_matmuls


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class FeedForward(ProductRecompute, nn.Module):
    """SwiGLU: w2(SiLU(w1 x) ⊙ w3 x). Shared experts and the optional GDN-block FFN."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the product recomputed in the backward, the projections kept (recompute.py)
        return keep_matmuls(_swiglu, x, self.w1.weight, self.w2.weight, self.w3.weight,
                            enabled=self.recompute_products)

    @torch.no_grad()
    def init_weights(self, init_std: float, out_std: float) -> None:
        # TorchTitan's split: w1 at the input std, w2 and w3 at the depth-scaled std
        trunc_normal_(self.w1.weight, mean=0.0, std=init_std)
        for linear in (self.w2, self.w3):
            trunc_normal_(linear.weight, mean=0.0, std=out_std)


class Router(nn.Module):
    """FP32 softmax router: top-k chosen from score + bias, weighted by the unbiased score."""

    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (gate weights [N, k] fp32, expert indices [N, k])."""
        # fp32 logits and softmax: in bf16 a near-uniform 16-way softmax rounds to ties
        scores = F.softmax(F.linear(x.float(), self.gate.weight.float()), dim=-1)
        _, idx = torch.topk(scores + expert_bias, k=self.top_k, dim=-1)
        return scores.gather(-1, idx), idx

    @torch.no_grad()
    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.gate.weight, mean=0.0, std=init_std)


class GroupedExperts(ProductRecompute, nn.Module):
    """n_experts SwiGLUs stored as 3-D weights [E, out, in].

    Args:
        dim, hidden_dim, num_experts: shapes.
        use_grouped_mm: one torch._grouped_mm per projection when on CUDA in bf16
            (grouped_mm.py; needs SM90); otherwise a loop over experts.
        mixed_precision: matmuls in the expert weights' dtype (DESIGN.md ``moe_mixed_precision``);
            False runs them in the wider of the activation and weight dtypes.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool, mixed_precision: bool):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm = use_grouped_mm
        self.mixed_precision = mixed_precision

    def forward(self, x: torch.Tensor, rows: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                capacity: int | None = None, assignments: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts on rows ``rows`` [M] of x [N, dim], sorted by expert (num_tokens_per_expert
        [E] summing to M) -> (out [R, dim] in x's dtype, at [M]): out[at[s]] is the output of
        x[rows[s]]; with ``capacity``, only the first ``capacity`` rows of each expert's group
        are computed and the others get at[s] = -1. The grouped GEMMs leave their outputs in their
        padded layout (R rows), so that the caller gathers each token's outputs once; the loop's
        are in order (at = s for a computed row). ``assignments`` [N, k]: where in ``rows`` each
        row of x's assignments sit, which lets the grouped path gather x's gradient
        (``grouped_mm.grouped_swiglu``)."""
        w1, w2, w3 = self.w1, self.w2, self.w3
        dtype = w1.dtype if self.mixed_precision else torch.promote_types(x.dtype, w1.dtype)
        if self.use_grouped_mm and x.is_cuda and dtype == torch.bfloat16:
            return grouped_swiglu(w1, w2, w3, x, rows, num_tokens_per_expert, capacity,
                                  recompute_products=self.recompute_products, assignments=assignments)
        out, at = self._loop(x[rows].to(dtype), w1.to(dtype), w2.to(dtype), w3.to(dtype), num_tokens_per_expert,
                             capacity)
        return out.to(x.dtype), at

    @staticmethod
    def defined_outputs(output: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
        """The rows of forward's output that hold values (what nonfinite_probe checks): the padded
        layout's rows past the last group are never written, nor are dropped assignments'."""
        out, at = output
        return [out[at[at >= 0]]]

    @staticmethod
    def _loop(x, w1, w2, w3, num_tokens_per_expert, capacity=None):
        """(out [K, dim], at [M]): out holds the K computed rows in order; the rows past
        ``capacity`` in each group are skipped (at -1)."""
        # one host sync for the split sizes; each expert is then three dense matmuls
        outs, ats, start = [], [], 0
        for e, xe in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            keep = xe if capacity is None else xe[:capacity]
            h = F.silu(keep @ w1[e].transpose(0, 1)) * (keep @ w3[e].transpose(0, 1))
            outs.append(h @ w2[e].transpose(0, 1))
            n = keep.shape[0]  # the group's computed rows sit at start.. in out, its dropped ones at -1
            ats += [torch.arange(start, start + n, device=x.device),
                    torch.full((xe.shape[0] - n,), -1, dtype=torch.long, device=x.device)]
            start += n
        out, at = torch.cat(outs), torch.cat(ats)
        return out, at

    @torch.no_grad()
    def init_weights(self, init_std: float, out_std: float) -> None:
        trunc_normal_(self.w1, mean=0.0, std=init_std)
        trunc_normal_(self.w2, mean=0.0, std=out_std)
        trunc_normal_(self.w3, mean=0.0, std=out_std)


class MoE(nn.Module):
    """Routed + shared SwiGLU experts with aux-loss-free balancing and a capacity factor.

    Buffers: ``expert_bias`` and ``load_ema`` [E] are persistent (exact resume needs them);
    ``tokens_per_expert`` and ``dropped_tokens`` [E] (float32) accumulate over the forwards of
    one optimizer step, for the bias update and for metrics, and are reset by the trainer.

    Args:
        args: model arguments (``moe_*`` fields, dim).
    """

    def __init__(self, args: HymoModelArgs):
        super().__init__()
        E = args.moe_num_experts
        self.num_experts = E
        self.top_k = args.moe_top_k
        self.capacity_factor = args.moe_capacity_factor
        self.bias_update_speed = args.moe_bias_update_speed
        self.load_ema_alpha = args.moe_load_ema_alpha
        self.balance_band = args.moe_balance_band

        self.router = Router(args.dim, E, args.moe_top_k)
        self.experts = GroupedExperts(
            args.dim, args.moe_inter_dim, E, args.moe_use_grouped_mm, args.moe_mixed_precision
        )
        self.shared_experts = (
            FeedForward(args.dim, args.moe_inter_dim * args.moe_num_shared_experts)
            if args.moe_num_shared_experts > 0
            else None
        )
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32), persistent=True)
        self.register_buffer("load_ema", torch.zeros(E, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros(E, dtype=torch.float32), persistent=False)

    def capacity(self, num_tokens: int) -> int | None:
        """Assignments one expert may take from num_tokens tokens; None when dropless."""
        if self.capacity_factor == 0:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]."""
        B, T, D = x.shape
        N, k, E = B * T, self.top_k, self.num_experts
        xf = x.reshape(N, D)
        weights, idx = self.router(xf, self.expert_bias)  # [N, k] fp32, [N, k]

        # Sort the N·k assignments by expert; within an expert, by position first and row
        # second, so a token is dropped only because of tokens at earlier (or equal)
        # positions: capacity never lets a later token change an earlier output.
        flat = idx.reshape(-1)
        token = torch.arange(N * k, device=x.device) // k
        priority = (token % T) * B + token // T
        order = torch.argsort(flat * N + priority)
        # per-expert counts by scatter_add: bincount sizes its output from the data (a host
        # sync on CUDA), and int64 histc has no CPU kernel
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))

        capacity = self.capacity(N)
        if capacity is None:
            dropped = torch.zeros_like(counts)
        else:
            starts = counts.cumsum(0) - counts
            rank = torch.arange(N * k, device=x.device) - starts[flat[order]]
            kept = torch.empty_like(flat, dtype=torch.bool)
            kept[order] = rank < capacity
            weights = weights * kept.view(N, k)  # a dropped assignment contributes nothing
            dropped = (counts - capacity).clamp(min=0)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts.float())
            self.dropped_tokens.add_(dropped.float())

        # A dropped assignment is never computed (the experts skip the rows past capacity); its
        # output reads as zero. Shapes stay fixed by N, k and E: no host sync, compile-friendly.
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(N * k, device=x.device)
        routed, at = self.experts(xf, token[order], counts, capacity, assignments=unsort.view(N, k))
        at = at[unsort]  # the expert output row of each token's assignments, -1 for a dropped one
        # each token's k outputs, in one gather; a dropped one's (at -1) zeroed in the same
        # expression; backward, each output row takes the gradient of the one assignment that
        # read it (readers: the inverse of at; a row no assignment read, padding, takes zero)
        R = routed.shape[0]
        readers = torch.full((R + 1,), -1, dtype=at.dtype, device=x.device).scatter_(
            0, torch.where(at >= 0, at, R), torch.arange(N * k, device=x.device))[:R, None]
        routed = gather_rows(routed, at, readers).view(N, k, -1)
        # the weighted sum over a token's k outputs as one elementwise-and-sum (fused by the
        # compiler; a [1, k] x [k, D] bmm per token runs as a batched gemv, far slower)
        out = (weights[..., None] * routed.float()).sum(1).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(xf)
        return out.view(B, T, D)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """The aux-loss-free balancing step, once per optimizer step (``balance_step``).

        Args:
            tokens_per_expert: [E] assignments per expert in the step, summed over
                data-parallel ranks by the caller.
        """
        update_expert_biases([self], tokens_per_expert[None])

    @torch.no_grad()
    def reset_load_counters(self) -> None:
        reset_load_counters([self])

    @torch.no_grad()
    def init_weights(self, init_std: float, out_std: float, buffer_device: torch.device | None = None) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std, out_std)
        device = buffer_device if buffer_device is not None else self.expert_bias.device
        with torch.device(device):
            for name in ("expert_bias", "load_ema", "tokens_per_expert", "dropped_tokens"):
                setattr(self, name, torch.zeros(self.num_experts, dtype=torch.float32))


def balance_step(load_ema: torch.Tensor, tokens_per_expert: torch.Tensor, alpha: float, band: float,
                 speed: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The aux-loss-free balancing step of each row of [..., E] loads: (the new load EMA, the
    change of the expert bias).

    The EMA (α = moe_load_ema_alpha) tracks each expert's share of the step's assignments;
    experts below (1 − band) of the mean EMA get +speed, those above (1 + band) get −speed. The
    EMA starts at zero and is compared with its own mean, so the first steps need no warm-up (a
    zero start only scales every entry alike). Loads are shares, so counting a step twice
    (activation-checkpoint recomputation) changes nothing. A row without tokens changes
    nothing; decided on the device (no host sync).
    """
    total = tokens_per_expert.sum(-1, keepdim=True)
    any_tokens = total > 0
    share = tokens_per_expert.to(load_ema) / total.clamp(min=1)
    ema = torch.add(load_ema * (1 - alpha), share, alpha=alpha)
    mean = ema.mean(-1, keepdim=True)
    under = (ema < (1 - band) * mean).float()
    over = (ema > (1 + band) * mean).float()
    return torch.where(any_tokens, ema, load_ema), torch.where(any_tokens, (under - over) * speed, 0.0)


@torch.no_grad()
def update_expert_biases(moes: list[MoE], tokens_per_expert: torch.Tensor, go: torch.Tensor | None = None) -> None:
    """``balance_step`` for several MoE layers at once: ``tokens_per_expert`` [L, E] the step's
    assignments of each of ``moes``. Layers with the same balancing settings and expert count
    are updated together, a dozen launches for all of them instead of a dozen per layer (the
    GPU waits for these launches at the end of every step). ``go``: a 0-d bool; where it holds
    False the EMAs and biases keep their values (a step skipped on the device)."""
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(moes):
        key = (m.load_ema_alpha, m.balance_band, m.bias_update_speed, m.num_experts, m.load_ema.device)
        groups.setdefault(key, []).append(i)
    for (alpha, band, speed, *_), rows in groups.items():
        layers = [moes[i] for i in rows]
        loads = (tokens_per_expert if len(rows) == len(moes)  # else stacked views: a list index would copy
                 else torch.stack([tokens_per_expert[i] for i in rows]))  # it from the host, a sync
        old = torch.stack([m.load_ema for m in layers])
        ema, change = balance_step(old, loads, alpha, band, speed)
        if go is not None:
            ema, change = torch.where(go, ema, old), torch.where(go, change, 0.0)
        torch._foreach_copy_([m.load_ema for m in layers], list(ema.unbind(0)))
        torch._foreach_add_([m.expert_bias for m in layers], list(change.unbind(0)))


@torch.no_grad()
def reset_load_counters(moes: list[MoE]) -> None:
    """Zeroes the step's load counters of ``moes`` (one launch per device and dtype)."""
    torch._foreach_zero_([t for m in moes for t in (m.tokens_per_expert, m.dropped_tokens)])
