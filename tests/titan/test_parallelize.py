"""parallelize_hymo refuses what it cannot do before touching the model."""

from types import SimpleNamespace

import pytest

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shim 1 first)
from hymo_recipes.titan.parallelize import parallelize_hymo


def _dims(**degrees):
    d = dict(tp=1, cp=1, pp=1, ep=1, dp_replicate=1, dp_shard=2) | degrees
    return SimpleNamespace(**d, dp_replicate_enabled=d["dp_replicate"] > 1,
                           dp_shard_enabled=d["dp_shard"] > 1)


def _job(ac_mode="none", cpu_offload=False, gdn_backend="flavor"):
    return SimpleNamespace(activation_checkpoint=SimpleNamespace(mode=ac_mode),
                           training=SimpleNamespace(enable_cpu_offload=cpu_offload),
                           hymo=SimpleNamespace(gdn_backend=gdn_backend))


@pytest.mark.parametrize("dims, job, message", [
    (_dims(tp=2), _job(), "tensor-parallel"),
    (_dims(cp=2), _job(), "context-parallel"),
    (_dims(pp=2), _job(), "pipeline-parallel"),
    (_dims(ep=2), _job(), "expert-parallel"),
    (_dims(dp_replicate=2, dp_shard=1), _job(), "pure DDP"),
    (_dims(), _job(ac_mode="memory_budget"), "memory_budget"),
    (_dims(), _job(cpu_offload=True), "cpu_offload"),
], ids=["tp", "cp", "pp", "ep", "ddp", "ac-budget", "offload"])
def test_unsupported_setups_raise(dims, job, message):
    with pytest.raises(NotImplementedError, match=message):
        parallelize_hymo(model=None, parallel_dims=dims, job_config=job)


def test_unapplied_gdn_backend_is_an_error():
    model = SimpleNamespace(model_args=SimpleNamespace(gdn_backend="torch_chunk"))
    with pytest.raises(ValueError, match="was not applied"):
        parallelize_hymo(model, _dims(), _job(gdn_backend="triton"))


def test_torch_chunk_backend_under_compile_is_a_clear_error():
    model = SimpleNamespace(model_args=SimpleNamespace(gdn_backend="torch_chunk"))
    job = _job()
    job.compile = SimpleNamespace(enable=True, components=["model", "loss"])
    with pytest.raises(ValueError, match="kept out of torch.compile"):
        parallelize_hymo(model, _dims(), job)


def test_reshard_after_forward_policy():
    from hymo_recipes.titan.parallelize import reshard_after_forward

    assert reshard_after_forward("default", 8) and not reshard_after_forward("default", 1)
    assert reshard_after_forward("always", 1) and not reshard_after_forward("never", 8)
    with pytest.raises(ValueError, match="default, always or never"):
        reshard_after_forward("sometimes", 2)


@pytest.mark.parametrize("enable, components, chunk, compiled", [
    (True, ["model", "loss"], 8192, True),
    (False, ["model", "loss"], 8192, False),
    (True, ["model"], 8192, False),
    (True, ["model", "loss"], 0, False),
])
def test_the_fused_loss_is_compiled_only_when_asked(enable, components, chunk, compiled):
    import torch

    from hymo_recipes.model.linear_ce import ce_chunk
    from hymo_recipes.titan.parallelize import apply_loss_compile

    model = SimpleNamespace(model_args=SimpleNamespace(fused_loss_chunk=chunk), loss_chunk_fn=ce_chunk)
    job = SimpleNamespace(compile=SimpleNamespace(enable=enable, components=components, backend="eager"))
    assert apply_loss_compile(model, job) is compiled
    assert (model.loss_chunk_fn is not ce_chunk) is compiled
    logits, targets = torch.randn(6, 11), torch.tensor([1, 2, -100, 4, 5, 0])
    for a, b in zip(model.loss_chunk_fn(logits.clone(), targets, True), ce_chunk(logits.clone(), targets, True)):
        torch.testing.assert_close(a, b)


def test_the_fused_loss_sends_gpu_chunks_to_the_triton_kernel(monkeypatch):
    """Compiled "loss": CUDA logits go to HyMo's Triton kernel, CPU logits to the compiled reference."""
    from types import SimpleNamespace as NS

    from hymo_recipes.titan import parallelize

    calls = []
    monkeypatch.setattr(parallelize, "ce_chunk_triton", lambda *a: calls.append(("triton", a)) or "triton")
    chunks = parallelize.LossChunks(lambda *a: calls.append(("cpu", a)) or "cpu")
    gpu_logits, cpu_logits = NS(is_cuda=True), NS(is_cuda=False)
    assert chunks(gpu_logits, "targets", True) == "triton"
    assert chunks(cpu_logits, "targets", False) == "cpu"
    assert calls == [("triton", (gpu_logits, "targets", True)), ("cpu", (cpu_logits, "targets", False))]
    model = NS(model_args=NS(fused_loss_chunk=8192), loss_chunk_fn=None)
    job = NS(compile=NS(enable=True, components=["model", "loss"], backend="eager"))
    assert parallelize.apply_loss_compile(model, job)
    assert isinstance(model.loss_chunk_fn, parallelize.LossChunks)


@pytest.mark.parametrize("units, sync_once, ranks, plan", [
    ("auto", False, 1, ("model", True)),  # one rank: one unit, gradients reduced once per step
    ("auto", False, 2, ("block", False)),
    ("auto", True, 8, ("block", True)),
    ("block", False, 1, ("block", False)),  # explicit values are kept on any rank count
    ("model", False, 1, ("model", False)),
    ("model", True, 4, ("model", True)),
])
def test_fsdp_plan_resolves_auto_by_the_rank_count(units, sync_once, ranks, plan):
    from hymo_recipes.titan.parallelize import fsdp_plan

    assert fsdp_plan(SimpleNamespace(fsdp_units=units, fsdp_sync_once_per_step=sync_once), ranks) == plan


def test_fsdp_plan_refuses_an_unknown_unit():
    from hymo_recipes.titan.parallelize import fsdp_plan

    with pytest.raises(ValueError, match="fsdp_units = 'layer': one of auto, block, model"):
        fsdp_plan(SimpleNamespace(fsdp_units="layer", fsdp_sync_once_per_step=False), 1)


@pytest.mark.parametrize("mode, option, wrapped", [
    ("full", "2", ["0", "1", "2", "3"]),
    ("selective", "2", ["1", "3"]),  # TorchTitan counts blocks from 1: every second one
    ("selective", "op", ["0", "1", "2", "3"]),
])
def test_checkpointed_blocks_leave_the_swiglu_recompute_to_the_outer_checkpoint(mode, option, wrapped):
    """In a block TorchTitan's apply_ac wraps, keep_matmuls would keep the SwiGLU projections the
    outer checkpoint drops (tests/model/test_recompute.py): apply_checkpointing turns it off
    there and leaves it on in the blocks it does not wrap."""
    import copy

    from torchtitan.config.job_config import ActivationCheckpoint

    from hymo_recipes.model import HymoModel, hymo_flavors
    from hymo_recipes.model.recompute import ProductRecompute
    from hymo_recipes.titan.parallelize import apply_checkpointing

    args = copy.deepcopy(hymo_flavors["debugmodel"])
    args.gdn_ffn_dim = 32  # a FeedForward in the GDN blocks too
    model = HymoModel(args)
    job = SimpleNamespace(activation_checkpoint=ActivationCheckpoint(mode=mode, selective_ac_option=option),
                          job=SimpleNamespace(dump_folder="/tmp"))
    assert apply_checkpointing(model, job, compile_model=False) == wrapped
    for name, layer in model.layers.named_children():
        flags = {m.recompute_products for m in layer.modules() if isinstance(m, ProductRecompute)}
        assert flags == {name not in wrapped}, (name, flags)
