"""Two CPU processes with FSDP2 over gloo against one process.

One spawn (each process pays a ~5-10 s import) checks, on the tiny model of _tiny.py (uneven
row splits, 3 experts over 2 ranks, same-shape matrices in two layers, a parameter without
gradient), with NorMuon on every matrix including the MoE ones:
1. 3 steps of NorMuon + CautiousAdamW under fully_shard give the single-process parameters;
2. save at step 3 (DCP), continue to 6; a fresh sharded run loaded from step 3 repeats the
   losses of steps 4..6 bitwise;
3. a checkpoint written by 1 process loads into 2 (and the 2-process one into 1, in the parent
   afterwards) and continues with the same losses up to float summation order;
4. the NaN-skip decision is the same on every rank when only one rank sees a NaN loss.
"""

import os
import sys
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
import _tiny  # noqa: E402
from _spawn import mark_passed, spawn_ranks  # noqa: E402

OPT = dict(moe_on_normuon=True, normuon_ortho_dtype="float32")
# Row shards reduce gradients in another order than one process: ~1e-7 relative per step,
# which 3 orthogonalised steps keep far below this.
ATOL, RTOL = 2e-5, 1e-4


def build(model, **overrides):
    from hymo_recipes.titan.optimizers import build_hymo_lr_schedulers, build_hymo_optimizers

    opts = build_hymo_optimizers([model], _tiny.optim_config(**OPT, **overrides), None)
    return opts, build_hymo_lr_schedulers(opts, _tiny.sched_config(), 10)


def states(model, opts, scheds):
    return {"model": _tiny.ModelState(model), "optimizer": opts, "lr_scheduler": scheds}


def sharded_model(seed, mesh):
    from torch.distributed.fsdp import fully_shard

    model = _tiny.make_model(seed)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_params(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.named_parameters()}


def worker(rank, world, tmp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    # A file store rather than tcp://: no store server thread on rank 0 that its peer may still
    # be talking to when rank 0 exits (seen: rank 0 aborting with "terminate called without an
    # active exception" after the test's work had finished), and no free-port race.
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        ref = torch.load(os.path.join(tmp, "ref.pt"))

        # 1. the distributed step equals the single-process step
        model = sharded_model(0, mesh)
        opts, scheds = build(model)
        losses = _tiny.train_steps(model, opts, scheds, range(1, 4), rank, world)
        got = full_params(model)
        for k, v in ref["params_after_3"].items():
            torch.testing.assert_close(got[k], v, atol=ATOL, rtol=RTOL, msg=lambda m: f"{k}: {m}")
        assert losses == pytest.approx(ref["losses_1_3"], rel=1e-5)
        st = opts.optimizers[0].state[model.layers["0"].attn.q_proj.weight]
        assert type(st["neuron_v"]).__name__ == "DTensor"  # sharded like the parameter

        # 1b. the same with NorMuon's fused kernels (Triton's interpreter): the expert stacks,
        # whole on each rank, through the kernels; the row-sharded matrices through the
        # PyTorch passes and their all-to-all
        model_f = sharded_model(0, mesh)
        opts_f, scheds_f = build(model_f, normuon_fused=True)
        _tiny.train_steps(model_f, opts_f, scheds_f, range(1, 4), rank, world)
        assert opts_f.optimizers[0]._tables  # some batch went through the kernels
        got_f = full_params(model_f)
        for k, v in ref["params_after_3"].items():
            torch.testing.assert_close(got_f[k], v, atol=ATOL, rtol=RTOL, msg=lambda m: f"fused {k}: {m}")

        # 2. save at 3, continue; a fresh sharded run from the checkpoint repeats 4..6 bitwise
        ckpt2 = os.path.join(tmp, "ckpt2")
        dcp.save(states(model, opts, scheds), checkpoint_id=ckpt2)
        cont = _tiny.train_steps(model, opts, scheds, range(4, 7), rank, world)
        model2 = sharded_model(123, mesh)
        opts2, scheds2 = build(model2)
        dcp.load(states(model2, opts2, scheds2), checkpoint_id=ckpt2)
        assert _tiny.train_steps(model2, opts2, scheds2, range(4, 7), rank, world) == cont

        # 3a. 1-process checkpoint into 2 processes
        model3 = sharded_model(7, mesh)
        opts3, scheds3 = build(model3)
        dcp.load(states(model3, opts3, scheds3), checkpoint_id=os.path.join(tmp, "ckpt1"))
        cont3 = _tiny.train_steps(model3, opts3, scheds3, range(4, 7), rank, world)
        assert cont3 == pytest.approx(ref["losses_4_6"], rel=1e-5)
        if rank == 0:
            torch.save({"losses_4_6_dist": cont}, os.path.join(tmp, "dist.pt"))

        # 4. a NaN loss on one rank only: every rank skips (the decision is all-reduced)
        from hymo_recipes.optim.nan_guard import NonFiniteGuard

        guard = NonFiniteGuard()
        guard.on_loss(torch.tensor(float("nan") if rank == 1 else 1.0))
        assert guard.check_step([torch.ones(3)]) is False
        grad = torch.tensor([float("inf") if rank == 0 else 1.0])
        assert guard.check_step([grad]) is False
        assert guard.check_step([torch.ones(3)]) is True
        assert guard.metrics() == {"skipped_steps": 2, "consecutive_skipped": 0}
        mark_passed(tmp, rank)
        # Both ranks finish their last collective before either closes its sockets: a rank
        # that tears down gloo while its peer still reads the last message aborts the peer.
        dist.barrier()
    except BaseException:
        # mp.spawn reports only the first process to die, and a rank that fails an assertion
        # can make its peer abort inside gloo first: keep every rank's own traceback (_spawn.py).
        with open(os.path.join(tmp, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_two_processes_match_one_and_reshard(tmp_path):
    tmp = str(tmp_path)
    # single-process reference: 3 steps, checkpoint, 3 more
    model = _tiny.make_model(0)
    opts, scheds = build(model)
    losses_1_3 = _tiny.train_steps(model, opts, scheds, range(1, 4))
    params_after_3 = {k: v.detach().clone() for k, v in model.named_parameters()}
    dcp.save(states(model, opts, scheds), checkpoint_id=os.path.join(tmp, "ckpt1"))
    losses_4_6 = _tiny.train_steps(model, opts, scheds, range(4, 7))
    torch.save(dict(params_after_3=params_after_3, losses_1_3=losses_1_3, losses_4_6=losses_4_6),
               os.path.join(tmp, "ref.pt"))
    # the test can fail: the model really moves
    assert max((params_after_3[k] - v).abs().max() for k, v in
               _tiny.make_model(0).named_parameters()) > 1e-2

    spawn_ranks(worker, 2, tmp)

    # 3b. the 2-process checkpoint into 1 process
    dist_losses = torch.load(os.path.join(tmp, "dist.pt"))["losses_4_6_dist"]
    model1 = _tiny.make_model(99)
    opts1, scheds1 = build(model1)
    dcp.load(states(model1, opts1, scheds1), checkpoint_id=os.path.join(tmp, "ckpt2"))
    losses1 = _tiny.train_steps(model1, opts1, scheds1, range(4, 7))
    assert losses1 == pytest.approx(dist_losses, rel=1e-5)
