"""The GDN token mixer's non-GEMM work as two fused ops, for training on the GPU.

``conv_gated_delta_rule``: short causal conv + SiLU on the q, k, v projections (one tensor, side
by side), then the chunked gated delta rule with q and k L2-normalised inside the kernels. It
saves the projection (which the conv reads anyway), the decay g and β, and the kernel's own
saved states; the conv outputs (the kernel's q, k, v) live only inside the forward and are
recomputed in the backward, whose projection gradient is one tensor (so the projection's
backward is one GEMM for the input and one for the weight).

``gated_norm_linear``: RMSNorm(o) ⊙ w ⊙ SiLU(gate), then the output projection. Of activations it
saves o and gate alone (and the two weights), never the normalised product or 1/rms per row:
the backward recomputes both (the product for the weight gradient).

With ``keep=True`` each op also keeps what it would otherwise recompute in the backward (the
conv outputs; the normalised product), trading memory for the recompute's time.

Both are ``torch.library.custom_op`` pairs with fake implementations, so ``torch.compile``
traces them without a graph break and Inductor cannot change what they save.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import chunk as _chunk
from .problem import _common, _overridden, saved_states_dtype, saved_t_dtype

from .gated_norm import gated_norm_bwd, gated_norm_fwd
from .mixer_torch import split_qkv
from .short_conv import conv_silu_qkv_bwd, conv_silu_qkv_fwd


def _heads(x: torch.Tensor, d: int) -> torch.Tensor:
    B, T, C = x.shape
    return x.view(B, T, C // d, d)


# ---------------------------------------------------------------------------------------------
# conv + gated delta rule
# ---------------------------------------------------------------------------------------------


def _convs(q_in, k_in, v_in, wq, wk, wv, positions, head_k: int, head_v: int):
    """The kernel's q, k, v [B, T, H, ·]: the three short convs + SiLU in one launch."""
    q, k, v = conv_silu_qkv_fwd(q_in, k_in, v_in, wq, wk, wv, positions)
    return _heads(q, head_k), _heads(k, head_k), _heads(v, head_v)


@torch.library.custom_op("hymo_kernels::conv_gdn_fwd", mutates_args=())
def conv_gdn_fwd(qkv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, cu_seqlens: torch.Tensor | None, positions: torch.Tensor | None, head_k: int,
                 head_v: int, scale: float, dot_bf16: bool | None = None, t_bf16: bool | None = None,
                 bwd_path: str | None = None, keep: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (o [B, T, H, V], the kernel's saved states, its saved T, the conv outputs q, k, v);
    ``keep``: the backward reads the conv outputs instead of recomputing them."""
    q_in, k_in, v_in = split_qkv(qkv, head_k, head_v)
    q, k, v = _convs(q_in, k_in, v_in, wq, wk, wv, positions, head_k, head_v)
    o, _, states, tinv = _chunk._forward(q, k, v, g, beta, None, cu_seqlens, scale, True, dot_bf16, t_bf16,
                                         bwd_path)
    return o, states, tinv, q, k, v


@conv_gdn_fwd.register_fake
def _(qkv, wq, wk, wv, g, beta, cu_seqlens, positions, head_k, head_v, scale, dot_bf16=None, t_bf16=None,
      bwd_path=None, keep=False):
    q_in, _, v_in = split_qkv(qkv, head_k, head_v)
    B, T, _ = qkv.shape
    q, v = qkv.new_empty(B, T, q_in.shape[-1] // head_k, head_k), qkv.new_empty(B, T, v_in.shape[-1] // head_v, head_v)
    B, T, H, K, V, N, cfg, NC = _common(q, v, cu_seqlens)
    cfg = _overridden(cfg, dot_bf16, t_bf16, bwd_path)
    return (v.new_empty(B, T, H, V),
            q.new_empty(NC * cfg.slots, H, K, V, dtype=saved_states_dtype(cfg, q.dtype)),
            q.new_empty(B, T, H, cfg.BC, dtype=saved_t_dtype(cfg, q.dtype)),
            torch.empty_like(q), q.new_empty(q.shape), torch.empty_like(v))


@torch.library.custom_op("hymo_kernels::conv_gdn_bwd", mutates_args=())
def conv_gdn_bwd(qkv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, cu_seqlens: torch.Tensor | None, positions: torch.Tensor | None,
                 states: torch.Tensor, tinv: torch.Tensor, do: torch.Tensor, head_k: int, head_v: int, scale: float,
                 dot_bf16: bool | None = None, t_bf16: bool | None = None, bwd_path: str | None = None,
                 q: torch.Tensor | None = None, k: torch.Tensor | None = None, v: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dqkv, dwq, dwk, dwv, dg, dbeta): the projection's gradient in one buffer (the
    conv's input gradients written into its column slices); q, k, v: the forward's conv outputs
    if it kept them, else recomputed."""
    q_in, k_in, v_in = split_qkv(qkv, head_k, head_v)
    if q is None:
        q, k, v = _convs(q_in, k_in, v_in, wq, wk, wv, positions, head_k, head_v)
    dq, dk, dv, dg, dbeta, _ = _chunk._backward(q, k, v, g, beta, None, cu_seqlens, states, tinv, do.contiguous(),
                                                None, scale, True, dot_bf16, t_bf16, bwd_path)
    del q, k, v
    B, T = qkv.shape[:2]
    dqkv = torch.empty_like(qkv)
    dwq, dwk, dwv = conv_silu_qkv_bwd(q_in, k_in, v_in, wq, wk, wv, dq.view(B, T, -1), dk.view(B, T, -1),
                                      dv.view(B, T, -1), positions, out=split_qkv(dqkv, head_k, head_v))[3:]
    return dqkv, dwq, dwk, dwv, dg, dbeta


@conv_gdn_bwd.register_fake
def _(qkv, wq, wk, wv, g, beta, cu_seqlens, positions, states, tinv, do, head_k, head_v, scale,
      dot_bf16=None, t_bf16=None, bwd_path=None, q=None, k=None, v=None):
    return (torch.empty_like(qkv), torch.empty_like(wq), torch.empty_like(wk), torch.empty_like(wv),
            torch.empty_like(g), torch.empty_like(beta))


def _conv_gdn_setup(ctx, inputs, output):
    (qkv, wq, wk, wv, g, beta, cu_seqlens, positions, head_k, head_v, scale, dot_bf16, t_bf16, bwd_path,
     keep) = inputs
    kept = output[3:6] if keep else (None, None, None)
    ctx.save_for_backward(qkv, wq, wk, wv, g, beta, cu_seqlens, positions, output[1], output[2], *kept)
    ctx.args = (head_k, head_v, scale, dot_bf16, t_bf16, bwd_path)
    ctx.set_materialize_grads(False)


def _conv_gdn_backward(ctx, do, _dstates, _dtinv, _dq, _dk, _dv):
    qkv, wq, wk, wv, g, beta, cu_seqlens, positions, states, tinv, q, k, v = ctx.saved_tensors
    head_k, head_v, scale, dot_bf16, t_bf16, bwd_path = ctx.args
    grads = conv_gdn_bwd(qkv, wq, wk, wv, g, beta, cu_seqlens, positions, states, tinv, do, head_k, head_v,
                         scale, dot_bf16, t_bf16, bwd_path, q, k, v)
    return (*grads, None, None, None, None, None, None, None, None, None)


conv_gdn_fwd.register_autograd(_conv_gdn_backward, setup_context=_conv_gdn_setup)


def conv_gated_delta_rule(qkv, wq, wk, wv, g, beta, *, head_k: int, head_v: int, scale: float | None = None,
                          cu_seqlens=None, positions=None, dot_bf16=None, t_bf16=None, bwd_path=None,
                          keep: bool = False) -> torch.Tensor:
    """silu(conv(q_in)), ... -> gated delta rule (q, k L2-normalised in the kernels) -> o [B, T, H, V].

    Args:
        qkv: [B, T, H·(2K + V)] the q, k, v projections side by side (mixer_torch.split_qkv; last
            dim contiguous). Its gradient comes back as one tensor, so the projection's backward
            is one GEMM for the input and one for the weight.
        wq, wk, wv: [H·K, W] / [H·V, W] depthwise conv weights (weight[..., W-1] multiplies the current token).
        g, beta: [B, T, H] log decay (fp32) and write strength.
        head_k, head_v: K and V.
        scale: multiplies q.
            Default: K ** -0.5.
        cu_seqlens, positions: a packed batch's document boundaries [N + 1] and in-document positions [T] (B = 1).
            Default: None.
        dot_bf16, t_bf16, bwd_path: the kernel's choices (hymo_kernels.gdn.chunk_gated_delta_rule).
        keep: keep the conv outputs for the backward (3 more [B, T, C] tensors) instead of
            recomputing them there.
            Default: False.
    """
    scale = head_k ** -0.5 if scale is None else float(scale)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32)
    return conv_gdn_fwd(qkv, wq, wk, wv, g.contiguous(), beta.contiguous(), cu_seqlens, positions, head_k, head_v,
                        scale, dot_bf16, t_bf16, bwd_path, keep)[0]


# ---------------------------------------------------------------------------------------------
# gated RMSNorm + output projection
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("hymo_kernels::gated_norm_linear_fwd", mutates_args=())
def gated_norm_linear_fwd(o: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, out_w: torch.Tensor,
                          eps: float, keep: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, the normalised product y); ``keep``: the backward reads y instead of
    recomputing it."""
    y = gated_norm_fwd(o, gate, norm_w, eps)
    return F.linear(y.view(*o.shape[:2], -1), out_w), y


@gated_norm_linear_fwd.register_fake
def _(o, gate, norm_w, out_w, eps, keep=False):
    return o.new_empty(*o.shape[:2], out_w.shape[0]), torch.empty_like(o)


@torch.library.custom_op("hymo_kernels::gated_norm_linear_bwd", mutates_args=())
def gated_norm_linear_bwd(o: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, out_w: torch.Tensor,
                          dout: torch.Tensor, eps: float, y: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if y is None:
        y = gated_norm_fwd(o, gate, norm_w, eps)  # recomputed: the forward did not keep it
    y2 = y.view(-1, out_w.shape[1])
    d2 = dout.reshape(-1, out_w.shape[0])
    dout_w = d2.t() @ y2
    dy = (d2 @ out_w).view(o.shape)
    do, dgate, dnorm_w = gated_norm_bwd(o, gate, norm_w, eps, dy)
    return do, dgate, dnorm_w, dout_w


@gated_norm_linear_bwd.register_fake
def _(o, gate, norm_w, out_w, dout, eps, y=None):
    return torch.empty_like(o), torch.empty_like(gate), torch.empty_like(norm_w), torch.empty_like(out_w)


def _gnl_setup(ctx, inputs, output):
    o, gate, norm_w, out_w, eps, keep = inputs
    ctx.save_for_backward(o, gate, norm_w, out_w, output[1] if keep else None)
    ctx.eps = eps
    ctx.set_materialize_grads(False)


def _gnl_backward(ctx, dout, _dy):
    o, gate, norm_w, out_w, y = ctx.saved_tensors
    do, dgate, dnorm_w, dout_w = gated_norm_linear_bwd(o, gate, norm_w, out_w, dout, ctx.eps, y)
    return do, dgate, dnorm_w, dout_w, None, None


gated_norm_linear_fwd.register_autograd(_gnl_backward, setup_context=_gnl_setup)


def gated_norm_linear(o: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, out_w: torch.Tensor,
                      eps: float, keep: bool = False) -> torch.Tensor:
    """out_proj(RMSNorm(o) ⊙ norm_w ⊙ SiLU(gate)).

    Args:
        o: [B, T, H, V] the recurrence's output.
        gate: [B, T, H, V] (or [B, T, H·V]) output-gate projection.
        norm_w: [V] RMSNorm weight, shared by the heads.
        out_w: [dim, H·V] output projection weight.
        eps: RMSNorm epsilon.
        keep: keep the normalised product for the backward (one more tensor like o) instead of
            recomputing it there.
            Default: False.
    Returns:
        [B, T, dim].
    """
    return gated_norm_linear_fwd(o.contiguous(), gate.contiguous().view(o.shape), norm_w, out_w, eps, keep)[0]
