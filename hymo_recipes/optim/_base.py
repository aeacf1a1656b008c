"""The step loop that NorMuon and CautiousAdamW share: each non-empty group in one batched call."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer


class GroupStepOptimizer(Optimizer):
    """``step`` runs the closure, then ``_step_group`` once per param group that has params."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["params"]:
                self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError  # abstract: each optimizer supplies its update
