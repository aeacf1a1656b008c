"""Skip the optimizer step on a non-finite loss or gradient; stop after too many in a row.

The trainer calls ``guard.step_ok(step, loss, grad_norm)`` after gradient clipping and before
``optimizers.step()``. On False it must skip ``optimizers.step()`` *and*
``lr_schedulers.step()`` (the container's step hooks, i.e. the MoE bias update, then do not run
either) and discard the step's MoE load counters. ``grad_norm`` from ``clip_grad_norm_`` is
already a global value; the loss is per rank, so the flag is max-reduced over all ranks: every
rank takes the same decision, otherwise FSDP's next collectives would hang.

After ``consecutive_limit`` skips in a row ``step_ok`` raises ``NonFiniteTrainingError`` before
anything is written, so the newest checkpoint on disk is the last good one.

Test hook: ``inject_nan_steps`` lists train steps whose loss ``maybe_inject`` turns into NaN
(multiplying by NaN keeps the autograd graph, so the gradients become NaN as well).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["NonFiniteGuard", "NonFiniteTrainingError"]


class NonFiniteTrainingError(RuntimeError):
    pass


class NonFiniteGuard:
    """Counts and decides skipped steps.

    Args:
        consecutive_limit (int):
            Stop after this many skipped steps in a row; 0 disables the stop. Default: ``5``.
        inject_nan_steps (tuple[int, ...]):
            1-based train steps whose loss is poisoned by ``maybe_inject`` (tests only).
            Default: ``()``.
    """

    def __init__(self, consecutive_limit: int = 5, inject_nan_steps: tuple[int, ...] = ()):
        if consecutive_limit < 0:
            raise ValueError(f"consecutive_nan_limit must be >= 0, got {consecutive_limit}")
        self.consecutive_limit = consecutive_limit
        self.inject_nan_steps = frozenset(int(s) for s in inject_nan_steps)
        self.skipped_total = 0
        self.consecutive = 0
        self.last_skipped_step: int | None = None

    def maybe_inject(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if step in self.inject_nan_steps:
            return loss * float("nan")
        return loss

    def step_ok(self, step: int, loss, grad_norm) -> bool:
        """True if the step's loss and gradient norm are finite on every rank."""
        # On the loss's device: with NCCL the all-reduce needs a CUDA tensor.
        device = loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu")
        bad = torch.maximum(_nonfinite(loss, device), _nonfinite(grad_norm, device))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        # One host sync per step: the skip is a host-side decision.
        if not bool(bad.item()):
            self.consecutive = 0
            return True
        self.skipped_total += 1
        self.consecutive += 1
        self.last_skipped_step = step
        if self.consecutive_limit and self.consecutive >= self.consecutive_limit:
            raise NonFiniteTrainingError(
                f"{self.consecutive} consecutive training steps (through step {step}) had a "
                f"non-finite loss or gradient norm; each was skipped without changing the model, "
                f"optimizer or lr schedule. Stopping (hymo.consecutive_nan_limit = "
                f"{self.consecutive_limit}); the newest checkpoint is the last good state. "
                f"Lower the learning rate or inspect the data around this step before resuming."
            )
        return False

    def state(self) -> dict[str, int]:
        """For metrics: total skipped steps and the current run of skips."""
        return {"skipped_steps": self.skipped_total, "consecutive_skipped": self.consecutive}


def _nonfinite(x, device: torch.device) -> torch.Tensor:
    """1.0 if x (tensor, DTensor or number) has a NaN/Inf, else 0.0; a 0-d tensor on device."""
    if isinstance(x, torch.Tensor):
        if hasattr(x, "full_tensor"):  # a DTensor norm: make it a plain value
            x = x.full_tensor()
        return (~torch.isfinite(x.detach().float())).any().float().to(device)
    return torch.tensor(0.0 if math.isfinite(float(x)) else 1.0, device=device)
