"""The readout and its cross-entropy in chunks of tokens, never holding a whole head's logits.

``linear_cross_entropy(h, weight, targets, chunk)`` is the sum that
``linear_cross_entropy_reference`` computes through full logits, ``F.cross_entropy(F.linear(h,
weight).float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)``, computed ``chunk``
tokens at a time. When a gradient is wanted, each chunk's gradient is taken in the forward,
while its logits exist (softmax − one-hot, zero on ignored targets; the gradients of h and of
the weight by two matmuls), so the forward keeps only dh [N, D] and dW [V, D] for the backward
instead of [N, V] logits and log-probabilities; the backward scales them by the incoming
gradient of the sum. First-order only (``once_differentiable``), and the weight must not change
between the forward and the backward (true of a training step).

Numerics follow the reference: h and the weight in their dtype (autocast's, when it is on, as
``F.linear`` would cast them), logits in that dtype (the matmul accumulates in fp32), the
softmax and the loss in fp32, the logits' gradient rounded to that dtype before its two matmuls;
each chunk's dW product in that dtype, summed over the chunks in fp32 (or the weight's dtype if
wider). The per-chunk elementwise work is ``ce_chunk`` (``hymo_kernels.ce``) or what the caller
passes instead (the parallelize function hands the model the Triton kernel on a GPU and a
compiled ``ce_chunk`` on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from hymo_kernels.ce import IGNORE_INDEX, ce_chunk

__all__ = ["IGNORE_INDEX", "ce_chunk", "linear_cross_entropy", "linear_cross_entropy_reference"]


def _chunks(h, weight, targets, chunk, chunk_fn, want_h: bool, want_w: bool):
    """(sum, dh or None, dW or None) over the chunks of the rows of h."""
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if want_h else None
    acc = torch.promote_types(weight.dtype, torch.float32)  # dW's sum over the chunks: fp32 at least
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
    for start in range(0, h.shape[0], chunk):
        hc = h[start:start + chunk]
        loss, grad = chunk_fn(hc @ weight.t(), targets[start:start + chunk], want_h or want_w)
        total += loss
        if want_h:
            torch.matmul(grad, weight, out=dh[start:start + chunk])
        if want_w:
            dw += grad.t() @ hc
    return total, dh, dw


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, chunk_fn
                ) -> torch.Tensor:
        total, dh, dw = _chunks(h, weight, targets, chunk, chunk_fn, ctx.needs_input_grad[0],
                                ctx.needs_input_grad[1])
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total: torch.Tensor):
        dh, dw = ctx.saved_tensors
        # the scale applied in fp32 (or wider): rounded to bf16 first it would bias every gradient alike
        scale = lambda g: (g.to(torch.promote_types(g.dtype, torch.float32)) * grad_total).to(g.dtype)  # noqa: E731
        return (scale(dh) if dh is not None else None,
                scale(dw).to(ctx.weight_dtype) if dw is not None else None, None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                         chunk_fn=ce_chunk) -> torch.Tensor:
    """Sum over the targets != IGNORE_INDEX of the cross-entropy of ``h @ weight.T``, as fp32 [].

    Args:
        h: [N, D] the readout's input (any leading shape is flattened).
        weight: [V, D] the readout.
        targets: [N] int64 class indices or IGNORE_INDEX.
        chunk: tokens per chunk (> 0); the peak extra memory is a few [chunk, V] tensors.
        chunk_fn: ``ce_chunk`` or a function that computes the same (e.g. it, compiled).
    """
    if chunk <= 0:
        raise ValueError(f"linear_cross_entropy: chunk must be positive, got {chunk}")
    h = h.reshape(-1, h.shape[-1])
    targets = targets.reshape(-1)
    if targets.shape[0] != h.shape[0]:
        raise ValueError(f"linear_cross_entropy: {h.shape[0]} rows of h but {targets.shape[0]} targets")
    if h.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_cross_entropy: h has {h.shape[-1]} features, the weight {weight.shape[-1]}")
    device = h.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        # the matmul's dtype, as F.linear would cast to it (a norm before the readout may return fp32)
        dtype = torch.get_autocast_dtype(device)
        h, weight = h.to(dtype), weight.to(dtype)
    if not (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)):
        return _chunks(h, weight, targets, chunk, chunk_fn, False, False)[0]
    return _LinearCrossEntropy.apply(h, weight, targets, chunk, chunk_fn)


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same sum through full logits (what the loss function computes without chunking)."""
    logits = F.linear(h.reshape(-1, h.shape[-1]), weight)
    return F.cross_entropy(logits.float(), targets.reshape(-1), reduction="sum", ignore_index=IGNORE_INDEX)
