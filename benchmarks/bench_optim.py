"""CautiousAdamW vs torch.optim.AdamW(foreach=True) on the same parameters: time per step.

    python benchmarks/bench_optim.py                          # debugmodel's AdamW group, CPU
    python benchmarks/bench_optim.py --flavor small --device cuda --compiled

The parameters are the CautiousAdamW side of HyMo's partition table for a model flavor (built
on the meta device, then materialised with random values), i.e. exactly what the optimizer
sees in training. Before timing, a parity check runs: CautiousAdamW with both cautious flags
off must equal torch's AdamW, and the compiled step must equal the eager one; the script
refuses to report speeds if either fails. Results go to BENCHMARKS.md by hand.

NorMuon mode (``--optimizer normuon``): the NorMuon side of the table, per-step time and the
number of aten ops dispatched per step (eager; on CUDA also the kernels launched per step):

    python benchmarks/bench_optim.py --optimizer normuon --flavor small --no-ortho --threads 1
    python benchmarks/bench_optim.py --optimizer normuon --flavor small --device cuda --compiled --fused
    git show <rev>:hymo_recipes/optim/normuon.py > /tmp/normuon_old.py
    python benchmarks/bench_optim.py --optimizer normuon --flavor 750m --device cuda \
        --compiled --baseline /tmp/normuon_old.py

``--baseline FILE`` times another NorMuon implementation (a copy of normuon.py, e.g. an older
revision) on the same tensors and checks it against the current one first. ``--no-ortho``
swaps the orthogonalisation for a cheap stand-in (Frobenius normalisation) in every variant:
on CPU the bf16 Newton-Schulz matmuls take seconds per step and hide the per-parameter
overhead this mode is meant to show; never use it for GPU numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import platform
import statistics
import sys
import time

import torch

from hymo_recipes.model.args import hymo_flavors
from hymo_recipes.model.model import HymoModel
from hymo_recipes.optim import CautiousAdamW
from hymo_recipes.optim import normuon as normuon_mod
from hymo_recipes.optim.partition import (
    CAUTIOUS_ADAMW,
    NORMUON,
    build_param_groups,
    hymo_param_table,
)
from torch.utils._python_dispatch import TorchDispatchMode


def adamw_params(flavor: str, device: str, moe_on_normuon: bool) -> list[torch.Tensor]:
    args = dataclasses.replace(hymo_flavors[flavor], gdn_backend="naive")
    with torch.device("meta"):
        model = HymoModel(args)
    table = hymo_param_table(moe_on_normuon=moe_on_normuon)
    groups = build_param_groups(model.named_parameters(), table)[CAUTIOUS_ADAMW]
    g = torch.Generator().manual_seed(0)
    return [torch.randn(p.shape, generator=g).to(device) for grp in groups for p in grp["params"]]


def fresh(params0, grads):
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    for p, gr in zip(params, grads):
        p.grad = gr
    return params


def make(kind, params):
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, foreach=True, **kw)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, fused=True, **kw)
    if kind == "cautious_eager":
        return CautiousAdamW(params, **kw)
    if kind == "cautious_compiled":
        return CautiousAdamW(params, compiled=True, **kw)
    if kind == "plain_eager":  # both cautious flags off: AdamW maths on our code path
        return CautiousAdamW(params, cautious_update=False, cautious_wd=False, **kw)
    raise ValueError(kind)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def parity(params0, grads, compiled: bool) -> None:
    a, b = fresh(params0, grads), fresh(params0, grads)
    oa, ob = make("plain_eager", a), make("adamw_foreach", b)
    for _ in range(3):
        oa.step()
        ob.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    if compiled:
        c, d = fresh(params0, grads), fresh(params0, grads)
        oc, od = make("cautious_eager", c), make("cautious_compiled", d)
        for _ in range(3):
            oc.step()
            od.step()
        for x, y in zip(c, d):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def time_steps(kind, params0, grads, device, warmup, steps) -> list[float]:
    params = fresh(params0, grads)
    opt = make(kind, params)
    for _ in range(warmup):
        opt.step()
    sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flavor", default="debugmodel", choices=list(hymo_flavors))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compiled", action="store_true", help="also time the torch.compile'd step")
    ap.add_argument("--fused", action="store_true",
                    help="NorMuon mode: also time NorMuon(fused=True), HyMo's Triton passes (CUDA)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per variant")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
    ap.add_argument("--optimizer", default="cautious_adamw", choices=["cautious_adamw", "normuon"])
    ap.add_argument("--moe-on-normuon", action="store_true",
                    help="the router and experts (3-D stacks) on NorMuon, as the shipped default has them; "
                         "without it the seed's split (them on CautiousAdamW), which BENCHMARKS.md's rows timed")
    ap.add_argument("--baseline", default=None,
                    help="normuon: a .py file defining another NorMuon to time against")
    ap.add_argument("--no-ortho", action="store_true",
                    help="normuon: cheap stand-in for the orthogonalisation (CPU overhead study)")
    ap.add_argument("--ortho-dtype", default="bfloat16",
                    choices=["bfloat16", "float32", "float64"])
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.steps * args.repeats < 2 or args.warmup < 0:
        ap.error("--steps and --repeats must be >= 1 with at least 2 timed steps in all (--steps x "
                 "--repeats), --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.optimizer == "normuon":
        return main_normuon(args)

    params0 = adamw_params(args.flavor, args.device, args.moe_on_normuon)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g).to(args.device) for p in params0]
    n = sum(p.numel() for p in params0)
    try:
        parity(params0, grads, args.compiled)
    except AssertionError as e:
        print(f"PARITY FAILED, not reporting speeds:\n{e}")
        return 1

    kinds = ["adamw_foreach", "cautious_eager"]
    if args.device.startswith("cuda"):
        kinds.append("adamw_fused")
    if args.compiled:
        kinds.append("cautious_compiled")
    results = {k: [] for k in kinds}
    # Interleave the variants so a noisy neighbour hurts them alike.
    for _ in range(args.repeats):
        for k in kinds:
            results[k] += time_steps(k, params0, grads, args.device, args.warmup, args.steps)

    print(f"flavor {args.flavor}: CautiousAdamW group, {len(params0)} tensors, "
          f"{n / 1e6:.2f} M params")
    print(f"device {args.device}, torch {torch.__version__}, python {platform.python_version()}, "
          f"threads {torch.get_num_threads()}")
    base = statistics.median(results["adamw_foreach"])
    for k in kinds:
        med = statistics.median(results[k])
        q = statistics.quantiles(results[k], n=4)
        print(f"{k:20s} median {med * 1e3:8.2f} ms/step  (IQR {q[0] * 1e3:.2f}-{q[2] * 1e3:.2f})"
              f"  ratio to adamw_foreach {med / base:.3f}")
    return 0


# ------------------------------------------------------------------------------------------------
# NorMuon mode


def normuon_params(flavor: str, device: str, moe_on_normuon: bool) -> list[torch.Tensor]:
    args = dataclasses.replace(hymo_flavors[flavor], gdn_backend="naive")
    with torch.device("meta"):
        model = HymoModel(args)
    table = hymo_param_table(moe_on_normuon=moe_on_normuon)
    groups = build_param_groups(model.named_parameters(), table)[NORMUON]
    g = torch.Generator().manual_seed(0)
    # 1/sqrt(fan_in) like the model's init: the cautious-wd mask then sees realistic signs.
    return [(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5).to(device)
            for grp in groups for p in grp["params"]]


def load_normuon_class(path: str):
    spec = importlib.util.spec_from_file_location("normuon_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _standin_orthogonalize(x, *, steps=5, method="polar_express", dtype=torch.bfloat16):
    x = x.to(dtype)
    return x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)


def _standin_iterate(X, inv, coeffs):
    return X * inv.to(X.dtype).view(-1, 1, 1)


def make_normuon(kind, params, mods, ortho_dtype):
    kw = dict(lr=0.02, weight_decay=0.1, ortho_dtype=ortho_dtype)
    if kind == "normuon_eager":
        return mods["current"].NorMuon(params, **kw)
    if kind == "normuon_compiled":
        return mods["current"].NorMuon(params, compiled=True, **kw)
    if kind == "normuon_fused":
        return mods["current"].NorMuon(params, fused=True, **kw)
    if kind == "baseline":
        return mods["baseline"].NorMuon(params, **kw)
    raise ValueError(kind)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def count_ops(opt) -> int:
    """aten ops dispatched by one step (below autograd: what eager mode turns into kernels)."""
    with _OpCounter() as c:
        opt.step()
    return c.n


def count_cuda_kernels(opt) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def time_normuon(kind, params0, grads, mods, args) -> tuple[list[float], int | None, int | None]:
    params = fresh(params0, grads)
    opt = make_normuon(kind, params, mods, args.ortho_dtype)
    cuda = args.device.startswith("cuda")
    for _ in range(args.warmup):
        opt.step()
    sync(args.device)
    times = []
    for _ in range(args.steps):
        if cuda:
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            opt.step()
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1) / 1e3)
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    # Dynamo does not trace under a dispatch mode: aten counts are for the eager variants only.
    ops = None if kind == "normuon_compiled" else count_ops(opt)
    kernels = count_cuda_kernels(opt) if cuda else None
    del opt, params
    return times, ops, kernels


def normuon_parity(params0, grads, mods, kinds, ortho_dtype) -> None:
    """Every variant takes the same 3 steps as the current eager NorMuon (or refuse to time)."""
    ref = fresh(params0, grads)
    opt = make_normuon("normuon_eager", ref, mods, ortho_dtype)
    for _ in range(3):
        opt.step()
    del opt
    for kind in kinds:
        if kind == "normuon_eager":
            continue
        got = fresh(params0, grads)
        opt = make_normuon(kind, got, mods, ortho_dtype)
        for _ in range(3):
            opt.step()
        for x, y, x0 in zip(got, ref, params0):
            if kind == "normuon_fused":
                # the fused step scales the iteration's input by U's fp32 norm, the eager one by
                # the norm of its cast: in bf16 the two iterations run one rounding apart
                tol = 5e-2 if ortho_dtype == "bfloat16" else 1e-4
                err, size = (x - y).norm(), (y - x0).norm()
                assert err <= tol * size, f"{kind}: update error {err:.3g} against an update of {size:.3g}"
            else:
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{kind}: {m}")
        del opt, got


def main_normuon(args) -> int:
    mods = {"current": normuon_mod}
    if args.baseline:
        mods["baseline"] = load_normuon_class(args.baseline)
    if args.no_ortho:
        for m in mods.values():
            m.orthogonalize = _standin_orthogonalize
        normuon_mod.ns_kernels.iterate = _standin_iterate
    params0 = normuon_params(args.flavor, args.device, args.moe_on_normuon)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g).to(args.device) for p in params0]
    n = sum(p.numel() for p in params0)
    kinds = ["normuon_eager"]
    if args.compiled:
        kinds.append("normuon_compiled")
    if args.fused:
        kinds.append("normuon_fused")
    if args.baseline:
        kinds.append("baseline")
    try:
        normuon_parity(params0, grads, mods, kinds, args.ortho_dtype)
    except AssertionError as e:
        print(f"PARITY FAILED, not reporting speeds:\n{e}")
        return 1

    results = {k: [] for k in kinds}
    ops, kernels = {}, {}
    for _ in range(args.repeats):
        for k in kinds:
            t, ops[k], kernels[k] = time_normuon(k, params0, grads, mods, args)
            results[k] += t

    shapes = len({tuple(p.shape) for p in params0})
    print(f"flavor {args.flavor}: NorMuon group{' (+MoE)' if args.moe_on_normuon else ''}, "
          f"{len(params0)} tensors, {shapes} shapes, {n / 1e6:.2f} M params, "
          f"ortho {'STAND-IN' if args.no_ortho else args.ortho_dtype}")
    print(f"device {args.device}, torch {torch.__version__}, python {platform.python_version()}, "
          f"threads {torch.get_num_threads()}")
    for k in kinds:
        med = statistics.median(results[k])
        q = statistics.quantiles(results[k], n=4) if len(results[k]) > 1 else [med, med, med]
        extra = f"  aten ops/step {ops[k]}" if ops[k] is not None else ""
        if kernels[k] is not None:
            extra += f"  cuda kernels/step {kernels[k]}"
        ratio = statistics.median(results["normuon_eager"]) / med
        print(f"{k:18s} median {med * 1e3:9.2f} ms/step  (IQR {q[0] * 1e3:.2f}-{q[2] * 1e3:.2f})  "
              f"{ratio:.2f}x eager{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
