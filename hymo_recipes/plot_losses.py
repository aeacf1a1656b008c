"""Loss curves of a run from its tensorboard events: ``python -m hymo_recipes.plot_losses``.

    python -m hymo_recipes.plot_losses outputs/debug_model -o loss_curves.png

The path is a dump folder (its ``tb/`` is searched), a tensorboard folder or one event file;
every ``events.out.tfevents.*`` below it is read with tensorboard's ``EventAccumulator``. One
PNG shows, against the training step, the cross-entropy of each head as HyMo logs it
(hymo_recipes/titan/metrics.py, validate.py):

- the training loss, the main head's cross-entropy (``loss_metrics/main_ce``);
- each MTP head's cross-entropy (``loss_metrics/mtp_<k>_ce``; head k predicts token t+1+k);
- the held-out loss, the main head's cross-entropy on the validation split
  (``validation_metrics/loss``);
- with ``--objective``, TorchTitan's logged loss too (``loss_metrics/global_avg_loss``: the
  training objective, main + weighted MTP, on a higher scale).

A dump folder holds one tensorboard folder per launch (``tb/<YYYYmmdd-HHMM>``), so a resumed run
is several files: they are merged in the order they were written, a step logged twice (a resume
from a checkpoint before the last logged step) taking the later launch's value. With
``[metrics] save_for_all_ranks`` each rank writes its own folder (``rank_<N>``); the losses are
global, so only the lowest rank's files are read.

Needs matplotlib (``pip install 'hymo-recipes[plot]'``, or the dev extra). Bad input (no such
path, no event files, event files without loss tags, an unreadable file) ends with one line
``plot_losses: error: ...`` and exit code 2; what was plotted goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

MAIN = "loss_metrics/main_ce"
MTP = re.compile(r"loss_metrics/mtp_(\d+)_ce")
HELD_OUT = "validation_metrics/loss"
OBJECTIVE = "loss_metrics/global_avg_loss"
EVENTS = "events.out.tfevents."


class PlotError(Exception):
    """A bad input, reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + error
        raise PlotError(f"{message} (python -m hymo_recipes.plot_losses --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m hymo_recipes.plot_losses", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a dump folder, a tensorboard folder (e.g. <dump_folder>/tb) or an event file")
    p.add_argument("-o", "--output", default="loss_curves.png", help="the PNG to write (default: loss_curves.png)")
    p.add_argument("--title", default=None, help="the plot's title (default: the path)")
    p.add_argument("--objective", action="store_true",
                   help="also draw TorchTitan's logged loss (main + weighted MTP, the training objective)")
    return p


def event_files(path: str) -> list[str]:
    """The event files of `path` (a file, or every one below a folder), only the lowest rank's
    where ranks wrote their own folders (``rank_<N>``)."""
    if not os.path.exists(path):
        raise PlotError(f"{path} does not exist")
    if os.path.isfile(path):
        if not os.path.basename(path).startswith(EVENTS):
            raise PlotError(f"{path} is not a tensorboard event file (events.out.tfevents.*)")
        return [path]
    files = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                   if name.startswith(EVENTS))
    if not files:
        raise PlotError(f"no tensorboard event files (events.out.tfevents.*) under {path}: was the run started "
                        "with [metrics] enable_tensorboard = true?")

    def rank(file: str) -> int | None:
        parts = os.path.relpath(file, path).split(os.sep)
        ranks = [int(m.group(1)) for part in parts if (m := re.fullmatch(r"rank_(\d+)", part))]
        return ranks[-1] if ranks else None

    ranks = {rank(f) for f in files} - {None}
    if ranks:
        files = [f for f in files if rank(f) in (None, min(ranks))]
    return files


def read_scalars(files: list[str]) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} over `files`, merged in the order they were written (a later
    file's value of a step replaces an earlier one's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = []
    for file in files:
        try:
            acc = EventAccumulator(file, size_guidance={"scalars": 0})  # 0: keep every event
            acc.Reload()
            scalars = {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}
        except Exception as e:  # noqa: BLE001 - whatever the reader raises, the file is unreadable
            raise PlotError(f"cannot read the event file {file}: {type(e).__name__}: {e}") from None
        start = min((ev.wall_time for evs in scalars.values() for ev in evs), default=float("inf"))
        runs.append((start, file, scalars))
    merged: dict[str, dict[int, float]] = {}
    for _, _, scalars in sorted(runs, key=lambda r: (r[0], r[1])):
        for tag, evs in scalars.items():
            merged.setdefault(tag, {}).update((ev.step, ev.value) for ev in evs)
    return merged


def curves(scalars: dict[str, dict[int, float]], objective: bool) -> list[tuple[str, str, dict[int, float]]]:
    """[(tag, label, {step: value})] in drawing order: training loss, MTP heads, held-out loss,
    (objective)."""
    heads = sorted((int(m.group(1)), tag) for tag in scalars if (m := MTP.fullmatch(tag)))
    out = []
    if MAIN in scalars:
        out.append((MAIN, "training loss (main head)", scalars[MAIN]))
    out += [(tag, f"MTP head {k} (token t+{k + 1})", scalars[tag]) for k, tag in heads]
    if HELD_OUT in scalars:
        out.append((HELD_OUT, "held-out loss (main head, validation split)", scalars[HELD_OUT]))
    if objective and OBJECTIVE in scalars:
        out.append((OBJECTIVE, "training objective (main + weighted MTP)", scalars[OBJECTIVE]))
    return out


def import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("matplotlib is not installed: pip install 'hymo-recipes[plot]' (or pip install matplotlib)") \
            from None
    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    return plt


def plot(lines: list[tuple[str, str, dict[int, float]]], output: str, title: str) -> None:
    plt = import_pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    mtp_colors = plt.get_cmap("Oranges")
    n_heads = sum(1 for tag, _, _ in lines if MTP.fullmatch(tag))
    for tag, label, points in lines:
        steps = sorted(points)
        values = [points[s] for s in steps]
        if tag == MAIN:
            ax.plot(steps, values, color="tab:blue", linewidth=1.8, label=label)
        elif m := MTP.fullmatch(tag):
            k = int(m.group(1))
            ax.plot(steps, values, color=mtp_colors(0.45 + 0.45 * k / max(n_heads, 1)), linewidth=1.2,
                    linestyle="--", label=label)
        elif tag == HELD_OUT:
            ax.plot(steps, values, color="black", linewidth=1.2, marker="o", markersize=5, label=label)
        else:
            ax.plot(steps, values, color="tab:gray", linewidth=1.0, linestyle=":", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        if parent := os.path.dirname(output):
            os.makedirs(parent, exist_ok=True)
        fig.savefig(output)
    except OSError as e:
        raise PlotError(f"cannot write {output}: {e}") from None
    finally:
        plt.close(fig)


def run(opts) -> None:
    files = event_files(opts.path)
    scalars = read_scalars(files)
    lines = curves(scalars, opts.objective)
    if not lines:
        raise PlotError(f"the {len(files)} event file(s) under {opts.path} hold none of the loss tags ({MAIN}, "
                        f"loss_metrics/mtp_<k>_ce, {HELD_OUT}): not a HyMo run's tensorboard folder?")
    plot(lines, opts.output, opts.title or opts.path)
    last = ", ".join(f"{label.split(' (')[0]} {points[max(points)]:.4f} at step {max(points)}"
                     for _, label, points in lines)
    print(f"plot_losses: wrote {opts.output} from {len(files)} event file(s); last values: {last}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        run(build_parser().parse_args(argv))
    except PlotError as e:
        print(f"plot_losses: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
