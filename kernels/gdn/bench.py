"""GDN kernel benchmark (GPU): ours vs flash-linear-attention vs the eager PyTorch reference.

    python -m hymo_kernels.gdn.bench [--shapes 4,4096,40,32,32 ...] [--tuning tune.json] [--no-fla] [--no-eager]
                                     [--variants default,split,bf16dots] [--rounds 3] [--fast-ref]
    python -m hymo_kernels.gdn.bench --tune [--budget-s 270] [--json tune.json] [--shapes ...]

In one run, for each (B, T, H, K, V): parity first (bf16 and fp32, ours against the float64
per-token recurrence on a slice of batch rows/heads, every output and gradient, relative error
‖out − ref‖/‖ref‖; fla's bf16 errors beside ours), then forward and forward+backward times
(do_bench medians, in ``--rounds`` rounds (3) whose order alternates, the median of the rounds:
timed once each in a fixed order, the first of two variants measured 8-17 % faster at the
HyMo shape; the eager reference is timed once), the minimal HBM bytes of each over that time against the
measured device-to-device copy bandwidth, and a per-kernel breakdown from torch.profiler.
Speed-ups are not printed for a shape whose parity failed.

``--variants`` compares backward paths in the same run, at every shape, each with its own parity
rows (one shared reference), fwd and fwd+bwd times and per-kernel breakdown: ``default`` (the
table's config as is; at K = 32 and 128 its backward is ``local_sub``: ``_bwd_local`` on the
saved sub-chunk states), ``local`` (``_bwd_local`` recomputing each chunk's sub-chunk states)
and ``split`` (``_bwd_dstate`` + ``_bwd_sub``, ``Config.bwd_split``), the dot precision,
``bf16dots`` / ``tf32dots`` (``Config.dot_bf16``), ``inv_tf32x3`` (``Config.inverse_prec``), and
the rest of ``VARIANTS``, on top of the table or ``--tuning``. On a GPU every variant also runs
the collapsed-keys stress case (nearly parallel keys, where tf32 in the WY inverse gave NaN);
failing it counts as failed parity.

All three are called the same way: q, k raw (L2-normalised in the kernel, fla's
``use_qk_l2norm_in_kernel=True``; the eager reference normalises them first), v, beta bf16,
g fp32 (as the model makes them), no initial state, no final state.

``--tune`` (GPU) tunes the launch of each kernel alone, on its own inputs, per shape (K = V =
128 first): parity of the default config (bf16, fp32), then the chunk size BT (every kernel at
its default launch), then per kernel warps × column tile at one stage and then the stage count
(``--full-grid``: warps × tile × stages in one round; triton.testing.do_bench each). Worker
processes precompile each batch of variants in parallel into Triton's cache first. It prints
the winners as ``chunk.TABLE`` entries, checks the tuned config's bf16 and fp32 parity
and times fwd+bwd with the default and the tuned config (fla: live at the
end if the budget allows, else the numbers from the notes), within ``--budget-s``, writing the
JSON after every shape.

``--warm-procs N`` (GPU) first runs one fwd+bwd per shape and implementation (ours per variant in
bf16 and fp32, with and without the state arguments, and fla in bf16) in N processes at once, so
that Triton's on-disk cache holds every kernel the run compiles: fla's autotuner compiles dozens
of configs at its first call at a shape (149 s at the first shape of the thirteenth session's
run, while the whole call had 600 s). The processes' own autotune timings are thrown away (they
share the GPU); the run then times everything itself, compiling nothing it has cached.

fla-core refuses to run its gated backward on Hopper with Triton < 3.7.1 (fla issue #640: a
miscompilation gives a wrong dg). For timing only, this script lifts that guard, says so in
its output, and reports the errors fla's gradients then have.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
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


class variant:
    """Runs ours with `cfg` (chunk.TUNING for the shape's head dims) inside the block, for the
    forward and the backward alike; cfg None leaves TUNING as it is."""

    def __init__(self, shape, cfg):
        self.key, self.cfg = tuple(shape[3:]), cfg

    def __enter__(self):
        self.saved = gdn_chunk.TUNING.get(self.key)
        if self.cfg is not None:
            gdn_chunk.TUNING[self.key] = self.cfg

    def __exit__(self, *exc):
        if self.saved is None:
            gdn_chunk.TUNING.pop(self.key, None)
        else:
            gdn_chunk.TUNING[self.key] = self.saved


# --variants: name -> Config fields replaced on top of the table's (or --tuning's) config
# the split gradient stage's kernels (and the inverse it needs) at 4 warps, 32-column key blocks
_LH_WIDE = dict(lh_inverse=KernelCfg(4, 1), lh_bwd_dv=KernelCfg(4, 1), lh_bwd_dqk=KernelCfg(4, 1, 32),
                lh_bwd_finish=KernelCfg(4, 1))
BWD_PATHS = gdn_chunk.BWD_PATHS


def other_paths(cfg) -> list:
    """cfg with each of the other two backward paths (the default path's configs only)."""
    return [dataclasses.replace(cfg, **f) for n, f in BWD_PATHS.items() if n != cfg.bwd_path]


VARIANTS = {
    "default": {},
    # the backward paths (local_sub: _bwd_local on the sub-chunk states the forward saved, no
    # forward sweep; built in the twelfth session, in the table since the thirteenth)
    **BWD_PATHS,
    "bf16dots": dict(dot_bf16=True),
    "tf32dots": dict(dot_bf16=False),
    "inv_tf32x3": dict(inverse_prec="tf32x3"),
    "inv_ieee": dict(inverse_prec="ieee"),
    # the K = 32 table of the fourth session (tf32 dots, inverse products in fp32)
    "tf32_ieee": dict(dot_bf16=False, inverse_prec="ieee"),
    # the large-head path: 64-token chunks, the kernels' default launches (2 warps: ≥ 4 fault on
    # Hopper, see chunk.check_large_head_launch), and with W, U from a parallel
    # kernel instead of two dots per chunk in the passes. Slower than the default at both K on an
    # H200 (seventh session, kernels/gdn/README.md)
    "large_head": dict(large_head=True, BT=64),
    "large_head_wu": dict(large_head=True, BT=64, lh_wu=True),
    # the gradient stage split in three kernels (Config.lh_split, fla's split of its dq/dk kernel
    # over key blocks): on the large-head path, and on the table's path instead of _bwd_local
    # (64-token chunks), at the 2-warp defaults. Slower than the default everywhere on an H200
    # (tenth session, kernels/gdn/README.md). tab_lh_w4 (4 warps) is refused on Hopper by the
    # launch check: at K = 32 it passed fault_probe and was timed with the check lifted; at
    # K = 128 its 4-warp kernels fault
    "lh_split": dict(large_head=True, BT=64, lh_split=True),
    "tab_lh": dict(BT=64, lh_split=True, local_sub_states=False),
    "tab_lh_w4": dict(BT=64, lh_split=True, local_sub_states=False, **_LH_WIDE),
    # without the large-head kernels' default register cap (every kernel at the compiler's
    # choice): Triton 3.6's ptxas then gives some 2-warp large-head kernels 32 registers and
    # kilobytes of spills (tenth session; the runs there named the capped ones *_r255)
    "lh_split_nocap": dict(large_head=True, BT=64, lh_split=True, maxnreg=0),
    "tab_lh_nocap": dict(BT=64, lh_split=True, local_sub_states=False, maxnreg=0),
    "large_head_nocap": dict(large_head=True, BT=64, maxnreg=0),
    # K = 32 shapes only (it sets K = 32 launches): the backward launches of the table before the
    # sixth session adopted the fifth session's retune
    "pre_retune32": dict(bwd_prep=KernelCfg(1, 2, 64), bwd_local=KernelCfg(2, 2, 32), bwd_dstate=KernelCfg(1, 2, 32),
                         bwd_sub=KernelCfg(2, 1, 32)),
    # K = 32 shapes only: what `--tune --full-grid` proposed at (4,4096,40,32,32) on the local_sub path
    # (thirteenth session; kernel sums 0.874 -> 0.855 ms, its end-to-end check timed the host). The
    # fourteenth session's A/B took its BT = 256 into the table, not its launches
    "tune13_32": dict(BT=256, fwd_prep=KernelCfg(2, 3, 64), fwd_out=KernelCfg(2, 3, 32), bwd_dstate=KernelCfg(2, 3, 32),
                      bwd_sub=KernelCfg(1, 2, 32)),
    # K = 32 shapes only: tune13_32's two-warp bwd_dstate on the table (fourteenth session, where
    # the table was timed against BT = 256 as "bt256", now its BT: level with it)
    "bt256_dstate": dict(BT=256, bwd_dstate=KernelCfg(2, 3, 32)),
    # the saved start states in bf16 or fp32 (Config.states_bf16; in the table since the thirteenth session)
    "states_bf16": dict(states_bf16=True),
    "states_fp32": dict(states_bf16=False),
    # T = (I + A)⁻¹ and the Gram matrix of A on bf16 operands too (as fla's A; 4-6 % faster, eighth
    # session; in the K = 32 and K = 128 entries since the ninth), or in tf32 (the table before)
    "tbf16": dict(t_bf16=True),
    "ttf32": dict(t_bf16=False),
    # a register cap (KernelCfg.maxnreg) on every kernel the config launches: fewer registers per
    # thread, more resident warps per SM for the latency-bound kernels, some spills
    "nreg168": dict(maxnreg=168),
    "nreg128": dict(maxnreg=128),
    "nreg96": dict(maxnreg=96),
    # the cap on _wy_inverse alone (K = 32 launch (1, 1)): at 1 warp and 79 registers (sm_90, Triton
    # 3.6) an SM holds 25 of its programs; 72 -> 28 (no spill), 64 -> 32, the block limit (16 B of
    # stack). Timed in the sixteenth session: level with the table (GPU time within 0.5 %)
    "wy_nreg72": dict(wy_inverse=KernelCfg(1, 1, 0, 72)),
    "wy_nreg64": dict(wy_inverse=KernelCfg(1, 1, 0, 64)),
    # _bwd_local without the one-step-ahead load of T (Config.prefetch_t, in the table since the
    # sixteenth session)
    "no_prefetch_t": dict(prefetch_t=False),
}


def variant_config(cfg, name):
    """The config of a --variants entry on top of `cfg` (``maxnreg`` applies to every kernel
    the config launches)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}: pick from {tuple(VARIANTS)}")
    fields = dict(VARIANTS[name])
    nreg = fields.pop("maxnreg", None)
    cfg = dataclasses.replace(cfg, **fields)
    if nreg is not None:
        cfg = dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), maxnreg=nreg) for k in cfg.kernels()})
    return cfg


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


# ‖Δo‖/‖o‖ and ‖Δh‖/‖h‖ bound of the collapsed-keys stress case (bf16; tf32 in the WY inverse gave NaN)
STRESS_TOL = 2e-2


def collapsed_keys_errors(K: int, T: int = 4096, B: int = 2, H: int = 4, seed: int = 0) -> dict:
    """bf16 forward where a sub-chunk's keys are nearly parallel (cos ≈ 0.99), β ≈ 0.98 and the
    decay slow: the regime HyMo's GDN keys reach when representations collapse early in
    training, and where the WY inverse's Neumann terms are large (see _unit_lower_inverse).
    Returns ‖ours − ref‖/‖ref‖ for o and the final state against the float64 recurrence."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    u = F.normalize(rnd(1, 1, H, K), dim=-1)
    x = dict(q=F.normalize(rnd(B, T, H, K), dim=-1), k=F.normalize(u + 0.05 * rnd(B, T, H, K), dim=-1),
             v=rnd(B, T, H, K), g=torch.full((B, T, H), -1e-3, dtype=torch.float64),
             beta=torch.full((B, T, H), 0.98, dtype=torch.float64))
    ref_o, ref_ht = naive_recurrent_gated_delta_rule(
        *(x[n].to(DEVICE) for n in ("q", "k", "v", "g", "beta")), output_final_state=True)
    o, ht = chunk_gated_delta_rule(*(x[n].to(DEVICE).bfloat16() for n in ("q", "k", "v", "g", "beta")),
                                   output_final_state=True)
    err = {}
    for name, a, b in (("o", o, ref_o), ("ht", ht, ref_ht)):
        a = a.double()
        err[name] = float("nan") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()
    return err


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
    base = [sys.executable, "-m", "hymo_kernels.gdn.bench", "--warm-only", "--no-eager", "--variants", args.variants]
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


# --------------------------------------------------------------------------------------------
# --tune: kernel-by-kernel launch tuning (each kernel timed alone on its own inputs)
# --------------------------------------------------------------------------------------------

# K = V = 128 first: it has never been timed, and earlier runs ran out of time before it
TUNE_SHAPES = [(4, 4096, 16, 128, 128), (4, 4096, 40, 32, 32), (1, 32768, 40, 32, 32), (8, 4096, 40, 32, 32)]
# fla-core 0.6 fwd+bwd on an H200 with the Hopper guard lifted, 2026-11-29 (benchmarks/LOG.md,
# KERNEL_NOTES.md): printed beside ours when fla is not timed live in the same run
FLA_NOTES_MS = {(4, 4096, 40, 32, 32): 2.922, (1, 32768, 40, 32, 32): 4.327, (8, 4096, 40, 32, 32): 4.054,
                (4, 4096, 16, 128, 128): 3.16}
_TILED = {"fwd_prep", "bwd_prep", "fwd_out", "bwd_local", "bwd_dstate", "bwd_sub", "state_pass",
          "lh_fwd_h", "lh_fwd_o", "lh_bwd_dh", "lh_bwd_grads", "lh_wu_kernel", "lh_bwd_dv", "lh_bwd_dqk"}


class Deadline:
    def __init__(self, budget_s):
        self.t0 = time.time()
        self.end = self.t0 + budget_s

    def left(self):
        return self.end - time.time()

    def elapsed(self):
        return time.time() - self.t0


def _pow2s(lo, hi):
    out, x = [], lo
    while x <= hi:
        out.append(x)
        x *= 2
    return out


def tile_choices(kname, K, V):
    """Legal column tiles of a kernel (≥ 16: tl.dot needs it)."""
    if kname in ("fwd_prep", "bwd_prep"):
        return _pow2s(32, min(128, gdn_chunk.triton_next_pow2(K + V)))
    if kname in ("fwd_out", "bwd_local", "bwd_dstate", "bwd_sub", "lh_fwd_h", "lh_fwd_o", "lh_bwd_dh", "lh_bwd_grads",
                 "lh_wu_kernel"):
        return _pow2s(max(16, V // 4), V)
    if kname == "state_pass":
        return _pow2s(16, min(64, V))
    return [0]


def with_kernel(cfg, kname, kc):
    return dataclasses.replace(cfg, **{kname: kc})


def kcfg_str(cfg, kname):
    kc = getattr(cfg, kname)
    t = f" block={cfg.tile(kname)}" if kname in _TILED else ""
    return f"w={kc.num_warps} s={kc.num_stages}{t}" + (f" nreg={kc.maxnreg}" if kc.maxnreg else "")


class Case:
    """Inputs of one (shape, dtype, BT) and zero-filled intermediates of the right shapes, so
    that each kernel can be launched (and timed) alone. No data-dependent control flow in the
    kernels, so the values of the intermediates do not change the time."""

    def __init__(self, shape, dtype, cfg, seed=0):
        B, T, H, K, V = shape
        x = make_inputs(shape, dtype, seed=seed)
        self.do = torch.randn_like(x["v"])
        self.p = gdn_chunk.make_problem(x["q"], x["k"], x["v"], x["g"], x["beta"], None, K**-0.5, True, cfg)
        p, z = self.p, dict(dtype=torch.float32, device=DEVICE)
        self.tinv = torch.zeros(B, T, H, cfg.t_width, dtype=gdn_chunk.saved_t_dtype(cfg, dtype), device=DEVICE)
        if p.gbp is not None:
            p.gbp.zero_()  # the γβ pack, as _wy_inverse / _bwd_prep would leave it
        self.mn = torch.zeros(p.NC, H, K, K + V, **z)
        self.mr = torch.zeros(p.NC, H, K, K + V, **z)
        zs = dict(z, dtype=gdn_chunk.saved_states_dtype(cfg, dtype))
        self.states = torch.zeros(p.NC, H, K, V, **zs)
        self.dstates = torch.zeros(p.NC, H, K, V, **z)
        # split backward and local_sub_states: one state (split: and end-state gradient) per sub-chunk
        self.sub_states = torch.zeros(p.NC * (cfg.BT // cfg.BC), H, K, V, **zs)
        self.dsub = torch.zeros(p.NC * (cfg.BT // cfg.BC), H, K, V, **z)
        # large-head path with Config.lh_wu: W and U
        self.wu = (torch.zeros(B, T, H, K, **z), torch.zeros(B, T, H, V, **z))

    def fn(self, kname, cfg):
        """A closure that launches kernel `kname` (both directions for the state pass) with cfg."""
        if cfg.BT != self.p.cfg.BT or cfg.BC != self.p.cfg.BC:
            raise ValueError("a Case is built for one BT and BC")
        p, c = dataclasses.replace(self.p, cfg=cfg), gdn_chunk
        wu = self.wu if cfg.lh_wu else None
        return {
            "wy_inverse": lambda: c.run_wy_inverse(p),
            "fwd_prep": lambda: c.run_fwd_prep(p, self.tinv),
            "state_pass": lambda: (c.run_state_pass(p, self.mn, None, False),
                                   c.run_state_pass(p, self.mr, None, True)),
            "fwd_out": lambda: c.run_fwd_out(p, self.tinv, self.sub_states if cfg.slots > 1 else self.states),
            "bwd_prep": lambda: c.run_bwd_prep(p, self.tinv, self.do),
            "bwd_local": lambda: c.run_bwd_local(p, self.tinv, self.do, self.sub_states if cfg.slots > 1 else self.states,
                                                 self.dstates),
            "bwd_dstate": lambda: c.run_bwd_dstate(p, self.tinv, self.do, self.dsub),
            "bwd_sub": lambda: c.run_bwd_sub(p, self.tinv, self.do, self.sub_states, self.dsub),
            "lh_inverse": lambda: c.run_lh_inverse(p),
            "lh_wu_kernel": lambda: c.run_lh_wu(p, self.tinv),
            "lh_fwd_h": lambda: c.run_lh_fwd_h(p, self.tinv, None, wu),
            "lh_fwd_o": lambda: c.run_lh_fwd_o(p, self.tinv, self.states, wu),
            "lh_bwd_dh": lambda: c.run_lh_bwd_dh(p, self.tinv, self.do, None, wu),
            "lh_bwd_grads": lambda: c.run_lh_bwd_grads(p, self.tinv, self.do, self.states, self.dstates, wu),
        }[kname]


# ---- parallel precompilation: Triton compiles on the first launch, one kernel at a time; worker
# processes launch every variant once so that it lands in Triton's on-disk cache, and the timing
# process then only loads it. Workers and the timer never run at the same time.

_WORKER_CASE: dict = {}


def _job_key(job):
    shape, dtype, cfg, what = job
    return (shape, str(dtype), what, cfg)


def _precompile_job(job):
    """Worker: launch one kernel (what = kernel name) or one fwd+bwd (what = 'e2e') once."""
    global DEVICE
    device, shape, dtype_name, cfg_d, what = job
    DEVICE = device
    dtype = getattr(torch, dtype_name)
    cfg = config_from_dict(cfg_d)
    try:
        if what == "e2e":
            gdn_chunk.TUNING[shape[3:]] = cfg
            try:
                x = make_inputs(shape, dtype)
                t = [x[n].requires_grad_() for n in NAMES]
                o, _ = ours(*t)  # as timed: no state arguments
                o.backward(torch.ones_like(o))
                B, T, H, K, V = shape  # as in parity(): initial and final state (other constexprs)
                h0 = torch.zeros(B, H, K, V, device=DEVICE, requires_grad=True)
                o, ht = ours(*t, initial_state=h0, output_final_state=True)
                torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
            finally:
                gdn_chunk.TUNING.pop(shape[3:], None)
        else:
            key = (shape, dtype_name, cfg.BT, cfg.BC)
            if key not in _WORKER_CASE:
                _WORKER_CASE.clear()  # one case at a time: they can be GBs
                if device == "cuda":
                    torch.cuda.empty_cache()
                _WORKER_CASE[key] = Case(shape, dtype, cfg)
            _WORKER_CASE[key].fn(what, cfg)()
        if device == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001
        return f"{what} {cfg_d}: {e!r}"[:400]


class Precompiler:
    def __init__(self, jobs):
        self.jobs = jobs
        self.pool = None
        self.done = set()
        if jobs > 0:
            self.pool = multiprocessing.get_context("spawn").Pool(jobs)

    def run(self, jobs, deadline, label):
        """Launch each (shape, dtype, cfg, what) once in the workers; False if the budget ran out."""
        todo, seen = [], set()
        for j in jobs:
            k = _job_key(j)
            if k not in self.done and k not in seen:
                seen.add(k)
                todo.append(j)
        if self.pool is None or not todo:
            return True
        from hymo_kernels.gdn import bench as mod  # a named module: picklable under `python -m`

        t0 = time.time()
        args = [(DEVICE, s, str(d)[6:], dataclasses.asdict(c), w) for s, d, c, w in todo]
        res = self.pool.map_async(mod._precompile_job, args, chunksize=1)
        try:
            errs = res.get(timeout=max(1.0, deadline.left()))
        except multiprocessing.TimeoutError:
            log(f"  precompile ({label}): budget ran out after {time.time() - t0:.0f}s; stopping the workers")
            self.close(terminate=True)
            return False
        self.done.update(_job_key(j) for j in todo)
        bad = [e for e in errs if e]
        log(f"  precompiled {len(todo)} launches ({label}) in {time.time() - t0:.1f}s with {self.jobs} workers"
            + (f", {len(bad)} failed (they time as inf), first: {bad[0]}" if bad else ""))
        return True

    def close(self, terminate=False):
        if self.pool is not None:
            (self.pool.terminate if terminate else self.pool.close)()
            self.pool.join()
            self.pool = None


def config_from_dict(d):
    d = dict(d)
    for n in gdn_chunk.KERNELS + gdn_chunk.KERNELS_LARGE_ALL:
        if n in d and isinstance(d[n], dict):
            d[n] = KernelCfg(**d[n])
    return Config(**d)


def bench_ms(fn, rep=20):
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def time_kernel(case, kname, cfg):
    try:
        fn = case.fn(kname, cfg)
        fn()
        return bench_ms(fn)
    except Exception as e:  # noqa: BLE001
        log(f"    {kname} {kcfg_str(cfg, kname)}: failed: {e!r}"[:300])
        return float("inf")


def kernel_variants(kname, cfg, K, V, warps, stages, nregs=(0,), full_grid=False):
    """Round A: the default, then warps × column tile at 1 stage; round B: the other stage
    counts at round A's winner (the inverse kernel has no loop, so no stages for it); round C:
    the register caps at round B's winner (none unless --nregs names one). full_grid: round A
    is warps × tile × stages and there is no round B (the best stage count can depend on the
    warps: twelfth session, benchmarks/LOG.md)."""
    tiles = tile_choices(kname, K, V) if kname in _TILED else [0]
    loop_stages = [1] if kname in ("wy_inverse", "lh_inverse") else [1] + [s for s in stages if s != 1]
    # round A keeps the kernel's register cap (the large-head kernels' default, see chunk.Config)
    a = [getattr(cfg, kname)] + [KernelCfg(w, s, t, getattr(cfg, kname).maxnreg) for w in warps
                                 for s in (loop_stages if full_grid else [1]) for t in tiles]
    b = [] if full_grid or len(loop_stages) == 1 else loop_stages
    c = [] if not [n for n in nregs if n] else [0] + [n for n in nregs if n]
    return a, b, c


def fwdbwd_ms(impl, shape, rep=100):
    x = make_inputs(shape, torch.bfloat16)
    t = [x[n].requires_grad_() for n in NAMES]
    do = torch.randn_like(x["v"])

    def fb():
        o, _ = impl(*t)
        o.backward(do)

    fb()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        import triton.testing

        return triton.testing.do_bench(fb, warmup=10, rep=rep, grad_to_none=t, return_mode="median")
    return bench_ms(fb)


def table_entry(cfg, K, V, NH):
    """The chunk.TABLE entry (Python source) for a tuned config at NH = sequences × heads: its BT
    is BT_FEW when NH < 128; the other chunk size stays the table's current one."""
    if cfg.large_head:  # the table's other chunk size is its own path's (up to 256)
        bt = bt_few = cfg.BT
    elif NH >= 128:
        bt, bt_few = cfg.BT, gdn_chunk.get_config(K, V, 1).BT
    else:
        bt, bt_few = gdn_chunk.get_config(K, V, 256).BT, cfg.BT
    ks = [] if not cfg.large_head else ["large_head=True"] + (["lh_wu=True"] if cfg.lh_wu else [])
    for n in gdn_chunk.KERNELS + (cfg.kernels() if cfg.large_head else ()):
        kc = getattr(cfg, n)
        tail = [cfg.tile(n)] if n in _TILED else []
        if kc.maxnreg:
            tail = (tail or [0]) + [kc.maxnreg]
        ks.append(f"{n}=({', '.join(map(str, [kc.num_warps, kc.num_stages, *tail]))})")
    return (f"({K}, {V}): dict(BT={bt}, BT_FEW={bt_few}, BC={cfg.BC}, BZ={cfg.BZ}, BV={cfg.BV}, "
            f"BV_PASS={cfg.BV_PASS}, bwd_split={cfg.bwd_split}, local_sub_states={cfg.local_sub_states}, "
            f"states_bf16={cfg.states_bf16}, " + (f"prefetch_t={cfg.prefetch_t}, " if cfg.prefetch_t else "") +
            f"dot_bf16={cfg.dot_bf16}, t_bf16={cfg.t_bf16}, "
            f"inverse_prec={cfg.inverse_prec!r}, " + ", ".join(ks) + "),")


def tune_shape(shape, args, pre, deadline, fla_impl, out):
    B, T, H, K, V = shape
    rec = out["shapes"].setdefault(",".join(map(str, shape)), {})
    base = gdn_chunk.get_config(K, V, B * H)
    if args.large_head:  # the large-head path's kernels from the table's other settings, BT ≤ 128
        base = dataclasses.replace(base, large_head=True, BT=min(base.BT, 64), lh_wu=args.lh_wu)
    # the kernels tuned: every kernel of the table's path (both backward paths), or the large-head path's
    kernels = base.kernels() if base.large_head else gdn_chunk.KERNELS
    rec["default"] = dataclasses.asdict(base)
    log(f"  default: {base}")
    warps = [int(w) for w in args.warps.split(",")]
    limit = gdn_chunk.large_head_warp_limit(torch.cuda.get_device_capability()) if DEVICE == "cuda" else None
    if base.large_head and limit is not None:  # the tuner swaps launches inside one Problem: skip refused ones
        warps = [w for w in warps if w <= limit]
        log(f"  warps {warps} only: the large-head kernels fault with more than {limit} warps on this GPU "
            "(chunk.check_large_head_launch)")
    stages = [int(s) for s in args.stages.split(",")]
    bts = [bt for bt in (int(b) for b in args.bts.split(","))
           if bt % base.BC == 0 and (bt <= 128 or not base.large_head)]

    # 0. precompile, in parallel: every kernel at every BT (the default BT first), the fp32
    # kernels for the parity check, then whole fwd+bwd calls (these also reach the state-pass
    # variants with initial/final state that parity() uses); a worker runs a job's kernels in
    # series, so the kernels go first as separate jobs
    dtypes = [torch.bfloat16] + ([] if args.no_parity else [torch.float32])
    jobs = [(shape, d, base, k) for d in dtypes for k in kernels]
    jobs += [(shape, torch.bfloat16, dataclasses.replace(base, BT=bt), k) for bt in bts for k in kernels]
    jobs += [(shape, d, base, "e2e") for d in dtypes]
    if not base.large_head:  # the other backward path, timed at the end
        jobs += [(shape, torch.bfloat16, other, "e2e") for other in other_paths(base)]
    if not pre.run(jobs, deadline, "defaults, all BT"):
        return False

    # 1. parity of the default config (bf16 and fp32 vs the float64 reference)
    if not args.no_parity:
        prow = parity(shape, [("ours", ours, torch.bfloat16), ("ours", ours, torch.float32)], [0, H - 1],
                      fast_ref=True)
        rec["parity_default"] = [dict(dtype=str(r[1]), errors=r[2], ok=r[3]) for r in prow]
        if not all(r[3] for r in prow):
            log("  parity FAILED with the default config: timing anyway, but no speed-up counts")
    if deadline.left() < 5:
        return False

    # 2. chunk size: every kernel at its default launch, per BT (state pass = both directions)
    bt_ms = {}
    for bt in bts:
        cfg = dataclasses.replace(base, BT=bt)
        case = Case(shape, torch.bfloat16, cfg)
        per = {k: time_kernel(case, k, cfg) for k in kernels}
        # the BT choice counts the kernels of the default's backward path
        bt_ms[bt] = sum(per[k] for k in base.kernels())
        path = "large-head" if base.large_head else base.bwd_path
        if not base.large_head:  # the other kernel set (local and local_sub launch the same kernels)
            alt = dataclasses.replace(base, **BWD_PATHS["local" if base.bwd_split else "split"])
            path += f" path; {alt.bwd_path} path {sum(per[k] for k in alt.kernels()):.3f}"
        log(f"  BT={bt:3d}: sum {bt_ms[bt]:.3f} ms ({path})  " + " ".join(f"{k}={v:.3f}" for k, v in per.items()))
        del case
    best_bt = min(bt_ms, key=bt_ms.get)
    rec["bt_sum_ms"] = bt_ms
    cfg = dataclasses.replace(base, BT=best_bt)
    log(f"  -> BT={best_bt} (t = {deadline.elapsed():.0f}s)")
    if DEVICE == "cuda":
        torch.cuda.empty_cache()

    # 3. per kernel, round A (warps × tile, 1 stage; --full-grid: × stages) then round B (stages at A's winner)
    case = Case(shape, torch.bfloat16, cfg)
    nregs = [int(n) for n in args.nregs.split(",")] if args.nregs else [0]
    variants = {k: kernel_variants(k, cfg, K, V, warps, stages, nregs, args.full_grid) for k in kernels}
    rec["kernels"] = {}
    for rnd in (0, 1, 2):
        jobs = []
        for k, rounds in variants.items():
            for v in rounds[rnd]:
                kc = (v if rnd == 0 else dataclasses.replace(getattr(cfg, k), num_stages=v) if rnd == 1
                      else dataclasses.replace(getattr(cfg, k), maxnreg=v))
                jobs.append((shape, torch.bfloat16, with_kernel(cfg, k, kc), k))
        if not jobs:
            continue
        if not pre.run(jobs, deadline, f"round {'ABC'[rnd]}"):
            return False
        for k in kernels:
            cands = [j[2] for j in jobs if j[3] == k]
            if not cands:
                continue
            rows = []
            for c in cands:
                if any(c.tile(k) == r[1].tile(k)
                       and dataclasses.replace(getattr(c, k), block=0) == dataclasses.replace(getattr(r[1], k), block=0)
                       for r in rows):
                    continue
                rows.append((time_kernel(case, k, c), c))
            rows.sort(key=lambda r: r[0])
            t_def = rows[[r[1] for r in rows].index(cands[0])][0] if rnd == 0 else None
            best_t, best = rows[0]
            cfg = with_kernel(cfg, k, getattr(best, k))
            if k in _TILED:  # make the tile explicit, so the table entry says it
                cfg = with_kernel(cfg, k, dataclasses.replace(getattr(cfg, k), block=best.tile(k)))
            rec["kernels"].setdefault(k, []).extend(
                dict(cfg=dataclasses.asdict(getattr(c, k)), tile=c.tile(k), ms=t) for t, c in rows)
            log(f"  {k:10s} round {'ABC'[rnd]}: best {kcfg_str(best, k)} {best_t:.4f} ms"
                + (f" (default {t_def:.4f})" if t_def is not None else "")
                + "   top: " + ", ".join(f"[{kcfg_str(c, k)}] {t:.4f}" for t, c in rows[1:4]))
            if deadline.left() < 5:
                return False
    del case
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    tuned = cfg
    rec["tuned"] = dataclasses.asdict(tuned)
    rec["table_entry"] = table_entry(tuned, K, V, B * H)
    log(f"  tuned: {tuned}")
    log(f"  TABLE entry: {rec['table_entry']}")

    # 4. end to end, bf16 fwd+bwd: default vs tuned (parity of the tuned config first, in both
    # dtypes: fp32 inputs compile other kernels with the same launches)
    if not pre.run([(shape, d, tuned, "e2e") for d in dtypes], deadline, "tuned e2e"):
        return False
    gdn_chunk.TUNING[(K, V)] = tuned
    try:
        if not args.no_parity:
            prow = parity(shape, [("ours", ours, d) for d in dtypes], [0, H - 1], fast_ref=True)
            rec["parity_tuned"] = [dict(dtype=str(r[1]), errors=r[2], ok=r[3]) for r in prow]
        t_tuned = fwdbwd_ms(ours, shape)
    finally:
        gdn_chunk.TUNING.pop((K, V), None)
    t_def = fwdbwd_ms(ours, shape)
    fla_ms = FLA_NOTES_MS.get(shape, float("nan"))
    rec["fwdbwd_ms"] = dict(default=t_def, tuned=t_tuned, fla_notes=fla_ms)
    log(f"  fwd+bwd bf16: default {t_def:.3f} ms, tuned {t_tuned:.3f} ms ({t_def / t_tuned:.2f}x); "
        f"fla {fla_ms:.3f} ms (notes, 2026-11-29; live fla below if timed) -> tuned {fla_ms / t_tuned:.2f}x fla"
        f"  (t = {deadline.elapsed():.0f}s)")
    # the tuned launches with the other backward path (parity: run the benchmark with --variants)
    others = [] if tuned.large_head else other_paths(tuned)
    if others and deadline.left() > 20 and pre.run([(shape, torch.bfloat16, o, "e2e") for o in others], deadline,
                                                   "other paths e2e"):
        for other in others:
            with variant(shape, other):
                t_other = fwdbwd_ms(ours, shape)
            rec["fwdbwd_ms"][f"tuned_{other.bwd_path}"] = t_other
            log(f"  fwd+bwd bf16, tuned launches, {other.bwd_path} backward: {t_other:.3f} ms")
    return True


def tune(args, fla_impl, out):
    shapes = [tuple(int(s) for s in a.split(",")) for a in args.shapes] if args.shapes else TUNE_SHAPES
    deadline = Deadline(args.budget_s)
    jobs = args.jobs
    if jobs is None:
        jobs = 0 if DEVICE == "cpu" else max(1, min(12, (os.cpu_count() or 2) - 2))
    log(f"# --tune: shapes {shapes}, budget {args.budget_s:.0f}s, warps {args.warps}, stages {args.stages}, "
        f"register caps {args.nregs or 'none'}, BT {args.bts}, {jobs} precompile workers")
    pre = Precompiler(jobs)
    out["tune"] = dict(shapes=[list(s) for s in shapes], budget_s=args.budget_s)
    out.setdefault("shapes", {})
    completed, failed = [], []
    try:
        for shape in shapes:
            log(f"## tune {shape} (t = {deadline.elapsed():.0f}s, {deadline.left():.0f}s left)")
            if deadline.left() < 10:
                log("  budget spent: stopping")
                break
            try:
                ok = tune_shape(shape, args, pre, deadline, fla_impl, out)
            except Exception as e:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                log(f"  tuning {shape} failed: {e!r}")
                failed.append(shape)
                ok = False
            if ok:
                completed.append(shape)
            else:
                log(f"  {shape}: stopped early (budget or error); results so far are in the JSON")
            write_json(args, out)
            if pre.pool is None and jobs > 0:  # the workers were stopped: the budget is spent
                break
    finally:
        pre.close(terminate=True)

    # live fla, last (its autotuning is slow, so it must not eat the tuning budget)
    if fla_impl is not None:
        for shape in sorted(completed, key=lambda s: s[3] * s[4]):  # small heads first: fla autotunes slowly
            if deadline.left() < 30:
                log(f"fla live timing skipped at {shape}: budget")
                continue
            try:
                t = fwdbwd_ms(fla_impl, shape)
            except Exception as e:  # noqa: BLE001
                log(f"fla live timing failed at {shape}: {e!r}")
                continue
            out["shapes"][",".join(map(str, shape))]["fwdbwd_ms"]["fla_live"] = t
            log(f"fla live fwd+bwd {shape}: {t:.3f} ms (t = {deadline.elapsed():.0f}s)")
            write_json(args, out)

    log("")
    log("# tune summary (bf16 fwd+bwd, median ms)")
    log(f"{'shape':24s} {'default':>8s} {'tuned':>8s} {'gain':>6s} {'fla':>8s} {'vs fla':>7s}  parity(default/tuned)")
    for key, rec in out["shapes"].items():
        fb = rec.get("fwdbwd_ms")
        if not fb:
            continue
        fla = fb.get("fla_live", fb["fla_notes"])
        pd = all(r["ok"] for r in rec.get("parity_default", [])) if "parity_default" in rec else None
        pt = all(r["ok"] for r in rec.get("parity_tuned", [])) if "parity_tuned" in rec else None
        log(f"{key:24s} {fb['default']:8.3f} {fb['tuned']:8.3f} {fb['default'] / fb['tuned']:5.2f}x {fla:8.3f} "
            f"{fla / fb['tuned']:6.2f}x  {pd}/{pt}" + ("" if "fla_live" in fb else "  (fla from notes)"))
    log("# chunk.TABLE entries (per shape; BT_FEW applies when sequences x heads < 128):")
    for key, rec in out["shapes"].items():
        if "table_entry" in rec:
            log(f"#   {key}: {rec['table_entry']}")
    write_json(args, out)
    if failed:  # an error, not the budget: the exit status says so (the log has the traceback)
        sys.exit(f"--tune failed at {failed}")


def write_json(args, out):
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="B,T,H,K,V ... (default: the four issue shapes; with --tune K = V = 128 first)")
    ap.add_argument("--tune", action="store_true",
                    help="GPU launch tuning, kernel by kernel (warps, stages, tiles, BT); prints chunk.TABLE entries")
    ap.add_argument("--budget-s", type=float, default=270.0, help="--tune: wall-clock budget in seconds")
    ap.add_argument("--large-head", action="store_true",
                    help="--tune: tune the large-head path's kernels (Config.large_head, BT <= 128) instead of the "
                         "table's path; the end-to-end comparison is then against the table's default")
    ap.add_argument("--lh-wu", action="store_true", help="--tune --large-head: with Config.lh_wu (W, U precomputed)")
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
    default_shapes = TUNE_SHAPES if args.tune else SHAPES
    shapes = [tuple(int(s) for s in a.split(",")) for a in args.shapes] if args.shapes else default_shapes

    import triton

    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test: timings meaningless)"
    log(f"# GDN benchmark {datetime.datetime.now().isoformat(timespec='seconds')} on {dev}, "
        f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}")
    fla_impl = None if args.no_fla else load_fla()
    if args.tune:
        out = dict(device=dev, torch=torch.__version__, triton=triton.__version__, shapes={})
        args.shapes = [",".join(map(str, s)) for s in shapes]
        tune(args, fla_impl, out)
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
            gdn_chunk.TUNING[(K, V)] = tuned[shape]
        base = gdn_chunk.get_config(K, V, B * H)
        gdn_chunk.TUNING.pop((K, V), None)
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
        # one after the other, whichever ran first measured 8-17 % faster at (4, 4096, 40, 32, 32)
        # (benchmarks/LOG.md). The eager reference (10-300x slower) is timed in the first round only.
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
        # host's (kernels README, Host time), so the table shows both
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
    main()
