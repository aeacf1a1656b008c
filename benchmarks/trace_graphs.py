#!/usr/bin/env python3
"""A training step's GPU time by the compiled graph (or host op) that launched each kernel, and
the GPU's idle gaps by the launch that ended them, from a torch.profiler chrome trace.

Each kernel is matched to its launch (the CUDA runtime or driver call with the same correlation
id) and charged to the innermost ``## Call CompiledFxGraph <hash> ##`` around that launch (a
per-block compiled forward or backward graph: all GDN blocks share one, all MLA + MoE blocks
another), else to the first optimizer or custom-op annotation, else to the innermost host op;
"bwd" when an autograd ``...Backward`` event encloses the launch. Per key: GPU ms, share, kernel
count, and the longest kernels by name. Then every gap of at least ``--gap-us`` between
consecutive kernels, charged to the key of the kernel that ended it: where the GPU waited for the
host. (``benchmarks/trace_breakdown.py`` sums by kernel category instead.)

    python -m benchmarks.trace_graphs outputs/step_profile/hymo_750m_trace.json.gz
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re

GRAPH = re.compile(r"## Call CompiledFxGraph (\w{8})\w* ##")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


class Launches:
    """The host events enclosing each kernel's launch."""

    def __init__(self, events: list[dict]):
        self.launch = {e["args"]["correlation"]: e for e in events
                       if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                       and "correlation" in e.get("args", {})}
        host = collections.defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
                host[e["tid"]].append(e)
        self.host = {t: sorted(v, key=lambda e: e["ts"]) for t, v in host.items()}
        self.starts = {t: [e["ts"] for e in v] for t, v in self.host.items()}
        self.longest = {t: max((e["dur"] for e in v), default=0) for t, v in self.host.items()}

    def key(self, kernel: dict) -> tuple[str, str]:
        r = self.launch.get(kernel.get("args", {}).get("correlation"))
        if r is None:
            return ("?", "fwd")
        t, ts = r["tid"], r["ts"]
        lo = bisect.bisect_left(self.starts[t], ts - self.longest[t])
        hi = bisect.bisect_right(self.starts[t], ts)
        names = [e["name"] for e in self.host[t][lo:hi] if e["ts"] + e["dur"] >= ts + r.get("dur", 0)]
        graph = next((f"graph {m[1]}" for n in reversed(names) if (m := GRAPH.search(n))), None)
        if graph is None:
            graph = next((n for n in names if n.startswith(("Optimizer.step", "hymo_kernels::"))), None)
        if graph is None:
            graph = names[-1][:60] if names else "?"
        return (graph, "bwd" if any("Backward" in n for n in names) else "fwd")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a chrome trace (.json or .json.gz) of one or more steps")
    ap.add_argument("--top", type=int, default=14, help="keys shown")
    ap.add_argument("--kernels", type=int, default=8, help="longest kernels shown per key")
    ap.add_argument("--gap-us", type=float, default=5.0, help="smallest idle gap counted")
    args = ap.parse_args(argv)
    events = load(args.trace)
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    if not kernels:
        raise SystemExit(f"trace_graphs: {args.trace} has no GPU kernels")
    launches = Launches(events)
    ms, count = collections.defaultdict(float), collections.Counter()
    by_name = collections.defaultdict(lambda: collections.defaultdict(float))
    gaps, gap_count = collections.defaultdict(float), collections.Counter()
    end = None
    for k in kernels:
        key = launches.key(k)
        ms[key] += k["dur"] / 1e3
        count[key] += 1
        by_name[key][re.sub(r"_\d+$", "", k["name"])[:70]] += k["dur"] / 1e3
        if end is not None and k["ts"] - end >= args.gap_us:
            gaps[key] += (k["ts"] - end) / 1e3
            gap_count[key] += 1
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    total = sum(ms.values())
    print("| launched by | pass | GPU ms | share | kernels | longest kernels (ms) |\n|---|---|---|---|---|---|")
    for key, v in sorted(ms.items(), key=lambda kv: -kv[1])[:args.top]:
        top = ", ".join(f"`{n}` {t:.2f}" for n, t in sorted(by_name[key].items(), key=lambda kv: -kv[1])[:args.kernels])
        print(f"| {key[0]} | {key[1]} | {v:.2f} | {100 * v / total:.1f} % | {count[key]} | {top} |")
    print(f"\nGPU idle in gaps of >= {args.gap_us:g} us: {sum(gaps.values()):.1f} ms, by the launch that ended each\n")
    print("| launched by | pass | idle ms | gaps |\n|---|---|---|---|")
    for key, v in sorted(gaps.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| {key[0]} | {key[1]} | {v:.2f} | {gap_count[key]} |")


if __name__ == "__main__":
    main()
