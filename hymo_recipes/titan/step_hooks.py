"""What runs once after every optimizer step: close the step's loss stats, balance the MoE.

Any HyMo optimizers builder calls ``register_step_hooks(optimizers, model_parts,
parallel_dims, stats)`` on the container it returns (TorchTitan's ``OptimizersContainer`` fires
container-level hooks once per train step, not per inner optimizer).

MoE contract (``hymo_recipes.model.moe``): the MoE modules are the ``MoE`` instances; during
forward each adds to ``tokens_per_expert`` (fp32 [E], routed token-expert assignments
before the capacity limit) and ``dropped_tokens`` (fp32 [E], those over the capacity), and
``reset_load_counters`` zeroes both. After each step this hook sums both over the
data-parallel ranks (one all-reduce for all layers), feeds the global counts to
``update_expert_biases`` (every layer's ``update_expert_bias`` in one batch of launches: an EMA
of load *shares*, so the double count under activation checkpointing does not move the bias),
leaves them in the run's ``StepStats`` for the metrics and resets the counters. Every rank
applies the same update, so the replicated bias stays identical.

A step the optimizer container skipped (``last_step_skipped``: a NaN/Inf loss or gradient,
hymo_recipes/optim/nan_guard.py) must change nothing: its counts are still all-reduced and
shown in the metrics (where the bad step routed its tokens is a useful diagnostic), but they
are discarded, not fed to ``update_expert_bias``: the EMA and the bias stay as they were, and
the next step starts from zeroed counters (its update sees only its own tokens). After a
replayed optimizer step (``optimizer.cuda_graph``) the host has not read the verdict yet: the
update then runs under the step's device flag (``pending_go``), which keeps the EMA and the bias
where the step was skipped.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hymo_recipes.model.moe import MoE, reset_load_counters, update_expert_biases
from hymo_recipes.titan.metrics import StepStats


def moe_modules(model_parts: list[nn.Module]) -> list[nn.Module]:
    return [m for part in model_parts for m in part.modules() if isinstance(m, MoE)]


@torch.no_grad()
def balance_experts(moes: list[nn.Module], loss_mesh, stats: StepStats, *, update: bool = True,
                    go: torch.Tensor | None = None) -> None:
    """All-reduce each MoE's counters over ``loss_mesh`` (None: single rank), update its bias
    (unless ``update`` is False: a skipped step; where the 0-d bool ``go`` holds False on the
    device, the update leaves the bias and its EMA as they were), record the global counts in
    ``stats`` and zero the counters."""
    # [2, L, E]: routed and dropped assignments per layer and expert
    counts = torch.stack([m.tokens_per_expert for m in moes]
                         + [m.dropped_tokens for m in moes]).view(2, len(moes), -1)  # one launch
    if loss_mesh is not None:
        torch.distributed.all_reduce(counts, group=loss_mesh.get_group())
    load, dropped = counts
    if update:
        update_expert_biases(moes, load, go)
    reset_load_counters(moes)
    stats.moe_load, stats.moe_dropped = load, dropped


def register_step_hooks(optimizers, model_parts: list[nn.Module], parallel_dims, stats: StepStats) -> None:
    """Registers the after-step hook on ``optimizers`` and publishes its NaN guard (if any) in
    ``stats`` for the loss function, which is built before the optimizers."""
    moes = moe_modules(model_parts)
    loss_mesh = parallel_dims.get_optional_mesh("loss")
    stats.nan_guard = getattr(optimizers, "nan_guard", None)

    def after_step(*args, **kwargs):
        stats.end_step()
        if moes:
            skipped = getattr(optimizers, "last_step_skipped", False)
            # a replayed step's verdict is read later: its update follows the device flag
            balance_experts(moes, loss_mesh, stats, update=not skipped, go=getattr(optimizers, "pending_go", None))

    optimizers.register_step_post_hook(after_step)
