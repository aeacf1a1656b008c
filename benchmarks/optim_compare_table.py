"""The table benchmarks/optim_compare.sh and benchmarks/ab_seeds.sh print: one row per run,
read from tensorboard.

    python -m benchmarks.optim_compare_table "NorMuon=outputs/run_a" "AdamW=outputs/run_b"

Each argument is LABEL=DUMP_FOLDER (the run's --job.dump_folder; its tb/ holds the events).
Columns, per run:
- final loss: mean training objective (main + weighted MTP) over the last 10 logged steps, and
  the main head's cross-entropy over the same steps;
- tokens/s: mean of TorchTitan's throughput(tps) after the first 10 steps (compile, warm-up);
- optimizer step: mean time of the optimizer container's step (NaN check + every optimizer)
  and its share of the wall time over the same steps (time_metrics/optimizer_step(%));
- skipped: steps skipped for a non-finite loss or gradient;
- MoE: mean max expert load (x the mean) and dropped fraction over the last 10 steps.
Needs every step logged (--metrics.log_freq 1).

Labels of the form NAME@SEED (benchmarks/ab_seeds.sh) also get a summary: per NAME the mean
final loss and main CE over its seeds, and for two NAMEs the per-seed differences (second
minus first) on the seeds both ran.
"""

from __future__ import annotations

import sys
from pathlib import Path

LAST, WARMUP = 10, 10


def read_scalars(dump_folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    events = sorted((dump_folder / "tb").rglob("events.out.tfevents.*"))
    if not events:
        raise SystemExit(f"optim_compare_table: no tensorboard events under {dump_folder}/tb")
    for path in events:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return scalars


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(scalars: dict[str, dict[int, float]]) -> dict[str, float]:
    loss = scalars["loss_metrics/global_avg_loss"]
    steps = sorted(loss)
    if steps != list(range(1, len(steps) + 1)):
        raise SystemExit(f"optim_compare_table: logged steps {steps[:5]}...: run with "
                         "--metrics.log_freq 1")
    last = steps[-min(LAST, len(steps)):]
    timed = [s for s in steps if s > min(WARMUP, len(steps) // 2)]

    def over(tag, which):
        return mean([scalars[tag][s] for s in which if s in scalars.get(tag, {})])

    return {
        "steps": len(steps),
        "loss": over("loss_metrics/global_avg_loss", last),
        "main_ce": over("loss_metrics/main_ce", last),
        "tps": over("throughput(tps)", timed),
        "opt_ms": 1e3 * over("time_metrics/optimizer_step(s)", timed),
        "opt_pct": over("time_metrics/optimizer_step(%)", timed),
        "step_s": over("time_metrics/end_to_end(s)", timed),
        "skipped": scalars.get("optimizer/skipped_steps", {}).get(steps[-1], float("nan")),
        "max_load": over("moe/max_load", last),
        "dropped": over("moe/dropped_frac", last),
        "first": last[0],
        "timed_from": timed[0] if timed else float("nan"),
    }


def main(argv: list[str]) -> None:
    runs = []
    for arg in argv:
        label, sep, folder = arg.partition("=")
        if not sep:
            raise SystemExit(f"optim_compare_table: expected LABEL=DUMP_FOLDER, got {arg!r}")
        runs.append((label, summarize(read_scalars(Path(folder)))))
    if not runs:
        raise SystemExit(__doc__)
    r0 = runs[0][1]
    print(f"final loss: mean over steps {r0['first']}-{r0['steps']}; tokens/s and optimizer "
          f"step: mean over steps {r0['timed_from']}-{r0['steps']}")
    for label, r in runs:
        if r["steps"] != r0["steps"]:  # e.g. a run cut by the script's timeout
            print(f"NOTE: {label} logged {r['steps']} steps, not {r0['steps']}: its row covers "
                  f"steps {r['first']}-{r['steps']} and {r['timed_from']}-{r['steps']}")
    header = (f"{'optimizer':<24}{'final loss':>11}{'main CE':>9}{'tokens/s':>10}"
              f"{'step (s)':>10}{'opt step (ms)':>15}{'opt share':>11}{'skipped':>9}"
              f"{'max load':>10}{'dropped':>9}")
    print(header)
    print("-" * len(header))
    for label, r in runs:
        print(f"{label:<24}{r['loss']:>11.4f}{r['main_ce']:>9.4f}{r['tps']:>10,.0f}"
              f"{r['step_s']:>10.3f}{r['opt_ms']:>15.1f}{r['opt_pct']:>10.1f}%"
              f"{r['skipped']:>9.0f}{r['max_load']:>10.2f}{r['dropped']:>9.3f}")
    print_seed_summary(runs)


def print_seed_summary(runs: list[tuple[str, dict]]) -> None:
    """Means per NAME over the NAME@SEED rows, and the per-seed differences of two NAMEs."""
    groups: dict[str, dict[str, dict]] = {}
    for label, r in runs:
        name, sep, seed = label.rpartition("@")
        if sep and name:
            groups.setdefault(name, {})[seed] = r
    if not groups:
        return
    print("\nper setting, mean over seeds:")
    for name, by_seed in groups.items():
        print(f"{name:<24}{mean([r['loss'] for r in by_seed.values()]):>11.4f}"
              f"{mean([r['main_ce'] for r in by_seed.values()]):>9.4f}   seeds {' '.join(by_seed)}")
    if len(groups) == 2:
        (na, a), (nb, b) = groups.items()
        seeds = [x for x in a if x in b]
        d = [b[x]["loss"] - a[x]["loss"] for x in seeds]
        dce = [b[x]["main_ce"] - a[x]["main_ce"] for x in seeds]
        if d:
            print(f"{nb} minus {na}, final loss per seed: " + ", ".join(f"{x}: {v:+.4f}" for x, v in zip(seeds, d))
                  + f"; mean {mean(d):+.4f} (min {min(d):+.4f}, max {max(d):+.4f}); main CE mean {mean(dce):+.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
