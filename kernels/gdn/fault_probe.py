"""Which launch sets of the large-head path run correctly on this GPU.

    python -m hymo_kernels.gdn.fault_probe --shape 2,257,2,128,128 --launches warps=4,BV=64 warps=4,BV=32,lh_wu
    python -m hymo_kernels.gdn.fault_probe --shape 1,1500,3,32,32 --packed --dtypes bf16,fp32 --launches warps=2
    python -m hymo_kernels.gdn.fault_probe --sanitizer memcheck --launches warps=4,BV=32   # where it faults

Each launch set runs in its own process, because a kernel fault (an illegal memory access)
poisons the process's CUDA context and every later call fails with it, and with
CUDA_LAUNCH_BLOCKING=1, so that the fault is reported by the launch that made it. Per launch
set and dtype: pass/fail against the float64 chunked reference (bench.py's per-tensor
tolerances; inputs as the GPU tests make them), or the launcher that raised; and per kernel the registers, spills (Triton's
``n_spills``) and shared memory of what was compiled. The probe runs launches that
``chunk.check_large_head_launch`` refuses (≥ 4 warps on Hopper): finding out which of those
fault is what it is for. On the CPU (TRITON_INTERPRET=1) every launch runs bounds-checked
(``interpret_bounds``): a load or store outside its tensors fails the launch set there, so an
access that strays in every layout is told apart from one that strays only in compiled code.

A launch set is comma-separated: ``warps=N`` (every large-head kernel), ``<kernel>=N`` for one
kernel's warps (``lh_inverse``, ``lh_wu_kernel``, ``lh_fwd_h``, ``lh_fwd_o``, ``lh_bwd_dh``,
``lh_bwd_grads``, and ``lh_bwd_dv``, ``lh_bwd_dqk``, ``lh_bwd_finish`` of ``lh_split``),
``BV=N`` (value columns per program), ``BK=N`` (``lh_bwd_dqk``'s key columns per program),
``lh_wu``, ``t_bf16`` (the dots with T on bf16 operands: no tf32 warpgroup MMAs left outside
``_lh_inverse``, the fault lead of kernels/gdn/README.md), ``lh_split`` (Config.lh_split: the
gradient stage split in three kernels) and ``default_path`` (the table's path with its backward
ending in ``_lh_inverse`` and the ``lh_split`` kernels; its other kernels keep the Config
defaults).
Unset: the Config defaults.

With ``--sanitizer TOOL`` each child runs under NVIDIA's ``compute-sanitizer --tool TOOL``
(memcheck, racecheck, synccheck, initcheck) with PyTorch's caching allocator off, so that an
access past a tensor's end is not hidden inside a pooled block. Triton keeps line info in its
kernels, so a report names the kernel, the source line of the access, global or shared memory,
and the address: where a fault comes from (kernels/gdn/README.md, large-head path), not only
which launch made it. The first report lines go into the row (``sanitizer``) and the summary.
Much slower; use small shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import traceback

import torch

from . import bench as Bm
from . import chunk as C
from . import chunk_torch as CT
from . import large_head_kernels as L
from .chunk import Config
from .interpret_bounds import bounds_checked

KERNELS = C.KERNELS_LARGE_ALL
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
SANITIZER_LINES = 12  # report lines kept per launch set


def sanitizer_prefix(tool: str | None) -> list[str]:
    """The command a child runs under (empty without a tool); exits with a message if
    compute-sanitizer is not on the PATH, since a probe asked to sanitize must not run without it."""
    if tool is None:
        return []
    if tool not in SANITIZER_TOOLS:
        raise ValueError(f"unknown sanitizer tool {tool!r}: pick from {SANITIZER_TOOLS}")
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        raise SystemExit("--sanitizer needs NVIDIA's compute-sanitizer on the PATH (it ships with the CUDA "
                         "toolkit, e.g. /usr/local/cuda/bin); run without --sanitizer to only probe")
    return [exe, "--tool", tool, "--print-limit", str(SANITIZER_LINES), "--show-backtrace", "device"]


def sanitizer_report(stdout: str) -> list[str]:
    """compute-sanitizer's report lines ("========= ..."), banner left out, at most SANITIZER_LINES."""
    lines = [s.removeprefix("=========").strip() for s in stdout.splitlines() if s.startswith("=========")]
    return [s for s in lines if s and not s.startswith("COMPUTE-SANITIZER")][:SANITIZER_LINES]


def run_child(prefix: list[str], cmd: list[str], timeout_s: float, failed: dict) -> dict:
    """Runs a probe's child (cmd, under the sanitizer prefix) with CUDA_LAUNCH_BLOCKING=1, so
    that a fault is reported by the launch that made it, and returns the JSON row it printed
    last, or `failed` with the error; with a sanitizer, its first report lines as "sanitizer"."""
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    if prefix:  # pooled blocks would hide an access past a tensor's end from memcheck
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    try:
        p = subprocess.run(prefix + cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(failed, error=f"did not finish in {timeout_s:g} s")
    lines = [s for s in p.stdout.splitlines() if s.startswith("{")]
    res = json.loads(lines[-1]) if lines else dict(failed, error=f"exit {p.returncode}: {p.stderr.strip()[-300:]}")
    if prefix:
        res["sanitizer"] = sanitizer_report(p.stdout)
    return res


def parse_launches(spec: str) -> Config:
    """The Config of a launch set (64-token chunks, bf16 dots, the tables' tf32x3 inverse)."""
    cfg = Config(BT=64, BC=16, large_head=True, dot_bf16=True, inverse_prec="tf32x3")
    warps, bk = {}, 0
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        if name in ("lh_wu", "t_bf16", "lh_split") and not value:
            cfg = dataclasses.replace(cfg, **{name: True})
        elif name == "default_path" and not value:
            cfg = dataclasses.replace(cfg, large_head=False, lh_split=True)
        elif name == "BV" and value.isdigit():
            cfg = dataclasses.replace(cfg, BV=int(value))
        elif name == "BK" and value.isdigit():  # lh_bwd_dqk's key columns; its warps stay as set
            bk = int(value)
        elif name == "warps" and value.isdigit():
            warps.update({k: int(value) for k in KERNELS if k not in warps})
        elif name in KERNELS and value.isdigit():
            warps[name] = int(value)
        else:
            raise ValueError(f"bad launch-set item {item!r} in {spec!r}: use warps=N, BV=N, BK=N, lh_wu, t_bf16, "
                             "lh_split, default_path or "
                             f"<kernel>=N with a kernel from {KERNELS}")
    cfg = dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), num_warps=w) for k, w in warps.items()})
    return dataclasses.replace(cfg, lh_bwd_dqk=dataclasses.replace(cfg.lh_bwd_dqk, block=bk))


def _packed_bounds(T: int) -> list[int]:
    # a one-token document, and one across several chunks
    return [0, T // 15, T // 15 + 1, T // 2, T]


def probe(shape, packed: bool, spec: str, dtype: str) -> dict:
    """Runs one launch set's forward + backward in this process; a dict for the report."""
    B, T, H, K, V = shape
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = dict(shape=list(shape), packed=packed, launches=spec, dtype=dtype)
    C.TUNING[(K, V)] = parse_launches(spec)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, device=dev, generator=gen)

    x = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, V),
             g=torch.nn.functional.logsigmoid(rnd(B, T, H) + 2.0), beta=torch.rand(B, T, H, device=dev, generator=gen))
    cu = torch.tensor(_packed_bounds(T), dtype=torch.int32, device=dev) if packed else None
    N = cu.numel() - 1 if packed else B
    h0, do, dht = 0.1 * rnd(N, H, K, V), rnd(B, T, H, V), rnd(N, H, K, V)

    def ours(q, k, v, g, beta, initial_state, output_final_state):
        return C.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                        cu_seqlens=cu, use_qk_l2norm_in_kernel=True)

    def reference(q, k, v, g, beta, initial_state, output_final_state):
        return CT.chunk_gated_delta_rule_torch(Bm.l2n(q), Bm.l2n(k), v, g, beta, initial_state=initial_state,
                                               output_final_state=True, cu_seqlens=cu)

    def run(impl, cast):
        fp = torch.float64 if cast == torch.float64 else torch.float32  # g and the states
        xs = {n: t.to(fp if n == "g" else cast) for n, t in x.items()}
        out = Bm.fwd_bwd_grads(impl, xs, h0.to(fp), do, dht.to(fp))
        if dev == "cuda":
            torch.cuda.synchronize()
        return out

    check = C.check_large_head_launch
    C.check_large_head_launch = lambda *a: None  # the launches it refuses are the ones to probe
    try:
        with bounds_checked() if dev == "cpu" else contextlib.nullcontext():
            out = run(ours, DTYPES[dtype])
    except Exception as e:  # noqa: BLE001 - a fault, out of resources, a compile error: all are results
        res.update(ok=False, where=[f.name for f in traceback.extract_tb(e.__traceback__) if f.name.startswith("run_")],
                   error=repr(e)[:200])
        return res
    finally:
        C.check_large_head_launch = check
    ref = run(reference, torch.float64)
    errs = {n: Bm.rel(out[n], ref[n]) for n in ref}
    res.update(ok=all(errs[n] <= Bm.TOL[DTYPES[dtype]][n] for n in errs), errors=errs, kernels=_compiled(L))
    return res


def _compiled(module) -> dict:
    """Registers, spills and shared memory of every compiled large-head kernel (GPU only)."""
    out = {}
    for name in KERNELS:
        fn = getattr(module, "_" + name.removesuffix("_kernel") + "_kernel")
        for cache in getattr(fn, "device_caches", {}).values():
            for ck in cache[0].values():
                ck._init_handles()
                out.setdefault(name, []).append(dict(warps=ck.metadata.num_warps, regs=ck.n_regs, spills=ck.n_spills,
                                                     shared=ck.metadata.shared))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="2,257,2,128,128", help="B,T,H,K,V")
    ap.add_argument("--packed", action="store_true", help="B = 1 split into documents (cu_seqlens)")
    ap.add_argument("--dtypes", default="bf16", help="comma-separated: bf16, fp32")
    ap.add_argument("--launches", nargs="+", default=["warps=2"], help="launch sets (see the module doc)")
    ap.add_argument("--timeout-s", type=float, default=150.0, help="per launch set and dtype (compiling counts)")
    ap.add_argument("--sanitizer", choices=SANITIZER_TOOLS, default=None,
                    help="run each child under compute-sanitizer with this tool (see the module doc)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shape = tuple(int(s) for s in args.shape.split(","))
    if len(shape) != 5 or (args.packed and shape[0] != 1):
        raise SystemExit(f"--shape needs B,T,H,K,V (B = 1 with --packed), got {args.shape}")
    dtypes = args.dtypes.split(",")
    if bad := [d for d in dtypes if d not in DTYPES]:
        raise SystemExit(f"unknown dtypes {bad}: pick from {tuple(DTYPES)}")
    for spec in args.launches:  # fail on a typo before any process starts
        try:
            parse_launches(spec)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if args.child:
        print(json.dumps(probe(shape, args.packed, args.launches[0], dtypes[0])), flush=True)
        return
    prefix = sanitizer_prefix(args.sanitizer)
    rows = []
    for spec in args.launches:
        for dt in dtypes:
            cmd = [sys.executable, "-m", "hymo_kernels.gdn.fault_probe", "--child", "--shape", args.shape,
                   "--dtypes", dt, "--launches", spec] + (["--packed"] if args.packed else [])
            res = run_child(prefix, cmd, args.timeout_s, dict(launches=spec, dtype=dt, ok=False))
            rows.append(res)
            print(json.dumps(res), flush=True)
    print(f"\n# fault_probe {shape}{' packed' if args.packed else ''} on "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (interpreter)'}")
    for r in rows:
        what = (f"max error {max(r['errors'].values()):.1e}" if r.get("errors")
                else f"{r.get('where') or ''} {r.get('error', '')}".strip())
        print(f"{r['launches']:32s} {r['dtype']:5s} {'PASS' if r['ok'] else 'FAIL'}  {what[:150]}")
        for line in r.get("sanitizer", [])[:4]:  # the first error: what, where (kernel, source line), address
            print(f"    {args.sanitizer}: {line[:200]}")


if __name__ == "__main__":
    main()
