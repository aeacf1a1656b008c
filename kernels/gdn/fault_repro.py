"""Reduced kernels for the large-head path's fault with ≥ 4 warps on Hopper, to bisect it.

    python -m hymo_kernels.gdn.fault_repro                     # the default grid of cases, GPU
    python -m hymo_kernels.gdn.fault_repro --cases stage=pass,warps=4,BV=32,K=128 stage=t_dot,warps=4,BV=32
    python -m hymo_kernels.gdn.fault_repro --sanitizer memcheck --cases stage=t_dot,warps=4,BV=32

`_lh_fwd_h` (large_head_kernels.py) faults with 4 warps and 32-column value blocks at K = 128
on an H200, under Triton 3.6 and 3.7.1; with 64-column blocks it passes (kernels/gdn/README.md).
Its addressing stays inside its tensors in the interpreter (``interpret_bounds``), so the fault
is in the compiled code. ``_repro_kernel`` is that kernel's chunk loop (and ``_lh_fwd_o``'s
chunk) cut down to its dots with T = (I + A)⁻¹ and the state, in stages that each add a piece:

| stage | what one chunk does (U, W: BT rows; S: K × BV) |
|---|---|
| ``t_dot`` | U = T Y: the dot with a BV-wide right operand, a tf32 warpgroup MMA as narrow as ``m64n32k8`` at BV = 32 (the lead in the README) |
| ``vnew`` | and W = T X, v_new = U − W S |
| ``pass`` | and S ← 0.9 S + K̃ᵀ v_new: ``_lh_fwd_h``'s algebra, without the l2 norms, decays and gates |
| ``out`` | ``vnew``, then o = Q S + (Q K̃ᵀ ⊙ causal) v_new with S held: ``_lh_fwd_o``'s algebra (it faulted first with 8 warps, and at K = 32 with 4) |

No l2 norm, cumsum, exp or packed sequences; rows past T are masked as in the real kernel. Each
case runs in its own process with CUDA_LAUNCH_BLOCKING=1 (a fault poisons the CUDA context) and
is checked against float64; the report gives per case PASS / FAIL (wrong numbers) / the error,
and the warpgroup MMA shapes in the compiled PTX. The smallest faulting case is the reproducer
to report upstream; if none faults, the difference to ``_lh_fwd_h`` (the norms, decays, masks
on the gates) is where to look next. On the CPU (TRITON_INTERPRET=1) the cases run in the
interpreter, bounds-checked, which checks this module's own code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys

import torch
import triton
import triton.language as tl

from .chunk_kernels import _dot  # the real kernels' dot, PREC "bf16" included
from .fault_probe import SANITIZER_TOOLS, run_child, sanitizer_prefix
from .interpret_bounds import bounds_checked

STAGES = ("t_dot", "vnew", "pass", "out")
PRECS = ("tf32", "bf16", "ieee")
# What a case sets, and its default: the launch set that faults in _lh_fwd_h.
DEFAULTS = dict(stage="pass", warps=4, BV=32, K=128, V=128, BT=64, prec="tf32", sprec="same", stages=2, T=250,
                ykmajor=0)
DEFAULT_GRID = [
    # the faulting launch of _lh_fwd_h, then one piece at a time, then the passing 64-column one
    "stage=pass", "stage=vnew", "stage=t_dot",
    "stage=t_dot,BV=64", "stage=pass,BV=64",
    "stage=t_dot,prec=bf16", "stage=pass,prec=bf16",
    "stage=t_dot,warps=8", "stage=t_dot,warps=2",
    "stage=t_dot,stages=1", "stage=t_dot,K=64,V=64",
    # how Y reaches shared memory (sm_90 TTGIR, Triton 3.6): by default cp.async straight into the
    # transposed (K-major) layout the tf32 MMA reads; ykmajor: cp.async in its own order, then a
    # transposed view; stages=1 (above): from registers, no cp.async
    "stage=t_dot,ykmajor=1", "stage=pass,ykmajor=1",
    # the real launch's precisions (T's dots tf32, the state's bf16: dot_bf16 without t_bf16); in
    # _lh_fwd_h the tf32 right operands (k·βe^γ, v·β) reach shared memory from registers, as with stages=1
    "stage=pass,sprec=bf16", "stage=pass,sprec=bf16,stages=1",
    # _lh_fwd_o's faulting launches: 8 warps with 64-column blocks, and K = 32 with 4 warps
    "stage=out", "stage=out,warps=8,BV=64", "stage=out,K=32,V=32",
]
# fp32 accumulation everywhere; tf32 operands keep 10 mantissa bits, bf16 7.
TOL = dict(tf32=5e-3, bf16=3e-2, ieee=1e-5)


@triton.jit
def _repro_kernel(t, x, y, kt, s0, u_out, s_out, T, NC,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                  STAGE: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, Y_KMAJOR: tl.constexpr = False):
    """One value block (program i_v) of a pass over NC chunks of BT rows: t [T, BT] holds each
    chunk's T, x / kt [T, K] (x is also the queries of ``out``), y [T, V] ([V, T] with Y_KMAJOR:
    then Y, the right operand of T Y, arrives with its reduction dimension contiguous, the
    layout a tf32 warpgroup MMA reads; otherwise Triton transposes it on the way into shared
    memory); u_out [T, V] gets U (t_dot), v_new (vnew, pass) or o (out); s_out [K, V] the final
    state."""
    i_v = tl.program_id(0)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    S = tl.load(s0 + o_k[:, None] * V + o_v[None, :])
    for c in range(NC):
        rows = c * BT + o_t
        m_r = (rows < T)[:, None]
        Tm = tl.load(t + rows[:, None] * BT + o_t[None, :], mask=m_r, other=0.0)
        if Y_KMAJOR:
            Y = tl.trans(tl.load(y + o_v[:, None] * T + rows[None, :], mask=(rows < T)[None, :], other=0.0))
        else:
            Y = tl.load(y + rows[:, None] * V + o_v[None, :], mask=m_r, other=0.0)
        U = _dot(Tm, Y, PREC)
        if STAGE != "t_dot":
            X = tl.load(x + rows[:, None] * K + o_k[None, :], mask=m_r, other=0.0)
            W = _dot(Tm, X, PREC)
            U = U - _dot(W, S, SPREC)
        if STAGE == "pass":
            Kt = tl.load(kt + rows[:, None] * K + o_k[None, :], mask=m_r, other=0.0)
            S = 0.9 * S + _dot(tl.trans(Kt), U, SPREC)
        if STAGE == "out":
            Kt = tl.load(kt + rows[:, None] * K + o_k[None, :], mask=m_r, other=0.0)
            P = tl.where(o_t[:, None] >= o_t[None, :], _dot(X, tl.trans(Kt), SPREC), 0.0)
            U = _dot(X, S, SPREC) + _dot(P, U, SPREC)
        tl.store(u_out + rows[:, None] * V + o_v[None, :], U, mask=m_r)
    tl.store(s_out + o_k[:, None] * V + o_v[None, :], S)


def parse_case(spec: str) -> dict:
    """A case's settings: DEFAULTS with the spec's comma-separated key=value items."""
    case = dict(DEFAULTS)
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in DEFAULTS or not value:
            raise ValueError(f"bad case item {item!r} in {spec!r}: use key=value with a key from {tuple(DEFAULTS)}")
        if isinstance(DEFAULTS[key], int):
            if not value.isdigit():
                raise ValueError(f"bad case item {item!r} in {spec!r}: {key} takes a whole number")
            value = int(value)
        case[key] = value
    if case["stage"] not in STAGES or case["prec"] not in PRECS or case["sprec"] not in PRECS + ("same",):
        raise ValueError(f"bad case {spec!r}: stage from {STAGES}, prec and sprec from {PRECS} (sprec also \"same\")")
    for key in ("K", "V", "BT", "BV"):
        if case[key] < 16 or case[key] & (case[key] - 1):
            raise ValueError(f"bad case {spec!r}: {key} = {case[key]} must be a power of two ≥ 16")
    if case["V"] % case["BV"] or case["T"] < 1 or case["ykmajor"] not in (0, 1):
        raise ValueError(f"bad case {spec!r}: BV must divide V, T ≥ 1 and ykmajor 0 or 1")
    return case


def sprec(case: dict) -> str:
    """The precision of the dots with the state (W S, K̃ᵀ v_new, Q S, P v_new): ``prec`` unless set."""
    return case["prec"] if case["sprec"] == "same" else case["sprec"]


def inputs(case: dict, device: str) -> dict:
    """Random inputs scaled as in the real kernel (T near unit lower triangular, unit-norm rows)."""
    T, K, V, BT = case["T"], case["K"], case["V"], case["BT"]
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return scale * torch.randn(*shape, device=device, generator=gen)

    nc = -(-T // BT)
    tinv = torch.eye(BT, device=device) + torch.tril(rnd(nc, BT, BT, scale=0.1), -1)  # per chunk
    return dict(t=tinv.reshape(nc * BT, BT)[:T].contiguous(), x=rnd(T, K, scale=K ** -0.5), y=rnd(T, V),
                kt=rnd(T, K, scale=K ** -0.5), s0=rnd(K, V, scale=0.1))


def reference(case: dict, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """U (or v_new) and the final state in float64, chunk by chunk as the kernel goes."""
    d = {n: a.double() for n, a in x.items()}
    BT, S, us = case["BT"], d["s0"], []
    for c0 in range(0, case["T"], BT):
        r = slice(c0, min(c0 + BT, case["T"]))
        Tm = d["t"][r, :r.stop - r.start]  # the masked rows past T are zeros in the kernel's dots
        U = Tm @ d["y"][r]
        if case["stage"] != "t_dot":
            U = U - (Tm @ d["x"][r]) @ S
        if case["stage"] == "pass":
            S = 0.9 * S + d["kt"][r].T @ U
        if case["stage"] == "out":
            Q = d["x"][r]
            U = Q @ S + torch.tril(Q @ d["kt"][r].T) @ U
        us.append(U)
    return torch.cat(us), S


def run_case(case: dict) -> dict:
    """Launches one case in this process; PASS/FAIL against float64, or the error."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = inputs(case, device)
    T, K, V, BT, BV = case["T"], case["K"], case["V"], case["BT"], case["BV"]
    u = torch.full((T, V), float("nan"), device=device)
    s = torch.full((K, V), float("nan"), device=device)
    res = dict(case)
    try:
        with bounds_checked() if device == "cpu" else contextlib.nullcontext():
            y = x["y"].t().contiguous() if case["ykmajor"] else x["y"]
            ck = _repro_kernel[(V // BV,)](x["t"], x["x"], y, x["kt"], x["s0"], u, s, T, -(-T // BT),
                                           K=K, V=V, BT=BT, BV=BV, STAGE=case["stage"], PREC=case["prec"],
                                           SPREC=sprec(case), Y_KMAJOR=bool(case["ykmajor"]), num_warps=case["warps"],
                                           num_stages=case["stages"])
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a fault, out of resources, a compile error: all are results
        return dict(res, result="ERROR", error=repr(e)[:300])
    u_ref, s_ref = reference(case, x)
    errs = {n: ((a.double() - b).norm() / b.norm()).item() for n, a, b in (("u", u, u_ref), ("s", s, s_ref))}
    tol = max(TOL[case["prec"]], TOL[sprec(case)])
    ok = all(e <= tol for e in errs.values())  # NaN (unwritten) compares False
    res.update(result="PASS" if ok else "FAIL", errors=errs)
    if device == "cuda":
        res["wgmma"] = sorted(set(re.findall(r"wgmma\.mma_async\.\S*?(m\d+n\d+k\d+)\.\S*?(tf32|bf16|f16)",
                                             ck.asm.get("ptx", ""))))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=DEFAULT_GRID,
                    help=f"cases: comma-separated key=value over {DEFAULTS}")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per case (compiling counts)")
    ap.add_argument("--sanitizer", choices=SANITIZER_TOOLS, default=None,
                    help="run each case under compute-sanitizer with this tool")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        cases = [parse_case(spec) for spec in args.cases]
    except ValueError as e:  # a typo fails before any process starts
        raise SystemExit(str(e)) from None
    if args.child:
        print(json.dumps(run_case(cases[0])), flush=True)
        return
    prefix = sanitizer_prefix(args.sanitizer)
    rows = []
    for spec, case in zip(args.cases, cases):
        cmd = [sys.executable, "-m", "hymo_kernels.gdn.fault_repro", "--child", "--cases", spec]
        res = run_child(prefix, cmd, args.timeout_s, dict(case, result="ERROR"))
        rows.append(dict(res, spec=spec))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n# fault_repro on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (interpreter)'}, "
          f"Triton {triton.__version__}, torch {torch.__version__}")
    for r in rows:
        what = (f"errors u {r['errors']['u']:.1e} s {r['errors']['s']:.1e}" if r.get("errors") else r.get("error", ""))
        mma = " ".join("/".join(m) for m in r.get("wgmma", []))
        print(f"{r['spec']:36s} {r['result']:5s}  {what[:120]}  {mma}")
        for line in r.get("sanitizer", [])[:4]:
            print(f"    {args.sanitizer}: {line[:200]}")


if __name__ == "__main__":
    main()
