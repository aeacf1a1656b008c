"""``python -m benchmarks.gdn.bench --tune``: kernel-by-kernel launch tuning of the Triton GDN op
(see bench.py's docstring). Each kernel is timed alone on its own inputs (``Case``), its
variants precompiled in parallel worker processes first (``Precompiler``); the winners are
printed as ``config.TABLE`` entries."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import time

import torch

from benchmarks.gdn import bench
from hymo_kernels.gdn import backward, output, prep, problem, state_pass, wy
from hymo_kernels.gdn import config as gdn_config
from hymo_kernels.gdn.config import KERNELS, KernelCfg


# K = V = 128 first: its kernels take the longest to tune, so a cut run still has it
TUNE_SHAPES = [(4, 4096, 16, 128, 128), (4, 4096, 40, 32, 32), (1, 32768, 40, 32, 32), (8, 4096, 40, 32, 32)]
# fla-core 0.6 fwd+bwd (ms) on an H200 with the Hopper guard lifted, measured by this script:
# printed beside ours when fla is not timed live in the same run
FLA_NOTES_MS = {(4, 4096, 40, 32, 32): 2.922, (1, 32768, 40, 32, 32): 4.327, (8, 4096, 40, 32, 32): 4.054,
                (4, 4096, 16, 128, 128): 3.16}
_TILED = {"fwd_prep", "bwd_prep", "fwd_out", "bwd_local", "state_pass"}


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
        return _pow2s(32, min(128, gdn_config.triton_next_pow2(K + V)))
    if kname in ("fwd_out", "bwd_local"):
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
        x = bench.make_inputs(shape, dtype, seed=seed)
        self.do = torch.randn_like(x["v"])
        self.p = problem.make_problem(x["q"], x["k"], x["v"], x["g"], x["beta"], None, K**-0.5, True, cfg)
        p, z = self.p, dict(dtype=torch.float32, device=bench.DEVICE)
        self.tinv = torch.zeros(B, T, H, cfg.BC, dtype=problem.saved_t_dtype(cfg, dtype), device=bench.DEVICE)
        p.gbp.zero_()  # the γβ pack, as _wy_inverse / _bwd_prep would leave it
        self.mn = torch.zeros(p.NC, H, K, K + V, **z)
        self.mr = torch.zeros(p.NC, H, K, K + V, **z)
        zs = dict(z, dtype=problem.saved_states_dtype(cfg, dtype))
        self.states = torch.zeros(p.NC, H, K, V, **zs)
        self.dstates = torch.zeros(p.NC, H, K, V, **z)
        # local_sub_states: one saved state per sub-chunk
        self.sub_states = torch.zeros(p.NC * (cfg.BT // cfg.BC), H, K, V, **zs)

    def fn(self, kname, cfg):
        """A closure that launches kernel `kname` (both directions for the state pass) with cfg."""
        if cfg.BT != self.p.cfg.BT or cfg.BC != self.p.cfg.BC:
            raise ValueError("a Case is built for one BT and BC")
        p = dataclasses.replace(self.p, cfg=cfg)
        states = self.sub_states if cfg.slots > 1 else self.states
        return {
            "wy_inverse": lambda: wy.run_wy_inverse(p),
            "fwd_prep": lambda: prep.run_fwd_prep(p, self.tinv),
            "state_pass": lambda: (state_pass.run_state_pass(p, self.mn, None, False),
                                   state_pass.run_state_pass(p, self.mr, None, True)),
            "fwd_out": lambda: output.run_fwd_out(p, self.tinv, states),
            "bwd_prep": lambda: prep.run_bwd_prep(p, self.tinv, self.do),
            "bwd_local": lambda: backward.run_bwd_local(p, self.tinv, self.do, states, self.dstates),
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
    device, shape, dtype_name, cfg_d, what = job
    bench.DEVICE = device
    dtype = getattr(torch, dtype_name)
    cfg = bench.config_from_dict(cfg_d)
    try:
        if what == "e2e":
            gdn_config.TUNING[shape[3:]] = cfg
            try:
                x = bench.make_inputs(shape, dtype)
                t = [x[n].requires_grad_() for n in bench.NAMES]
                o, _ = bench.ours(*t)  # as timed: no state arguments
                o.backward(torch.ones_like(o))
                B, T, H, K, V = shape  # as in parity(): initial and final state (other constexprs)
                h0 = torch.zeros(B, H, K, V, device=bench.DEVICE, requires_grad=True)
                o, ht = bench.ours(*t, initial_state=h0, output_final_state=True)
                torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
            finally:
                gdn_config.TUNING.pop(shape[3:], None)
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
        from benchmarks.gdn import tune as mod  # a named module: picklable under `python -m`

        t0 = time.time()
        args = [(bench.DEVICE, s, str(d)[6:], dataclasses.asdict(c), w) for s, d, c, w in todo]
        res = self.pool.map_async(mod._precompile_job, args, chunksize=1)
        try:
            errs = res.get(timeout=max(1.0, deadline.left()))
        except multiprocessing.TimeoutError:
            bench.log(f"  precompile ({label}): budget ran out after {time.time() - t0:.0f}s; stopping the workers")
            self.close(terminate=True)
            return False
        self.done.update(_job_key(j) for j in todo)
        bad = [e for e in errs if e]
        bench.log(f"  precompiled {len(todo)} launches ({label}) in {time.time() - t0:.1f}s with {self.jobs} workers"
            + (f", {len(bad)} failed (they time as inf), first: {bad[0]}" if bad else ""))
        return True

    def close(self, terminate=False):
        if self.pool is not None:
            (self.pool.terminate if terminate else self.pool.close)()
            self.pool.join()
            self.pool = None



def bench_ms(fn, rep=20):
    if bench.DEVICE == "cpu":
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
        bench.log(f"    {kname} {kcfg_str(cfg, kname)}: failed: {e!r}"[:300])
        return float("inf")


def kernel_variants(kname, cfg, K, V, warps, stages, nregs=(0,), full_grid=False):
    """Round A: the default, then warps × column tile at 1 stage; round B: the other stage
    counts at round A's winner (the inverse kernel has no loop, so no stages for it); round C:
    the register caps at round B's winner (none unless --nregs names one). full_grid: round A
    is warps × tile × stages and there is no round B (the best stage count can depend on the
    warps)."""
    tiles = tile_choices(kname, K, V) if kname in _TILED else [0]
    loop_stages = [1] if kname == "wy_inverse" else [1] + [s for s in stages if s != 1]
    # round A keeps the kernel's register cap
    a = [getattr(cfg, kname)] + [KernelCfg(w, s, t, getattr(cfg, kname).maxnreg) for w in warps
                                 for s in (loop_stages if full_grid else [1]) for t in tiles]
    b = [] if full_grid or len(loop_stages) == 1 else loop_stages
    c = [] if not [n for n in nregs if n] else [0] + [n for n in nregs if n]
    return a, b, c


def fwdbwd_ms(impl, shape, rep=100):
    x = bench.make_inputs(shape, torch.bfloat16)
    t = [x[n].requires_grad_() for n in bench.NAMES]
    do = torch.randn_like(x["v"])

    def fb():
        o, _ = impl(*t)
        o.backward(do)

    fb()
    if bench.DEVICE == "cuda":
        torch.cuda.synchronize()
        import triton.testing

        return triton.testing.do_bench(fb, warmup=10, rep=rep, grad_to_none=t, return_mode="median")
    return bench_ms(fb)


def table_entry(cfg, K, V, NH):
    """The config.TABLE entry (Python source) for a tuned config at NH = sequences × heads: its BT
    is BT_FEW when NH < 128; the other chunk size stays the table's current one."""
    if NH >= 128:
        bt, bt_few = cfg.BT, gdn_config.get_config(K, V, 1).BT
    else:
        bt, bt_few = gdn_config.get_config(K, V, 256).BT, cfg.BT
    ks = []
    for n in KERNELS:
        kc = getattr(cfg, n)
        tail = [cfg.tile(n)] if n in _TILED else []
        if kc.maxnreg:
            tail = (tail or [0]) + [kc.maxnreg]
        ks.append(f"{n}=({', '.join(map(str, [kc.num_warps, kc.num_stages, *tail]))})")
    return (f"({K}, {V}): dict(BT={bt}, BT_FEW={bt_few}, BC={cfg.BC}, BZ={cfg.BZ}, BV={cfg.BV}, "
            f"BV_PASS={cfg.BV_PASS}, local_sub_states={cfg.local_sub_states}, "
            f"states_bf16={cfg.states_bf16}, " + (f"prefetch_t={cfg.prefetch_t}, " if cfg.prefetch_t else "") +
            f"dot_bf16={cfg.dot_bf16}, t_bf16={cfg.t_bf16}, "
            f"inverse_prec={cfg.inverse_prec!r}, " + ", ".join(ks) + "),")


def tune_shape(shape, args, pre, deadline, fla_impl, out):
    B, T, H, K, V = shape
    rec = out["shapes"].setdefault(",".join(map(str, shape)), {})
    base = gdn_config.get_config(K, V, B * H)
    kernels = KERNELS
    rec["default"] = dataclasses.asdict(base)
    bench.log(f"  default: {base}")
    warps = [int(w) for w in args.warps.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    bts = [bt for bt in (int(b) for b in args.bts.split(",")) if bt % base.BC == 0]

    # 0. precompile, in parallel: every kernel at every BT (the default BT first), the fp32
    # kernels for the parity check, then whole fwd+bwd calls (these also reach the state-pass
    # variants with initial/final state that parity() uses); a worker runs a job's kernels in
    # series, so the kernels go first as separate jobs
    dtypes = [torch.bfloat16] + ([] if args.no_parity else [torch.float32])
    jobs = [(shape, d, base, k) for d in dtypes for k in kernels]
    jobs += [(shape, torch.bfloat16, dataclasses.replace(base, BT=bt), k) for bt in bts for k in kernels]
    jobs += [(shape, d, base, "e2e") for d in dtypes]
    jobs += [(shape, torch.bfloat16, other, "e2e") for other in bench.other_paths(base)]  # timed at the end
    if not pre.run(jobs, deadline, "defaults, all BT"):
        return False

    # 1. parity of the default config (bf16 and fp32 vs the float64 reference)
    if not args.no_parity:
        impls = [("ours", bench.ours, torch.bfloat16), ("ours", bench.ours, torch.float32)]
        prow = bench.parity(shape, impls, [0, H - 1], fast_ref=True)
        rec["parity_default"] = [dict(dtype=str(r[1]), errors=r[2], ok=r[3]) for r in prow]
        if not all(r[3] for r in prow):
            bench.log("  parity FAILED with the default config: timing anyway, but no speed-up counts")
    if deadline.left() < 5:
        return False

    # 2. chunk size: every kernel at its default launch, per BT (state pass = both directions)
    bt_ms = {}
    for bt in bts:
        cfg = dataclasses.replace(base, BT=bt)
        case = Case(shape, torch.bfloat16, cfg)
        per = {k: time_kernel(case, k, cfg) for k in kernels}
        bt_ms[bt] = sum(per.values())
        bench.log(f"  BT={bt:3d}: sum {bt_ms[bt]:.3f} ms ({base.bwd_path} path)  "
            + " ".join(f"{k}={v:.3f}" for k, v in per.items()))
        del case
    best_bt = min(bt_ms, key=bt_ms.get)
    rec["bt_sum_ms"] = bt_ms
    cfg = dataclasses.replace(base, BT=best_bt)
    bench.log(f"  -> BT={best_bt} (t = {deadline.elapsed():.0f}s)")
    if bench.DEVICE == "cuda":
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
            bench.log(f"  {k:10s} round {'ABC'[rnd]}: best {kcfg_str(best, k)} {best_t:.4f} ms"
                + (f" (default {t_def:.4f})" if t_def is not None else "")
                + "   top: " + ", ".join(f"[{kcfg_str(c, k)}] {t:.4f}" for t, c in rows[1:4]))
            if deadline.left() < 5:
                return False
    del case
    if bench.DEVICE == "cuda":
        torch.cuda.empty_cache()
    tuned = cfg
    rec["tuned"] = dataclasses.asdict(tuned)
    rec["table_entry"] = table_entry(tuned, K, V, B * H)
    bench.log(f"  tuned: {tuned}")
    bench.log(f"  TABLE entry: {rec['table_entry']}")

    # 4. end to end, bf16 fwd+bwd: default vs tuned (parity of the tuned config first, in both
    # dtypes: fp32 inputs compile other kernels with the same launches)
    if not pre.run([(shape, d, tuned, "e2e") for d in dtypes], deadline, "tuned e2e"):
        return False
    gdn_config.TUNING[(K, V)] = tuned
    try:
        if not args.no_parity:
            prow = bench.parity(shape, [("ours", bench.ours, d) for d in dtypes], [0, H - 1], fast_ref=True)
            rec["parity_tuned"] = [dict(dtype=str(r[1]), errors=r[2], ok=r[3]) for r in prow]
        t_tuned = fwdbwd_ms(bench.ours, shape)
    finally:
        gdn_config.TUNING.pop((K, V), None)
    t_def = fwdbwd_ms(bench.ours, shape)
    fla_ms = FLA_NOTES_MS.get(shape, float("nan"))
    rec["fwdbwd_ms"] = dict(default=t_def, tuned=t_tuned, fla_notes=fla_ms)
    bench.log(f"  fwd+bwd bf16: default {t_def:.3f} ms, tuned {t_tuned:.3f} ms ({t_def / t_tuned:.2f}x); "
        f"fla {fla_ms:.3f} ms (FLA_NOTES_MS; live fla below if timed) -> tuned {fla_ms / t_tuned:.2f}x fla"
        f"  (t = {deadline.elapsed():.0f}s)")
    # the tuned launches with the other backward path (parity: run the benchmark with --variants)
    others = bench.other_paths(tuned)
    if others and deadline.left() > 20 and pre.run([(shape, torch.bfloat16, o, "e2e") for o in others], deadline,
                                                   "other paths e2e"):
        for other in others:
            with bench.variant(shape, other):
                t_other = fwdbwd_ms(bench.ours, shape)
            rec["fwdbwd_ms"][f"tuned_{other.bwd_path}"] = t_other
            bench.log(f"  fwd+bwd bf16, tuned launches, {other.bwd_path} backward: {t_other:.3f} ms")
    return True


def tune(args, fla_impl, out):
    shapes = [tuple(int(s) for s in a.split(",")) for a in args.shapes] if args.shapes else TUNE_SHAPES
    deadline = Deadline(args.budget_s)
    jobs = args.jobs
    if jobs is None:
        jobs = 0 if bench.DEVICE == "cpu" else max(1, min(12, (os.cpu_count() or 2) - 2))
    bench.log(f"# --tune: shapes {shapes}, budget {args.budget_s:.0f}s, warps {args.warps}, stages {args.stages}, "
        f"register caps {args.nregs or 'none'}, BT {args.bts}, {jobs} precompile workers")
    pre = Precompiler(jobs)
    out["tune"] = dict(shapes=[list(s) for s in shapes], budget_s=args.budget_s)
    out.setdefault("shapes", {})
    completed, failed = [], []
    try:
        for shape in shapes:
            bench.log(f"## tune {shape} (t = {deadline.elapsed():.0f}s, {deadline.left():.0f}s left)")
            if deadline.left() < 10:
                bench.log("  budget spent: stopping")
                break
            try:
                ok = tune_shape(shape, args, pre, deadline, fla_impl, out)
            except Exception as e:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                bench.log(f"  tuning {shape} failed: {e!r}")
                failed.append(shape)
                ok = False
            if ok:
                completed.append(shape)
            else:
                bench.log(f"  {shape}: stopped early (budget or error); results so far are in the JSON")
            bench.write_json(args, out)
            if pre.pool is None and jobs > 0:  # the workers were stopped: the budget is spent
                break
    finally:
        pre.close(terminate=True)

    # live fla, last (its autotuning is slow, so it must not eat the tuning budget)
    if fla_impl is not None:
        for shape in sorted(completed, key=lambda s: s[3] * s[4]):  # small heads first: fla autotunes slowly
            if deadline.left() < 30:
                bench.log(f"fla live timing skipped at {shape}: budget")
                continue
            try:
                t = fwdbwd_ms(fla_impl, shape)
            except Exception as e:  # noqa: BLE001
                bench.log(f"fla live timing failed at {shape}: {e!r}")
                continue
            out["shapes"][",".join(map(str, shape))]["fwdbwd_ms"]["fla_live"] = t
            bench.log(f"fla live fwd+bwd {shape}: {t:.3f} ms (t = {deadline.elapsed():.0f}s)")
            bench.write_json(args, out)

    bench.log("")
    bench.log("# tune summary (bf16 fwd+bwd, median ms)")
    bench.log(f"{'shape':24s} {'default':>8s} {'tuned':>8s} {'gain':>6s} {'fla':>8s} {'vs fla':>7s}  "
              "parity(default/tuned)")
    for key, rec in out["shapes"].items():
        fb = rec.get("fwdbwd_ms")
        if not fb:
            continue
        fla = fb.get("fla_live", fb["fla_notes"])
        pd = all(r["ok"] for r in rec.get("parity_default", [])) if "parity_default" in rec else None
        pt = all(r["ok"] for r in rec.get("parity_tuned", [])) if "parity_tuned" in rec else None
        bench.log(f"{key:24s} {fb['default']:8.3f} {fb['tuned']:8.3f} {fb['default'] / fb['tuned']:5.2f}x {fla:8.3f} "
            f"{fla / fb['tuned']:6.2f}x  {pd}/{pt}" + ("" if "fla_live" in fb else "  (fla from notes)"))
    bench.log("# config.TABLE entries (per shape; BT_FEW applies when sequences x heads < 128):")
    for key, rec in out["shapes"].items():
        if "table_entry" in rec:
            bench.log(f"#   {key}: {rec['table_entry']}")
    bench.write_json(args, out)
    if failed:  # an error, not the budget: the exit status says so (the log has the traceback)
        sys.exit(f"--tune failed at {failed}")


