"""Main + multi-token-prediction (MTP) cross-entropy under TorchTitan's loss contract.

TorchTitan calls ``loss_fn(pred, labels)`` once per microbatch, expects a **sum** over tokens,
and divides it by the global number of main-head labels != -100 (all microbatches, all
data-parallel ranks). HyMo's ``pred`` is ``(logits, mtp_logits)``: head k (1-based) at
position t predicts ``labels[:, t + k]``, so it scores ``mtp_logits[k-1][:, :T-k]`` against
``labels[:, k:]`` and has fewer valid targets than the main head. With ``fused_loss_chunk`` > 0
the trainer hands the model the labels and ``pred`` is the model's ``HeadLosses``: those sums
and counts, computed in chunks without full logits (hymo_recipes/model/linear_ce.py).

Returned sum = CE_main_sum + sum_k w_k * CE_k_sum * (n_main / n_k), with n_* the microbatch's
valid-target counts. After TorchTitan's division by the global main count N_main, the MTP term
is w_k times head k's mean CE whenever n_main / n_k is the same in every microbatch, which holds
for TorchTitan's packed data (no -100 labels: the ratio is T / (T - k)). With -100 labels the
ratio varies between microbatches and each is weighted by its own ratio (documented, not
corrected). The per-head means reported to tensorboard are exact in both cases: they are
global sums over global counts.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.nn.functional as F

from hymo_recipes.model.model import HeadLosses
from hymo_recipes.model.mtp import shift_for_head
from hymo_recipes.titan.api import IGNORE_INDEX, logger
from hymo_recipes.titan.metrics import StepStats


def head_ce_sums(logits: torch.Tensor, mtp_logits: Sequence[torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head CE sums and valid-target counts, main head first.

    Args:
        logits: [B, T, V] main-head logits.
        mtp_logits: depth tensors of [B, T, V]; entry k-1 is MTP head k.
        labels: [B, T] int64 next-token targets, IGNORE_INDEX where there is none.

    Returns:
        ``(sums, counts)``, both fp32 [1 + depth].
    """
    sums, counts = [], []
    for k, head in enumerate([logits, *mtp_logits]):
        pred, target = shift_for_head(head, labels, k)
        sums.append(F.cross_entropy(pred.flatten(0, 1).float(), target.flatten(0, 1),
                                    reduction="sum", ignore_index=IGNORE_INDEX))
        counts.append((target != IGNORE_INDEX).sum())
    return torch.stack(sums), torch.stack(counts).float()


class MTPLoss:
    """TorchTitan loss function for HyMo: see the module docstring.

    Args:
        mtp_loss_weights: one weight per MTP head (the model's ``mtp_depth`` entries).
        stats: where each training microbatch's per-head sums and counts go (the metrics read
            them), and whose ``nan_guard`` (once the optimizers set it) sees each training loss.
        compile_backend: if set, ``head_ce_sums`` is compiled with this torch.compile backend.
            Default: ``None``
    """

    def __init__(self, mtp_loss_weights: Sequence[float], stats: StepStats,
                 compile_backend: str | None = None):
        self.stats = stats
        self.weights = torch.tensor([1.0, *mtp_loss_weights])
        self._head_ce_sums = (torch.compile(head_ce_sums, backend=compile_backend)
                              if compile_backend else head_ce_sums)
        self._training = True

    def __call__(self, pred, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(pred, HeadLosses):  # the model computed them from the labels it was given
            sums, counts = pred
            heads = sums.shape[0] - 1
        else:
            logits, mtp_logits = pred
            heads = len(mtp_logits)
        if heads != len(self.weights) - 1:
            raise ValueError(f"the model returned {heads} MTP heads but the loss has "
                             f"{len(self.weights) - 1} weights (mtp_loss_weights)")
        if not isinstance(pred, HeadLosses):
            sums, counts = self._head_ce_sums(logits, mtp_logits, labels)
        if not self._training:
            return sums[0]
        self.stats.add_head_losses(sums.detach(), counts)
        if self.weights.device != sums.device:
            self.weights = self.weights.to(sums.device)
        # n_main / n_k; clamp: a head with no valid target contributes 0, not NaN.
        scale = self.weights * counts[0] / counts.clamp(min=1)
        loss = (sums * scale).sum()
        if self.stats.nan_guard is not None:
            # Notes a NaN/Inf loss for the optimizer step's skip decision (and, on the steps of
            # optimizer.inject_nan_steps, makes it NaN: a test hook).
            loss = self.stats.nan_guard.on_loss(loss)
        return loss

    @contextlib.contextmanager
    def evaluating(self):
        """Inside: returns only the main-head CE sum and records nothing (validation)."""
        self._training = False
        try:
            yield
        finally:
            self._training = True


def build_mtp_loss(job_config, *, mtp_loss_weights: Sequence[float], stats: StepStats, **kwargs) -> MTPLoss:
    """Builds the loss; the weights come from the model flavor (hymo_recipes/titan/spec.py)."""
    del kwargs  # parallel_dims: unused
    backend = None
    if job_config.compile.enable and "loss" in job_config.compile.components:
        logger.info("Compiling the MTP loss's full-logits path with torch.compile (validation, and training "
                    "with fused_loss_chunk = 0)")
        backend = job_config.compile.backend
    return MTPLoss(mtp_loss_weights, stats, compile_backend=backend)
