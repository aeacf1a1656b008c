"""The two-optimizer container and scheduler container: DCP round trip, exact resume, NaN skip."""

import copy
import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
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
from hymo_recipes.optim.container import build_hymo_optimizers  # noqa: E402
from hymo_recipes.optim.nan_guard import NonFiniteGuard, NonFiniteTrainingError  # noqa: E402
from hymo_recipes.scheduler import build_hymo_lr_schedulers  # noqa: E402


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
    assert opts.lrs() == pytest.approx({"normuon": 0.01, "cautious_adamw": 1.5e-4})
    assert len(scheds.schedulers) == 2


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
    assert opts2.lrs() == pytest.approx({"normuon": 0.02 * factor, "cautious_adamw": 3e-4 * factor})
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
    assert sd["cautious_adamw"]["base_lrs"][0] == pytest.approx(3e-4)
    assert sd["normuon"]["last_epoch"] == 2


def test_baseline_names():
    model = make_model()
    opts, _ = build(model, name="AdamW")
    assert opts.optimizer_names == ["adamw"]
    assert isinstance(opts.optimizers[0], torch.optim.AdamW)
    opts, _ = build(model, name="CautiousAdamW")
    assert opts.optimizer_names == ["cautious_adamw"]


def test_missing_hymo_fields_is_a_clear_error():
    import types

    from hymo_recipes.optim.container import optimizers_for_part

    with pytest.raises(ValueError, match="normuon_lr"):
        optimizers_for_part(make_model(), types.SimpleNamespace(name="NorMuon", lr=1e-3))


def guarded_train_steps(model, opts, scheds, guard, steps):
    """The NaN-skip protocol the trainer follows (hymo_recipes/optim/nan_guard.py)."""
    for s in steps:
        opts.zero_grad()
        loss = guard.maybe_inject(s, loss_fn(model, batch(s)))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard.step_ok(s, loss, grad_norm):
            opts.step()
            scheds.step()


def test_injected_nan_skips_exactly_that_step():
    model = make_model()
    opts, scheds = build(model)
    guard = NonFiniteGuard(consecutive_limit=5, inject_nan_steps=(3,))
    guarded_train_steps(model, opts, scheds, guard, range(1, 3))
    params, state = snapshot(model, opts)
    sched_state = copy.deepcopy(scheds.state_dict())
    guarded_train_steps(model, opts, scheds, guard, [3])
    assert guard.state() == {"skipped_steps": 1, "consecutive_skipped": 1}
    now_params, now_state = snapshot(model, opts)
    assert_same(now_params, params)
    assert_same(now_state, state)
    assert scheds.state_dict() == sched_state
    # the next step trains normally and resets the run of skips
    guarded_train_steps(model, opts, scheds, guard, [4])
    assert guard.state() == {"skipped_steps": 1, "consecutive_skipped": 0}
    assert not torch.equal(model.norm.weight, params["norm.weight"])


def test_consecutive_nan_limit_stops_training():
    model = make_model()
    opts, scheds = build(model)
    guard = NonFiniteGuard(consecutive_limit=3, inject_nan_steps=(2, 3, 4, 5))
    with pytest.raises(NonFiniteTrainingError, match="3 consecutive training steps"):
        guarded_train_steps(model, opts, scheds, guard, range(1, 7))
    assert guard.skipped_total == 3 and guard.last_skipped_step == 4


def test_container_level_nan_guard_skips_step_and_schedule():
    """The trainer-free variant: the container checks the gradients itself."""
    model = make_model()
    opts = build_hymo_optimizers([model], optim_config(), None,
                                 nan_guard=NonFiniteGuard(consecutive_limit=2))
    scheds = build_hymo_lr_schedulers(opts, sched_config(), 10)
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
    now_params, now_state = snapshot(model, opts)
    assert_same(now_params, params)
    assert_same(now_state, state)
    assert [s.last_epoch for s in scheds.schedulers] == [1, 1]
    train_steps(model, opts, scheds, [2])
    assert not opts.last_step_skipped and [s.last_epoch for s in scheds.schedulers] == [2, 2]
    for _ in range(2):
        opts.zero_grad()
        loss_fn(model, batch(3)).backward()
        model.norm.weight.grad[0] = float("nan")
        if _ == 1:
            with pytest.raises(NonFiniteTrainingError):
                opts.step()
        else:
            opts.step()
