"""The after-step hook (MoE balancing, per-head stats) and the metrics computed from it."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shim 1 first)
from hymo_recipes.titan.api import OptimizersContainer
from hymo_recipes.titan.metrics import HymoMetricsProcessor, StepStats
from hymo_recipes.model import hymo_flavors
from hymo_recipes.model.moe import MoE
from hymo_recipes.titan.step_hooks import moe_modules, register_step_hooks

SINGLE_RANK = SimpleNamespace(get_optional_mesh=lambda name: None)


@pytest.fixture
def step_stats():
    return StepStats()


def _moe(seed):
    torch.manual_seed(seed)
    args = dataclasses.replace(hymo_flavors["debugmodel"], moe_capacity_factor=1.0)
    moe = MoE(args)
    moe.init_weights(args.init_std, args.init_std)
    return moe


def test_hook_balances_every_moe_then_resets_its_counters(step_stats):
    model = torch.nn.ModuleDict({"a": _moe(0), "b": _moe(1)})
    reference = copy.deepcopy(model)
    optimizers = OptimizersContainer([model], torch.optim.SGD, {"lr": 0.1})
    register_step_hooks(optimizers, [model], SINGLE_RANK, step_stats)
    assert len(moe_modules([model])) == 2

    x = torch.randn(2, 16, hymo_flavors["debugmodel"].dim)
    sum(m(x).square().mean() for m in model.values()).backward()
    counts = [(m.tokens_per_expert.clone(), m.dropped_tokens.clone()) for m in model.values()]
    assert all(c.sum() == 2 * 16 * m.top_k for (c, _), m in zip(counts, model.values()))
    optimizers.step()

    for m, ref, (load, dropped) in zip(model.values(), reference.values(), counts):
        ref.update_expert_bias(load)
        torch.testing.assert_close(m.expert_bias, ref.expert_bias, rtol=0, atol=0)
        torch.testing.assert_close(m.load_ema, ref.load_ema, rtol=0, atol=0)
        assert m.tokens_per_expert.sum() == 0 and m.dropped_tokens.sum() == 0
    assert torch.equal(step_stats.moe_load, torch.stack([c[0] for c in counts]))
    assert torch.equal(step_stats.moe_dropped, torch.stack([c[1] for c in counts]))


@pytest.mark.parametrize("go", [True, False])
def test_a_replayed_steps_flag_decides_the_update_on_the_device(step_stats, go):
    """After a replayed optimizer step the host has not read the NaN verdict yet: the hook
    hands the step's device flag (``pending_go``) to the update, which updates as without it
    when the flag holds True and keeps the EMAs and biases, bit for bit, when it holds False;
    the counts are shown and zeroed either way."""
    model = torch.nn.ModuleDict({"a": _moe(0), "b": _moe(1)})
    reference = copy.deepcopy(model)
    optimizers = OptimizersContainer([model], torch.optim.SGD, {"lr": 0.1})
    optimizers.pending_go = torch.tensor(go)
    register_step_hooks(optimizers, [model], SINGLE_RANK, step_stats)
    x = torch.randn(2, 16, hymo_flavors["debugmodel"].dim)
    sum(m(x).square().mean() for m in model.values()).backward()
    counts = [m.tokens_per_expert.clone() for m in model.values()]
    optimizers.step()
    for m, ref, load in zip(model.values(), reference.values(), counts):
        if go:
            ref.update_expert_bias(load)
        else:
            assert not torch.equal(load, torch.zeros_like(load))
        torch.testing.assert_close(m.expert_bias, ref.expert_bias, rtol=0, atol=0)
        torch.testing.assert_close(m.load_ema, ref.load_ema, rtol=0, atol=0)
        assert m.tokens_per_expert.sum() == 0
    assert torch.equal(step_stats.moe_load, torch.stack(counts))
    if not go:  # the same step with the flag true does move the bias
        optimizers.pending_go = torch.tensor(True)
        sum(m(x).square().mean() for m in model.values()).backward()
        optimizers.step()
        assert not torch.equal(model["a"].expert_bias, reference["a"].expert_bias)


def test_a_skipped_step_discards_its_counts_and_keeps_the_bias(step_stats):
    """A step the NaN guard skipped changes no balancing state: the EMA and bias stay, the
    step's counts are shown in the metrics but discarded (zeroed), so the next update sees
    only the next step's tokens."""
    model = torch.nn.ModuleDict({"a": _moe(0)})
    moe = model["a"]
    optimizers = OptimizersContainer([model], torch.optim.SGD, {"lr": 0.1})
    register_step_hooks(optimizers, [model], SINGLE_RANK, step_stats)
    x = torch.randn(2, 16, hymo_flavors["debugmodel"].dim)

    moe(x).square().mean().backward()  # step 1: a normal update moves the EMA and the bias
    optimizers.step()
    assert moe.load_ema.abs().sum() > 0
    ema, bias = moe.load_ema.clone(), moe.expert_bias.clone()

    moe(x).square().mean().backward()  # step 2: skipped
    routed = moe.tokens_per_expert.clone()
    optimizers.last_step_skipped = True  # what HymoOptimizersContainer.step sets on a skip
    optimizers.step()
    assert torch.equal(moe.load_ema, ema) and torch.equal(moe.expert_bias, bias)
    assert moe.tokens_per_expert.sum() == 0 and moe.dropped_tokens.sum() == 0
    assert torch.equal(step_stats.moe_load, routed[None])

    moe(x).square().mean().backward()  # step 3: updates from its own counts only
    optimizers.last_step_skipped = False
    counts = moe.tokens_per_expert.clone()
    reference = copy.deepcopy(moe)
    optimizers.step()
    reference.update_expert_bias(counts)
    assert torch.equal(moe.load_ema, reference.load_ema)
    assert torch.equal(moe.expert_bias, reference.expert_bias)


def test_hook_publishes_the_steps_head_losses(step_stats):
    model = torch.nn.Linear(2, 2)
    optimizers = OptimizersContainer([model], torch.optim.SGD, {"lr": 0.1})
    register_step_hooks(optimizers, [model], SINGLE_RANK, step_stats)
    step_stats.add_head_losses(torch.tensor([6.0, 4.0]), torch.tensor([3.0, 2.0]))
    optimizers.step()
    assert step_stats.head_sums.tolist() == [6.0, 4.0]


def test_metrics_from_step_stats(step_stats):
    processor = object.__new__(HymoMetricsProcessor)  # only _hymo_metrics is exercised
    processor.parallel_dims = SINGLE_RANK
    processor.stats = step_stats
    step_stats.head_sums, step_stats.head_counts = torch.tensor([8.0, 9.0]), torch.tensor([4.0, 3.0])
    # two layers of 4 experts; per-layer mean load is 4
    step_stats.moe_load = torch.tensor([[4.0, 4.0, 4.0, 4.0], [8.0, 6.0, 1.0, 1.0]])
    step_stats.moe_dropped = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    assert processor._hymo_metrics() == pytest.approx({
        "loss_metrics/main_ce": 2.0,
        "loss_metrics/mtp_1_ce": 3.0,
        "moe/max_load": 2.0,
        "moe/min_load": 0.25,
        "moe/dropped_frac": 4.0 / 32.0,
    })


def test_lr_of_every_optimizer():
    processor = object.__new__(HymoMetricsProcessor)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    processor.optimizers = [torch.optim.SGD(a.parameters(), lr=0.5),
                            torch.optim.AdamW(b.parameters(), lr=0.25),
                            torch.optim.SGD(b.parameters(), lr=0.125)]
    assert processor._optimizer_lrs() == {"lr/SGD": 0.5, "lr/AdamW": 0.25, "lr/SGD_2": 0.125}


def test_skip_count_and_optimizer_step_time_metrics(monkeypatch):
    import hymo_recipes.titan.metrics as metrics_module
    from hymo_recipes.optim.nan_guard import NonFiniteGuard

    class Timer:
        last_laps = {"normuon": 0.15, "cautious_adamw": 0.09}

        def collect(self):
            return 0.3, 3

    processor = object.__new__(HymoMetricsProcessor)
    processor.optimizers = SimpleNamespace(nan_guard=NonFiniteGuard(), step_timer=Timer())
    processor.optimizers.nan_guard.skipped_total = 2
    processor.time_last_log = 100.0  # one second since the last log, on a clock the test holds still
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: 101.0)
    metrics = processor._optimizer_step_metrics()
    assert metrics["optimizer/skipped_steps"] == 2
    assert metrics["optimizer/consecutive_skipped"] == 0
    assert metrics["time_metrics/optimizer_step(s)"] == pytest.approx(0.1)
    assert metrics["time_metrics/optimizer_step(%)"] == pytest.approx(30)
    assert metrics["time_metrics/optimizer_step_normuon(s)"] == pytest.approx(0.05)
    assert metrics["time_metrics/optimizer_step_cautious_adamw(%)"] == pytest.approx(9, rel=0.05)
