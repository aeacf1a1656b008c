"""The fused loss's per-chunk cross-entropy: HyMo's Triton kernel beside the PyTorch reference
compiled by Inductor (what the CPU path runs and what the GPU ran before the kernel) and eager.

    python -m benchmarks.ce_bench                  # GPU: chunks of 8,192 tokens, vocab 8,192 and 64,256
    python -m benchmarks.ce_bench --dry            # CPU: a tiny chunk, the code paths only

Per vocabulary, one chunk as training hands it over (``fused_loss_chunk`` tokens of bf16 logits,
a gradient wanted): ms per call (median of ``triton.testing.do_bench``; the host clock in the dry
mode), the GB/s of the least the work moves (the logits read once and the gradient written
once), each row's time over the kernel's, and its largest gradient error against the eager
reference (a row above 1e-2 fails the run).
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import bench_device, rel_err, timer, timing_args
from hymo_kernels.ce import IGNORE_INDEX, ce_chunk
from hymo_kernels.ce.chunk import ce_chunk as ce_chunk_triton

_MAX_ERR = 1e-2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="rows of a chunk (default 8192, the flavors' fused_loss_chunk)")
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 64256])
    ap.add_argument("--dry", action="store_true", help="CPU: 16 tokens, vocab 100, fp32, Triton in its interpreter")
    timing_args(ap)
    args = ap.parse_args(argv)
    device = bench_device(ap, args.dry)
    tokens, vocabs, dtype = (16, [100], torch.float32) if args.dry else (args.tokens, args.vocab, torch.bfloat16)
    time_it = timer(device, args.warmup_ms, args.rep_ms)
    if device == "cuda":
        print(f"ce_bench: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    compiled = torch.compile(ce_chunk, dynamic=False)
    print("| vocab | function | ms | GB/s (logits read + gradient written once) | × the kernel's time | grad error |")
    print("|---|---|---|---|---|---|")
    failed = False
    for V in vocabs:
        g = torch.Generator().manual_seed(V)
        logits = (3 * torch.randn(tokens, V, generator=g)).to(dtype).to(device)
        targets = torch.randint(0, V, (tokens,), generator=g).to(device)
        targets[::97] = IGNORE_INDEX
        ref = ce_chunk(logits.clone(), targets, True)[1]
        # the reference works in place on fp32 logits (its .float() is then no copy): give it a copy
        fresh = (lambda: logits.clone()) if dtype == torch.float32 else (lambda: logits)
        rows = {"Triton kernel": lambda: ce_chunk_triton(logits, targets, True),
                "reference, compiled": lambda: compiled(fresh(), targets, True),
                "reference, eager": lambda: ce_chunk(fresh(), targets, True)}
        moved = 2 * logits.numel() * logits.element_size()
        times = {name: time_it(f) for name, f in rows.items()}
        for name, f in rows.items():
            err = rel_err(f()[1], ref)
            failed |= not err <= _MAX_ERR
            ms = times[name]
            print(f"| {V:,} | {name} | {ms:.3f} | {moved / ms / 1e6:,.0f} | {ms / times['Triton kernel']:.2f} | {err:.1e} |")
    if failed:
        print(f"ce_bench: a gradient error above {_MAX_ERR}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
