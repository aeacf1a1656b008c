"""GDN kernel benchmark (GPU): ours vs flash-linear-attention vs the eager PyTorch reference.

    python -m hymo_kernels.gdn.bench [--sweep] [--shapes 4,4096,40,32,32 ...] [--no-fla] [--no-eager]

In one run, for each (B, T, H, K, V): parity first (bf16 and fp32, ours against the float64
per-token recurrence on a slice of batch rows/heads, every output and gradient, relative error
‖out − ref‖/‖ref‖; fla's bf16 errors beside ours), then forward and forward+backward times
(median of triton.testing.do_bench), the minimal HBM bytes of each over that time against the
measured device-to-device copy bandwidth, and a per-kernel breakdown from torch.profiler.
Speed-ups are not printed for a shape whose parity failed.

All three are called the same way: q, k raw (L2-normalised in the kernel, fla's
``use_qk_l2norm_in_kernel=True``; the eager reference normalises them first), v, beta bf16,
g fp32 (as the model makes them), no initial state, no final state.

fla-core refuses to run its gated backward on Hopper with Triton < 3.7.1 (fla issue #640: a
miscompilation gives a wrong dg). For timing only, this script lifts that guard, says so in
its output, and reports the errors fla's gradients then have.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time

import torch
import torch.nn.functional as F

from hymo_kernels.gdn import chunk as gdn_chunk
from hymo_kernels.gdn.chunk import Config, KernelCfg, chunk_gated_delta_rule
from hymo_kernels.gdn.naive import naive_recurrent_gated_delta_rule

SHAPES = [(4, 4096, 40, 32, 32), (8, 4096, 40, 32, 32), (1, 32768, 40, 32, 32), (4, 4096, 16, 128, 128)]
# fwd+bwd goals (ms) and fla's fwd+bwd measured on this kind of machine on 2026-11-29 (KERNEL_NOTES.md)
GOAL_MS = {(4, 4096, 40, 32, 32): 0.45, (1, 32768, 40, 32, 32): 0.6, (4, 4096, 16, 128, 128): 3.16}
TOL = {
    torch.bfloat16: dict(o=5e-3, ht=5e-3, dq=8e-3, dk=8e-3, dv=8e-3, dg=2e-2, dbeta=2e-2, dh0=5e-3),
    torch.float32: dict(o=1e-4, ht=1e-4, dq=1e-4, dk=1e-4, dv=1e-4, dg=1e-4, dbeta=1e-4, dh0=1e-4),
}
NAMES = ("q", "k", "v", "g", "beta")
DEVICE = "cuda"  # "cpu" with --smoke: checks this script's code paths in Triton's interpreter


def log(*a):
    print(*a, flush=True)


def do_bench(fn, rep=200, grad_to_none=None):
    import triton.testing

    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return triton.testing.do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def make_inputs(shape, dtype, seed=0):
    B, T, H, K, V = shape
    device = DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    x = dict(
        q=torch.randn(B, T, H, K, device=device, generator=gen),
        k=torch.randn(B, T, H, K, device=device, generator=gen),
        v=torch.randn(B, T, H, V, device=device, generator=gen),
        g=F.logsigmoid(torch.randn(B, T, H, device=device, generator=gen)),
        beta=torch.rand(B, T, H, device=device, generator=gen),
    )
    return {n: t.to(torch.float32 if n == "g" else dtype) for n, t in x.items()}


def l2n(x):
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


# --------------------------------------------------------------------------------------------
# implementations, called the same way
# --------------------------------------------------------------------------------------------


def ours(q, k, v, g, beta, initial_state=None, output_final_state=False):
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)


def load_fla():
    try:
        import fla
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    except Exception as e:  # noqa: BLE001
        log(f"fla: not available ({e!r})")
        return None
    lifted = bool(fla_chunk_o.IS_NVIDIA_HOPPER and fla_chunk_o.TRITON_ABOVE_3_4_0 and not fla_chunk_o.TRITON_ABOVE_3_7_1)
    if lifted:
        fla_chunk_o.TRITON_ABOVE_3_4_0 = False  # the guard reads this module global
    log(f"fla-core {fla.__version__}: Hopper/Triton<3.7.1 guard on gated backward (fla #640) "
        f"{'LIFTED for this benchmark' if lifted else 'not active here'}")

    def run(q, k, v, g, beta, initial_state=None, output_final_state=False):
        return fla_gdn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                       use_qk_l2norm_in_kernel=True)

    return run


def load_eager():
    try:
        from hymo_kernels.gdn import get_backend

        ref = get_backend("torch_chunk")
    except Exception as e:  # noqa: BLE001
        log(f"eager reference (torch_chunk): not available ({e!r})")
        return None

    def run(q, k, v, g, beta, initial_state=None, output_final_state=False):
        return ref(l2n(q), l2n(k), v, g, beta, initial_state=initial_state, output_final_state=output_final_state)

    return run


# --------------------------------------------------------------------------------------------
# parity
# --------------------------------------------------------------------------------------------


def rel(a, b):
    if a is None:
        return float("nan")
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def fwd_bwd_grads(impl, x, h0, do, dht):
    t = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
    h = h0.detach().clone().requires_grad_()
    o, ht = impl(*(t[n] for n in NAMES), initial_state=h, output_final_state=True)
    torch.autograd.backward([o, ht], [do.to(o.dtype), dht])
    return dict(o=o, ht=ht, dq=t["q"].grad, dk=t["k"].grad, dv=t["v"].grad, dg=t["g"].grad,
                dbeta=t["beta"].grad, dh0=h.grad)


def parity(shape, impls, heads):
    """Errors of each implementation against the fp64 recurrence on batch row 0, `heads`."""
    B, T, H, K, V = shape
    xb = make_inputs(shape, torch.bfloat16, seed=1)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    h0 = 0.1 * torch.randn(B, H, K, V, device=DEVICE, generator=gen)
    do = torch.randn(B, T, H, V, device=DEVICE, generator=gen)
    dht = torch.randn(B, H, K, V, device=DEVICE, generator=gen)

    # reference on the slice, from the bf16 values upcast (so one reference serves bf16 and fp32)
    hs = torch.tensor(heads, device=DEVICE)
    rx = {n: xb[n][:1].index_select(2, hs).double().requires_grad_() for n in NAMES}
    rh0 = h0[:1].index_select(1, hs).double().requires_grad_()
    t0 = time.time()
    # the per-token loop costs ~50 s at T = 32768; there the float64 chunked torch reference
    # stands in (it matches the recurrence to ~1e-15 in float64)
    if T >= 16384:
        from hymo_kernels.gdn.chunk_torch import chunk_gated_delta_rule_torch as ref_fn
        ref_name = "fp64 chunked torch reference"
    else:
        ref_fn, ref_name = naive_recurrent_gated_delta_rule, "fp64 recurrence"
    ro, rht = ref_fn(l2n(rx["q"]), l2n(rx["k"]), rx["v"], rx["g"], rx["beta"],
                     initial_state=rh0, output_final_state=True)
    torch.autograd.backward([ro, rht], [do[:1].index_select(2, hs).double(), dht[:1].index_select(1, hs).double()])
    ref = dict(o=ro, ht=rht, dq=rx["q"].grad, dk=rx["k"].grad, dv=rx["v"].grad, dg=rx["g"].grad,
               dbeta=rx["beta"].grad, dh0=rh0.grad)
    log(f"  reference ({ref_name}, batch row 0, heads {heads}): {time.time() - t0:.1f}s")
    del rx, rh0, ro, rht

    rows = []
    for name, impl, dtype in impls:
        x = {n: (xb[n].float() if dtype == torch.float32 else xb[n]) for n in NAMES}
        try:
            out = fwd_bwd_grads(impl, x, h0, do, dht)
        except Exception as e:  # noqa: BLE001
            log(f"  {name} {dtype}: FAILED to run: {e!r}")
            rows.append((name, dtype, None, False))
            continue
        errs = {}
        for n, r in ref.items():
            o = out[n]
            if n in ("ht", "dh0"):
                o = o[:1].index_select(1, hs) if o is not None else None
            else:
                o = o[:1].index_select(2, hs) if o is not None else None
            errs[n] = rel(o, r)
        ok = all(errs[n] <= TOL[dtype][n] for n in errs)
        rows.append((name, dtype, errs, ok))
        log(f"  {name:5s} {str(dtype)[6:]:8s} " + " ".join(f"{n}={e:.1e}" for n, e in errs.items())
            + ("  PASS" if ok else "  FAIL") + ("" if name == "ours" else " (informational)"))
        del out
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def min_bytes(shape):
    """HBM bytes if every input is read once and every output written once (bf16; g fp32)."""
    B, T, H, K, V = shape
    n = B * T * H
    fwd = n * (2 * K + V) * 2 + n * 4 + n * 2 + n * V * 2
    bwd = (n * (2 * K + V) * 2 + n * 4 + n * 2 + n * V * 2) + (n * (2 * K + V) * 2 + n * 4 + n * 2)
    return fwd, fwd + bwd


def time_impl(impl, shape, rep=200):
    x = make_inputs(shape, torch.bfloat16)
    t = [x[n].requires_grad_() for n in NAMES]
    do = torch.randn_like(x["v"])

    def fwd():
        return impl(*t)

    def fwdbwd():
        o, _ = impl(*t)
        o.backward(do)

    fwd()
    fwdbwd()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    tf = do_bench(fwd, rep=rep, grad_to_none=t)
    tfb = do_bench(fwdbwd, rep=rep, grad_to_none=t)
    return tf, tfb


def kernel_breakdown(impl, shape, iters=10):
    """Mean CUDA time per kernel name over `iters` forward+backward calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    x = make_inputs(shape, torch.bfloat16)
    t = [x[n].requires_grad_() for n in NAMES]
    do = torch.randn_like(x["v"])
    for _ in range(3):
        o, _ = impl(*t)
        o.backward(do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            o, _ = impl(*t)
            o.backward(do)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dt > 0:
            rows.append((dt / iters / 1e3, e.key))
    rows.sort(reverse=True)
    return rows


def copy_bandwidth():
    x = torch.empty(2**29, dtype=torch.float32, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), rep=200)
    del x, y
    return 2 * 2**29 * 4 / (ms * 1e-3) / 1e12  # TB/s, bytes read + written


# --------------------------------------------------------------------------------------------
# tuning sweep (coordinate descent over the per-kernel choices, fwd+bwd time)
# --------------------------------------------------------------------------------------------

VARIANTS = {
    "wy_inverse": [KernelCfg(1), KernelCfg(2)],
    "fwd_prep": [KernelCfg(1), KernelCfg(2)],
    "fwd_out": [KernelCfg(1), KernelCfg(2)],
    "bwd_prep": [KernelCfg(1), KernelCfg(2)],
    "bwd_local": [KernelCfg(1), KernelCfg(2), KernelCfg(4)],
}


def sweep(shape, base=None, per_kernel=True, bts=(64, 128), pass_warps=True):
    B, T, H, K, V = shape
    base = base or gdn_chunk.get_config(K, V, B * H)
    results = []

    def measure(cfg):
        gdn_chunk.TUNING[(K, V)] = cfg
        try:
            t = time_impl(ours, shape, rep=60)[1]
        except Exception as e:  # noqa: BLE001
            log(f"    {cfg}: failed {e!r}")
            t = float("inf")
        results.append((t, cfg))
        return t

    best_t = measure(base)
    best = base
    for kname, variants in (VARIANTS.items() if per_kernel else ()):
        for kc in variants:
            if kc == getattr(best, kname):
                continue
            cfg = dataclasses.replace(best, **{kname: kc})
            t = measure(cfg)
            log(f"    {kname}={kc.num_warps}w: {t:.3f} ms (best {best_t:.3f})")
            if t < best_t:
                best_t, best = t, cfg
    for bt in bts:
        for bvp in (16, 32):
            if (bt, bvp) == (best.BT, best.BV_PASS) or bvp > V:
                continue
            cfg = dataclasses.replace(best, BT=bt, BV_PASS=bvp)
            t = measure(cfg)
            log(f"    BT={bt} BV_PASS={bvp}: {t:.3f} ms (best {best_t:.3f})")
            if t < best_t:
                best_t, best = t, cfg
    for nwp in ((1, 2, 4) if pass_warps else ()):
        if nwp == best.num_warps_pass:
            continue
        cfg = dataclasses.replace(best, num_warps_pass=nwp)
        t = measure(cfg)
        log(f"    num_warps_pass={nwp}: {t:.3f} ms (best {best_t:.3f})")
        if t < best_t:
            best_t, best = t, cfg
    gdn_chunk.TUNING.pop((K, V), None)
    return best, best_t


# --------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=None, help="B,T,H,K,V ...")
    ap.add_argument("--sweep", action="store_true", help="tune the per-kernel choices first")
    ap.add_argument("--sweep-shapes", nargs="*", default=None)
    ap.add_argument("--quick-sweep", action="store_true", help="per-kernel warps only, first sweep shape")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes: tests this script")
    ap.add_argument("--tuning", default=None, help="JSON of configs keyed 'B,T,H,K,V' (from --sweep)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(s) for s in a.split(",")) for a in args.shapes] if args.shapes else SHAPES
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"

    import triton

    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test: timings meaningless)"
    log(f"# GDN benchmark {datetime.datetime.now().isoformat(timespec='seconds')} on {dev}, "
        f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}")
    fla_impl = None if args.no_fla else load_fla()
    eager_impl = None if args.no_eager else load_eager()
    bw = copy_bandwidth() if DEVICE == "cuda" else float("nan")
    log(f"device-to-device copy bandwidth: {bw:.2f} TB/s (bytes read + written)")
    result = dict(device=dev, torch=torch.__version__, triton=triton.__version__, copy_tbps=bw, shapes={})

    tuned: dict[tuple, Config] = {}
    if args.tuning:
        for key, d in json.load(open(args.tuning)).items():
            d = dict(d)
            for kname in VARIANTS:
                d[kname] = KernelCfg(**d[kname])
            tuned[tuple(int(s) for s in key.split(","))] = Config(**d)
    if args.sweep:
        sweep_shapes = ([tuple(int(s) for s in a.split(",")) for a in args.sweep_shapes]
                        if args.sweep_shapes else shapes)
        first = None
        if args.quick_sweep:
            sweep_shapes = sweep_shapes[:1]
        for shape in sweep_shapes:
            log(f"## sweep at {shape}" + ("" if first is None else " (chunk size and pass only)"))
            t0 = time.time()
            same_dims = first is not None and first[0][3:] == shape[3:]
            best, t = sweep(shape, base=first[1] if same_dims else None, per_kernel=not same_dims,
                            bts=() if args.quick_sweep else (64, 128) if not same_dims else (64, 128, 256),
                            pass_warps=not args.quick_sweep)
            first = first or (shape, best)
            tuned[shape] = best
            log(f"  best {t:.3f} ms: {best} ({time.time() - t0:.0f}s)")
        result["tuned"] = {",".join(map(str, s)): dataclasses.asdict(c) for s, c in tuned.items()}

    table = []
    t_start = time.time()
    for shape in shapes:
        B, T, H, K, V = shape
        log(f"## {shape} (t = {time.time() - t_start:.0f}s)")
        if shape in tuned:
            gdn_chunk.TUNING[(K, V)] = tuned[shape]
        cfg = gdn_chunk.get_config(K, V, B * H)
        log(f"  config: {cfg}")
        ok = True
        if not args.no_parity:
            heads = [0] if T >= 16384 else [0, H - 1]
            impls = [("ours", ours, torch.bfloat16), ("ours", ours, torch.float32)]
            if fla_impl is not None:
                impls.append(("fla", fla_impl, torch.bfloat16))
            prow = parity(shape, impls, heads)
            ok = all(r[3] for r in prow if r[0] == "ours")
            result["shapes"].setdefault(str(shape), {})["parity"] = [
                dict(impl=r[0], dtype=str(r[1]), errors=r[2], ok=r[3]) for r in prow]
        times = {}
        for name, impl in (("ours", ours), ("fla", fla_impl), ("eager", eager_impl)):
            if impl is None:
                continue
            try:
                times[name] = time_impl(impl, shape, rep=200 if name != "eager" else 300)
            except Exception as e:  # noqa: BLE001
                log(f"  {name}: timing failed: {e!r}")
                continue
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            log(f"  {name:5s} fwd {times[name][0]:8.3f} ms   fwd+bwd {times[name][1]:8.3f} ms"
                f"  (t = {time.time() - t_start:.0f}s)")
        try:
            for ms, kname in (kernel_breakdown(ours, shape)[:8] if DEVICE == "cuda" else []):
                log(f"    ours kernel {ms:7.3f} ms  {kname[:90]}")
        except Exception as e:  # noqa: BLE001
            log(f"  profiler failed: {e!r}")
        fb, fbb = min_bytes(shape)
        result["shapes"].setdefault(str(shape), {}).update(
            times={n: dict(fwd_ms=t[0], fwdbwd_ms=t[1]) for n, t in times.items()}, parity_ok=ok,
            config=dataclasses.asdict(cfg), min_bytes_fwd=fb, min_bytes_fwdbwd=fbb)
        table.append((shape, times, ok, fb, fbb))
        gdn_chunk.TUNING.pop((K, V), None)

    log("")
    log(f"# summary ({dev}, torch {torch.__version__}, triton {triton.__version__}; bf16, median ms; "
        f"BW = minimal bytes / time vs copy {bw:.2f} TB/s)")
    log(f"{'shape':24s} {'ours fwd':>9s} {'fla fwd':>9s} {'eager fwd':>10s} {'ours f+b':>9s} {'fla f+b':>9s} "
        f"{'eager f+b':>10s} {'vs fla':>7s} {'vs eager':>8s} {'BW f+b':>7s} {'goal':>6s} parity")
    for shape, times, ok, fb, fbb in table:
        def g(n, i):
            return times[n][i] if n in times else float("nan")

        o_f, o_fb = g("ours", 0), g("ours", 1)
        ratio_fla = g("fla", 1) / o_fb if ok else float("nan")
        ratio_eager = g("eager", 1) / o_fb if ok else float("nan")
        bwf = fbb / (o_fb * 1e-3) / 1e12 / bw
        goal = GOAL_MS.get(shape)
        log(f"{str(shape):24s} {o_f:9.3f} {g('fla', 0):9.3f} {g('eager', 0):10.2f} {o_fb:9.3f} {g('fla', 1):9.3f} "
            f"{g('eager', 1):10.2f} {ratio_fla:6.1f}x {ratio_eager:7.0f}x {bwf:6.0%} "
            f"{(f'{goal:.2f}' if goal else '-'):>6s} {'ok' if ok else 'FAILED (no speedup reported)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
