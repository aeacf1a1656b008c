#!/usr/bin/env python3
"""Where a training step's GPU time goes, from a torch.profiler chrome trace.

TorchTitan writes one trace per profiled step (``--profiling.enable_profiling``:
``<dump_folder>/profile_traces/iteration_N/rank0_trace.json``). This sums the GPU kernels of
the trace by category (CATEGORIES: the first pattern that matches a kernel's name wins) and
prints a table: GPU ms per category, its share of all kernel time, the kernel count, and how
much of it was launched inside ``Optimizer.step`` (the optimizers' profiler annotations). Then
the step's host time (the host's ``ProfilerStep#N`` annotation), how busy the GPU was over the
span of its kernels, for the whole step and for the kernels launched inside the optimizer step
and outside it (the step's span less the optimizer's; a GPU busy well below 100 % means the
host, not the GPU, sets the pace), the
host's CUDA API time in launches and synchronisations, how often the host waited for the GPU
(a synchronisation or a blocking copy) inside ``Optimizer.step``, and the longest kernels by
name. With
``--idle``: the GPU's idle gaps, charged to the host events around the launch that ended each,
every synchronising call under its host events, and the GPU's busy share window by window over
the step (``--window`` ms). A trace of CUDA activity alone (``CUDA_ONLY=1 bash
benchmarks/step_profile.sh``) has no host events to charge gaps to, but its timeline is the
undisturbed one: the host-side profiler slows the host, and so inflates the GPU's idle time.

    python -m benchmarks.trace_breakdown outputs/hymo_750m/profile_traces/iteration_12/rank0_trace.json

(benchmarks/step_profile.sh takes such a trace and runs this on it.)
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict

# (category, regex on the kernel name): the first match wins, so the specific ones come first
CATEGORIES: tuple[tuple[str, str], ...] = (
    # the Triton kernels of hymo_kernels.gdn, by their function names
    ("GDN (hymo_kernels.gdn)", r"^_(wy_inverse|fwd_prep|state_pass|fwd_out|bwd_prep|bwd_local|bwd_dstate|bwd_sub"
                               r"|sum_parts)_kernel"),
    ("NCCL", r"nccl"),
    ("attention (SDPA)", r"flash|fmha|sdpa|attention"),
    ("grouped GEMM (MoE experts)", r"group"),
    ("GEMM", r"gemm|xmma|cutlass|nvjet|cublas|splitk|sm90_|sm80_"),
    ("Inductor (fused Triton)", r"^triton_"),
    ("ATen elementwise / reductions", r"at::native|elementwise|reduce_kernel|vectorized|unrolled"),
)
OTHER = "other kernels"
COPY = "memcpy / memset"
# host CUDA API calls (cat cuda_runtime / cuda_driver) by what they do
LAUNCH_API = re.compile(r"^(cudaLaunch|cuLaunch)")
SYNC_API = re.compile(r"^cuda(Stream|Device|Event)Synchronize$")
# calls that make the host wait for the GPU: the explicit synchronisations and the blocking copies
BLOCKING_API = ("cudaMemcpy", "cudaStreamWaitEvent_sync")


def _blocks(name: str) -> bool:
    return bool(SYNC_API.match(name)) or name in BLOCKING_API


def categorize(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return OTHER


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length (ms) of the union of [start, end) intervals given in µs."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def breakdown(trace: dict) -> dict:
    """Per-category GPU time of one trace (times in ms)."""
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("not a chrome trace: no 'traceEvents' list")
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]
    gpu = [e for e in complete if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        raise ValueError("the trace has no GPU kernels (was it taken on a GPU, with CUDA activities?)")
    # host annotations only: the profiler mirrors them on the GPU's track as gpu_user_annotation
    host = [e for e in complete if e.get("cat") == "user_annotation"]
    api = [e for e in complete if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    # which host launches ran inside an optimizer step: by the launch's correlation id
    opt_spans = [(e["ts"], e["ts"] + e["dur"]) for e in host if str(e.get("name", "")).startswith("Optimizer.step#")]
    in_opt = set()
    for e in api:
        if "correlation" in e.get("args", {}) and any(s <= e["ts"] <= t for s, t in opt_spans):
            in_opt.add(e["args"]["correlation"])
    cats: dict[str, dict] = defaultdict(lambda: dict(ms=0.0, n=0, opt_ms=0.0))
    names: dict[str, dict] = defaultdict(lambda: dict(ms=0.0, n=0))
    for e in gpu:
        cat = COPY if e["cat"] != "kernel" else categorize(e["name"])
        ms = e["dur"] / 1e3
        c = cats[cat]
        c["ms"] += ms
        c["n"] += 1
        if _corr(e) in in_opt:
            c["opt_ms"] += ms
        names[e["name"]]["ms"] += ms
        names[e["name"]]["n"] += 1
    steps = [e for e in host if str(e.get("name", "")).startswith("ProfilerStep#")]
    phases = {}
    for phase, part in (("step", gpu), ("inside Optimizer.step", [e for e in gpu if _corr(e) in in_opt]),
                        ("outside Optimizer.step", [e for e in gpu if _corr(e) not in in_opt])):
        if part:
            span = (max(e["ts"] + e["dur"] for e in part) - min(e["ts"] for e in part)) / 1e3
            if phase.startswith("outside") and "inside Optimizer.step" in phases:
                # the optimizer's kernels run as one block: the rest of the step's span is everything else
                span = phases["step"]["span_ms"] - phases["inside Optimizer.step"]["span_ms"]
            phases[phase] = dict(busy_ms=_union_ms([(e["ts"], e["ts"] + e["dur"]) for e in part]), span_ms=span,
                                 n=len(part))
    calls = {what: dict(n=sum(1 for e in api if rx.match(e["name"])),
                        ms=sum(e["dur"] for e in api if rx.match(e["name"])) / 1e3)
             for what, rx in (("launches", LAUNCH_API), ("synchronisations", SYNC_API))}
    # the host waiting for the GPU inside an optimizer step (a sync or a blocking copy)
    waits_in_opt = sum(1 for e in api if _blocks(e["name"]) and any(s <= e["ts"] <= t for s, t in opt_spans))
    return dict(categories=dict(cats), kernels=dict(names), kernel_ms=sum(c["ms"] for c in cats.values()),
                busy_ms=phases["step"]["busy_ms"], span_ms=phases["step"]["span_ms"], phases=phases, api=calls,
                host_waits_in_optimizer=waits_in_opt,
                step_ms=sum(e["dur"] for e in steps) / 1e3 if steps else None, n_steps=len(steps),
                optimizer_spans=len(opt_spans))


def _corr(e: dict):
    return e.get("args", {}).get("correlation")


def _enclosing(ops_by_tid: dict, tid, ts: float) -> list[str]:
    """Names of the host events on thread tid that contain time ts, outermost first."""
    return [e["name"] for e in ops_by_tid.get(tid, ()) if e["ts"] <= ts <= e["ts"] + e["dur"]]


def _label(stack: list[str], depth: int = 3) -> str:
    """A short name for a host stack: its innermost `depth` events below the ProfilerStep."""
    inner = [n for n in stack if not n.startswith("ProfilerStep#")]
    return " > ".join(n[:60] for n in inner[-depth:]) or "(outside any host event)"


def idle_and_syncs(trace: dict, min_gap_us: float = 20.0) -> dict:
    """Where the GPU waits and where the host synchronises.

    Each idle gap of the GPU (no kernel, copy or memset running, at least min_gap_us long) is
    charged to what the host was doing when it launched the kernel that ended the gap (the
    innermost host events around that launch): a gap means the host was late with that launch.
    Each synchronising CUDA API call is listed under its own host events.
    """
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launch_of = {e["args"]["correlation"]: e for e in api if "correlation" in e.get("args", {})}
    ops_by_tid: dict = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            ops_by_tid[e.get("tid")].append(e)
    for ops in ops_by_tid.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
    gaps: dict[str, dict] = defaultdict(lambda: dict(ms=0.0, n=0))
    end = gpu[0]["ts"] + gpu[0]["dur"] if gpu else 0.0
    total = 0.0
    for e in gpu[1:]:
        gap = e["ts"] - end
        if gap >= min_gap_us:
            launch = launch_of.get(_corr(e))
            label = _label(_enclosing(ops_by_tid, launch.get("tid"), launch["ts"])) if launch else "(no launch record)"
            gaps[label]["ms"] += gap / 1e3
            gaps[label]["n"] += 1
            total += gap / 1e3
        end = max(end, e["ts"] + e["dur"])
    syncs: dict[str, dict] = defaultdict(lambda: dict(ms=0.0, n=0))
    for e in api:
        if _blocks(e["name"]):
            label = _label(_enclosing(ops_by_tid, e.get("tid"), e["ts"]), depth=4)
            syncs[f"{e['name']}: {label}"]["ms"] += e["dur"] / 1e3
            syncs[f"{e['name']}: {label}"]["n"] += 1
    return dict(gaps=dict(gaps), gap_ms=total, syncs=dict(syncs), min_gap_us=min_gap_us)


def busy_timeline(trace: dict, window_ms: float = 50.0) -> list[float]:
    """The GPU's busy share (%) in consecutive windows of window_ms from the first kernel's start
    to the last one's end (the last window as long as what is left): where in the step the GPU
    waited, e.g. at the step's start, after the previous step's closing host read (idle before
    the first kernel is not counted)."""
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not gpu:
        return []
    t0, t1, w = gpu[0][0], max(e for _, e in gpu), window_ms * 1e3
    n = max(1, int(-(-(t1 - t0) // w)))
    busy = [0.0] * n
    end = float("-inf")  # the union of the intervals, swept once, each piece split across windows
    for s0, e0 in gpu:
        s0 = max(s0, end)
        if e0 <= s0:
            continue
        end = e0
        while s0 < e0:
            i = min(int((s0 - t0) // w), n - 1)
            while i < n - 1 and t0 + (i + 1) * w <= s0:  # rounding in the division
                i += 1
            cut = e0 if i == n - 1 else min(e0, t0 + (i + 1) * w)
            busy[i] += cut - s0
            s0 = cut
    lengths = [min(w, t1 - t0 - i * w) for i in range(n)]
    return [100 * b / length if length > 0 else 100.0 for b, length in zip(busy, lengths)]


def render_idle(r: dict, top: int = 15) -> str:
    rows = [f"GPU idle in gaps of >= {r['min_gap_us']:.0f} us: {r['gap_ms']:.1f} ms, charged to the host events "
            "around the launch that ended each gap", "",
            f"| host events at the late launch (top {top}) | idle ms | gaps |", "|---|---|---|"]
    for label, g in sorted(r["gaps"].items(), key=lambda kv: -kv[1]["ms"])[:top]:
        rows.append(f"| {label} | {g['ms']:.2f} | {g['n']} |")
    rows += ["", f"| synchronising call: host events (top {top}) | host ms | calls |", "|---|---|---|"]
    for label, s in sorted(r["syncs"].items(), key=lambda kv: -kv[1]["ms"])[:top]:
        rows.append(f"| {label} | {s['ms']:.2f} | {s['n']} |")
    return "\n".join(rows)


def render(b: dict, top: int = 12) -> str:
    total = b["kernel_ms"]
    rows = ["| category | GPU ms | share | kernels | of it in Optimizer.step (ms) |", "|---|---|---|---|---|"]
    for cat, c in sorted(b["categories"].items(), key=lambda kv: -kv[1]["ms"]):
        rows.append(f"| {cat} | {c['ms']:.2f} | {100 * c['ms'] / total:.1f} % | {c['n']} | {c['opt_ms']:.2f} |")
    rows.append(f"| all | {total:.2f} | 100 % | {sum(c['n'] for c in b['categories'].values())} | "
                f"{sum(c['opt_ms'] for c in b['categories'].values()):.2f} |")
    step = (f"{b['step_ms']:.1f} ms host time in {b['n_steps']} ProfilerStep annotation(s)" if b["step_ms"]
            else "no ProfilerStep annotation")
    rows += ["", f"{step}; {b['optimizer_spans']} Optimizer.step annotation(s)", "",
             "| GPU work | span ms | busy ms | busy share | kernels |", "|---|---|---|---|---|"]
    for phase, p in b["phases"].items():
        share = 100 * p["busy_ms"] / p["span_ms"] if p["span_ms"] else 100.0
        rows.append(f"| {phase} | {p['span_ms']:.1f} | {p['busy_ms']:.1f} | {share:.0f} % | {p['n']} |")
    rows += ["", "host CUDA API: " + ", ".join(f"{c['n']} {what} ({c['ms']:.1f} ms)" for what, c in b["api"].items())
             + f"; host waits for the GPU inside Optimizer.step: {b['host_waits_in_optimizer']}",
             "", f"| longest kernels (top {top}) | GPU ms | count |", "|---|---|---|"]
    for name, k in sorted(b["kernels"].items(), key=lambda kv: (-kv[1]["ms"], kv[0]))[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        rows.append(f"| `{short}` | {k['ms']:.2f} | {k['n']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a chrome trace (.json) written by torch.profiler")
    ap.add_argument("--top", type=int, default=12, help="how many kernels to list by GPU time")
    ap.add_argument("--idle", action="store_true",
                    help="also: where the GPU sat idle (by the host events around the late launch) and where "
                         "the host synchronised")
    ap.add_argument("--window", type=float, default=50.0,
                    help="with --idle: the window (ms) of the GPU's busy timeline (default 50)")
    args = ap.parse_args(argv)
    if args.window <= 0:
        ap.error(f"--window must be > 0 ms, got {args.window:g}")
    try:
        opener = gzip.open if args.trace.endswith(".gz") else open
        with opener(args.trace, "rt") as f:
            trace = json.load(f)
        print(render(breakdown(trace), args.top))
        if args.idle:
            print()
            print(render_idle(idle_and_syncs(trace), args.top))
            print()
            print(f"GPU busy per {args.window:g} ms from the first kernel (%): "
                  + " ".join(f"{x:.0f}" for x in busy_timeline(trace, args.window)))
    except (OSError, json.JSONDecodeError, ValueError) as e:
        print(f"trace_breakdown: {args.trace}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
