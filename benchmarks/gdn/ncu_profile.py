"""Where the GDN kernels' GPU time goes, from Nsight Compute's hardware counters.

    python -m benchmarks.gdn.ncu_profile run --shape 4,4096,40,32,32 [--iters 3]   # GPU: what ncu profiles
    python -m benchmarks.gdn.ncu_profile summarize DIR                              # anywhere: tables from ncu's CSVs

`benchmarks/gdn/ncu_profile.sh` runs ncu on `run` (the last fwd+bwd of the op at that shape, bf16, every
kernel with `--set full` and source counters), exports CSVs into a folder and calls `summarize`.
The exports it reads, per shape tag (e.g. 4_4096_40_32_32):

- `raw_<tag>.csv`: `ncu --import R --page raw --csv` (one row per profiled kernel launch);
- `src_<kernel>_<tag>.csv`: `ncu --import R --page source --print-source cuda,sass --csv --kernel-name K`
  (Python source lines, each with its SASS below it; a line's row carries the sum of its
  instructions' warp-stall samples).

The stall samples say where warps wait, attributed to the instruction that waits: a load's
latency shows on the first instruction that uses the loaded value, not on the load.
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import os
import sys

# per-launch columns of the raw page: (header, metric, the unit shown); ncu picks each
# column's unit per report (us or ms, Mbyte or Gbyte, ...), given in the row under the header
RAW_COLUMNS = (
    ("us", "gpu__time_duration.sum", "us"),
    ("regs", "launch__registers_per_thread", None),
    ("warps/SM", "sm__warps_active.avg.per_cycle_active", None),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active", None),
    ("DRAM rd MB", "dram__bytes_read.sum", "Mbyte"),
    ("DRAM wr MB", "dram__bytes_write.sum", "Mbyte"),
    ("warp insts M", "smsp__inst_executed.sum", "Minst"),
)
_PREFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BASES = ("byte", "inst", "s")  # Gbyte, Minst, ms / us
# Python source lines by what they do: the first rule that matches a line wins
CATEGORIES = (
    ("reductions", lambda path, text: os.path.basename(path) == "standard.py"),  # tl.sum / tl.cumsum bodies
    ("dots", lambda path, text: "tl.dot(" in text or "_dot(" in text),
    ("loads", lambda path, text: "tl.load(" in text),
    ("stores", lambda path, text: "tl.store(" in text),
    ("other", lambda path, text: True),
)
SAMPLES = "Warp Stall Sampling (All Samples)"


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def unit_factor(unit: str, want: str | None) -> float:
    """Factor from ncu's unit to want, e.g. ("ms", "us") -> 1000 or ("Gbyte", "Mbyte") -> 1000;
    want None: the column is read as it is (registers, warps, %)."""
    if want is None or unit == want:
        return 1.0
    for base in _BASES:
        if unit.endswith(base) and want.endswith(base):
            a, b = unit[: -len(base)], want[: -len(base)]
            if a in _PREFIX and b in _PREFIX:
                return _PREFIX[a] / _PREFIX[b]
    raise ValueError(f"cannot convert ncu unit {unit!r} to {want!r}")


def read_raw(path: str) -> list[dict]:
    """One dict per kernel launch: name and RAW_COLUMNS values (a missing metric reads nan)."""
    rows = list(csv.reader(open(path, newline="")))
    if not rows or "Kernel Name" not in rows[0]:
        raise ValueError(f"{path}: not an ncu --page raw --csv export (no 'Kernel Name' column)")
    hdr, units = rows[0], rows[1]
    out = []
    for r in rows[2:]:
        if len(r) != len(hdr):
            continue
        d = {"kernel": r[hdr.index("Kernel Name")]}
        for col, metric, want in RAW_COLUMNS:
            i = hdr.index(metric) if metric in hdr else None
            d[col] = float("nan") if i is None else _num(r[i]) * unit_factor(units[i], want)
        out.append(d)
    return out


def read_source(path: str) -> list[dict]:
    """One dict per Python source line with samples: file, line, text, samples, stalls
    (Counter of reason → samples)."""
    rows = list(csv.reader(open(path, newline="")))
    hdr, cur_file, out = None, "?", []
    for r in rows:
        if not r:
            continue
        if r[0] == "File Path":
            cur_file = r[1]
        elif r[0] == "Line No":
            hdr = r
        elif hdr is not None and r[0] and len(r) == len(hdr):
            stalls = collections.Counter({h[len("stall_"):]: _num(v) for h, v in zip(hdr, r)
                                          if h.startswith("stall_") and "Not Issued" not in h})
            out.append(dict(file=cur_file, line=int(r[0]), text=r[1], samples=_num(r[hdr.index(SAMPLES)]),
                            stalls=stalls))
    if hdr is None:
        raise ValueError(f"{path}: not an ncu --page source --print-source cuda,sass --csv export (no 'Line No' row)")
    return out


def category(path: str, text: str) -> str:
    return next(name for name, match in CATEGORIES if match(path, text))


def summarize_kernel(lines: list[dict]) -> dict:
    """Total samples, shares by stall reason and by category, and the lines by samples."""
    total = sum(x["samples"] for x in lines) or 1.0
    stalls, cats = collections.Counter(), collections.Counter()
    for x in lines:
        stalls.update(x["stalls"])
        cats[category(x["file"], x["text"])] += x["samples"]
    n_stall = sum(stalls.values()) or 1.0
    return dict(samples=total,
                stalls={k: v / n_stall for k, v in stalls.most_common()},
                categories={k: v / total for k, v in cats.most_common()},
                top=sorted(lines, key=lambda x: -x["samples"]))


def summarize(folder: str, top: int = 8) -> str:
    raws = sorted(glob.glob(os.path.join(folder, "raw_*.csv")))
    if not raws:
        raise FileNotFoundError(f"no raw_<tag>.csv in {folder} (benchmarks/gdn/ncu_profile.sh writes them)")
    out = []
    for raw in raws:
        tag = os.path.basename(raw)[len("raw_"):-len(".csv")]
        out.append(f"== {tag}")
        out.append("kernel                  " + "".join(f"{c:>13s}" for c, _, _ in RAW_COLUMNS))
        for d in read_raw(raw):
            out.append(f"{d['kernel'][:24]:24s}" + "".join(f"{d[c]:13.1f}" for c, _, _ in RAW_COLUMNS))
        for src in sorted(glob.glob(os.path.join(folder, f"src_*_{tag}.csv"))):
            kernel = os.path.basename(src)[len("src_"):-len(f"_{tag}.csv")]
            s = summarize_kernel(read_source(src))
            out.append(f"-- {kernel}: {s['samples']:.0f} stall samples")
            out.append("   stalls:  " + ", ".join(f"{k} {v:.0%}" for k, v in list(s["stalls"].items())[:7]))
            out.append("   by line: " + ", ".join(f"{k} {v:.0%}" for k, v in s["categories"].items()))
            for x in s["top"][:top]:
                why = ", ".join(f"{k} {v / (x['samples'] or 1):.0%}" for k, v in x["stalls"].most_common(2))
                out.append(f"   {x['samples'] / s['samples']:5.1%}  {os.path.basename(x['file'])}:{x['line']:<5d}"
                           f"{x['text'].strip()[:64]:64s} [{why}]")
    return "\n".join(out)


def run(shape: tuple[int, ...], iters: int) -> None:
    """iters fwd+bwd calls of chunk_gated_delta_rule at shape, bf16, l2norm in the kernel (as
    the benchmark times it); ncu skips the earlier calls' launches."""
    import torch

    from . import bench

    x = bench.make_inputs(shape, torch.bfloat16)
    t = [x[n].requires_grad_() for n in bench.NAMES]
    do = torch.randn_like(x["v"])
    for _ in range(iters):
        for x_ in t:
            x_.grad = None
        o, _ = bench.ours(*t)
        o.backward(do)
    torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="GPU: fwd+bwd calls for ncu to profile")
    r.add_argument("--shape", default="4,4096,40,32,32", help="B,T,H,K,V")
    r.add_argument("--iters", type=int, default=3)
    s = sub.add_parser("summarize", help="tables from ncu's CSV exports")
    s.add_argument("folder")
    s.add_argument("--top", type=int, default=8, help="source lines listed per kernel")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        shape = tuple(int(v) for v in a.shape.split(","))
        if len(shape) != 5:
            ap.error(f"--shape takes B,T,H,K,V, got {a.shape!r}")
        run(shape, a.iters)
    else:
        print(summarize(a.folder, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
