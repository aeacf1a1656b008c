"""Host time per call of HyMo's Triton launch paths, beside a bare Triton launch and an ATen op.

    python -m benchmarks.launch_overhead             # GPU
    TRITON_INTERPRET=1 python -m benchmarks.launch_overhead --dry   # CPU: 3 calls each (code paths only)

A training step's forward is host-bound when the host takes longer to issue a GDN block's
kernels than the GPU takes to run them. This times each entry point on inputs so small that
the GPU finishes every kernel before the next is issued: the wall time of ``--calls``
back-to-back calls (one synchronisation at the end) over their number is the host's time per
call. Rows:

- ``aten_add``: ``torch.add`` on a small tensor (the cost of one ATen launch);
- ``triton_bare``: an empty ``@triton.jit`` kernel with the argument mix of the conv kernels
  (4 pointers, 6 ints, 4 constexprs) launched by ``kernel[grid](...)``;
- ``triton_cached``: the same kernel's compiled object launched directly (no argument binding
  or specialisation lookup): what a launcher that cached the compiled kernel would pay;
- ``conv_fwd`` / ``conv_bwd``: ``hymo_kernels.gdn.short_conv`` forward and backward (1 and 1
  launches, plus the backward's dw sum); ``conv_qkv_fwd`` / ``conv_qkv_bwd``: the q, k and v
  convs in one launch each way (the mixer's);
- ``chunk_fwd``: the chunked GDN kernel's forward (``chunk_gated_delta_rule``, 4 launches);
- ``mixer_fwd``: the fused mixer's forward op (``conv_gated_delta_rule``: the q/k/v convs + the chunk
  forward); ``mixer_fwd_packed``: the same on a packed batch of 4 documents (cu_seqlens);
- ``gated_norm_fwd``: ``gated_norm_linear`` (the gated norm kernel + the output GEMM).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _empty_kernel(a_ptr, b_ptr, c_ptr, d_ptr, n0, n1, n2, n3, n4, n5, W: tl.constexpr, L: tl.constexpr,
                  BC: tl.constexpr, FLAG: tl.constexpr):
    pass


def _cases(dev: str, dtype: torch.dtype):
    from hymo_kernels.gdn.chunk import chunk_gated_delta_rule
    from hymo_kernels.gdn.mixer import conv_gated_delta_rule, gated_norm_linear
    from hymo_kernels.gdn.short_conv import conv_silu_bwd, conv_silu_fwd, conv_silu_qkv_bwd, conv_silu_qkv_fwd

    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    B, T, H, K = 1, 64, 2, 32
    C = H * K
    x, w, dy = rand(B, T, C), rand(C, 4, scale=0.5), rand(B, T, C)
    q, k, v = (rand(B, T, H, K) for _ in range(3))
    g = (-torch.rand(B, T, H, generator=gen)).to(dev)
    beta = torch.rand(B, T, H, generator=gen).to(dev, dtype)
    qkv = rand(B, T, 3 * C)  # the mixer's q, k, v projection in one tensor
    o, gate, norm_w, out_w = rand(B, T, H, K), rand(B, T, H, K), rand(K), rand(64, C)
    cu = torch.tensor([0, 10, 30, 31, 64], dtype=torch.int32, device=dev)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]).to(dev)
    ptrs = [torch.empty(16, device=dev) for _ in range(4)]
    ints = (64, 256, 4096, 1280, 1, 3)
    meta = dict(W=4, L=16, BC=256, FLAG=True)

    cases = {
        "aten_add": lambda: torch.add(x, x),
        "triton_bare": lambda: _empty_kernel[(1, 1, 1)](*ptrs, *ints, **meta),
    }
    if dev == "cuda":  # Triton's compiled-kernel call (its internals: a diagnostic row only)
        compiled = []

        def cached():
            if not compiled:
                compiled.append(_empty_kernel.warmup(*ptrs, *ints, **meta, grid=(1, 1, 1)))
            compiled[0][(1, 1, 1)](*ptrs, *ints, *meta.values())  # the launcher takes every argument

        cases["triton_cached"] = cached
    cases.update({
        "conv_fwd": lambda: conv_silu_fwd(x, w),
        "conv_bwd": lambda: conv_silu_bwd(x, w, dy),
        "conv_qkv_fwd": lambda: conv_silu_qkv_fwd(x, x, x, w, w, w),
        "conv_qkv_bwd": lambda: conv_silu_qkv_bwd(x, x, x, w, w, w, dy, dy, dy),
        "chunk_fwd": lambda: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True),
        "mixer_fwd": lambda: conv_gated_delta_rule(qkv, w, w, w, g, beta, head_k=K, head_v=K),
        "mixer_fwd_packed": lambda: conv_gated_delta_rule(qkv, w, w, w, g, beta, head_k=K, head_v=K,
                                                          cu_seqlens=cu, positions=pos),
        "gated_norm_fwd": lambda: gated_norm_linear(o, gate, norm_w, out_w, 1e-6),
    })
    return cases


def measure(fn, calls: int, warmup: int, sync) -> float:
    """Host microseconds per call over ``calls`` back-to-back calls."""
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=None, help="timed calls per row (default 300; 3 with --dry)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 30; 1 with --dry)")
    ap.add_argument("--dry", action="store_true", help="CPU under Triton's interpreter: the code paths only")
    args = ap.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU; --dry runs the code paths on the CPU")
    if args.dry and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--dry runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 before starting")
    calls = args.calls or (3 if args.dry else 300)
    warmup = args.warmup or (1 if args.dry else 30)
    dev, dtype = ("cpu", torch.float32) if args.dry else ("cuda", torch.bfloat16)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    where = torch.cuda.get_device_name() if dev == "cuda" else "CPU (Triton interpreter)"
    print(f"# launch_overhead: {where}, torch {torch.__version__}, Triton {triton.__version__}; host µs per "
          f"call over {calls} calls")
    rows = {}
    for name, fn in _cases(dev, dtype).items():
        try:
            rows[name] = f"{measure(fn, calls, warmup, sync):.1f}"
        except Exception as e:  # one row's failure (e.g. Triton internals moved) leaves the others
            rows[name] = f"error: {type(e).__name__}: {str(e)[:120]}"
    base = None if rows["triton_bare"].startswith("error") else float(rows["triton_bare"])
    print("| entry point | host µs / call | × a bare Triton launch |\n|---|---|---|")
    for name, us in rows.items():
        ratio = f"{float(us) / base:.2f}" if base and not us.startswith("error") else ""
        print(f"| {name} | {us} | {ratio} |")


if __name__ == "__main__":
    main()
