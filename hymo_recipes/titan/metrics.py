"""HyMo's training metrics on top of TorchTitan's: each head's loss and the MoE load.

TorchTitan already logs loss, grad norm, lr, tokens/s, MFU and memory. HyMo adds, per logged
step (tensorboard tags):
- ``loss_metrics/main_ce`` and ``loss_metrics/mtp_<k>_ce``: each head's mean cross-entropy over
  the step's valid targets, all data-parallel ranks (the logged ``global_avg_loss`` is the
  training objective, main + weighted MTP);
- ``moe/max_load`` and ``moe/min_load``: the most and least loaded expert over all MoE layers,
  as a multiple of its layer's mean load (1.0 = balanced);
- ``moe/dropped_frac``: routed token-expert assignments dropped by the capacity limit, as a
  fraction of all assignments;
- ``lr/<optimizer class>``: each optimizer's current lr (its first parameter group), since
  TorchTitan's ``lr`` is the first scheduler's only;
- ``optimizer/skipped_steps`` and ``optimizer/consecutive_skipped``: steps skipped for a
  non-finite loss or gradient, in the whole run (across resumes) and in a row right now;
- ``time_metrics/optimizer_step(s)`` and ``time_metrics/optimizer_step(%)``: mean time of the
  optimizer container's step (NaN check + every optimizer, optimizers.py ``StepTimer``)
  since the last log, and its share of the wall time over the same interval;
  ``time_metrics/optimizer_step_<name>(s)`` and ``(%)`` the same per part (``nan_check``, then
  each optimizer by name: ``normuon``, ``cautious_adamw``; with ``optimizer.cuda_graph``
  ``stage`` for the gradients' copy into the graph's buffers before the NaN check, then one
  ``graph`` for the replayed step).
The MoE numbers are ratios on purpose: activation checkpointing re-runs a block's forward in
backward, which counts every routed and dropped token twice; a ratio is unaffected.

The loss function, the after-step hook and the metrics processor are built separately by
TorchTitan's Trainer and never see each other: they share one ``StepStats``, which the TrainSpec's
builders hand to each of them (``hymo_recipes.titan.spec.HymoBuilders``: one per Trainer).
"""

from __future__ import annotations

import time

import torch

from hymo_recipes.titan.api import MetricsProcessor, logger


class StepStats:
    """Numbers a step leaves for the metrics processor. Counters stay on the device: nothing
    here synchronises with the host except ``HymoMetricsProcessor.log`` on logged steps."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._head_sums = self._head_counts = None  # the step in progress
        self.head_sums = self.head_counts = None  # [1 + mtp_depth], the last finished step
        self.moe_load = None  # [n_moe_layers, n_experts] routed tokens, all ranks
        self.moe_dropped = None  # [n_moe_layers, n_experts] dropped tokens, all ranks
        # The optimizer container's NonFiniteGuard (step_hooks.register_step_hooks sets it);
        # the loss function passes each training loss through it.
        self.nan_guard = None

    def add_head_losses(self, sums: torch.Tensor, counts: torch.Tensor) -> None:
        if self._head_sums is None:
            self._head_sums, self._head_counts = sums.clone(), counts.clone()
        else:
            self._head_sums += sums
            self._head_counts += counts

    def end_step(self) -> None:
        """Called once per optimizer step (see step_hooks.py), after all its microbatches."""
        self.head_sums, self.head_counts = self._head_sums, self._head_counts
        self._head_sums = self._head_counts = None


class HymoMetricsProcessor(MetricsProcessor):
    """TorchTitan's MetricsProcessor plus the per-head losses and MoE load (module docstring),
    read from ``stats``."""

    def __init__(self, job_config, parallel_dims, tag=None, *, stats: StepStats):
        super().__init__(job_config, parallel_dims, tag)
        self.stats = stats

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        extra = dict(extra_metrics or {})
        extra.update(self._hymo_metrics())
        extra.update(self._optimizer_lrs())
        extra.update(self._optimizer_step_metrics())
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

    def _hymo_metrics(self) -> dict[str, float]:
        names, values = [], []
        stats = self.stats
        if stats.head_sums is not None:
            sums_counts = torch.cat([stats.head_sums, stats.head_counts])
            loss_mesh = self.parallel_dims.get_optional_mesh("loss")
            if loss_mesh is not None:
                torch.distributed.all_reduce(sums_counts, group=loss_mesh.get_group())
            sums, counts = sums_counts.chunk(2)
            names += ["loss_metrics/main_ce"] + [f"loss_metrics/mtp_{k}_ce"
                                                 for k in range(1, len(sums))]
            values.append(sums / counts)
        if stats.moe_load is not None:
            share = stats.moe_load / stats.moe_load.mean(dim=1, keepdim=True)
            names += ["moe/max_load", "moe/min_load", "moe/dropped_frac"]
            values.append(torch.stack([share.max(), share.min(),
                                       stats.moe_dropped.sum() / stats.moe_load.sum()]))
        if not names:
            return {}
        # One host sync for all of them.
        metrics = dict(zip(names, torch.cat([v.float().flatten() for v in values]).tolist()))
        logger.info("  ".join(f"{name.split('/')[-1]}: {value:.4f}"
                              for name, value in metrics.items()))
        return metrics

    def _optimizer_step_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        guard = getattr(self.optimizers, "nan_guard", None)
        if guard is not None:
            out.update({f"optimizer/{k}": v for k, v in guard.metrics().items()})
        timer = getattr(self.optimizers, "step_timer", None)
        if timer is not None:
            seconds, steps = timer.collect()
            # the same interval TorchTitan's time_metrics/end_to_end(s) divides up
            elapsed = time.perf_counter() - self.time_last_log
            if steps:
                out["time_metrics/optimizer_step(s)"] = seconds / steps
                out["time_metrics/optimizer_step(%)"] = 100 * seconds / elapsed
                for name, lap in getattr(timer, "last_laps", {}).items():
                    out[f"time_metrics/optimizer_step_{name}(s)"] = lap / steps
                    out[f"time_metrics/optimizer_step_{name}(%)"] = 100 * lap / elapsed
        return out

    def _optimizer_lrs(self) -> dict[str, float]:
        lrs: dict[str, float] = {}
        for i, optimizer in enumerate(self.optimizers or ()):
            name = f"lr/{type(optimizer).__name__}"
            lrs[name if name not in lrs else f"{name}_{i}"] = optimizer.param_groups[0]["lr"]
        return lrs

