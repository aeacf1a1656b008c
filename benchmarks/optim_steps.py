"""Steps to a loss: NorMuon + CautiousAdamW against AdamW with its lr tuned, same tokens and seeds.

    python -m benchmarks.optim_steps                       # GPU: hymo_small, 600 steps, tune then 3 seeds
    python -m benchmarks.optim_steps --normuon-lrs 0.04:2.4e-3 0.04:2.4e-3:moe --cautious-lrs 2.4e-3
    python -m benchmarks.optim_steps --report-only         # the table and plot from the stored runs
    python -m benchmarks.optim_steps --dry                 # CPU: 4 layers at width 64, 12 steps
    for i in 0 1 2 3; do python -m benchmarks.optim_steps --shard $i/4 & done; wait   # 4 processes, one GPU

Each run is ``benchmarks.mup_lr_sweep.run_one`` in this process: the flavor (hymo_small's
shape, muP off) built and initialised with the run's seed, HyMo's optimizers from its own builder
(``optimizers_for_part``: the partition table for "NorMuon" and "CautiousAdamW", TorchTitan's
AdamW over every parameter for "AdamW"), HyMo's warmup-stable-decay schedule (2 % / 83 % / 15 %),
clipping at ``--max-norm``, fp32 parameters and TF32 matmuls on the GPU (no compile), and
``--steps`` steps of ``--batch`` × ``--seq`` Brown tokens in the same order for every run (the
training split read again from its start when the run needs more). The per-step main-head
cross-entropy is kept.

A recipe is (optimizer, lr, NorMuon lr, MoE on NorMuon): ``lr`` is AdamW's, or CautiousAdamW's
(for "NorMuon" the lr of the table's CautiousAdamW groups: embedding, norms, gates, and the MoE
router and experts unless they are on NorMuon).

1. Tuning, on the first seed: AdamW at each of ``--adamw-lrs``; NorMuon + CautiousAdamW at each
   of ``--normuon-mults`` × the seed's lrs (NorMuon 0.02, CautiousAdamW 3e-4, the MoE on
   CautiousAdamW; both scaled together) and at each pair of
   ``--normuon-lrs NORMUON_LR:LR[:moe]`` (set apart; ``:moe`` puts the MoE on NorMuon);
   CautiousAdamW over every parameter at each of ``--cautious-lrs`` (a diagnostic: the cautious
   AdamW and the table's decays without NorMuon). The best AdamW and the best NorMuon recipe =
   the lowest final loss (mean main-head CE of the last tenth of the steps) among the stored
   runs of the first seed.
2. Both best recipes at every seed of ``--seeds``, and the shipped recipe (job_config's
   defaults) and the seed's too.
3. The tuned NorMuon recipe at every seed for fewer steps: ``--fractions`` of ``--steps``, each
   run its own warmup-stable-decay schedule over its steps (the first batches of the same order).
4. The target = tuned AdamW's held-out CE after ``--steps`` (mean over the seeds; the held-out
   batch is the same for every run). Steps needed = the fewest run steps at which the tuned
   NorMuon recipe's mean held-out CE is at or below it; ratio = those over ``--steps``. The
   issue's goal: ≤ 0.8. (Not the first step of a full-length curve below AdamW's final loss:
   under WSD most of a run's last drop comes with its decay, and the per-step training loss
   follows the difficulty of the batch order, so a curve crosses a level at a point that says
   little about the steps a run needs.)

Every finished run is appended to ``<out>.json`` (a call cut by its time limit resumes; with
``--shard I/N`` N processes of one call take every N-th run of each phase each and append to the
same file under a lock; a phase starts once the one before is stored, so run the shards again), then
``<out>.md`` (the tuning table, the per-seed table, the shorter runs' table and the ratio) and ``<out>.png``
(the smoothed training curves of the full-length seeded runs; held-out CE against run steps).
Exit 0 if the ratio is ≤ ``--goal``, 1 otherwise or when runs are missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from benchmarks.mup_coord_check import optimizer_config
from benchmarks.mup_lr_sweep import REPO, append_run, brown_windows, run_device, run_one, shard_arg, stored_runs
from hymo_recipes.model import hymo_flavors
from hymo_recipes.titan.job_config import Optimizer as _OptimizerFields


def _lr(x: float) -> float:
    """An lr as stored and compared: 6 significant digits (3e-4 × 8 and 2.4e-3 are one lr)."""
    return float(f"{x:.6g}")


class Recipe(NamedTuple):
    optimizer: str  # "AdamW", "CautiousAdamW" or "NorMuon"
    lr: float  # AdamW's, or CautiousAdamW's (for NorMuon: its CautiousAdamW groups')
    normuon_lr: float | None = None
    moe_on_normuon: bool = False

    def label(self) -> str:
        if self.optimizer != "NorMuon":
            return f"{self.optimizer} {self.lr:g}"
        return f"NorMuon {self.normuon_lr:g} + CautiousAdamW {self.lr:g}" + (", MoE on NorMuon" if
                                                                              self.moe_on_normuon else "")

    def config(self, dry: bool):
        if self.optimizer != "NorMuon":
            return optimizer_config(self.optimizer, lr=self.lr)
        return optimizer_config("NorMuon", lr=self.lr, normuon_lr=self.normuon_lr, moe_on_normuon=self.moe_on_normuon,
                                normuon_ortho_dtype="float32" if dry else "bfloat16")


_FIELDS = _OptimizerFields()
SHIPPED = Recipe("NorMuon", _lr(_FIELDS.lr), _lr(_FIELDS.normuon_lr), _FIELDS.moe_on_normuon)
# the seed's recipe (DESIGN.md §3): the MoE on CautiousAdamW at 3e-4; --normuon-mults scale it
SEED = Recipe("NorMuon", 3e-4, 0.02, False)
ROW_NAMES = {"adamw": "AdamW (tuned)", "normuon": "NorMuon + CautiousAdamW (tuned)",
             "shipped": "NorMuon + CautiousAdamW (shipped)", "seed": "NorMuon + CautiousAdamW (the seed's)"}


def recipe_of(r: dict) -> Recipe:
    return Recipe(r["optimizer"], r["lr"], r.get("normuon_lr"), r.get("moe_on_normuon", False))


def run_key(r: dict) -> tuple:
    return (*recipe_of(r), r["run_steps"], r["seed"])


def normuon_pair(spec: str) -> Recipe:
    """``--normuon-lrs NORMUON_LR:LR[:moe]`` -> its NorMuon recipe."""
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "moe"):
            raise ValueError
        n, a = float(parts[0]), float(parts[1])
        if not (n > 0 and a > 0):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--normuon-lrs {spec!r}: NORMUON_LR:LR or NORMUON_LR:LR:moe, both > 0") from None
    return Recipe("NorMuon", _lr(a), _lr(n), len(parts) == 3)


def trailing_mean(curve: list[float], window: int) -> list[float]:
    """[mean of curve[max(0, i - window + 1): i + 1] for every i]."""
    out, acc = [], 0.0
    for i, v in enumerate(curve):
        acc += v
        if i >= window:
            acc -= curve[i - window]
        out.append(acc / min(i + 1, window))
    return out


def best(results: list[dict], optimizer: str, seed: int) -> dict | None:
    """The stored run of ``optimizer`` (any of its recipes) at ``seed`` with the lowest final loss."""
    runs = [r for r in results if r["optimizer"] == optimizer and r["seed"] == seed and math.isfinite(r["final"])]
    return min(runs, key=lambda r: r["final"]) if runs else None


def _row(recipe: Recipe, runs: list[dict]) -> dict:
    return dict(recipe=recipe, runs=runs, final=statistics.fmean(r["final"] for r in runs),
                heldout=statistics.fmean(r["heldout"] for r in runs),
                seconds=statistics.fmean(r["seconds"] for r in runs))


def verdict(results: list[dict], seeds: list[int], steps: int, lengths: list[int]) -> dict | None:
    """{"adamw", "normuon", "shipped", "seed": rows of full-length runs, "lengths": {run steps: row of the
    tuned NorMuon recipe}, "target", "needed", "ratio"} from the stored runs, or None if some are
    missing. The target is tuned AdamW's held-out CE after ``steps`` (mean over the seeds);
    "needed" the fewest run steps (of ``lengths`` and ``steps``) at which the tuned NorMuon
    recipe's mean held-out CE is at or below it (None: not even at ``steps``)."""
    full = [r for r in results if r["run_steps"] == steps]
    tuned = {name: best(full, name, seeds[0]) for name in ("AdamW", "NorMuon")}
    if None in tuned.values():
        return None
    by_key = {run_key(r): r for r in results}
    rows = {}
    for label, recipe in (("adamw", recipe_of(tuned["AdamW"])), ("normuon", recipe_of(tuned["NorMuon"])),
                          ("shipped", SHIPPED), ("seed", SEED)):
        runs = [by_key.get((*recipe, steps, s)) for s in seeds]
        if None in runs:
            return None
        rows[label] = _row(recipe, runs)
    by_length = {}
    for n in sorted(set(lengths) | {steps}):
        runs = [by_key.get((*rows["normuon"]["recipe"], n, s)) for s in seeds]
        if None in runs:
            return None
        by_length[n] = _row(rows["normuon"]["recipe"], runs)
    target = rows["adamw"]["heldout"]
    needed = next((n for n, row in by_length.items() if row["heldout"] <= target), None)
    return dict(rows, lengths=by_length, target=target, needed=needed,
                ratio=None if needed is None else needed / steps)


def markdown(results: list[dict], seeds: list[int], steps: int, lengths: list[int], meta: str) -> str:
    window = max(1, steps // 10)
    lines = ["# NorMuon + CautiousAdamW against tuned AdamW: steps to AdamW's loss", "", meta, "",
             f"## Tuning (seed {seeds[0]}, {steps} steps): final main-head CE (mean of the last {window} steps), "
             "held-out CE", "", "| recipe | final | held-out | seconds |", "|---|---|---|---|"]
    for r in sorted((r for r in results if r["seed"] == seeds[0] and r["run_steps"] == steps),
                    key=lambda r: (r["optimizer"], r.get("moe_on_normuon", False), r.get("normuon_lr") or 0, r["lr"])):
        lines.append(f"| {recipe_of(r).label()} | {r['final']:.4f} | {r['heldout']:.4f} | {r['seconds']:.0f} |")
    v = verdict(results, seeds, steps, lengths)
    if v is None:
        lines += ["", "Seeded or shorter runs missing: no verdict yet."]
        return "\n".join(lines)
    lines += ["", f"## Seeds {seeds}, {steps} steps (means over the seeds)", "",
              "| run | recipe | final | held-out, per seed | held-out | seconds per run |", "|---|---|---|---|---|---|"]
    for label, name in ROW_NAMES.items():
        row = v[label]
        per_seed = ", ".join(f"{r['heldout']:.4f}" for r in row["runs"])
        lines.append(f"| {name} | {row['recipe'].label()} | {row['final']:.4f} | {per_seed} | {row['heldout']:.4f} | "
                     f"{row['seconds']:.0f} |")
    lines += ["", f"## The tuned NorMuon recipe trained for fewer steps (each run its own schedule over its "
              f"steps): held-out CE against tuned AdamW's after {steps} steps ({v['target']:.4f})", "",
              "| run steps | fraction | held-out, per seed | held-out | at or below AdamW's |", "|---|---|---|---|---|"]
    for n, row in v["lengths"].items():
        per_seed = ", ".join(f"{r['heldout']:.4f}" for r in row["runs"])
        lines.append(f"| {n} | {n / steps:.2f} | {per_seed} | {row['heldout']:.4f} | "
                     f"{'yes' if row['heldout'] <= v['target'] else 'no'} |")
    ratio = "not reached" if v["ratio"] is None else f"{v['ratio']:.2f}"
    lines += ["", f"Steps NorMuon + CautiousAdamW (tuned) needs to reach tuned AdamW's held-out CE, over AdamW's "
              f"steps: **{ratio}** (the shortest run measured that gets there; goal ≤ 0.8)."]
    return "\n".join(lines)


def plot(results: list[dict], seeds: list[int], steps: int, lengths: list[int], path: Path) -> bool:
    """Left: the full-length seeded runs' training CE (trailing mean of a tenth of the steps);
    right: the tuned NorMuon recipe's held-out CE against its run steps, beside tuned AdamW's."""
    v = verdict(results, seeds, steps, lengths)
    try:
        import matplotlib
    except ImportError:
        return False
    if v is None:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, steps // 10)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn = set()
    for label, color in (("adamw", "tab:blue"), ("normuon", "tab:red"), ("shipped", "tab:purple"),
                         ("seed", "tab:orange")):
        row = v[label]
        if row["recipe"] in drawn:
            continue  # the same recipe as a row before (the shipped one is the tuned one)
        drawn.add(row["recipe"])
        tags = [n.split("(")[1].rstrip(")") for n, r in ((ROW_NAMES[k], v[k]["recipe"]) for k in ROW_NAMES)
                if r == row["recipe"]]
        for i, r in enumerate(row["runs"]):
            ax.plot(range(1, len(r["curve"]) + 1), trailing_mean(r["curve"], window), color=color, alpha=0.8,
                    lw=1, label=f"{row['recipe'].label()} ({', '.join(tags)})" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training main-head CE (trailing mean of {window})")
    ax.set_ylim(v["normuon"]["final"] - 0.5, v["normuon"]["final"] + 2.5)
    ax.legend(fontsize=8)
    ns = list(v["lengths"])
    for i, s in enumerate(seeds):
        bx.plot(ns, [v["lengths"][n]["runs"][i]["heldout"] for n in ns], "o", color="tab:red", alpha=0.4,
                label="per seed" if i == 0 else None)
    bx.plot(ns, [v["lengths"][n]["heldout"] for n in ns], "-o", color="tab:red", label=v["normuon"]["recipe"].label())
    bx.axhline(v["target"], color="tab:blue", ls="--", lw=1, label=f"AdamW (tuned) after {steps} steps")
    bx.axvline(0.8 * steps, color="gray", ls=":", lw=1, label="0.8 x the steps")
    bx.set_xlabel("run steps (each run its own schedule)")
    bx.set_ylabel("held-out main-head CE (mean over seeds)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="CPU: 4 layers at width 64, 12 steps of 2 x 32")
    p.add_argument("--flavor", default="small", choices=sorted(hymo_flavors))
    p.add_argument("--steps", type=int, default=None, help="default 600")
    p.add_argument("--batch", type=int, default=None, help="default 8")
    p.add_argument("--seq", type=int, default=None, help="default 512")
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=None, help="default 3e-4 6e-4 1.2e-3 2.4e-3 4.8e-3")
    p.add_argument("--normuon-mults", type=float, nargs="+", default=None,
                   help="NorMuon recipes: both of the seed's lrs times each (default 0.5 1 2 4 8 16)")
    p.add_argument("--normuon-lrs", type=normuon_pair, nargs="+", default=[], metavar="NORMUON_LR:LR[:moe]",
                   help="more NorMuon recipes, the two lrs set apart (':moe': the MoE on NorMuon too)")
    p.add_argument("--cautious-lrs", type=float, nargs="+", default=[],
                   help="CautiousAdamW over every parameter at each lr (tuning seed only)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (the first tunes)")
    p.add_argument("--fractions", type=float, nargs="+", default=None,
                   help="shorter runs of the tuned NorMuon recipe, as fractions of --steps (default 0.5 0.65 0.8)")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--goal", type=float, default=0.8)
    p.add_argument("--out", default="benchmarks/optim_steps", help="output prefix (.json, .md, .png)")
    p.add_argument("--report-only", action="store_true", help="write .md and .png from the stored runs; run nothing")
    p.add_argument("--shard", type=shard_arg, default=(0, 1), metavar="I/N",
                   help="run every N-th run of each phase from the I-th on (those not stored yet; N processes of one "
                        "call share the GPU and one .json); each phase (tuning, seeds, shorter runs) starts once "
                        "every shard's runs of the one before are in")
    a = p.parse_args(argv)
    dry = a.dry
    steps = a.steps or (12 if dry else 600)
    batch, seq = a.batch or (2 if dry else 8), a.seq or (32 if dry else 512)
    adamw_lrs = a.adamw_lrs or ([1e-3, 4e-3] if dry else [3e-4, 6e-4, 1.2e-3, 2.4e-3, 4.8e-3])
    # up to x 16 of the seed's lrs: 200-step muP sweeps at this batch found x 8 best (benchmarks/mup_lr_sweep.md)
    mults = a.normuon_mults or ([1.0, 2.0] if dry else [0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
    seeds = a.seeds or ([0, 1] if dry else [0, 1, 2])
    fractions = a.fractions or ([0.5] if dry else [0.5, 0.65, 0.8])
    if not all(0 < f < 1 for f in fractions):
        p.error(f"--fractions {fractions}: each between 0 and 1")
    lengths = sorted({max(1, round(f * steps)) for f in fractions})
    device = run_device(p, dry, a.report_only)

    from hymo_recipes.titan.datasets import load_tokenizer

    tokenizer_dir, data_dir = REPO / "assets" / "tokenizer", REPO / "data" / "brown"
    vocab = load_tokenizer(str(tokenizer_dir)).get_vocab_size()
    overrides = dict(vocab_size=vocab, max_seq_len=max(seq, 16), mup_base_width=0,
                     gdn_backend="triton" if device.type == "cuda" else "torch_chunk")
    if dry:
        overrides.update(dim=64, n_layers=4, mla_layers=(3,), nope_layers=(), gdn_n_heads=2, n_heads=2, n_kv_heads=1,
                         q_lora_rank=32, kv_lora_rank=32, moe_inter_dim=64, mtp_inter_dim=64)
    args = dataclasses.replace(hymo_flavors[a.flavor], **overrides)
    setting = dict(flavor=a.flavor, steps=steps, batch=batch, seq=seq, max_norm=a.max_norm, device=device.type,
                   dry=dry)

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    store = out.with_suffix(".json")
    results = [r for r in stored_runs(store) if r["setting"] == setting]
    machine = None if a.report_only else (
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}")
    t0 = time.perf_counter()
    if not a.report_only:
        batches = brown_windows("train", steps * batch, seq, tokenizer_dir, data_dir, repeat=True)
        heldout = brown_windows("validation", batch, seq, tokenizer_dir, data_dir)

        shard, shards = a.shard

        def run_all(keys: list[tuple[Recipe, int, int]]) -> list[dict]:
            """This shard's share of ``keys`` (recipe, run steps, seed; every N-th from the I-th:
            fixed, so that a resumed call picks up where it stopped), those not stored yet; then
            every stored run."""
            have = {run_key(r) for r in results}
            for recipe, n, seed in [k for k in keys[shard::shards] if (*k[0], *k[1:]) not in have]:
                r = run_one(args, batches, heldout, recipe.config(dry), steps=n, batch=batch, max_norm=a.max_norm,
                            seed=seed, device=device, curve=True)
                append_run(store, dict(recipe._asdict(), run_steps=n, seed=seed, setting=setting, machine=machine,
                                       **r))
                print(f"optim_steps: {recipe.label()}, {n} steps, seed {seed}: final {r['final']:.4f}, held-out "
                      f"{r['heldout']:.4f} ({r['seconds']:.0f} s)", flush=True)
            return [r for r in stored_runs(store) if r["setting"] == setting]  # the other shards' runs too

        def stored(keys) -> bool:
            return {(*k[0], *k[1:]) for k in keys} <= {run_key(r) for r in results}

        recipes = ([Recipe("AdamW", _lr(lr)) for lr in adamw_lrs]
                   + [Recipe("NorMuon", _lr(SEED.lr * m), _lr(SEED.normuon_lr * m), SEED.moe_on_normuon)
                      for m in mults]
                   + a.normuon_lrs + [Recipe("CautiousAdamW", _lr(lr)) for lr in a.cautious_lrs])
        recipes = list(dict.fromkeys(recipes + [SHIPPED, SEED]))  # both are always rows
        tuning = [(recipe, steps, seeds[0]) for recipe in recipes]
        results = run_all(tuning)
        waiting = "the tuning runs"
        if stored(tuning):
            full = [r for r in results if r["run_steps"] == steps]
            bests = [best(full, name, seeds[0]) for name in ("AdamW", "NorMuon")]
            if None in bests:
                sys.exit("optim_steps: every tuning run of AdamW or of NorMuon diverged: widen the lr grids")
            tuned = [recipe_of(r) for r in bests] + [SHIPPED, SEED]
            seeded = [(recipe, steps, seed) for seed in seeds[1:] for recipe in dict.fromkeys(tuned)]
            results = run_all(seeded)
            waiting = "the seeded runs"
            if stored(seeded):
                results = run_all([(tuned[1], n, seed) for n in lengths for seed in seeds])
                waiting = None
        if waiting:
            print(f"optim_steps: {waiting} of other shards are not all stored yet: the next phase waits for the next "
                  "call", flush=True)

    machines = "; ".join(sorted({r.get("machine") or "GPU" for r in results})) or "no runs"
    meta = (f"Flavor {a.flavor} ({args.n_layers} layers, dim {args.dim}, vocab {vocab}), {steps} steps of {batch} x "
            f"{seq} Brown tokens (the same order for every run), WSD 2/83/15 %, clipping {a.max_norm}; shipped: "
            f"{SHIPPED.label()}; the seed's: {SEED.label()}; "
            f"{machines}; this call "
            f"{time.perf_counter() - t0:.0f} s. Command: python -m benchmarks.optim_steps "
            + " ".join(argv if argv is not None else sys.argv[1:]))
    text = markdown(results, seeds, steps, lengths, meta)
    out.with_suffix(".md").write_text(text + "\n")
    plotted = plot(results, seeds, steps, lengths, out.with_suffix(".png"))
    print(text)
    print(f"wrote {store}, {out.with_suffix('.md')}" + (f" and {out.with_suffix('.png')}" if plotted else ""))
    v = verdict(results, seeds, steps, lengths)
    return 0 if v is not None and v["ratio"] is not None and v["ratio"] <= a.goal else 1


if __name__ == "__main__":
    sys.exit(main())
