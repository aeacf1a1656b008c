"""Gradient accumulation of one microbatch: every parameter's bf16 gradient added into its fp32
sum, as FSDP2 does it (one PyTorch add per parameter) beside hymo_kernels.accum (every pair in
one Triton launch).

    python -m benchmarks.accum_bench                   # GPU: the 750m's parameters (vocab 8,192)
    python -m benchmarks.accum_bench --flavor small --vocab 64256
    python -m benchmarks.accum_bench --dry             # CPU: the debug model, the kernel interpreted

Per row: ms per microbatch's accumulation (median of ``triton.testing.do_bench``; the host clock
in the dry mode), the GB/s of the bytes it must move (the sum read and written, the gradient
read: 10 bytes per parameter with bf16 gradients), and the time over the kernel's. The kernel's
sums are checked bitwise against the loop's (a mismatch fails the run).
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import bench_device, timer, timing_args
from hymo_kernels.accum import accumulate_ as accumulate_torch
from hymo_kernels.accum.add import accumulate_ as accumulate_triton
from hymo_recipes.model.args import hymo_flavors
from hymo_recipes.model.model import HymoModel


def param_shapes(flavor: str, vocab: int) -> list[torch.Size]:
    """The shapes of a flavor's parameters (the model built on the meta device)."""
    import dataclasses

    args = dataclasses.replace(hymo_flavors[flavor], vocab_size=vocab)
    with torch.device("meta"):
        model = HymoModel(args)
    return [p.shape for p in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="750m", choices=sorted(hymo_flavors))
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary (default 8,192: the Brown BPE's)")
    ap.add_argument("--dry", action="store_true", help="CPU: the debug model, fp16 gradients, Triton interpreted")
    timing_args(ap)
    args = ap.parse_args(argv)
    device = bench_device(ap, args.dry)
    flavor, dtype = ("debugmodel", torch.float16) if args.dry else (args.flavor, torch.bfloat16)
    shapes = param_shapes(flavor, 512 if args.dry else args.vocab)
    n = sum(s.numel() for s in shapes)
    g = torch.Generator(device=device).manual_seed(0)
    sums = [torch.randn(s, generator=g, device=device) for s in shapes]
    grads = [torch.randn(s, generator=g, device=device).to(dtype) for s in shapes]
    ref = [s.clone() for s in sums]
    accumulate_torch(ref, grads)
    got = [s.clone() for s in sums]
    accumulate_triton(got, grads)
    bad = [i for i, (a, b) in enumerate(zip(got, ref)) if not torch.equal(a, b)]
    if device == "cuda":
        print(f"accum_bench: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"{flavor}: {len(shapes)} parameters, {n / 1e6:,.1f} M elements, {dtype} gradients into fp32 sums")
    time_it = timer(device, args.warmup_ms, args.rep_ms)
    rows = {"hymo_kernels.accum (one launch)": lambda: accumulate_triton(sums, grads),
            "one add per parameter (FSDP2's)": lambda: accumulate_torch(sums, grads)}
    times = {name: time_it(f) for name, f in rows.items()}
    moved = n * (8 + grads[0].element_size())
    kernel = times["hymo_kernels.accum (one launch)"]
    print("| accumulation | ms | GB/s (sums read and written, gradients read) | × the kernel's time |")
    print("|---|---|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.3f} | {moved / ms / 1e6:,.0f} | {ms / kernel:.2f} |")
    if bad:
        print(f"accum_bench: the kernel's sums differ from the loop's for {len(bad)} parameters", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
