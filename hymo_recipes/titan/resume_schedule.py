"""Whether a resume continues the learning-rate schedule it was saved in (preflight.py).

The WSD schedule is a function of its total steps (``lr_scheduler.total_steps``, by default
``training.steps``), and the checkpoint keeps only the position in it (the scheduler's
``last_epoch``) and each optimizer's last lr. A resume with another total recomputes the lr at
that position: extending a finished 60-step run to 120 steps puts step 61 at the full lr of
the new schedule's stable phase (0.001 -> 0.02 for NorMuon) instead of its end, and the decay
moves. The checkpoint's last lr / base lr is the factor its schedule gives the next step; when
this run's schedule gives another, one warning says so and names the total that keeps it.
"""

from __future__ import annotations

import io
import os

from hymo_recipes.titan.api import logger

SCAN = 20_000  # schedules tried when looking for the checkpoint's total (a moment's work)


def saved_scheduler(path: str) -> tuple[int, float] | None:
    """(last_epoch, lr factor of the next step) of the first scheduler in a DCP checkpoint, read
    from its shard file without a process group; None if the checkpoint has no scheduler (a
    model-only save)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata()
    keys = [k for k in metadata.state_dict_metadata if k.startswith("lr_scheduler.") and k.endswith(".last_epoch")]
    if not keys:
        return None
    prefix = keys[0][: -len("last_epoch")]
    storage = {index.fqn: info for index, info in metadata.storage_data.items()}

    def read(fqn: str):
        info = storage[fqn]
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            return torch.load(io.BytesIO(f.read(info.length)), weights_only=False)

    last_epoch, last_lr, base = read(prefix + "last_epoch"), read(prefix + "_last_lr"), read(prefix + "base_lrs")
    return int(last_epoch), float(last_lr[0]) / float(base[0])


def candidate_totals(cfg, last_epoch: int, factor: float) -> list[int]:
    """Totals whose schedule (this config's fractions) gives ``factor`` at step last_epoch + 1."""
    from hymo_recipes.scheduler import WSDSchedule

    def fits(total: int) -> bool:
        s = WSDSchedule.from_fractions(total, cfg.warmup_fraction, cfg.stable_fraction, cfg.decay_fraction,
                                       cfg.decay_type, cfg.min_lr_factor)
        return abs(s.factor(last_epoch + 1) - factor) <= 1e-9 * max(1.0, factor)

    if last_epoch >= 1 and fits(last_epoch) and abs(factor - cfg.min_lr_factor) <= 1e-9:
        return [last_epoch]  # the schedule had ended: the run that wrote it was this long
    return [t for t in range(max(last_epoch, 1), max(last_epoch, 1) + SCAN) if fits(t)]


def check_schedule_continues(config, path: str) -> None:
    """One warning if resuming from the checkpoint in ``path`` changes the lr at its step."""
    from hymo_recipes.scheduler import wsd_schedule

    if "lr_scheduler" in config.checkpoint.exclude_from_loading:
        return
    saved = saved_scheduler(path)
    if saved is None:
        return
    last_epoch, factor = saved
    schedule = wsd_schedule(config.lr_scheduler, config.training.steps)
    new = schedule.factor(last_epoch + 1)
    if abs(new - factor) <= 1e-6 * max(1.0, factor):
        return
    totals = candidate_totals(config.lr_scheduler, last_epoch, factor)
    if len(totals) == 1:
        keep = f"--lr_scheduler.total_steps {totals[0]}"
    elif totals:
        keep = (f"--lr_scheduler.total_steps set to the checkpoint run's steps (its schedule fits "
                f"{totals[0]}..{totals[-1]})")
    else:
        keep = "--lr_scheduler.total_steps set to the checkpoint run's training.steps"
    logger.warning(f"resuming at step {last_epoch + 1} with a schedule of {schedule.total_steps:,} steps changes the "
                   f"learning rate there from {factor:.4g} to {new:.4g} × the peak (the checkpoint was written "
                   f"under another total: training.steps or lr_scheduler.total_steps changed); to keep its schedule "
                   f"pass {keep}")
