"""apply_one_rank_copy: FSDP2's one-rank gather (a cast and a copy per parameter) replaced by one
multi-tensor cast per unit, on a 1-rank gloo mesh on CPU: the same parameters, losses and
gradients bitwise over steps that change the parameters, and FSDP's per-parameter path unused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

import hymo_recipes.titan.parallelize as par


def _model(mesh, units: str, reshard: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Sequential(nn.Linear(40, 40), nn.LayerNorm(40)),
                          nn.Linear(40, 8, bias=False))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if units == "block":
        fully_shard(model[2], mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _train(model, steps: int = 3):
    """Losses, the last step's gradients and the final parameters of ``steps`` SGD steps (each
    step's forward sees the parameters the step before changed)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    device = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(1)  # the same inputs whatever the default device
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(6, 24, generator=g, device="cpu").to(device)).float().square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    return losses, grads, params


def _counting_gathers(monkeypatch) -> list:
    """Counts reads of FSDPParam.all_gather_inputs: FSDP's own per-parameter gather path."""
    reads = []
    original = FSDPParam.all_gather_inputs

    def counted(self):
        reads.append(1)
        return original.fget(self)

    monkeypatch.setattr(FSDPParam, "all_gather_inputs", property(counted))
    return reads


@pytest.mark.parametrize("units,reshard", [("model", False), ("block", False), ("block", True)])
def test_the_same_training_as_fsdps_loop_without_its_per_parameter_path(one_rank, units, reshard, monkeypatch):
    reads = _counting_gathers(monkeypatch)
    want = _train(_model(one_rank, units, reshard))
    assert reads, "FSDP's own gather was expected to read all_gather_inputs"

    reads.clear()
    copies = []
    foreach_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda outs, srcs: copies.append(len(outs)) or foreach_copy(outs, srcs))
    model = _model(one_rank, units, reshard)
    par.apply_one_rank_copy(model)
    got = _train(model)

    assert not reads, "FSDP's per-parameter gather ran under apply_one_rank_copy"
    assert copies and all(n > 0 for n in copies)
    for w, g in zip(want[0], got[0]):
        assert torch.equal(w, g)
    for want_d, got_d in zip(want[1:], got[1:]):
        assert want_d.keys() == got_d.keys()
        for name in want_d:
            assert torch.equal(want_d[name], got_d[name]), name
    # the unsharded parameters the modules hold are the bf16 casts of the updated masters
    model(torch.zeros(1, 24))
    lin = model[0]
    assert lin.weight.dtype == torch.bfloat16
    assert torch.equal(lin.weight.to_local() if hasattr(lin.weight, "to_local") else lin.weight,
                       got[2]["0.weight"].to(torch.bfloat16))


def test_a_torch_without_the_internals_it_needs_is_refused_in_one_line(one_rank, monkeypatch):
    model = _model(one_rank, "model", False)
    monkeypatch.setattr(par, "_ONE_RANK_GROUP_API", par._ONE_RANK_GROUP_API + ("_no_such_attribute",))
    with pytest.raises(RuntimeError, match="lacks _no_such_attribute .*fsdp_one_rank_copy = false"):
        par.apply_one_rank_copy(model)


@pytest.mark.gpu
def test_gpu_the_same_training_as_fsdps_loop(tmp_path, monkeypatch):
    """On CUDA, where torch._foreach_copy_ casts fp32 to bf16 in multi-tensor kernels (the CPU
    copies tensor by tensor): a 1-rank NCCL mesh, the same losses, gradients and parameters
    bitwise as FSDP's own gather over steps that change the parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this process")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        with torch.device("cuda"):
            reads = _counting_gathers(monkeypatch)
            want = _train(_model(mesh, "block", False))
            assert reads
            reads.clear()
            model = _model(mesh, "block", False)
            par.apply_one_rank_copy(model)
            got = _train(model)
            assert not reads
    finally:
        dist.destroy_process_group()
    for w, g in zip(want[0], got[0]):
        assert torch.equal(w, g)
    for want_d, got_d in zip(want[1:], got[1:]):
        for name in want_d:
            assert torch.equal(want_d[name], got_d[name]), name
