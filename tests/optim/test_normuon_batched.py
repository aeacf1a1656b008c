"""The batched NorMuon step equals a per-parameter step (the implementation before batching).

NorMuon stacks same-shape matrices (and the experts of 3-D stacks) and runs the momentum,
neuron norm, rescale, cautious decay and update once per stack or as multi-tensor ops. This
file keeps a small per-parameter transcription of the previous loop, one tensor at a time,
and checks the optimizer against it on a mix of shapes, in fp32 with the production bf16
orthogonalisation as well as fp32 and fp64 iterations.
"""

import math
import os
import sys
import traceback

import pytest
import torch

from hymo_recipes.optim import NorMuon, orthogonalize, update_scale_factor

sys.path.insert(0, os.path.dirname(__file__))
from _spawn import mark_passed, spawn_ranks  # noqa: E402

# tall, wide, two squares (one batch), a 3-D expert stack and a 2-D matrix of the experts'
# shape (one local batch with them), a matrix that never gets a gradient
SHAPES = [(48, 20), (20, 48), (32, 32), (32, 32), (3, 24, 16), (24, 16), (12, 8)]
NO_GRAD = 6


def per_param_step(params, grads, states, *, lr, beta1=0.95, beta2=0.95, eps=1e-8, wd=0.1,
                   cautious_wd=True, neuron_norm=True, nesterov=True, update_scale="jordan",
                   ortho_dtype=torch.bfloat16, method="polar_express"):
    """One step, one parameter at a time (the pre-batching loop of normuon.py)."""
    for p, g, st in zip(params, grads, states):
        m, v = st["momentum_buffer"], st["neuron_v"]
        g = torch.zeros_like(m) if g is None else g.to(m.dtype)
        m.lerp_(g, 1.0 - beta1)
        u = g.lerp(m, beta1) if nesterov else m
        O = orthogonalize(u, method=method, dtype=ortho_dtype).to(m.dtype)
        if neuron_norm:
            v.lerp_(O.square().mean(dim=-1), 1.0 - beta2)
            N = O / (v.sqrt() + eps).unsqueeze(-1)
            ratio = (O.square().sum(dim=(-2, -1)) / N.square().sum(dim=(-2, -1)).clamp_min(1e-30))
            O = N * ratio.sqrt().reshape(*N.shape[:-2], 1, 1)
        s = update_scale_factor(update_scale, p.shape[-2], p.shape[-1])
        delta = O * (lr * s)
        if wd:
            decay = p.to(O.dtype) * (lr * wd)
            if cautious_wd:
                decay = decay * (O * p >= 0)
            delta = delta + decay
        p.sub_(delta.to(p.dtype))


def make_case(seed=0, steps=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    W0 = [(torch.randn(s, generator=g, dtype=torch.float64) / math.sqrt(s[-1])).to(dtype)
          for s in SHAPES]
    grads = [[None if i == NO_GRAD else torch.randn(s, generator=g, dtype=torch.float64).to(dtype)
              for i, s in enumerate(SHAPES)] for _ in range(steps)]
    return W0, grads


def run_both(hp, ortho_dtype, dtype=torch.float32, compiled=False, lr=0.02, fused=False):
    W0, grads = make_case(dtype=dtype)
    params = [torch.nn.Parameter(w.clone()) for w in W0]
    opt = NorMuon(params, lr=lr, momentum=hp.get("beta1", 0.95), beta2=hp.get("beta2", 0.95),
                  eps=hp.get("eps", 1e-8), weight_decay=hp.get("wd", 0.1),
                  cautious_wd=hp.get("cautious_wd", True),
                  neuron_norm=hp.get("neuron_norm", True), nesterov=hp.get("nesterov", True),
                  update_scale=hp.get("update_scale", "jordan"), ortho_dtype=ortho_dtype,
                  compiled=compiled, fused=fused)
    ref = [w.clone() for w in W0]
    states = [dict(momentum_buffer=torch.zeros_like(w), neuron_v=torch.zeros(w.shape[:-1],
                                                                             dtype=w.dtype))
              for w in W0]
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr
        opt.step()
        per_param_step(ref, step_grads, states, lr=lr, ortho_dtype=getattr(torch, ortho_dtype),
                       **hp)
    return W0, params, ref, opt, states


VARIANTS = {
    "default": {},
    "plain_muon": dict(neuron_norm=False),
    "no_cautious_no_nesterov": dict(cautious_wd=False, nesterov=False),
    "no_decay_rms": dict(wd=0.0, update_scale="rms"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("ortho_dtype", ["bfloat16", "float32"])
def test_batched_equals_per_parameter(variant, ortho_dtype):
    W0, params, ref, opt, states = run_both(VARIANTS[variant], ortho_dtype)
    for i, (p, r, w0, st) in enumerate(zip(params, ref, W0, states)):
        msg = lambda m, i=i: f"param {i} {tuple(w0.shape)}: {m}"  # noqa: E731
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7, msg=msg)
        # relative to the size of the change too, so the check is not satisfied by W alone
        assert (p.detach() - r).norm() <= 1e-5 * (r - w0).norm() + 1e-12, msg("update")
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], st["momentum_buffer"],
                                   rtol=1e-6, atol=1e-7, msg=msg)
        torch.testing.assert_close(opt.state[p]["neuron_v"], st["neuron_v"], rtol=1e-6,
                                   atol=1e-12, msg=msg)
    # the test can fail: every parameter moved, the one without gradient through decay only
    # (zero update: [0 ⊙ W ≥ 0] keeps every entry decaying)
    wd = VARIANTS[variant].get("wd", 0.1)
    for i, (r, w0) in enumerate(zip(ref, W0)):
        moved = (r - w0).abs().max()
        if i != NO_GRAD:
            assert moved > 1e-3, i
        else:
            assert (moved > 1e-5) if wd else (moved == 0), (i, moved)
    # the parameter without a gradient decays by exactly (1 - lr·wd) per step (3 steps)
    decayed = (W0[NO_GRAD].double() * (1 - 0.02 * wd) ** 3).to(W0[NO_GRAD].dtype)
    torch.testing.assert_close(params[NO_GRAD].detach(), decayed, rtol=1e-6, atol=0)


def _update_errors(params, ref, W0):
    """‖p − r‖ / ‖r − w0‖ per parameter that moved."""
    return [float((p.detach() - r).norm() / (r - w0).norm()) for p, r, w0 in zip(params, ref, W0)
            if (r - w0).norm() > 0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_equals_per_parameter(variant):
    """The fused kernels (hymo_kernels.normuon, in Triton's interpreter, whose bf16 is not the
    GPU's: fp32 here, bf16 in the GPU test below) give the per-parameter step."""
    W0, params, ref, opt, states = run_both(VARIANTS[variant], "float32", fused=True)
    assert len(opt._tables) == 4 * len(opt._batches(params))  # the kernels ran, for every batch
    assert max(_update_errors(params, ref, W0)) <= 1e-5
    for i, (p, w0, st) in enumerate(zip(params, W0, states)):
        msg = lambda m, i=i: f"param {i} {tuple(w0.shape)}: {m}"  # noqa: E731
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], st["momentum_buffer"],
                                   rtol=1e-6, atol=1e-7, msg=msg)
        torch.testing.assert_close(opt.state[p]["neuron_v"], st["neuron_v"], rtol=1e-5, atol=1e-12, msg=msg)
        if i != NO_GRAD:
            assert (p.detach() - w0).abs().max() > 1e-3, msg("moved")
    # the parameter without a gradient decays by exactly (1 - lr·wd) per step (3 steps)
    wd = VARIANTS[variant].get("wd", 0.1)
    decayed = (W0[NO_GRAD].double() * (1 - 0.02 * wd) ** 3).to(W0[NO_GRAD].dtype)
    torch.testing.assert_close(params[NO_GRAD].detach(), decayed, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_fused_bf16_within_the_bf16_iterations_own_error(variant):
    """On the GPU with the production bf16 orthogonalisation: the fused step starts the
    iteration from U scaled by the fp32 norm of U, the eager one by the norm of U's bf16 cast,
    so the two differ by bf16's noise. Bound: twice the bf16 eager step's own distance from the
    fp32 one, per parameter."""
    W0, grads = make_case()
    dev = "cuda"

    def run(ortho_dtype, fused):
        params = [torch.nn.Parameter(w.clone().to(dev)) for w in W0]
        hp = VARIANTS[variant]
        opt = NorMuon(params, lr=0.02, ortho_dtype=ortho_dtype, fused=fused, weight_decay=hp.get("wd", 0.1),
                      neuron_norm=hp.get("neuron_norm", True), cautious_wd=hp.get("cautious_wd", True),
                      nesterov=hp.get("nesterov", True), update_scale=hp.get("update_scale", "jordan"))
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = None if gr is None else gr.to(dev)
            opt.step()
        return [p.detach().cpu() for p in params]

    fused, eager, exact = run("bfloat16", True), run("bfloat16", False), run("float32", False)
    own = _update_errors(eager, exact, W0)
    got = _update_errors(fused, eager, W0)
    assert all(g <= 2 * max(o, 1e-3) for g, o in zip(got, own)), (got, own)
    assert max(_update_errors(run("float32", True), exact, W0)) <= 1e-4


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_a_state_load_keeps_fp32_states_for_bf16_parameters(fused):
    """torch's load_state_dict casts states to the parameter's dtype: NorMuon casts its momentum
    and second moments back to fp32 (bitwise the saved values), and the fused kernels, which
    refuse bf16 momentum, step on after the load."""
    g = torch.Generator().manual_seed(0)
    shapes = [(12, 8), (2, 8, 12)]
    make = lambda: [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in shapes]  # noqa: E731
    params, params2 = make(), make()
    kw = dict(fused=fused, ortho_dtype="float32")
    opt = NorMuon(params, **kw)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).bfloat16()
    opt.step()
    saved = {k: v.clone() for k, v in opt.state[params[1]].items()}
    opt2 = NorMuon(params2, **kw)
    opt2.load_state_dict(opt.state_dict())
    for p in params2:
        for key in ("momentum_buffer", "neuron_v"):
            assert opt2.state[p][key].dtype == torch.float32, key
    assert all(torch.equal(opt2.state[params2[1]][k], v) for k, v in saved.items())
    for p in params2:
        p.grad = torch.randn(p.shape, generator=g).bfloat16()
    before = [p.detach().clone() for p in params2]
    opt2.step()
    assert all(not torch.equal(p, b) for p, b in zip(params2, before))


def test_fused_is_refused_where_it_cannot_run():
    p = [torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))]
    with pytest.raises(ValueError, match="fp64 parameters or ortho_dtype"):
        NorMuon(p, fused=True)
    with pytest.raises(ValueError, match="fp64 parameters or ortho_dtype"):
        NorMuon([torch.nn.Parameter(torch.zeros(4, 4))], fused=True, ortho_dtype="float64")
    with pytest.raises(ValueError, match="compiled and fused"):
        NorMuon([torch.nn.Parameter(torch.zeros(4, 4))], fused=True, compiled=True)
    # under a CUDA graph one gradient dtype per batch (a parameter without a gradient gets fp32 zeros)
    ps = [torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16)) for _ in range(2)]
    ps[0].grad = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"one gradient dtype per batch.*\[4, 4\] has \['torch.bfloat16', 'torch.float32'\]"):
        NorMuon(ps, fused=True).prepare_capture()


@pytest.mark.parametrize("chunk", [1, 700])
def test_cpu_chunked_update_equals_per_parameter(monkeypatch, chunk):
    """On CPU the update stage runs in pieces of whole members; any split gives the same."""
    import hymo_recipes.optim.normuon as normuon

    monkeypatch.setattr(normuon, "_CPU_CHUNK_ELEMS", chunk)
    W0, params, ref, _, _ = run_both({}, "float32")
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7)


def test_float64_bitwise_close():
    """In fp64 the only differences left are summation order: ~1e-15."""
    W0, params, ref, _, _ = run_both({}, "float64", dtype=torch.float64)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-12, atol=1e-14)


def test_lr_zero_changes_nothing():
    W0, params, ref, opt, _ = run_both({}, "float32", lr=0.0)
    for p, w0 in zip(params, W0):
        assert torch.equal(p.detach(), w0)
    assert opt.state[params[NO_GRAD]]["momentum_buffer"].abs().max() == 0


@pytest.mark.slow
def test_compiled_equals_eager():
    """torch.compile of the per-batch maths gives the eager numbers (up to fused rounding),
    with a few graphs for many shapes and none more when the scheduled lr changes."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    # Compile in this process: a pool of compile workers would outlive the test and compete
    # for the 2 cores. A plain assignment, not monkeypatch: pytest's undo of a monkeypatch on
    # this config (test_cautious_adamw.py does one) leaves the key hidden ("does not exist")
    # for the rest of the process, and an assignment brings it back.
    try:
        prior_threads = inductor_config.compile_threads
    except AttributeError:
        prior_threads = 1
    inductor_config.compile_threads = 1
    try:
        _check_compiled(counters)
    finally:
        inductor_config.compile_threads = prior_threads


def _check_compiled(counters):
    torch._dynamo.reset()
    counters.clear()
    _, eager, _, opt_e, _ = run_both({}, "float32")
    _, comp, _, opt_c, _ = run_both({}, "float32", compiled=True)
    for p, q in zip(comp, eager):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    graphs = counters["stats"]["unique_graphs"]
    # two compiled functions; dynamic shapes still specialise B = 1 and m == k, so 5 batches
    # make 4 graphs each (hymo_small: 2 each, 750m: 1 each), under dynamo's limit of 8
    assert 0 < graphs <= 8, graphs
    for opt in (opt_e, opt_c):
        opt.param_groups[0]["lr"] = 0.013
        opt.step()
    assert counters["stats"]["unique_graphs"] == graphs
    for p, q in zip(comp, eager):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


# 2 ranks: the (1, 8) matrix has no rows on rank 1, three (3, 8) matrices pad the all-to-all
# slots, the expert stack is split by experts, one gradient is missing in step 2.
DIST_SHAPES = [(1, 8), (3, 8), (3, 8), (3, 8), (5, 4), (2, 6, 4), (7, 5)]


def _dist_case():
    g = torch.Generator().manual_seed(0)
    W = [torch.randn(s, generator=g) for s in DIST_SHAPES]
    G = [[None if (k == 1 and i == 6) else torch.randn(s, generator=g)
          for i, s in enumerate(DIST_SHAPES)] for k in range(3)]
    return W, G


def _dist_run(params, G, wrap=lambda t: t):
    opt = NorMuon(params, ortho_dtype="float32")
    for gs in G:
        for p, g in zip(params, gs):
            p.grad = None if g is None else wrap(g)
        opt.step()
    return opt


def _dist_worker(rank, world, tmp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                            rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        W, G = _dist_case()
        params = [torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)])) for w in W]
        opt = _dist_run(params, G, lambda g: distribute_tensor(g, mesh, [Shard(0)]))
        out = ([p.full_tensor() for p in params],
               [opt.state[p]["neuron_v"].full_tensor() for p in params])
        if rank == 0:
            torch.save(out, os.path.join(tmp, "dist.pt"))
        mark_passed(tmp, rank)
        dist.barrier()
    except BaseException:
        with open(os.path.join(tmp, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_row_sharded_batches_match_one_process(tmp_path):
    """Stacked row-sharded batches (all-to-all, empty local rows, padding slots) under 2 gloo
    ranks give the one-process parameters and second moments."""
    spawn_ranks(_dist_worker, 2, str(tmp_path))
    W, G = _dist_case()
    params = [torch.nn.Parameter(w.clone()) for w in W]
    opt = _dist_run(params, G)
    full, vs = torch.load(tmp_path / "dist.pt")
    for p, w0, f, v in zip(params, W, full, vs):
        assert (p.detach() - w0).abs().max() > 1e-3
        torch.testing.assert_close(f, p.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, opt.state[p]["neuron_v"], rtol=1e-5, atol=1e-8)
