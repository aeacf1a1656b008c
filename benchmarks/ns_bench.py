"""The orthogonalisation's iteration at a flavor's NorMuon batches: hymo_kernels.normuon.ns
(three GEMM launches a step, the addends in the epilogues, the symmetric products' upper tiles
only) against torch's bmm/baddbmm chain that NorMuon's eager path runs (with its X / scale
pass), in the same process. GPU only.

    python -m benchmarks.ns_bench --flavor small
    python -m benchmarks.ns_bench --flavor small --sweep   # each TILES choice per batch shape
    TRITON_INTERPRET=1 python -m benchmarks.ns_bench --dry  # the code path on a CPU (debug model)

Prints per batch shape [B, m, n]: milliseconds of each (CUDA events around ``--iters`` calls
after ``--warmup``), the ratio, and the kernel's error against the fp64 iteration beside the
eager chain's; then the totals over the flavor's batches.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

import hymo_kernels.normuon.ns as ns
import hymo_kernels.normuon.ns_torch as ns_torch
from hymo_recipes.model.args import hymo_flavors
from hymo_recipes.model.model import HymoModel
from hymo_recipes.optim.normuon import POLAR_EXPRESS_COEFFS, _iterate
from hymo_recipes.optim.partition import NORMUON, build_param_groups, hymo_param_table

SWEEP = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
         (128, 128, 32, 4, 4), (128, 256, 64, 8, 3), (32, 64, 64, 4, 3), (16, 64, 64, 4, 3)]


def batches(flavor: str) -> list[tuple[int, int, int]]:
    """[(B, m, n)] of the flavor's NorMuon batches, wide orientation (m ≤ n)."""
    with torch.device("meta"):
        model = HymoModel(hymo_flavors[flavor])
    groups = build_param_groups(model.named_parameters(), hymo_param_table())[NORMUON]
    count: collections.Counter = collections.Counter()
    for grp in groups:
        for p in grp["params"]:
            count[tuple(sorted(p.shape[-2:]))] += p.shape[0] if p.ndim == 3 else 1
    return [(B, m, n) for (m, n), B in sorted(count.items())]


def eager(X: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return _iterate(X / inv.reciprocal().to(X.dtype).view(-1, 1, 1), list(POLAR_EXPRESS_COEFFS))


def timed(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # --dry: wall time on the CPU
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="small", choices=sorted(hymo_flavors))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="time each SWEEP tiling per shape too")
    ap.add_argument("--dry", action="store_true",
                    help="the debug model's batches on the CPU, one call each (needs TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if args.dry:
        args.flavor, args.iters, args.warmup, args.sweep = "debugmodel", 1, 0, False
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks.ns_bench needs a CUDA GPU (or --dry with TRITON_INTERPRET=1)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    coeffs = list(POLAR_EXPRESS_COEFFS)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton's interpreter)"
    print(f"{name} torch {torch.__version__}; flavor {args.flavor}")
    failed = 0
    print(f"{'[B, m, n]':>18} {'eager ms':>9} {'ns ms':>8} {'ratio':>6} {'err ns':>8} {'err eager':>9}")
    tot_e = tot_n = 0.0
    shapes = batches(args.flavor)
    if args.dry:  # the interpreter's cost grows with the tiles: the small batches
        shapes = [s for s in shapes if s[1] * s[2] <= 64 * 256]
    for B, m, n in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        # bf16 on the GPU; fp32 in the interpreter, whose bf16 is not the GPU's
        X = torch.randn(B, m, n, device=device, generator=g).to(torch.bfloat16 if device == "cuda" else torch.float32)
        inv = 1.0 / (X.float().square().sum(dim=(-2, -1)).sqrt() * 1.02 + 1e-6)
        te = timed(lambda: eager(X, inv), args.iters, args.warmup)
        tn = timed(lambda: ns.iterate(X, inv, coeffs), args.iters, args.warmup)
        exact = ns_torch.iterate(X.double(), inv, coeffs)
        err = lambda Y: ((Y.double() - exact).norm() / exact.norm()).item()  # noqa: E731
        tot_e, tot_n = tot_e + te, tot_n + tn
        e_ns, e_eager = err(ns.iterate(X, inv, coeffs)), err(eager(X, inv))
        print(f"{str([B, m, n]):>18} {te:9.3f} {tn:8.3f} {tn / te:6.2f} {e_ns:8.2e} {e_eager:9.2e}")
        if not e_ns <= 1.25 * e_eager + 1e-5:
            failed += 1
        if args.sweep:
            shipped = ns._tiles
            for tiles in SWEEP:
                ns._tiles = lambda *_shape, t=tiles: t
                try:
                    t = timed(lambda: ns.iterate(X, inv, coeffs), args.iters, args.warmup)
                    print(f"{'':>18}   tiles {tiles}: {t:.3f} ms")
                except Exception as e:  # a tiling that does not compile for this shape
                    print(f"{'':>18}   tiles {tiles}: {type(e).__name__}")
                finally:
                    ns._tiles = shipped
    print(f"{'total':>18} {tot_e:9.3f} {tot_n:8.3f} {tot_n / tot_e:6.2f}")
    if failed:
        print(f"ns_bench: the kernel's error exceeds 1.25x the chain's for {failed} batches", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
