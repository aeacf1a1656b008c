"""Elementwise work between matmuls recomputed in the backward instead of kept.

A SwiGLU ``w2(SiLU(w1 x) ⊙ w3 x)`` leaves three hidden-size tensors for autograd: the two
input projections (for the SiLU's and the product's gradients) and their product (for w2's
weight gradient); torch.compile's partitioner keeps all three too, since the product feeds a
matmul it cannot fuse into. The product is one elementwise op of the other two, so
``keep_matmuls`` runs such a region under selective activation checkpointing whose policy keeps
every matmul's output and recomputes everything else in the backward: one hidden-size tensor
fewer per row (a third of a SwiGLU's activations) for one elementwise kernel more in the
backward. The values and gradients are the same as without it (the recomputed ops are the same
ops on the same inputs).

Inside a block that activation checkpointing already wraps (TorchTitan's full, per-layer or
per-op AC), the outer checkpoint drops the whole region and recomputes it; keeping the matmuls'
outputs there would keep what the outer checkpoint drops. The modules that use ``keep_matmuls``
carry a ``recompute_products`` flag (``ProductRecompute``), and ``defer_to_outer_checkpoint``
turns it off in a wrapped block.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
KEPT_OPS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten._grouped_mm.default})


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_contexts = functools.partial(create_selective_checkpoint_contexts, _policy)


def keep_matmuls(fn, *args: torch.Tensor, enabled: bool = True) -> torch.Tensor:
    """``fn(*args)``; with autograd recording and ``enabled``, its backward keeps only the inputs
    and the outputs of the matmuls in ``fn`` (KEPT_OPS) and recomputes the other ops. ``fn`` must
    be free of in-place ops on its inputs and of randomness (no RNG state is restored)."""
    if not enabled or not torch.is_grad_enabled() or \
            not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts, preserve_rng_state=False)


class ProductRecompute:
    """Mixin of the modules that run their SwiGLU through ``keep_matmuls``: they pass
    ``enabled=self.recompute_products``."""

    recompute_products: bool = True


def defer_to_outer_checkpoint(module: torch.nn.Module) -> int:
    """Turns ``keep_matmuls`` off in every ``ProductRecompute`` module under ``module`` (a block
    that an outer activation checkpoint recomputes whole); returns how many."""
    found = [m for m in module.modules() if isinstance(m, ProductRecompute)]
    for m in found:
        m.recompute_products = False
    return len(found)
