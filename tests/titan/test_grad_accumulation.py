"""apply_grad_accumulation: FSDP2's per-parameter gradient accumulation (fsdp_sync_once_per_step)
replaced by one hymo_kernels.accum launch per unit, on a 1-rank gloo mesh on CPU (the kernel in
Triton's interpreter): the same gradients bitwise as FSDP's own loop, and the kernel did add them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

import hymo_recipes.titan.parallelize as par


def _model(mesh, units: str, reduce_dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 8)))
    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=reduce_dtype)
    if units == "block":
        fully_shard(model[2], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _grads(model, microbatches: int):
    """Gradients after one step of ``microbatches``, synced on the last only (the trainer's way)."""
    g = torch.Generator().manual_seed(1)
    for i in range(microbatches):
        last = i == microbatches - 1
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        model(torch.randn(6, 24, generator=g)).square().mean().backward()
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("units", ["model", "block"])
def test_the_same_gradients_as_fsdps_loop_added_by_the_kernel(one_rank, units, monkeypatch):
    expected = _grads(_model(one_rank, units), 3)

    calls = []
    kernel = par.accumulate_triton

    def counting(sums, grads, **kwargs):
        calls.append(len(sums))
        kernel(sums, grads, **kwargs)

    monkeypatch.setattr(par, "ACCUMULATE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(par, "accumulate_triton", counting)
    model = _model(one_rank, units)
    par.apply_grad_accumulation(model)
    got = _grads(model, 3)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    # microbatches 2 and 3 of the step: every parameter of every unit added by the kernel
    per_unit = [2, 4] if units == "block" else [6]
    assert sorted(calls) == sorted(per_unit * 2), calls


def test_off_the_kernels_devices_fsdps_loop_adds(one_rank, monkeypatch):
    calls = []
    monkeypatch.setattr(par, "accumulate_triton", lambda s, g, **kwargs: calls.append(s))
    expected = _grads(_model(one_rank, "model"), 2)
    model = _model(one_rank, "model")
    par.apply_grad_accumulation(model)  # CPU tensors: not ACCUMULATE_DEVICES
    got = _grads(model, 2)
    assert not calls and all(torch.equal(got[n], expected[n]) for n in expected)


def test_the_added_gradients_are_freed_before_fsdps_post_backward(monkeypatch):
    # FSDP's post-backward then allocates its reduce-scatter buffers (the step's last microbatch):
    # the hook must not keep the gradients it added alive through it
    import weakref
    from types import SimpleNamespace

    monkeypatch.setattr(par, "ACCUMULATE_DEVICES", ("cuda", "cpu"))
    params = [nn.Parameter(torch.zeros(n, dtype=torch.float16)) for n in (64, 40)]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    alive = [weakref.ref(p.grad) for p in params]
    fsdp_params = [SimpleNamespace(unsharded_accumulated_grad=torch.ones(p.numel()), unsharded_param=p) for p in params]
    seen = []
    post_backward = par._accumulating_first(SimpleNamespace(fsdp_params=fsdp_params),
                                            lambda: seen.append([ref() is not None for ref in alive]))
    post_backward()
    assert seen == [[False, False]]
    assert all(p.grad is None for p in params)
    assert all(torch.equal(fp.unsharded_accumulated_grad, torch.full((fp.unsharded_param.numel(),), 3.0))
               for fp in fsdp_params)


def test_sums_not_in_fp32_stay_with_fsdps_loop_and_the_log_says_so(one_rank, monkeypatch, caplog):
    # fp16 parameters reduced in bf16: FSDP keeps its sums in bf16, which the kernel does not take
    calls = []
    monkeypatch.setattr(par, "ACCUMULATE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(par, "_left_to_fsdp_logged", False)
    monkeypatch.setattr(par, "accumulate_triton", lambda s, g, **kwargs: calls.append(s))
    expected = _grads(_model(one_rank, "model", torch.bfloat16), 3)
    model = _model(one_rank, "model", torch.bfloat16)
    par.apply_grad_accumulation(model)
    with caplog.at_level("INFO"):
        got = _grads(model, 3)
    assert not calls and all(torch.equal(got[n], expected[n]) for n in expected)
    said = [r.getMessage() for r in caplog.records if "left to FSDP2's own adds" in r.getMessage()]
    assert len(said) == 1 and "6 gradient sum(s)" in said[0] and "torch.bfloat16 += torch.float16" in said[0], said
