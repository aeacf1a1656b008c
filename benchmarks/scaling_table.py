"""The table benchmarks/scaling.sh prints: FSDP2 weak scaling and resume across world sizes.

    python -m benchmarks.scaling_table --warmup 5 --save-step 20 --save-ngpu 2 \\
        --scale 2 RUN_DIR/scale_2gpu OUT/scale_2gpu.log \\
        --scale 1 RUN_DIR/scale_1gpu OUT/scale_1gpu.log \\
        --resume 1 RUN_DIR/resume_2to1gpu OUT/resume_2to1gpu.log [--json OUT/scalars.json]

Each run is NGPU, its --job.dump_folder (tb/ holds the tensorboard events) and its console log.
Both are read: tensorboard has every metric (TorchTitan's and HyMo's), the log survives a run
cut by a timeout (TorchTitan buffers its events; scaling.sh flushes them at every step, the
log fills in any step they miss: loss, grad norm, memory, tokens/s).

Scaling rows (one per --scale run), means over the timed steps WARMUP+1..SAVE_STEP (after
compile and warm-up; before the checkpoint save, whose time lands in step SAVE_STEP+1):
- tokens/s per GPU: TorchTitan's throughput(tps), which is already per device;
- efficiency: that over the 1-GPU run's (the smallest run's, without a 1-GPU run);
- step time: time_metrics/end_to_end(s) (from the log's timestamps where tensorboard has none);
- optimizer step: HyMo's container step time (NaN check + NorMuon + CautiousAdamW, timed with
  CUDA events) and its share of the wall time (time_metrics/optimizer_step(s) and (%));
- peak memory: the largest memory/max_reserved(GiB) (and max_active) of any step, rank 0;
- first step: seconds from "Starting job" to the first step's log line (init + compile).
Resume rows (one per --resume run): the resumed losses at SAVE_STEP+1.. against the --scale
run with NGPU == --save-ngpu (the uninterrupted reference): max |dloss|, mean dloss, max and
mean |dloss| / loss, next to the reference's own step-to-step change and its drop since step 1.
With another DP degree the resumed run reads other sequences (the epoch continues on the
documents no rank has read, cut into sequences differently; hymo_recipes/titan/dataloader.py),
so it is judged against --rel-tol-data (batch noise); with the same DP degree against
--rel-tol-same (reduction order only). Both also bound the trend: how much further the resumed
loss moved over the continued steps than the reference's (--trend-tol, at least 3x the
reference's step-to-step change); a resume that re-reads sequences the model has trained on
shows up there.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from datetime import datetime
from pathlib import Path

LOSS = "loss_metrics/global_avg_loss"
TPS = "throughput(tps)"
STEP_S = "time_metrics/end_to_end(s)"
OPT_S = "time_metrics/optimizer_step(s)"
OPT_PCT = "time_metrics/optimizer_step(%)"
NORMUON_S = "time_metrics/optimizer_step_normuon(s)"
NORMUON_PCT = "time_metrics/optimizer_step_normuon(%)"
ADAMW_S = "time_metrics/optimizer_step_cautious_adamw(s)"
MAIN_CE = "loss_metrics/main_ce"
RESERVED = "memory/max_reserved(GiB)"
ACTIVE = "memory/max_active(GiB)"
SKIPPED = "optimizer/skipped_steps"

STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)\s+memory:\s*([\d.]+)GiB"
                       r".*?tps:\s*([\d,]+)")
SHAPE = re.compile(r"local batch size (\d+), global batch size (\d+), gradient accumulation "
                   r"steps (\d+), sequence length (\d+)")
DATA_FALLBACK = re.compile(r"Resuming with \d+ data-parallel ranks from a checkpoint of \d+: .*?"
                           r"(sequences consumed so far \(\d+ on rank 0\)|no rank has read yet "
                           r"\(\d+ on rank 0, in \d+ range\(s\)\))")


def read_tb(dump_folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} over every event file under DUMP_FOLDER/tb ({} if none)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted((dump_folder / "tb").rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return scalars


def read_log(path: Path) -> tuple[dict[str, dict[int, float]], dict]:
    """The step lines of a console log as scalars (plus their times), and facts about the run:
    seconds to the first step, batch shape, the dataloader fallback warning, the last error."""
    scalars: dict[str, dict[int, float]] = {}
    info: dict = {}
    if not path.is_file():
        return scalars, info
    start = None
    stamps: dict[int, datetime] = {}
    for line in path.read_text(errors="replace").splitlines():
        m = STAMP.search(line)
        when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") if m else None
        if start is None and when is not None and "Starting job" in line:
            start = when
        if (s := STEP_LINE.search(line)) is not None:
            step = int(s.group(1))
            for tag, text in ((LOSS, s.group(2)), ("grad_norm", s.group(3)),
                              (RESERVED, s.group(4)), (TPS, s.group(5).replace(",", ""))):
                scalars.setdefault(tag, {})[step] = float(text)
            if when is not None:
                stamps[step] = when
        if (s := SHAPE.search(line)) is not None:
            info["local_batch"], info["global_batch"], info["accumulation"], info["seq_len"] = (
                int(g) for g in s.groups())
        if (s := DATA_FALLBACK.search(line)) is not None:
            info["data_fallback"] = s.group(0)
        if (s := re.search(r"Finished saving the checkpoint.*?in ([\d.]+) seconds", line)):
            info.setdefault("save_s", []).append(float(s.group(1)))
        if (s := re.search(r"Finished loading the checkpoint in ([\d.]+) seconds", line)):
            info["load_s"] = float(s.group(1))
        if re.search(r"Training starts at step (\d+)", line):
            info["starts_at"] = int(re.search(r"Training starts at step (\d+)", line).group(1))
        if re.search(r"\w+(Error|Exception)\b.*:", line) and "Traceback" not in line:
            info["error"] = line.split("]:", 1)[-1].strip()[:160]
    if stamps:
        first = min(stamps)
        if start is not None:
            info["first_step_s"] = (stamps[first] - start).total_seconds()
        # step time from consecutive log lines, for steps tensorboard does not have
        scalars["log_step_s"] = {s: (stamps[s] - stamps[s - 1]).total_seconds()
                                 for s in stamps if s - 1 in stamps}
    return scalars, info


def read_run(dump_folder: Path, log: Path) -> tuple[dict[str, dict[int, float]], dict]:
    scalars = read_tb(dump_folder) if dump_folder.is_dir() else {}
    from_log, info = read_log(log)
    info["tb_steps"] = len(scalars.get(LOSS, {}))
    for tag, values in from_log.items():  # tensorboard first, the log fills the gaps
        merged = scalars.setdefault(tag, {})
        for step, value in values.items():
            merged.setdefault(step, value)
    if STEP_S in scalars or "log_step_s" in scalars:
        step_s = scalars.setdefault(STEP_S, {})
        for step, value in scalars.get("log_step_s", {}).items():
            step_s.setdefault(step, value)
    return scalars, info


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def over(scalars: dict, tag: str, steps) -> float:
    return mean([scalars[tag][s] for s in steps if s in scalars.get(tag, {})])


def fmt(value: float, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None or value != value else f"{value:>{width}{spec}}"


def summarize_scale(scalars: dict, info: dict, warmup: int, until: int) -> dict:
    steps = sorted(scalars.get(LOSS, {}))
    timed = [s for s in steps if warmup < s <= until]
    reserved = list(scalars.get(RESERVED, {}).values())
    active = list(scalars.get(ACTIVE, {}).values())
    last = steps[-1] if steps else None
    return {
        "steps": len(steps), "last_step": last, "timed": timed,
        "tps": over(scalars, TPS, timed), "step_s": over(scalars, STEP_S, timed),
        "opt_ms": 1e3 * over(scalars, OPT_S, timed), "opt_pct": over(scalars, OPT_PCT, timed),
        "normuon_ms": 1e3 * over(scalars, NORMUON_S, timed),
        "normuon_pct": over(scalars, NORMUON_PCT, timed),
        "adamw_ms": 1e3 * over(scalars, ADAMW_S, timed),
        "reserved": max(reserved) if reserved else math.nan,
        "active": max(active) if active else math.nan,
        "loss_at_until": scalars.get(LOSS, {}).get(until, math.nan),
        "skipped": scalars.get(SKIPPED, {}).get(last, math.nan) if last else math.nan,
        "first_step_s": info.get("first_step_s", math.nan),
    }


def compare_resume(ref: dict, resumed: dict, save_step: int) -> dict:
    ref_loss, res_loss = ref.get(LOSS, {}), resumed.get(LOSS, {})
    steps = sorted(s for s in res_loss if s > save_step and s in ref_loss)
    deltas = [res_loss[s] - ref_loss[s] for s in steps]
    rel = [abs(d) / abs(ref_loss[s]) for d, s in zip(deltas, steps) if ref_loss[s]]
    changes = [abs(ref_loss[s] - ref_loss[s - 1]) for s in steps if s - 1 in ref_loss]
    return {
        "steps": steps, "ref": [ref_loss[s] for s in steps],
        "resumed": [res_loss[s] for s in steps],
        "deltas": deltas,
        "max_abs": max((abs(d) for d in deltas), default=math.nan),
        "mean": mean(deltas), "max_rel": max(rel, default=math.nan), "mean_rel": mean(rel),
        "ref_change": mean(changes),
        "ref_drop": ref_loss.get(1, math.nan) - ref_loss.get(save_step, math.nan),
        "unlogged": sorted(s for s in res_loss if s <= save_step),
        # how far the loss moved over the continued steps, resumed minus reference: a resume
        # that trains differently (lr, optimizer state) shows here even when every single
        # step is within the per-step tolerance
        "trend_diff": _trend_diff(ref, resumed, LOSS, steps),
        "main_ce_trend_diff": _trend_diff(ref, resumed, MAIN_CE, steps),
    }


def _trend_diff(ref: dict, resumed: dict, tag: str, steps: list[int]) -> float:
    a, b = ref.get(tag, {}), resumed.get(tag, {})
    if not steps or any(s not in a or s not in b for s in (steps[0], steps[-1])):
        return math.nan
    return (b[steps[-1]] - b[steps[0]]) - (a[steps[-1]] - a[steps[0]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", nargs=3, action="append", default=[],
                        metavar=("NGPU", "DUMP_FOLDER", "LOG"))
    parser.add_argument("--resume", nargs=3, action="append", default=[],
                        metavar=("NGPU", "DUMP_FOLDER", "LOG"))
    parser.add_argument("--config-batch", nargs=3, action="append", default=[],
                        metavar=("NGPU", "DUMP_FOLDER", "LOG"),
                        help="a run with the config's own (accumulated) batch; means over its "
                        "steps after the first")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the means")
    parser.add_argument("--save-step", type=int, required=True)
    parser.add_argument("--save-ngpu", type=int, default=2)
    parser.add_argument("--rel-tol-data", type=float, default=0.03,
                        help="max mean |dloss|/loss when the resume reads other data")
    parser.add_argument("--rel-tol-same", type=float, default=0.01,
                        help="max mean |dloss|/loss with the same DP degree")
    parser.add_argument("--trend-tol", type=float, default=0.005,
                        help="max |change of the resumed loss over the continued steps minus the "
                        "reference's change| / loss (at least 3x the reference's mean step-to-step "
                        "change)")
    parser.add_argument("--config", default="")
    parser.add_argument("--json", type=Path, help="write every run's scalars and summary here")
    args = parser.parse_args(argv)
    if not args.scale and not args.resume and not args.config_batch:
        parser.error("no runs given")

    runs, dump = {}, {}
    for kind, specs in (("scale", args.scale), ("resume", args.resume),
                        ("config_batch", args.config_batch)):
        for n, folder, log in specs:
            scalars, info = read_run(Path(folder), Path(log))
            runs[(kind, int(n))] = (scalars, info)
            key = {"resume": f"resume_{args.save_ngpu}to{n}gpu",
                   "config_batch": f"config_batch_{n}gpu"}.get(kind, f"scale_{n}gpu")
            dump[key] = {"info": info, "scalars": {
                tag: {str(s): v for s, v in sorted(values.items())}
                for tag, values in scalars.items()}}

    ok = True
    w, until = args.warmup, args.save_step
    print(f"{args.config}: tokens/s, step and optimizer times are means over steps {w + 1}-"
          f"{until} (first {w} left out: compile, warm-up); weak scaling, the same local batch "
          "per GPU, no gradient accumulation")
    scale = {n: summarize_scale(*runs[("scale", n)], w, until)
             for kind, n in sorted(runs) if kind == "scale"}
    base_n = min((n for n in scale if scale[n]["tps"] == scale[n]["tps"]), default=None)
    header = (f"{'GPUs':>4}{'batch/GPU':>11}{'steps':>7}{'1st step':>10}{'tok/s/GPU':>11}"
              f"{'effic.':>8}{'step (s)':>10}{'opt (ms)':>10}{'opt %':>7}{'NorMuon':>9}{'NM %':>6}"
              f"{'AdamW':>7}{'peak GiB':>10}"
              f"{'active':>8}{f'loss@{until}':>10}{'skipped':>8}")
    print(header)
    print("-" * len(header))
    for n, r in scale.items():
        info = runs[("scale", n)][1]
        if not r["steps"]:
            print(f"{n:>4}  no step logged (skipped, or failed before step 1"
                  f"{': ' + info['error'] if 'error' in info else ''})")
            ok = False
            continue
        shape = (f"{info['local_batch']}x{info['seq_len']}" if "seq_len" in info else "?")
        eff = (r["tps"] / scale[base_n]["tps"] if base_n is not None else math.nan)
        print(f"{n:>4}{shape:>11}{r['steps']:>7}{fmt(r['first_step_s'], '.0f', 9)}s"
              f"{fmt(r['tps'], ',.0f', 11)}{fmt(100 * eff, '.1f', 7)}%{fmt(r['step_s'], '.3f', 10)}"
              f"{fmt(r['opt_ms'], '.1f', 10)}{fmt(r['opt_pct'], '.1f', 7)}"
              f"{fmt(r['normuon_ms'], '.1f', 9)}{fmt(r['normuon_pct'], '.1f', 6)}"
              f"{fmt(r['adamw_ms'], '.1f', 7)}"
              f"{fmt(r['reserved'], '.2f', 10)}{fmt(r['active'], '.2f', 8)}"
              f"{fmt(r['loss_at_until'], '.4f', 10)}{fmt(r['skipped'], '.0f', 8)}")
        if len(r["timed"]) < until - w:
            tb = (f", tensorboard {info['tb_steps']}" if info["tb_steps"] != r["steps"] else "")
            print(f"      NOTE: only {len(r['timed'])} timed steps ({r['steps']} logged{tb})")
        if "save_s" in info:
            print(f"      full checkpoint save(s), rank 0: "
                  f"{', '.join(f'{t:.1f}' for t in info['save_s'])} s")
        if "error" in info:
            print(f"      error in log: {info['error']}")
    if base_n is not None:
        print(f"efficiency = tokens/s per GPU over the {base_n}-GPU run's; step time includes "
              "the optimizer step; opt = the optimizer container's step (NaN check + NorMuon + "
              "CautiousAdamW), NorMuon / AdamW = its NorMuon and CautiousAdamW parts in ms, "
              "NM % = NorMuon's share of the wall time; peak = max_reserved of rank 0 (active: "
              "max_active)")

    for n in sorted(n for kind, n in runs if kind == "config_batch"):
        scalars, info = runs[("config_batch", n)]
        steps = sorted(scalars.get(LOSS, {}))
        r = summarize_scale(scalars, info, 1, steps[-1] if steps else 0)
        print(f"\nThe config's own batch on {n} GPU(s): " + (
            f"local {info.get('local_batch')}, global {info.get('global_batch')}, "
            f"{info.get('accumulation')} microbatch(es) per step; means over steps 2-{steps[-1]}:"
            if len(steps) > 1 else "fewer than 2 steps logged"
            + (f" ({info['error']})" if "error" in info else "")))
        if len(steps) > 1:
            print(f"    step {fmt(r['step_s'], '.2f', 1)} s, tok/s/GPU {fmt(r['tps'], ',.0f', 1)}, "
                  f"optimizer step {fmt(r['opt_ms'], '.1f', 1)} ms ({fmt(r['opt_pct'], '.2f', 1)} %"
                  f"), NorMuon {fmt(r['normuon_ms'], '.1f', 1)} ms "
                  f"({fmt(r['normuon_pct'], '.2f', 1)} % of the step), CautiousAdamW "
                  f"{fmt(r['adamw_ms'], '.1f', 1)} ms, peak {fmt(r['reserved'], '.2f', 1)} GiB")
        else:
            ok = False

    resumes = sorted(n for kind, n in runs if kind == "resume")
    if resumes:
        ref_key = ("scale", args.save_ngpu)
        print(f"\nResume of the {args.save_ngpu}-GPU checkpoint of step {until}: losses of steps "
              f"{until + 1}.. against the uninterrupted {args.save_ngpu}-GPU run")
        if ref_key not in runs or not runs[ref_key][0].get(LOSS):
            print(f"  no reference: the {args.save_ngpu}-GPU run logged no step")
            return 1
        ref = runs[ref_key][0]
        for n in resumes:
            scalars, info = runs[("resume", n)]
            if not scalars and not info.get("tb_steps") and "starts_at" not in info:
                print(f"- on {n} GPU(s): not run (skipped, see the phases above) or no log")
                ok = False
                continue
            c = compare_resume(ref, scalars, until)
            dump[f"resume_{args.save_ngpu}to{n}gpu"]["comparison"] = c
            shape = (f"local batch {info['local_batch']}, global {info['global_batch']}, "
                     f"{info['accumulation']} microbatch(es)" if "accumulation" in info else "")
            print(f"- on {n} GPU(s) ({shape}; checkpoint loaded in "
                  f"{fmt(info.get('load_s', math.nan), '.1f', 1)} s, first step after "
                  f"{fmt(info.get('first_step_s', math.nan), '.0f', 1)} s, "
                  f"tok/s/GPU {fmt(over(scalars, TPS, c['steps'][1:]), ',.0f', 1)}, "
                  f"opt step {fmt(1e3 * over(scalars, OPT_S, c['steps'][1:]), '.1f', 1)} ms"
                  f" / {fmt(over(scalars, OPT_PCT, c['steps'][1:]), '.1f', 1)} %):")
            if not c["steps"]:
                print(f"    no step after {until} in both runs"
                      f"{': ' + info['error'] if 'error' in info else ''}")
                ok = False
                continue
            if info.get("starts_at") not in (None, until + 1) or c["unlogged"]:
                print(f"    WARNING: started at step {info.get('starts_at')}, not {until + 1}: "
                      "the checkpoint was not loaded")
                ok = False
            for s, a, b, d in zip(c["steps"], c["ref"], c["resumed"], c["deltas"]):
                print(f"    step {s:>3}: reference {a:.4f}  resumed {b:.4f}  dloss {d:+.4f}")
            same_dp = n == args.save_ngpu
            tol = args.rel_tol_same if same_dp else args.rel_tol_data
            print(f"    max |dloss| {c['max_abs']:.4f}, mean dloss {c['mean']:+.4f}, "
                  f"max |dloss|/loss {100 * c['max_rel']:.2f} %, mean {100 * c['mean_rel']:.2f} %"
                  f" (reference: mean step-to-step change {c['ref_change']:.4f}, drop since "
                  f"step 1 {c['ref_drop']:.4f})")
            if same_dp:
                print("    data: same DP degree, same sequences; differences come from "
                      "reduction order and gradient accumulation only")
            else:
                print("    data: DP degree changed, so the resumed run reads OTHER sequences "
                      "(hymo_recipes/titan/dataloader.py: the epoch continues on the documents no "
                      "rank has read, or, without document positions, each rank restarts its "
                      "shard and skips its share of the sequences consumed); dloss includes "
                      "batch noise" + ("" if "data_fallback" in info
                                       else "; WARNING: the loader's resume warning is not in "
                                       "the log"))
            if "data_fallback" in info:
                print(f"    log: {info['data_fallback']}")
            finite = all(x == x and abs(x) != math.inf for x in c["resumed"])
            trend_rel = abs(c["trend_diff"]) / abs(c["ref"][0])
            # the allowance grows with the reference's own step-to-step noise (short CPU runs)
            trend_tol = max(args.trend_tol, 3 * c["ref_change"] / abs(c["ref"][0]))
            print(f"    trend: over steps {c['steps'][0]}-{c['steps'][-1]} the resumed loss moved "
                  f"{c['trend_diff']:+.4f} more than the reference's ({100 * trend_rel:.2f} % of "
                  f"the loss; main CE "
                  f"{'-' if c['main_ce_trend_diff'] != c['main_ce_trend_diff'] else format(c['main_ce_trend_diff'], '+.4f')})")
            within = finite and c["mean_rel"] <= tol and trend_rel <= trend_tol
            print(f"    verdict: {'within' if within else 'OUTSIDE'} tolerance (mean |dloss|/loss"
                  f" <= {100 * tol:.1f} %, |trend| <= {100 * trend_tol:.2f} %"
                  f"{', all finite' if finite else '; non-finite losses'})")
            ok = ok and within
            if len(c["steps"]) < len([s for s in ref.get(LOSS, {}) if s > until]):
                print(f"    NOTE: {len(c['steps'])} steps compared; the reference has "
                      f"{len([s for s in ref[LOSS] if s > until])} after step {until}")
    if args.json:
        args.json.write_text(json.dumps(dump, indent=None, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
