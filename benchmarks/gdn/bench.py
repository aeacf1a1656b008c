"""GDN kernel benchmark (GPU): ours vs flash-linear-attention vs the eager PyTorch reference.

Run from the repository root:

    python -m benchmarks.gdn.bench [--shapes 4,4096,40,32,32 ...] [--tuning tune.json] [--no-fla] [--no-eager]
                                   [--variants default,local,tf32dots] [--rounds 3] [--fast-ref]
    python -m benchmarks.gdn.bench --tune [--budget-s 270] [--json tune.json] [--shapes ...]
    TRITON_INTERPRET=1 python -m benchmarks.gdn.bench --smoke ...   # CPU: this script's code paths only

In one run, for each (B, T, H, K, V): parity first (bf16 and fp32, ours against the float64
per-token recurrence on a slice of batch rows/heads, every output and gradient, relative error
‖out − ref‖/‖ref‖; fla's bf16 errors beside ours), then forward and forward+backward times
(do_bench medians, in ``--rounds`` rounds (3) whose order alternates, the median of the rounds:
timed once each in a fixed order, whichever runs first measures faster; the eager reference is
timed once), the minimal HBM bytes of each over that time against the measured device-to-device
copy bandwidth, and a per-kernel breakdown from torch.profiler, whose sum is the GPU time.
Speed-ups are not printed for a shape whose parity failed.

``--variants`` compares configs in the same run, at every shape, each with its own parity rows
(one shared reference), fwd and fwd+bwd times and per-kernel breakdown: ``default`` (the
table's config as is; at K = 32 and 128 its backward is ``local_sub``), ``local`` / ``local_sub``
(the backward paths), ``bf16dots`` / ``tf32dots`` (``Config.dot_bf16``), and the rest of
``VARIANTS``, on top of the table or ``--tuning``. On a GPU every variant also runs the
collapsed-keys stress case (nearly parallel keys, where tf32 in the WY inverse gave NaN);
failing it counts as failed parity.

All three are called the same way: q, k raw (L2-normalised in the kernel, fla's
``use_qk_l2norm_in_kernel=True``; the eager reference normalises them first), v, beta bf16,
g fp32 (as the model makes them), no initial state, no final state.

``--tune`` (GPU) tunes the launch of each kernel alone, on its own inputs, per shape (K = V =
128 first): parity of the default config (bf16, fp32), then the chunk size BT (every kernel at
its default launch), then per kernel warps × column tile at one stage and then the stage count
(``--full-grid``: warps × tile × stages in one round; triton.testing.do_bench each). Worker
processes precompile each batch of variants in parallel into Triton's cache first. It prints
the winners as ``config.TABLE`` entries, checks the tuned config's bf16 and fp32 parity
and times fwd+bwd with the default and the tuned config (fla: live at the end if the budget
allows, else the last numbers measured, FLA_NOTES_MS), within ``--budget-s``, writing the
JSON after every shape.

``--warm-procs N`` (GPU) first runs one fwd+bwd per shape and implementation (ours per variant in
bf16 and fp32, with and without the state arguments, and fla in bf16) in N processes at once, so
that Triton's on-disk cache holds every kernel the run compiles: fla's autotuner compiles dozens
of configs at its first call at a shape, for minutes. The processes' own autotune timings are
thrown away (they share the GPU); the run then times everything itself, compiling nothing it
has cached.

fla-core refuses to run its gated backward on Hopper with Triton < 3.7.1 (fla issue #640: a
miscompilation gives a wrong dg). For timing only, this script lifts that guard, says so in
its output, and reports the errors fla's gradients then have.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.common import rel_err as rel
from hymo_kernels.gdn import config as gdn_config
from hymo_kernels.gdn import stress
from hymo_kernels.gdn.chunk import chunk_gated_delta_rule
from hymo_kernels.gdn.config import BWD_PATHS, KERNELS, Config, KernelCfg
from hymo_kernels.gdn.naive import naive_recurrent_gated_delta_rule
from hymo_kernels.gdn.stress import STRESS_TOL

SHAPES = [(4, 4096, 40, 32, 32), (8, 4096, 40, 32, 32), (1, 32768, 40, 32, 32), (4, 4096, 16, 128, 128)]
# fwd+bwd goals (ms) of the kernel's design card, printed beside the times
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


class variant:
    """Runs ours with `cfg` (chunk.TUNING for the shape's head dims) inside the block, for the
    forward and the backward alike; cfg None leaves TUNING as it is."""

    def __init__(self, shape, cfg):
        self.key, self.cfg = tuple(shape[3:]), cfg

    def __enter__(self):
        self.saved = gdn_config.TUNING.get(self.key)
        if self.cfg is not None:
            gdn_config.TUNING[self.key] = self.cfg

    def __exit__(self, *exc):
        if self.saved is None:
            gdn_config.TUNING.pop(self.key, None)
        else:
            gdn_config.TUNING[self.key] = self.saved


# --variants: name -> Config fields replaced on top of the table's (or --tuning's) config


def other_paths(cfg) -> list:
    """cfg with the other backward path."""
    return [dataclasses.replace(cfg, **f) for n, f in BWD_PATHS.items() if n != cfg.bwd_path]


VARIANTS = {
    "default": {},
    # the backward paths (local_sub: _bwd_local on the sub-chunk states the forward saved;
    # local: _bwd_local re-runs each chunk's forward into a scratch area)
    **BWD_PATHS,
    "bf16dots": dict(dot_bf16=True),
    "tf32dots": dict(dot_bf16=False),
    "inv_tf32x3": dict(inverse_prec="tf32x3"),
    "inv_ieee": dict(inverse_prec="ieee"),
    # the saved start states in bf16 or fp32 (Config.states_bf16)
    "states_bf16": dict(states_bf16=True),
    "states_fp32": dict(states_bf16=False),
    # T = (I + A)⁻¹ and the Gram matrix of A on bf16 operands too (as fla's A), or in tf32
    "tbf16": dict(t_bf16=True),
    "ttf32": dict(t_bf16=False),
    # a register cap (KernelCfg.maxnreg) on every kernel the config launches: fewer registers per
    # thread, more resident warps per SM for the latency-bound kernels, some spills
    "nreg168": dict(maxnreg=168),
    "nreg128": dict(maxnreg=128),
    "nreg96": dict(maxnreg=96),
    # the cap on the two forward chunk kernels alone: 12 one-warp programs per SM instead of 8 for
    # 9-12 spilled loads and stores (benchmarks.gdn.regs --maxnreg 168)
    "fwd_nreg168": dict(maxnreg=168, capped=("fwd_prep", "fwd_out")),
    # _bwd_local without the one-step-ahead load of T (Config.prefetch_t)
    "no_prefetch_t": dict(prefetch_t=False),
    # sub-chunks of 32 tokens at 2 warps (Triton then splits the 32-row tiles' rows between the
    # warps, where 16-row tiles split their columns and cross between the warps through shared
    # memory), _bwd_local at 2 or 4 warps
    "bc32": dict(BC=32, launches=dict(wy_inverse=(2, 1), fwd_prep=(2, 3, 64), fwd_out=(2, 3, 32),
                                      bwd_prep=(2, 3, 64), bwd_local=(2, 3, 32))),
    "bc32_bwd4": dict(BC=32, launches=dict(wy_inverse=(2, 1), fwd_prep=(2, 3, 64), fwd_out=(2, 3, 32),
                                           bwd_prep=(2, 3, 64), bwd_local=(4, 3, 32))),
}


def variant_config(cfg, name):
    """The config of a --variants entry on top of `cfg` (``maxnreg`` applies to the kernels
    named in ``capped``, by default every kernel the config launches; ``launches`` replaces
    kernels' launches, as TABLE entries write them)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}: pick from {tuple(VARIANTS)}")
    fields = dict(VARIANTS[name])
    nreg = fields.pop("maxnreg", None)
    capped = fields.pop("capped", None) or cfg.kernels()
    launches = {k: KernelCfg(*v) for k, v in fields.pop("launches", {}).items()}
    cfg = dataclasses.replace(cfg, **fields, **launches)
    if nreg is not None:
        cfg = dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), maxnreg=nreg) for k in capped})
    return cfg


def fwd_bwd_grads(impl, x, h0, do, dht):
    t = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
    h = h0.detach().clone().requires_grad_()
    o, ht = impl(*(t[n] for n in NAMES), initial_state=h, output_final_state=True)
    torch.autograd.backward([o, ht], [do.to(o.dtype), dht])
    return dict(o=o, ht=ht, dq=t["q"].grad, dk=t["k"].grad, dv=t["v"].grad, dg=t["g"].grad,
                dbeta=t["beta"].grad, dh0=h.grad)


def collapsed_keys_errors(K: int) -> dict:
    """The collapsed-keys stress case (hymo_kernels.gdn.stress) at head dim K on DEVICE."""
    return stress.collapsed_keys_errors(K, device=DEVICE)


def parity(shape, impls, heads, fast_ref=False):
    """Errors of each implementation against the fp64 recurrence on batch row 0, `heads`
    (fast_ref: the float64 chunked torch reference at every T, seconds instead of minutes)."""
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
    if T >= 16384 or fast_ref:
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
    for name, impl, dtype, *cfg in impls:
        # optional 4th element: the Config to run ours with (a --variants entry)
        x = {n: (xb[n].float() if dtype == torch.float32 else xb[n]) for n in NAMES}
        try:
            with variant(shape, cfg[0] if cfg else None):
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
            + ("  PASS" if ok else "  FAIL") + ("" if name.startswith("ours") else " (informational)"))
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


def warm_shape(shape, cfgs, fla_impl):
    """One fwd+bwd of each implementation at `shape`, as the run calls them (parity: with the
    state arguments, ours in bf16 and fp32 and fla in bf16; timing: without, in bf16): compiles
    what the run will (--warm-procs)."""
    B, T, H, K, V = shape
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    h0, dht = (0.1 * torch.randn(B, H, K, V, device=DEVICE, generator=gen) for _ in range(2))
    do = torch.randn(B, T, H, V, device=DEVICE, generator=gen)

    def both(impl, x):
        fwd_bwd_grads(impl, x, h0, do, dht)
        t = [x[n].detach().clone().requires_grad_() for n in NAMES]
        o, _ = impl(*t)
        o.backward(do.to(o.dtype))

    for dt in (torch.bfloat16, torch.float32):
        x = make_inputs(shape, dt, seed=1)
        for cfg in cfgs:
            with variant(shape, cfg):
                both(ours, x)
        if fla_impl is not None and dt == torch.bfloat16:
            both(fla_impl, x)
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def warm_up(shapes, args):
    """--warm-procs: warm_shape for every shape, in child processes, at most args.warm_procs at a
    time; logs each one's time and exit status (a failed one leaves its compiles to the run)."""
    t0 = time.time()
    base = [sys.executable, "-m", "benchmarks.gdn.bench", "--warm-only", "--no-eager", "--variants", args.variants]
    base += ["--no-fla"] * args.no_fla + ["--smoke"] * args.smoke + (["--tuning", args.tuning] if args.tuning else [])
    pending = [(shape, base + ["--shapes", ",".join(map(str, shape))]) for shape in shapes]
    running = []
    while pending or running:
        while pending and len(running) < args.warm_procs:
            shape, cmd = pending.pop(0)
            err = tempfile.TemporaryFile(mode="w+")  # a pipe could fill up and stall the child
            running.append((shape, time.time(), err, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)))
        time.sleep(0.2)
        for item in [r for r in running if r[3].poll() is not None]:
            shape, start, err, proc = item
            running.remove(item)
            err.seek(0)
            tail = "" if proc.returncode == 0 else f": {err.read().strip()[-500:]} (the run compiles this shape itself)"
            err.close()
            log(f"  warm-up {shape}: exit {proc.returncode} after {time.time() - start:.0f}s{tail}")
    log(f"warm-up: {len(shapes)} shapes in {time.time() - t0:.0f}s with {args.warm_procs} processes")


def kernel_breakdown(impl, shape, iters=10):
    """Mean CUDA time per kernel name over `iters` forward+backward calls (torch.profiler), the
    longest first; their sum is the GPU time of one fwd+bwd. Empty on the CPU (--smoke)."""
    from torch.profiler import ProfilerActivity, profile

    if DEVICE != "cuda":
        return []
    x = make_inputs(shape, torch.bfloat16)
    t = [x[n].requires_grad_() for n in NAMES]
    do = torch.randn_like(x["v"])
    for _ in range(3):
        o, _ = impl(*t)
        o.backward(do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            for x_ in t:  # as do_bench's grad_to_none: no accumulation adds in the profile
                x_.grad = None
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


def config_from_dict(d):
    d = dict(d)
    for n in KERNELS:
        if n in d and isinstance(d[n], dict):
            d[n] = KernelCfg(**d[n])
    return Config(**d)


def write_json(args, out):
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="B,T,H,K,V ... (default: SHAPES; with --tune TUNE_SHAPES, K = V = 128 first)")
    ap.add_argument("--tune", action="store_true",
                    help="GPU launch tuning, kernel by kernel (warps, stages, tiles, BT); prints config.TABLE entries")
    ap.add_argument("--budget-s", type=float, default=270.0, help="--tune: wall-clock budget in seconds")
    ap.add_argument("--jobs", type=int, default=None,
                    help="--tune: processes precompiling the variants in parallel (0: none; default cores - 2, <= 12)")
    ap.add_argument("--warps", default="1,2,4,8", help="--tune: num_warps choices")
    ap.add_argument("--stages", default="1,2,3", help="--tune: num_stages choices")
    ap.add_argument("--full-grid", action="store_true",
                    help="--tune: time every warps × tile × stages launch per kernel instead of the stages at "
                         "the best 1-stage launch only (more compiles: about len(--stages) times as many)")
    ap.add_argument("--nregs", default="", help="--tune: register caps (KernelCfg.maxnreg) tried last, e.g. 128,96 "
                    "(0: the compiler's choice, always a candidate then)")
    ap.add_argument("--bts", default="64,128,256", help="--tune: chunk sizes (multiples of BC)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--variants", default="default",
                    help="comma list of configs timed at every shape, each the table's with some Config fields "
                         f"replaced (bench.VARIANTS): {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timing rounds per shape (order reversed every other round; median; eager timed once)")
    ap.add_argument("--fast-ref", action="store_true",
                    help="parity against the float64 chunked torch reference at every T (seconds; the per-token "
                         "recurrence takes ~6 s per shape at T = 4096)")
    ap.add_argument("--json", default=None, help="write the results here (with --tune: after every shape)")
    ap.add_argument("--warm-procs", type=int, default=0,
                    help="processes compiling every shape's kernels (ours, fla) in parallel before the timing "
                         "run (see the module doc; 0: none)")
    ap.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, under TRITON_INTERPRET=1, tiny shapes: tests this script's code paths")
    ap.add_argument("--tuning", default=None,
                    help="JSON from --tune (its per-shape 'tuned' configs) or of configs keyed 'B,T,H,K,V'")
    args = ap.parse_args(argv)
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
    if args.tune:
        from benchmarks.gdn import tune as tuner
    default_shapes = tuner.TUNE_SHAPES if args.tune else SHAPES
    shapes = [tuple(int(s) for s in a.split(",")) for a in args.shapes] if args.shapes else default_shapes

    import triton

    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test: timings meaningless)"
    log(f"# GDN benchmark {datetime.datetime.now().isoformat(timespec='seconds')} on {dev}, "
        f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}")
    fla_impl = None if args.no_fla else load_fla()
    if args.tune:
        out = dict(device=dev, torch=torch.__version__, triton=triton.__version__, shapes={})
        args.shapes = [",".join(map(str, s)) for s in shapes]
        tuner.tune(args, fla_impl, out)
        return
    eager_impl = None if args.no_eager else load_eager()
    bw = copy_bandwidth() if DEVICE == "cuda" and not args.warm_only else float("nan")
    log(f"device-to-device copy bandwidth: {bw:.2f} TB/s (bytes read + written)")
    result = dict(device=dev, torch=torch.__version__, triton=triton.__version__, copy_tbps=bw, shapes={})

    tuned: dict[tuple, Config] = {}
    if args.tuning:
        data = json.load(open(args.tuning))
        if "shapes" in data:  # the JSON --tune writes
            data = {k: r["tuned"] for k, r in data["shapes"].items() if "tuned" in r}
        for key, d in data.items():
            tuned[tuple(int(s) for s in key.split(","))] = config_from_dict(d)

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        variant_config(Config(), v)  # fail early on a typo

    def configs(shape):
        """ours per variant at `shape`: (name, config); one variant keeps the plain name "ours"."""
        B, T, H, K, V = shape
        if shape in tuned:
            gdn_config.TUNING[(K, V)] = tuned[shape]
        base = gdn_config.get_config(K, V, B * H)
        gdn_config.TUNING.pop((K, V), None)
        return [("ours" if len(variants) == 1 else f"ours:{v}", variant_config(base, v)) for v in variants]

    if args.warm_only:
        for shape in shapes:
            warm_shape(shape, [cfg for _, cfg in configs(shape)], fla_impl)
        return
    if args.warm_procs > 0:
        warm_up(shapes, args)
    table = []
    t_start = time.time()
    for shape in shapes:
        B, T, H, K, V = shape
        log(f"## {shape} (t = {time.time() - t_start:.0f}s)")
        mine = configs(shape)
        for name, cfg in mine:
            log(f"  {name} config: {cfg}")
        res = result["shapes"].setdefault(str(shape), {})
        ok = {name: True for name, _ in mine}
        if not args.no_parity:
            heads = [0] if T >= 16384 else [0, H - 1]
            impls = [(name, ours, dt, cfg) for name, cfg in mine for dt in (torch.bfloat16, torch.float32)]
            if fla_impl is not None:
                impls.append(("fla", fla_impl, torch.bfloat16))
            prow = parity(shape, impls, heads, fast_ref=args.fast_ref)
            # the CPU interpreter computes bf16 wrongly (smoke mode tests code paths): fp32 rows only there
            judged = [r for r in prow if DEVICE == "cuda" or r[1] == torch.float32]
            ok = {name: all(r[3] for r in judged if r[0] == name) for name, _ in mine}
            res["parity"] = [dict(impl=r[0], dtype=str(r[1]), errors=r[2], ok=r[3]) for r in prow]
            if DEVICE == "cuda":  # the collapsed-keys case at this K, per variant (the interpreter has no bf16)
                res["stress"] = {}
                for name, cfg in mine:
                    with variant(shape, cfg):
                        err = collapsed_keys_errors(K)
                    good = err["o"] < STRESS_TOL and err["ht"] < STRESS_TOL
                    ok[name] = ok[name] and good
                    res["stress"][name] = err
                    log(f"  {name} collapsed keys (bf16, K = {K}): o {err['o']:.1e} ht {err['ht']:.1e}  "
                        f"{'PASS' if good else 'FAIL'} (< {STRESS_TOL:g})")
        times, kernels = {}, {}
        runs = [(name, ours, cfg) for name, cfg in mine] + [("fla", fla_impl, None), ("eager", eager_impl, None)]
        runs = [r for r in runs if r[1] is not None]
        # Rounds, the order reversed every other round, the median per implementation: timed
        # one after the other, whichever ran first measured faster at (4, 4096, 40, 32, 32).
        # The eager reference (10-300x slower) is timed in the first round only.
        per_round: dict[str, list] = {}
        for rnd in range(args.rounds):
            for name, impl, cfg in runs if rnd % 2 == 0 else runs[::-1]:
                if rnd > 0 and (name == "eager" or name not in per_round):
                    continue
                try:
                    with variant(shape, cfg):
                        t = time_impl(impl, shape, rep=200 if name != "eager" else 300)
                except Exception as e:  # noqa: BLE001
                    log(f"  {name}: timing failed: {e!r}")
                    per_round.pop(name, None)
                    continue
                per_round.setdefault(name, []).append(t)
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
        for name, rs in per_round.items():
            times[name] = (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
            spread = f"  f+b rounds {min(r[1] for r in rs):.3f}-{max(r[1] for r in rs):.3f}" if len(rs) > 1 else ""
            log(f"  {name:5s} fwd {times[name][0]:8.3f} ms   fwd+bwd {times[name][1]:8.3f} ms{spread}"
                f"  (t = {time.time() - t_start:.0f}s)")
        # GPU time (the kernels' sum): at the HyMo shape the wall time of an eager fwd+bwd is the
        # host's (kernels/gdn/DESIGN.md, Host time), so the table shows both
        gpu = {}
        for name, impl, cfg in [(n, ours, c) for n, c in mine] + [("fla", fla_impl, None)]:
            if impl is None or name not in times:
                continue
            try:
                with variant(shape, cfg):
                    rows = kernel_breakdown(impl, shape)
            except Exception as e:  # noqa: BLE001
                log(f"  {name}: profiler failed: {e!r}")
                continue
            if rows:
                gpu[name] = sum(ms for ms, _ in rows)
            kernels[name] = [dict(ms=ms, kernel=kname) for ms, kname in rows[:10]]
            for ms, kname in rows[:10]:
                log(f"    {name} kernel {ms:7.3f} ms  {kname[:90]}")
        fb, fbb = min_bytes(shape)
        res.update(times={n: dict(fwd_ms=t[0], fwdbwd_ms=t[1]) for n, t in times.items()}, parity_ok=ok, gpu_ms=gpu,
                   rounds={n: [dict(fwd_ms=t[0], fwdbwd_ms=t[1]) for t in rs] for n, rs in per_round.items()},
                   config={name: dataclasses.asdict(cfg) for name, cfg in mine}, kernels=kernels,
                   min_bytes_fwd=fb, min_bytes_fwdbwd=fbb)
        table.append((shape, times, ok, fb, fbb, gpu))
        if args.json:  # after every shape: a run cut by its time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)

    log("")
    log(f"# summary ({dev}, torch {torch.__version__}, triton {triton.__version__}; bf16, median ms; "
        f"BW = minimal bytes / time vs copy {bw:.2f} TB/s)")
    log(f"{'shape':24s} {'variant':13s} {'ours fwd':>9s} {'fla fwd':>9s} {'eager fwd':>10s} {'ours f+b':>9s} "
        f"{'fla f+b':>9s} {'eager f+b':>10s} {'vs fla':>7s} {'vs eager':>8s} {'BW f+b':>7s} {'goal':>6s} "
        f"{'ours GPU':>9s} {'fla GPU':>8s} {'GPU vs fla':>10s} parity")
    for shape, times, ok, fb, fbb, gpu in table:
        def g(n, i):
            return times[n][i] if n in times else float("nan")

        for name, good in ok.items():
            o_f, o_fb = g(name, 0), g(name, 1)
            ratio_fla = g("fla", 1) / o_fb if good else float("nan")
            ratio_eager = g("eager", 1) / o_fb if good else float("nan")
            bwf = fbb / (o_fb * 1e-3) / 1e12 / bw
            goal = GOAL_MS.get(shape)
            nan = float("nan")
            o_gpu, f_gpu = gpu.get(name, nan), gpu.get("fla", nan)
            log(f"{str(shape):24s} {name:13s} {o_f:9.3f} {g('fla', 0):9.3f} {g('eager', 0):10.2f} {o_fb:9.3f} "
                f"{g('fla', 1):9.3f} {g('eager', 1):10.2f} {ratio_fla:6.1f}x {ratio_eager:7.0f}x {bwf:6.0%} "
                f"{(f'{goal:.2f}' if goal else '-'):>6s} {o_gpu:9.3f} {f_gpu:8.3f} "
                f"{(f_gpu / o_gpu if good else nan):9.1f}x {'ok' if good else 'FAILED (no speedup reported)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    bad = [(str(shape), name) for shape, times, ok, *_ in table for name, good in ok.items()
           if not good or name not in times]
    if bad:  # parity failed or ours could not be timed: not a benchmark result
        sys.exit(f"benchmark failed (parity or timing of ours) at {bad}")


if __name__ == "__main__":
    # run in the named module, whose DEVICE tune.py reads (not in a second copy, __main__)
    from benchmarks.gdn import bench as _named

    _named.main()
