"""Host (CPU) time per call of the Triton GDN op at one shape, on a GPU.

    python -m hymo_kernels.gdn.host_probe [--shape 4,4096,40,32,32]

The GPU is kept busy by a sleep kernel while the calls are issued, so the host never waits on
it and the time per call is what the host spends (Python, dispatch, autograd, Triton's
launcher). Beside it the wall time with the GPU free. When the host time of the op exceeds its
GPU time, an eager benchmark measures the host, not the kernels (benchmarks/LOG.md, fifth session).
20 calls per row: the fifth session's numbers used 50, and there the single-launcher rows
summed to 0.25 ms against 0.64 ms for the direct _forward + _backward row; whether a deep
launch queue behind the sleep slows the driver is what fewer calls per row would show.
Rows: the op's fwd+bwd as an eager call runs it (a plain autograd.Function; what bench.py
times), the same through the custom ops and their registered autograd (what torch.compile
traces; the eager path until the sixth session), the same launches through ``_forward`` +
``_backward`` directly, an autograd.Function that launches nothing (autograd's own cost),
the custom-op forward under no_grad against ``_forward``, each launcher alone, and fla's
fwd+bwd when fla-core is installed.
"""

from __future__ import annotations

import argparse
import time

import torch

from . import bench as Bm
from . import chunk as C


def host_ms(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # ~2 s of GPU work queued ahead of the calls
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    ms = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return ms


def wall_ms(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4,4096,40,32,32", help="B,T,H,K,V (bf16 inputs)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_probe: needs a CUDA GPU (it measures host time against queued GPU work)")
    shape = tuple(int(s) for s in args.shape.split(","))
    x = Bm.make_inputs(shape, torch.bfloat16)
    t = [x[n].requires_grad_() for n in Bm.NAMES]
    d = [a.detach() for a in t]
    do = torch.randn_like(x["v"])
    scale = shape[3] ** -0.5

    def op():
        for a in t:
            a.grad = None
        o, _ = Bm.ours(*t)
        o.backward(do)

    def custom_ops():
        for a in t:
            a.grad = None
        o, _, _, _ = C.gdn_chunk_fwd(*t, None, None, scale, True)
        o.backward(do)

    def direct():
        o, ht, st, ti = C._forward(*d, None, None, scale, True)
        C._backward(*d, None, None, st, ti, do, None, scale, True)

    class Nop(torch.autograd.Function):
        """Autograd's own host cost: no kernels, outputs from torch.empty_like."""

        @staticmethod
        def forward(ctx, *a):
            ctx.save_for_backward(*a)
            return torch.empty_like(a[2])

        @staticmethod
        def backward(ctx, g_):
            return tuple(torch.empty_like(a) for a in ctx.saved_tensors)

    def empty_function():
        for a in t:
            a.grad = None
        Nop.apply(*t).backward(do)

    def op_fwd_nograd():
        with torch.no_grad():
            C.gdn_chunk_fwd(*d, None, None, scale, True)

    p = C.make_problem(*d, None, scale, True)
    tinv = C.run_wy_inverse(p)
    mn = C.run_fwd_prep(p, tinv)
    states, _ = C.run_state_pass(p, mn, None, False)
    mr = C.run_bwd_prep(p, tinv, do)
    dstates, _ = C.run_state_pass(p, mr, None, True)
    rows = [("op fwd+bwd (eager: autograd.Function)", op), ("same through the custom ops", custom_ops),
            ("_forward + _backward directly", direct),
            ("empty autograd.Function, same inputs", empty_function),
            ("custom op forward, no_grad", op_fwd_nograd),
            ("_forward directly", lambda: C._forward(*d, None, None, scale, True)),
            ("make_problem", lambda: C.make_problem(*d, None, scale, True)),
            ("run_wy_inverse", lambda: C.run_wy_inverse(p)), ("run_fwd_prep", lambda: C.run_fwd_prep(p, tinv)),
            ("run_state_pass", lambda: C.run_state_pass(p, mn, None, False)),
            ("run_fwd_out", lambda: C.run_fwd_out(p, tinv, states)),
            ("run_bwd_prep", lambda: C.run_bwd_prep(p, tinv, do)),
            ("run_bwd_local", lambda: C.run_bwd_local(p, tinv, do, states, dstates))]
    fla = Bm.load_fla()
    if fla is not None:
        def fla_op():
            for a in t:
                a.grad = None
            o, _ = fla(*t)
            o.backward(do)
        rows.append(("fla fwd+bwd", fla_op))
    print(f"# host_probe {shape} on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'what':40s} {'host ms':>8s} {'wall ms':>8s}")
    for name, fn in rows:
        print(f"{name:40s} {host_ms(fn):8.3f} {wall_ms(fn):8.3f}", flush=True)


if __name__ == "__main__":
    main()
