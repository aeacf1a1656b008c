"""Compare two scripts/update_probe.py tables (a reference run and a run that should match it).

    python scripts/probe_compare.py REF.tsv OTHER.tsv [--top 15]

Prints, per optimizer, the summed squared update and the median ratio (other / reference) of
the relative update, the gradient norm and each optimizer-state norm, then the parameters
whose relative update differs most.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics


def read(path):
    with open(path) as f:
        return {row["name"]: row for row in csv.DictReader(f, delimiter="\t")}


def ratio(a: str, b: str) -> float:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return math.nan
    return y / x if x else (math.inf if y else 1.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ref")
    ap.add_argument("other")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    ref, other = read(args.ref), read(args.other)
    common = [n for n in ref if n in other]
    print(f"{len(common)} parameters in both ({len(ref)} / {len(other)}); ratios are other / ref")
    cols = ["rel_update", "grad_norm", "w_norm", "lr", "momentum_buffer", "neuron_v", "exp_avg",
            "exp_avg_sq", "step"]
    for opt in sorted({ref[n]["optimizer"] for n in common}):
        names = [n for n in common if ref[n]["optimizer"] == opt]
        meds = []
        for c in cols:
            rs = [r for r in (ratio(ref[n][c], other[n][c]) for n in names) if not math.isnan(r)]
            meds.append(f"{c} {statistics.median(rs):.3g}" if rs else f"{c} -")
        print(f"{opt} ({len(names)} params): median ratio " + ", ".join(meds))
    worst = sorted(common, key=lambda n: -abs(math.log(max(ratio(ref[n]['rel_update'],
                                                                 other[n]['rel_update']), 1e-30))))
    print(f"\nlargest differences of the relative update (top {args.top}):")
    print(f"{'parameter':<52}{'opt':>15}{'ref upd':>11}{'other upd':>11}{'ref |g|':>10}"
          f"{'other |g|':>10}{'ref st':>10}{'other st':>10}")
    for n in worst[:args.top]:
        a, b = ref[n], other[n]
        st = "exp_avg_sq" if a["optimizer"] != "normuon" else "neuron_v"
        print(f"{n[-52:]:<52}{a['optimizer']:>15}{float(a['rel_update']):>11.3g}"
              f"{float(b['rel_update']):>11.3g}{float(a['grad_norm']):>10.3g}"
              f"{float(b['grad_norm']):>10.3g}{float(a[st]):>10.3g}{float(b[st]):>10.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
