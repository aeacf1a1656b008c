"""The two-optimizer container and scheduler container: DCP round trip, exact resume, NaN skip."""

import copy
import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "optim"))  # its tiny model
from _tiny import (  # noqa: E402
    ModelState,
    batch,
    loss_fn,
    make_model,
    optim_config,
    sched_config,
    train_steps,
)

from hymo_recipes.optim import CautiousAdamW, NorMuon  # noqa: E402
from hymo_recipes.optim.nan_guard import NonFiniteGuard, NonFiniteTrainingError  # noqa: E402
from hymo_recipes.titan.optimizers import build_hymo_lr_schedulers, build_hymo_optimizers  # noqa: E402


def build(model, **opt_overrides):
    opts = build_hymo_optimizers([model], optim_config(**opt_overrides), None)
    scheds = build_hymo_lr_schedulers(opts, sched_config(), 10)
    return opts, scheds


def snapshot(model, opts):
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = copy.deepcopy(opts.state_dict())
    return params, state


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_container_holds_both_optimizers_with_their_lrs():
    model = make_model()
    opts, scheds = build(model)
    assert opts.optimizer_names == ["normuon", "cautious_adamw"]
    assert isinstance(opts.optimizers[0], NorMuon) and isinstance(opts.optimizers[1], CautiousAdamW)
    # warmup of 2 steps (0.2 × 10): step 1 runs at half the peak lr
    assert opts.lrs() == pytest.approx({"normuon": 0.01, "cautious_adamw": 1.2e-3})
    assert len(scheds.schedulers) == 2


def test_compiled_switches_reach_both_optimizers():
    opts, _ = build(make_model())
    assert not opts.optimizers[0]._compiled and not opts.optimizers[1]._compiled
    opts, _ = build(make_model(), normuon_compiled=True, adamw_compiled=True)
    assert opts.optimizers[0]._compiled and opts.optimizers[1]._compiled


def test_state_dict_is_flat_fqn_keyed_and_does_not_step():
    model = make_model()
    opts, _ = build(model)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    sd = opts.state_dict()  # must not run torch's zero-grad init step (state is pre-created)
    for k, v in model.named_parameters():
        assert torch.equal(v, before[k]), k
    assert "state.layers.0.attn.q_proj.weight.momentum_buffer" in sd
    assert "state.layers.0.attn.q_proj.weight.neuron_v" in sd
    assert "state.tok_embeddings.weight.exp_avg_sq" in sd
    assert sd["param_groups.layers.0.attn.A_log.weight_decay"] == 0.0
    assert sd["param_groups.layers.0.attn.q_proj.weight.lr"] == pytest.approx(0.01)
    # every trainable parameter has state: the same keys on every rank
    n_params = sum(1 for _ in model.parameters())
    first_keys = [k for k in sd if k.endswith((".exp_avg", ".momentum_buffer"))]
    assert len(first_keys) == n_params


def test_dcp_save_load_resumes_exactly(tmp_path):
    """Save after step 3, keep going to 6; a fresh run loaded from step 3 repeats 4..6 bitwise."""
    model = make_model(seed=0)
    opts, scheds = build(model)
    train_steps(model, opts, scheds, range(1, 4))
    dcp.save({"model": ModelState(model), "optimizer": opts, "lr_scheduler": scheds},
             checkpoint_id=str(tmp_path / "step-3"))
    expected = train_steps(model, opts, scheds, range(4, 7))
    expected_params, expected_state = snapshot(model, opts)

    model2 = make_model(seed=123)  # different init: everything must come from the checkpoint
    opts2, scheds2 = build(model2)
    dcp.load({"model": ModelState(model2), "optimizer": opts2, "lr_scheduler": scheds2},
             checkpoint_id=str(tmp_path / "step-3"))
    # the scheduler bug TorchTitan 0.2.2 has: each optimizer must keep its own base lr
    factor = 1.0  # step 4 is in the stable phase (steps 3..6)
    assert opts2.lrs() == pytest.approx({"normuon": 0.02 * factor, "cautious_adamw": 2.4e-3 * factor})
    got = train_steps(model2, opts2, scheds2, range(4, 7))
    assert got == expected
    params, state = snapshot(model2, opts2)
    assert_same(params, expected_params)
    assert_same(state, expected_state)
    assert [s.last_epoch for s in scheds2.schedulers] == [6, 6]


def test_lr_scheduler_state_has_one_entry_per_optimizer():
    model = make_model()
    opts, scheds = build(model)
    train_steps(model, opts, scheds, range(1, 3))
    sd = scheds.state_dict()
    assert set(sd) == {"normuon", "cautious_adamw"}
    assert sd["normuon"]["base_lrs"][0] == pytest.approx(0.02)
    assert sd["cautious_adamw"]["base_lrs"][0] == pytest.approx(2.4e-3)
    assert sd["normuon"]["last_epoch"] == 2


def test_baseline_names():
    model = make_model()
    # "AdamW" is TorchTitan's optimizer: one group, every parameter, one weight decay
    opts, _ = build(model, name="AdamW", weight_decay=0.05, implementation="for-loop")
    assert opts.optimizer_names == ["adamw"]
    (adamw,) = opts.optimizers
    assert type(adamw) is torch.optim.AdamW and len(adamw.param_groups) == 1
    group = adamw.param_groups[0]
    assert len(group["params"]) == len(list(model.parameters()))
    assert (group["weight_decay"], group["foreach"], group["fused"]) == (0.05, False, False)
    assert group["betas"] == (0.9, 0.95) and group["lr"] == pytest.approx(1.2e-3)  # warmup
    opts, _ = build(model, name="CautiousAdamW", weight_decay=0.05, normuon_weight_decay=0.3)
    assert opts.optimizer_names == ["cautious_adamw"]
    # every group of the table on CautiousAdamW; the experts at its weight decay, not NorMuon's
    # (where the default moe_on_normuon would put them)
    (cadamw,) = opts.optimizers
    experts = next(g for g in cadamw.param_groups if g["group"] == "experts")
    hidden = next(g for g in cadamw.param_groups if g["group"] == "hidden")
    assert experts["weight_decay"] == 0.05 and hidden["weight_decay"] == 0.3
    with pytest.raises(ValueError, match="optimizer.name"):
        build(model, name="Adam")


def test_missing_hymo_fields_is_a_clear_error():
    import types

    from hymo_recipes.titan.optimizers import optimizers_for_part

    with pytest.raises(ValueError, match="normuon_lr"):
        optimizers_for_part(make_model(), types.SimpleNamespace(name="NorMuon", lr=1e-3))


def guarded_train_steps(model, opts, scheds, steps):
    """TorchTitan's order with the loss passed through the container's guard, as HyMo's loss
    function does (hymo_recipes/titan/loss.py)."""
    for s in steps:
        opts.zero_grad()
        loss = opts.nan_guard.on_loss(loss_fn(model, batch(s)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opts.step()
        scheds.step()


def test_injected_nan_skips_exactly_that_step():
    model = make_model()
    opts, scheds = build(model, inject_nan_steps=[3])
    guard = opts.nan_guard
    seen = []
    opts.register_step_post_hook(lambda *a, **k: seen.append(opts.last_step_skipped))
    guarded_train_steps(model, opts, scheds, range(1, 3))
    params, state = snapshot(model, opts)
    sched_state = copy.deepcopy(scheds.state_dict())
    guarded_train_steps(model, opts, scheds, [3])
    assert seen == [False, False, True]
    assert guard.metrics() == {"skipped_steps": 1, "consecutive_skipped": 1}
    now_params, now_state = snapshot(model, opts)
    assert_same(now_params, params)
    # the optimizers' state is untouched; only the guard's own counters moved
    counters = {k for k in state if k.startswith("nan_guard.")}
    assert counters == {"nan_guard.steps_done", "nan_guard.skipped_total", "nan_guard.consecutive"}
    assert_same({k: v for k, v in now_state.items() if k not in counters},
                {k: v for k, v in state.items() if k not in counters})
    assert (now_state["nan_guard.steps_done"], now_state["nan_guard.skipped_total"]) == (3, 1)
    assert scheds.state_dict() == sched_state
    # the next step trains normally and resets the run of skips
    guarded_train_steps(model, opts, scheds, [4])
    assert guard.metrics() == {"skipped_steps": 1, "consecutive_skipped": 0}
    assert not torch.equal(model.norm.weight, params["norm.weight"])
    assert [s.last_epoch for s in scheds.schedulers] == [3, 3]


def test_consecutive_nan_limit_stops_training():
    model = make_model()
    opts, scheds = build(model, consecutive_nan_limit=3, inject_nan_steps=[2, 3, 4, 5])
    with pytest.raises(NonFiniteTrainingError, match="3 consecutive training steps .*step 4"):
        guarded_train_steps(model, opts, scheds, range(1, 7))
    assert opts.nan_guard.skipped_total == 3 and opts.nan_guard.last_skipped_step == 4


def test_a_nonfinite_loss_alone_skips_the_step():
    """A NaN loss whose gradients stay finite (here: the NaN enters through a constant) is
    still skipped: the loss flag is part of the decision."""
    model = make_model()
    opts, scheds = build(model)
    train_steps(model, opts, scheds, [1])
    params, _ = snapshot(model, opts)
    opts.zero_grad()
    loss = loss_fn(model, batch(2))
    opts.nan_guard.on_loss(loss + torch.tensor(float("inf"))).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    opts.step()
    assert opts.last_step_skipped
    assert_same(snapshot(model, opts)[0], params)


def test_nonfinite_gradient_skips_step_and_schedule():
    model = make_model()
    opts, scheds = build(model, consecutive_nan_limit=2)
    seen = []
    opts.register_step_post_hook(lambda *a, **k: seen.append(opts.last_step_skipped))
    train_steps(model, opts, scheds, [1])
    params, state = snapshot(model, opts)
    opts.zero_grad()
    loss_fn(model, batch(2)).backward()
    model.layers["1"].attn.q_proj.weight.grad[0, 0] = float("inf")  # one bad entry anywhere
    opts.step()
    scheds.step()
    assert seen == [False, True] and opts.last_step_skipped
    now_params, _ = snapshot(model, opts)
    assert_same(now_params, params)
    assert [s.last_epoch for s in scheds.schedulers] == [1, 1]
    train_steps(model, opts, scheds, [2])
    assert not opts.last_step_skipped and [s.last_epoch for s in scheds.schedulers] == [2, 2]
    for attempt in range(2):
        opts.zero_grad()
        loss_fn(model, batch(3)).backward()
        model.norm.weight.grad[0] = float("nan")
        if attempt == 1:
            with pytest.raises(NonFiniteTrainingError, match="2 consecutive"):
                opts.step()
        else:
            opts.step()


def test_guard_counters_resume_through_dcp(tmp_path):
    """Step numbers (for inject_nan_steps) and the skip total continue after a resume."""
    model = make_model()
    opts, scheds = build(model, inject_nan_steps=[2, 5])
    guarded_train_steps(model, opts, scheds, range(1, 4))
    dcp.save({"optimizer": opts}, checkpoint_id=str(tmp_path / "ckpt"))
    opts2, scheds2 = build(make_model(), inject_nan_steps=[2, 5])
    dcp.load({"optimizer": opts2}, checkpoint_id=str(tmp_path / "ckpt"))
    assert (opts2.nan_guard.current_step, opts2.nan_guard.skipped_total) == (4, 1)


def test_step_timer_counts_every_step():
    model = make_model()
    opts, scheds = build(model)
    train_steps(model, opts, scheds, range(1, 4))
    seconds, steps = opts.step_timer.collect()
    assert steps == 3 and seconds > 0
    laps = opts.step_timer.last_laps
    # one lap per optimizer name (the NaN check's too when the guard is on), inside the total
    assert set(opts.optimizer_names) <= set(laps) <= set(opts.optimizer_names) | {"nan_check"}
    assert all(v > 0 for v in laps.values()) and sum(laps.values()) <= seconds
    assert opts.step_timer.collect() == (0.0, 0) and opts.step_timer.last_laps == {}


@pytest.mark.parametrize("overrides, message", [
    (dict(consecutive_nan_limit=-1), "consecutive_nan_limit must be >= 0"),
    (dict(inject_nan_steps=[0]), "1-based train steps"),
])
def test_bad_nan_guard_settings_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        build(make_model(), **overrides)


def test_skipped_step_names_the_nonfinite_gradients_and_parameters():
    model = make_model()
    opts, _ = build(model)
    opts.zero_grad()
    loss_fn(model, batch(1)).backward()
    assert opts.describe_nonfinite() == ("on this rank, non-finite gradients: none; "
                                         "non-finite parameters: none")
    with torch.no_grad():
        model.layers["0"].attn.q_proj.weight.grad[0, 0] = float("inf")
        model.norm.weight[1] = float("nan")
    assert opts.describe_nonfinite() == (
        "on this rank, non-finite gradients: layers.0.attn.q_proj.weight; "
        "non-finite parameters: norm.weight")
