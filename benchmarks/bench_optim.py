"""CautiousAdamW vs torch.optim.AdamW(foreach=True) on the same parameters: time per step.

    python benchmarks/bench_optim.py                          # debugmodel's AdamW group, CPU
    python benchmarks/bench_optim.py --flavor small --device cuda --compiled

The parameters are the CautiousAdamW side of HyMo's partition table for a model flavor (built
on the meta device, then materialised with random values), i.e. exactly what the optimizer
sees in training. Before timing, a parity check runs: CautiousAdamW with both cautious flags
off must equal torch's AdamW, and the compiled step must equal the eager one; the script
refuses to report speeds if either fails. Results go to BENCHMARKS.md by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time

import torch

from hymo_recipes.model.args import hymo_flavors
from hymo_recipes.model.model import HymoModel
from hymo_recipes.optim import CautiousAdamW
from hymo_recipes.optim.partition import CAUTIOUS_ADAMW, build_param_groups, hymo_param_table


def adamw_params(flavor: str, device: str) -> list[torch.Tensor]:
    args = dataclasses.replace(hymo_flavors[flavor], gdn_backend="naive")
    with torch.device("meta"):
        model = HymoModel(args)
    groups = build_param_groups(model.named_parameters(), hymo_param_table())[CAUTIOUS_ADAMW]
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
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per variant")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    params0 = adamw_params(args.flavor, args.device)
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


if __name__ == "__main__":
    sys.exit(main())
