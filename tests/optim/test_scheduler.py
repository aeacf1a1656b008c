"""WSD schedule: the seed's worked example, each decay shape, the step convention, errors.

Convention under test: ``step`` is TorchTitan's 1-based train step (``trainer.step`` while
``train_step`` runs). The optimizer update of step s uses factor(s); TorchTitan steps the
LambdaLR after every optimizer step, so the lambda sees last_epoch = s − 1.
"""

import math
import types

import pytest
import torch

from hymo_recipes.scheduler import (
    WSDSchedule,
    make_wsd_lambda,
    wsd_factor,
    wsd_schedule,
)

T = 57_220  # the seed's run: 2% / 83% / 15%, linear, min 0.05
W, S, D = 1_144, 47_492, 8_584  # ⌊T·0.02⌋, ⌊T·0.83⌋, the rest

# (step, expected factor), hand-computed
SEED_TABLE = [
    (1, 1 / 1144),
    (572, 0.5),  # the seed's "0.5 at step 572"
    (1_143, 1143 / 1144),
    (1_144, 1.0),
    (1_145, 1.0),
    (48_635, 1.0),  # "1.0 through 48,635"
    (48_636, 1.0),  # the last stable step (DESIGN: "stable until 48,636")
    (48_637, 0.05 + 0.95 * (1 - 1 / 8584)),
    # The seed says 0.525 at 52,884. 52,884 is 4,248 of 8,584 decay steps in (p = 0.4949), so the
    # factor is 0.5299; 0.525 (p = 1/2) falls at 52,928. No convention with these fractions
    # gives 0.525 at 52,884 (it would need the decay to end at 57,133): a seed slip.
    (52_884, 0.05 + 0.95 * (1 - 4248 / 8584)),
    (52_928, 0.525),
    (57_220, 0.05),  # the last step ends at min_lr_ratio
    (60_000, 0.05),  # past the end: hold the minimum
]


def test_seed_phase_lengths():
    sched = WSDSchedule.from_fractions(T)
    assert (sched.warmup_steps, sched.stable_steps, sched.decay_steps) == (W, S, D)
    assert sched.stable_end == 48_636


@pytest.mark.parametrize("step,expected", SEED_TABLE)
def test_seed_worked_example(step, expected):
    assert wsd_factor(step, T) == pytest.approx(expected, abs=1e-12)


def test_seed_quoted_value_at_52884_is_close_but_not_exact():
    assert abs(wsd_factor(52_884, T) - 0.525) > 4e-3
    assert wsd_factor(52_884, T) == pytest.approx(0.5299, abs=1e-4)


# T = 100 with 10/50/40: W = 10, S = 50, D = 40; step 70 is p = 1/4, step 80 p = 1/2
SHAPES = {
    "linear": [(70, 0.05 + 0.95 * 0.75), (80, 0.525), (100, 0.05)],
    "cosine": [
        (70, 0.05 + 0.95 * (1 + math.cos(math.pi / 4)) / 2),
        (80, 0.525),
        (100, 0.05),
    ],
    "sqrt": [(70, 0.05 + 0.95 * 0.5), (80, 0.05 + 0.95 * (1 - math.sqrt(0.5))), (100, 0.05)],
}


@pytest.mark.parametrize("decay_type", list(SHAPES))
def test_decay_shapes(decay_type):
    for step, expected in [(5, 0.5), (10, 1.0), (60, 1.0)] + SHAPES[decay_type]:
        got = wsd_factor(step, 100, (0.1, 0.5, 0.4), decay_type, 0.05)
        assert got == pytest.approx(expected, abs=1e-12), (decay_type, step)


def test_decimal_rounding_of_fractions():
    # 100 × 0.29 is 28.999999999999996 in binary floating point; the schedule uses 29.
    sched = WSDSchedule.from_fractions(100, 0.29, 0.51, 0.2)
    assert (sched.warmup_steps, sched.stable_steps, sched.decay_steps) == (29, 51, 20)


def test_no_decay_and_no_warmup():
    sched = WSDSchedule.from_fractions(10, 0.0, 1.0, 0.0)
    assert [sched.factor(s) for s in (1, 5, 10, 11)] == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "args,match",
    [
        ((100, 0.02, 0.83, 0.16), "sum to 1"),
        ((100, -0.1, 0.95, 0.15), "warmup fraction"),
        ((100, 0.02, float("nan"), 0.15), "stable fraction"),
        ((100, 0.02, 0.83, 0.15, "exp"), "decay_type"),
        ((100, 0.02, 0.83, 0.15, "linear", 1.5), "min_lr_ratio"),
        ((0, 0.02, 0.83, 0.15), "total_steps"),
    ],
)
def test_bad_arguments_raise(args, match):
    with pytest.raises(ValueError, match=match):
        WSDSchedule.from_fractions(*args)


def _drive(sched, n_steps, opt, scheduler, start=1):
    """Mimic TorchTitan's loop: the lr read at step s is used by that step's update."""
    used = {}
    for s in range(start, start + n_steps):
        used[s] = opt.param_groups[0]["lr"]
        opt.step()
        scheduler.step()
    return used


def test_lambdalr_convention_matches_torchtitan_loop():
    sched = WSDSchedule.from_fractions(T)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, make_wsd_lambda(sched))
    used = _drive(sched, 1_150, opt, lam)
    assert used[1] == pytest.approx(2.0 / 1144)
    assert used[572] == pytest.approx(1.0)  # factor 0.5 at train step 572
    assert used[1_144] == pytest.approx(2.0)
    # TorchTitan's built-in schedule with warmup_steps = 1144 uses the same convention for the
    # warmup ramp: its lambda gives (last_epoch + 1) / warmup to train step last_epoch + 1.
    import hymo_recipes.titan  # noqa: F401  (before TorchTitan: CPU shim 1)
    from torchtitan.components.lr_scheduler import build_lr_schedulers

    cfg = types.SimpleNamespace(total_steps=T, warmup_steps=W, decay_ratio=0.15,
                                decay_type="linear", min_lr_factor=0.05)
    titan = build_lr_schedulers([torch.optim.SGD([p], lr=1.0)], cfg, T).schedulers[0]
    ours = make_wsd_lambda(sched)
    for s in (1, 572, 1_144, 20_000):
        assert titan.lr_lambdas[0](s - 1) == pytest.approx(ours(s - 1)), s


def test_schedule_rejects_step_based_fields():
    cfg = types.SimpleNamespace(
        warmup_steps=200, decay_ratio=None, total_steps=None, warmup_fraction=0.02,
        stable_fraction=0.83, decay_fraction=0.15, decay_type="linear", min_lr_factor=0.05,
    )
    with pytest.raises(ValueError, match="warmup_fraction"):
        wsd_schedule(cfg, 100)
    cfg.warmup_steps, cfg.decay_ratio = None, 0.2
    with pytest.raises(ValueError, match="decay_fraction"):
        wsd_schedule(cfg, 100)
    cfg.decay_ratio, cfg.stable_fraction = None, 0.9
    with pytest.raises(ValueError, match="sum to 1"):
        wsd_schedule(cfg, 100)
