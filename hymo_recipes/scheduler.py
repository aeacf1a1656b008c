"""Warmup–stable–decay (WSD) learning-rate factor by fractions of the run (DESIGN.md §3).

Step convention (the one TorchTitan's train loop uses): ``step`` is the 1-based train step,
i.e. ``trainer.step`` while ``train_step`` runs; the optimizer update of step s uses
``wsd_factor(s)``. TorchTitan steps the LambdaLR once after every optimizer step, so when step
s runs the scheduler's ``last_epoch`` is s − 1 and the lambda adds the 1 back.

With W = ⌊T·warmup⌋, S = ⌊T·stable⌋ and D = T − W − S (the decay absorbs the rounding, so the
last step T ends exactly at ``min_lr_ratio``):

    s ≤ W:          s / W                                     (0.5 at s = W/2; never 0)
    W < s ≤ W + S:  1
    s > W + S:      min + (1 − min) · f(p),  p = min(1, (s − W − S) / D)
                    f = 1 − p (linear) | (1 + cos πp)/2 (cosine) | 1 − √p (sqrt)

Seed example, T = 57,220 (0.02/0.83/0.15, linear, min 0.05): W = 1,144, S = 47,492, D = 8,584;
0.5 at step 572, 1.0 from 1,144 through 48,636, 0.525 at the decay midpoint 52,928, 0.05 at
57,220. (The seed quotes 0.525 at 52,884; that step is 4,248/8,584 = 0.495 into the decay, so its
factor is 0.5299: an arithmetic slip in the seed, see tests/optim/test_scheduler.py.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["WSDSchedule", "wsd_factor", "make_wsd_lambda", "wsd_schedule"]

DECAY_TYPES = ("linear", "cosine", "sqrt")


@dataclass(frozen=True)
class WSDSchedule:
    """Validated WSD phases in steps. Build with ``WSDSchedule.from_fractions``."""

    total_steps: int
    warmup_steps: int
    stable_steps: int
    decay_steps: int
    decay_type: str = "linear"
    min_lr_ratio: float = 0.05

    @classmethod
    def from_fractions(
        cls,
        total_steps: int,
        warmup: float = 0.02,
        stable: float = 0.83,
        decay: float = 0.15,
        decay_type: str = "linear",
        min_lr_ratio: float = 0.05,
    ) -> "WSDSchedule":
        """Raises ValueError for fractions that are negative or do not sum to 1, etc."""
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"WSD total_steps must be a positive int, got {total_steps!r}")
        fracs = {"warmup": warmup, "stable": stable, "decay": decay}
        for name, f in fracs.items():
            if not (isinstance(f, (int, float)) and math.isfinite(f) and 0.0 <= f <= 1.0):
                raise ValueError(f"WSD {name} fraction must be a number in [0, 1], got {f!r}")
        if abs(warmup + stable + decay - 1.0) > 1e-6:
            raise ValueError(
                f"WSD fractions must sum to 1: warmup {warmup} + stable {stable} + decay {decay} "
                f"= {warmup + stable + decay}"
            )
        if decay_type not in DECAY_TYPES:
            raise ValueError(f"WSD decay_type must be one of {DECAY_TYPES}, got {decay_type!r}")
        if not (math.isfinite(min_lr_ratio) and 0.0 <= min_lr_ratio <= 1.0):
            raise ValueError(f"WSD min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
        # Decimal arithmetic: ⌊57,220 × 0.83⌋ is 47,492, and ⌊100 × 0.29⌋ is 29, not the 28 that
        # binary floating point (28.999999999999996) would give.
        w = math.floor(Fraction(str(warmup)) * total_steps)
        s = math.floor(Fraction(str(stable)) * total_steps)
        if warmup > 0:
            w = max(w, 1)  # a requested warmup is at least one step
        s = min(s, total_steps - w)
        d = total_steps - w - s
        if decay == 0.0:
            s, d = s + d, 0  # no decay asked: the rounding remainder stays stable
        return cls(total_steps, w, s, d, decay_type, float(min_lr_ratio))

    @property
    def stable_end(self) -> int:
        """The last step at the full learning rate."""
        return self.warmup_steps + self.stable_steps

    def factor(self, step: int) -> float:
        """LR multiplier for 1-based train step ``step`` (steps past the end hold the minimum)."""
        if step <= self.warmup_steps:
            return max(step, 0) / self.warmup_steps
        if step <= self.stable_end or self.decay_steps == 0:
            return 1.0
        p = min(1.0, (step - self.stable_end) / self.decay_steps)
        if self.decay_type == "linear":
            f = 1.0 - p
        elif self.decay_type == "cosine":
            f = 0.5 * (1.0 + math.cos(math.pi * p))
        else:  # "sqrt" (Hägele et al. 2024: 1 − sqrt cooldown beats linear)
            f = 1.0 - math.sqrt(p)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * f


def wsd_factor(
    step: int,
    total_steps: int,
    fractions: tuple[float, float, float] = (0.02, 0.83, 0.15),
    decay_type: str = "linear",
    min_lr_ratio: float = 0.05,
) -> float:
    """Pure function: the WSD factor of 1-based train step ``step`` (see module docstring)."""
    sched = WSDSchedule.from_fractions(total_steps, *fractions, decay_type, min_lr_ratio)
    return sched.factor(step)


def _lambda(last_epoch: int, schedule: WSDSchedule) -> float:
    # LambdaLR passes the number of scheduler steps taken so far (0 before the first
    # optimizer step), which is the 1-based train step minus one.
    return schedule.factor(last_epoch + 1)


def make_wsd_lambda(schedule: WSDSchedule):
    """A picklable lr_lambda for torch's LambdaLR (a partial of a module-level function)."""
    return functools.partial(_lambda, schedule=schedule)


def wsd_schedule(lr_scheduler_config, training_steps: int) -> WSDSchedule:
    """The WSD schedule a ``[lr_scheduler]`` section asks for (HyMo's fields:
    hymo_recipes/titan/job_config.py); raises ValueError naming the setting to change. Run before
    the Trainer starts (the preflight) and by the lr-scheduler builder."""
    cfg = lr_scheduler_config
    if getattr(cfg, "warmup_steps", None) is not None:
        raise ValueError(
            "lr_scheduler.warmup_steps is not used by HyMo's WSD schedule; set "
            "lr_scheduler.warmup_fraction instead (and leave warmup_steps unset)"
        )
    if getattr(cfg, "decay_ratio", None) is not None:
        raise ValueError(
            "lr_scheduler.decay_ratio is not used by HyMo's WSD schedule; set "
            "lr_scheduler.decay_fraction (and stable_fraction) instead"
        )
    total, name = ((cfg.total_steps, "lr_scheduler.total_steps") if cfg.total_steps is not None
                   else (training_steps, "training.steps"))
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"{name} must be a positive whole number of steps, got {total!r}")
    return WSDSchedule.from_fractions(
        total,
        cfg.warmup_fraction,
        cfg.stable_fraction,
        cfg.decay_fraction,
        cfg.decay_type,
        cfg.min_lr_factor,
    )
