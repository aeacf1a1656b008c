"""Skip the optimizer step on a non-finite loss or gradient; stop after too many in a row.

How it is wired into TorchTitan's train loop (through the loss function and the optimizer
container, not through the Trainer):

- The loss function passes every training microbatch's loss through ``on_loss``: it remembers,
  on the device and without a host sync, whether the loss was NaN/Inf, and (test hook) turns the
  loss of the steps listed in ``inject_nan_steps`` into NaN.
- ``HymoOptimizersContainer.step`` asks it before any optimizer runs: ``flag(grads)`` folds the
  loss flag together with the gradients' finiteness and max-reduces it over all ranks (every
  rank must take the same decision, or FSDP's next collectives hang), on the device; ``decide``
  reads it on the host, one sync per step (``check_step`` is the two in one). On a skip no
  optimizer runs, so no parameter or optimizer state changes; the container sets
  ``last_step_skipped``, the scheduler container then does not advance and the MoE step hook
  discards the step's routing counts without touching the balancing bias.
- A CUDA-graphed optimizer step (after its warm-up) launches its replay between the two
  halves, its state writes keeping the old values where the flag says so
  (hymo_recipes/optim/graph.py), and the host reads the verdict later: ``count`` numbers the
  step at once, ``decide(bad, step)`` judges it at the container's ``resolve`` (the next step's
  optimizer step, a logging step, the last step, or before a checkpoint is written or loaded).
  Until then the MoE update follows the flag on the device (``pending_go``) and the schedule's
  step waits for the verdict; the skip's warning comes then, without the parameters' names.
- After ``consecutive_limit`` skips in a row ``decide`` raises NonFiniteTrainingError from
  inside ``optimizers.step()`` (a replayed step's: from the next step's, or from ``resolve``
  before a save starts or after the logging or last step), i.e. before TorchTitan's
  ``checkpointer.save`` writes the skipped state, so the newest checkpoint on disk is one that
  was completely written before the bad run began (a DCP checkpoint counts only once its
  ``.metadata`` exists, and DCP writes that file last, via a temporary file and a rename).

The guard counts train steps itself (``steps_done``: every ``count``, skipped or not, i.e.
TorchTitan's ``trainer.step`` after the step) because neither the loss function nor the
optimizers see the trainer. Its counters travel in the optimizer checkpoint (see
``state_dict``), so step numbers, the injected steps and the skip total continue across a resume.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["NonFiniteGuard", "NonFiniteTrainingError"]


class NonFiniteTrainingError(RuntimeError):
    pass


class NonFiniteGuard:
    """Decides, counts and reports skipped steps.

    Args:
        consecutive_limit (int):
            Stop after this many skipped steps in a row; 0 never stops. Default: ``5``.
        inject_nan_steps (Sequence[int]):
            1-based train steps whose loss ``on_loss`` turns into NaN (a test hook).
            Default: ``()``.
    """

    def __init__(self, consecutive_limit: int = 5, inject_nan_steps: Sequence[int] = ()):
        if consecutive_limit < 0:
            raise ValueError(f"consecutive_nan_limit must be >= 0, got {consecutive_limit}")
        bad = [s for s in inject_nan_steps if int(s) < 1]
        if bad:
            raise ValueError(f"inject_nan_steps are 1-based train steps, got {bad}")
        self.consecutive_limit = consecutive_limit
        self.inject_nan_steps = frozenset(int(s) for s in inject_nan_steps)
        self.steps_done = 0
        self.skipped_total = 0
        self.consecutive = 0
        self.last_skipped_step: int | None = None
        self._loss_bad: torch.Tensor | None = None  # this step's losses so far, on the device

    @property
    def current_step(self) -> int:
        """The 1-based train step in progress (TorchTitan's ``trainer.step`` during train_step)."""
        return self.steps_done + 1

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Called by the loss function with each training microbatch's loss; returns the loss
        to backpropagate (NaN on an injected step: multiplying keeps the autograd graph, so the
        gradients become NaN too, as they would after a real blow-up)."""
        if self.current_step in self.inject_nan_steps:
            loss = loss * float("nan")
        bad = (~torch.isfinite(loss.detach())).any()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
        return loss

    def check_step(self, grads: list[torch.Tensor]) -> bool:
        """True if this step may update: every rank's losses (seen by ``on_loss``) and local
        gradient shards are finite. Counts the step; raises NonFiniteTrainingError at the limit.
        Every rank must call it (it all-reduces on the default group)."""
        return self.decide(self.flag(grads))

    def flag(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The step's verdict on the device, without a host sync: a 0-d float tensor, 1 where
        any rank's loss or local gradient shard is non-finite, else 0 (max-reduced over the
        default group). Hand it to ``decide``; a CUDA-graphed optimizer step reads it on the
        device first (hymo_recipes/optim/graph.py)."""
        loss_bad, self._loss_bad = self._loss_bad, None
        if grads:
            # A NaN/Inf entry makes its tensor's norm non-finite: one multi-tensor pass.
            norms = torch._foreach_norm(grads)  # grouped by device and dtype
            bad = ~torch.isfinite(torch.stack([n.float() for n in norms])).all()
        else:
            device = loss_bad.device if loss_bad is not None else "cpu"
            bad = torch.zeros((), dtype=torch.bool, device=device)
        if loss_bad is not None:
            bad = bad | loss_bad.to(bad.device)
        bad = bad.float()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # On the gradients' device: NCCL needs CUDA tensors, gloo takes CPU ones.
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad

    def count(self) -> int:
        """Counts the step in progress before its verdict is read (``decide(bad, step)``, later);
        returns its number."""
        step = self.current_step
        self.steps_done += 1
        return step

    def decide(self, bad: torch.Tensor, step: int | None = None) -> bool:
        """Reads ``flag``'s verdict on the host, counts the step (unless ``count`` did: ``step``
        is then its number) and returns whether it may update; raises NonFiniteTrainingError at
        the limit."""
        if step is None:
            step = self.count()
        if not bool(bad.item()):
            self.consecutive = 0
            return True
        self.skipped_total += 1
        self.consecutive += 1
        self.last_skipped_step = step
        if self.consecutive_limit and self.consecutive >= self.consecutive_limit:
            raise NonFiniteTrainingError(
                f"{self.consecutive} consecutive training steps (through step {step}) had a "
                f"non-finite loss or gradient; each was skipped without changing the model, the "
                f"optimizer state, the MoE balancing or the lr schedule. Stopping "
                f"(optimizer.consecutive_nan_limit = {self.consecutive_limit}); the newest "
                f"complete checkpoint is the last good state. Lower the learning rate or inspect "
                f"the data around this step before resuming."
            )
        return False

    def metrics(self) -> dict[str, int]:
        """For tensorboard: skipped steps so far (across resumes) and the current run of skips."""
        return {"skipped_steps": self.skipped_total, "consecutive_skipped": self.consecutive}

    # Checkpointed inside the optimizer container's state (plain ints, identical on every rank).
    def state_dict(self) -> dict[str, int]:
        return {"steps_done": self.steps_done, "skipped_total": self.skipped_total,
                "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps_done = int(state["steps_done"])
        self.skipped_total = int(state["skipped_total"])
        self.consecutive = int(state["consecutive"])
