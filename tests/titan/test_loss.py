"""The MTP loss under TorchTitan's sum-then-divide contract, and the per-head statistics."""

import pytest
import torch
import torch.nn.functional as F

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shim 1 first)
from hymo_recipes.titan.api import IGNORE_INDEX
from hymo_recipes.titan.loss import MTPLoss
from hymo_recipes.titan.metrics import StepStats

B, T, V = 2, 7, 11
WEIGHTS = (0.3, 0.1)


@pytest.fixture
def step_stats():
    return StepStats()


def _batch(seed=0, ignore=()):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    mtp = [torch.randn(B, T, V, generator=g) for _ in WEIGHTS]
    labels = torch.randint(0, V, (B, T), generator=g)
    for b, t in ignore:
        labels[b, t] = IGNORE_INDEX
    return logits, mtp, labels


def _mean_ce(logits, labels):
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def test_after_division_each_mtp_term_is_weight_times_its_mean_ce(step_stats):
    logits, mtp, labels = _batch()
    total = MTPLoss(WEIGHTS, step_stats)((logits, mtp), labels)
    n_main = labels.numel()
    # TorchTitan divides the returned sum by the number of main-head labels
    expected = _mean_ce(logits, labels)
    for k, (w, head) in enumerate(zip(WEIGHTS, mtp), start=1):
        # head k at position t predicts the label k positions further on
        expected = expected + w * _mean_ce(head[:, : T - k], labels[:, k:])
    torch.testing.assert_close(total / n_main, expected, rtol=1e-6, atol=1e-6)


def test_ignored_labels_are_excluded_per_head(step_stats):
    logits, mtp, labels = _batch(seed=1, ignore=[(0, 6), (1, 2)])
    loss = MTPLoss(WEIGHTS, step_stats)
    total = loss((logits, mtp), labels)
    n = [(labels[:, k:] != IGNORE_INDEX).sum().item() for k in range(3)]
    assert n == [12, 10, 8]
    expected = _mean_ce(logits, labels) * n[0]
    for k, (w, head) in enumerate(zip(WEIGHTS, mtp), start=1):
        expected = expected + w * _mean_ce(head[:, : T - k], labels[:, k:]) * n[0]
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-5)


def test_per_head_stats_accumulate_over_microbatches_until_the_step_ends(step_stats):
    loss = MTPLoss(WEIGHTS, step_stats)
    batches = [_batch(seed=s) for s in (2, 3)]
    for logits, mtp, labels in batches:
        loss((logits, mtp), labels)
    assert step_stats.head_sums is None  # nothing published before the step ends
    step_stats.end_step()
    means = (step_stats.head_sums / step_stats.head_counts).tolist()
    logits = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[2] for b in batches])
    assert means[0] == pytest.approx(_mean_ce(logits, labels).item(), rel=1e-6)
    for k in (1, 2):
        head = torch.cat([b[1][k - 1] for b in batches])
        assert means[k] == pytest.approx(_mean_ce(head[:, : T - k], labels[:, k:]).item(), rel=1e-6)
    step_stats.end_step()  # a step without microbatches publishes nothing
    assert step_stats.head_sums is None


def test_evaluating_returns_main_ce_sum_and_records_nothing(step_stats):
    logits, mtp, labels = _batch(seed=4)
    loss = MTPLoss(WEIGHTS, step_stats)
    with loss.evaluating():
        main = loss((logits, mtp), labels)
    torch.testing.assert_close(main, _mean_ce(logits, labels) * labels.numel())
    step_stats.end_step()
    assert step_stats.head_sums is None


def test_head_count_mismatch_raises(step_stats):
    logits, mtp, labels = _batch()
    with pytest.raises(ValueError, match="MTP heads"):
        MTPLoss((0.3,), step_stats)((logits, mtp), labels)


def test_gradients_flow_to_every_head(step_stats):
    logits, mtp, labels = _batch(seed=5)
    logits.requires_grad_()
    for head in mtp:
        head.requires_grad_()
    MTPLoss(WEIGHTS, step_stats)((logits, mtp), labels).backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in [logits, *mtp])


def test_training_losses_go_through_the_nan_guard(step_stats):
    """The loss reports to the optimizer container's guard (wired by step_hooks) and, on an
    injected step, returns NaN with gradients; validation losses bypass the guard."""
    from hymo_recipes.optim.nan_guard import NonFiniteGuard

    guard = step_stats.nan_guard = NonFiniteGuard(inject_nan_steps=[2])
    loss_fn = MTPLoss(WEIGHTS, step_stats)
    logits, mtp, labels = _batch()
    logits.requires_grad_(True)
    assert torch.isfinite(loss_fn((logits, mtp), labels))
    assert guard.check_step([torch.ones(2)]) is True  # step 1 ends
    poisoned = loss_fn((logits, mtp), labels)  # step 2: injected
    assert torch.isnan(poisoned)
    poisoned.backward()
    assert torch.isnan(logits.grad).all()
    with loss_fn.evaluating():
        assert torch.isfinite(loss_fn((logits, mtp), labels))
    assert guard.check_step([torch.ones(2)]) is False  # the loss flag alone decides
    assert guard.metrics() == {"skipped_steps": 1, "consecutive_skipped": 1}
