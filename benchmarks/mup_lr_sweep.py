"""muP learning-rate transfer for HyMo: final loss against lr at several widths, with and without muP.

    python -m benchmarks.mup_lr_sweep                                  # GPU: widths 128..1024, 5 lrs, 200 steps
    python -m benchmarks.mup_lr_sweep --parametrizations muP --out benchmarks/mup_lr_sweep   # one half per call
    python -m benchmarks.mup_lr_sweep --dry                            # CPU: 2 tiny widths, 3 lrs, 4 steps
    for i in 0 1 2 3; do python -m benchmarks.mup_lr_sweep --shard $i/4 & done; wait   # 4 processes, one GPU

For each parametrization (muP with base width = the narrowest width; the standard
parametrization "SP" = muP off), each width (``hymo_recipes.mup.scale_args_to_width`` of the
flavor: dim, head counts, LoRA ranks and inner dims scaled together; head dims, depth, layout and
expert count kept) and each lr multiplier m, one run in this process: the model built and
initialised with seed ``--seed``, HyMo's optimizers from its own builder
(``hymo_recipes.titan.optimizers.optimizers_for_part``: the partition table, muP's lr
multipliers when on) at m × the configured lrs (NorMuon ``--normuon-lr``, (Cautious)AdamW
``--lr``), HyMo's warmup-stable-decay schedule (2 % / 83 % / 15 %, linear to 0.05), gradient
clipping at ``--max-norm``, and ``--steps`` steps of ``--batch`` × ``--seq`` tokens of Brown
(the same batches in the same order for every run: consecutive windows of the training split,
each document framed by BOS/EOS as training frames it). The loss is the training loss (main
head plus the MTP heads at the flavor's weights). Per run: the mean main-head cross-entropy of
the last 10 % of the steps (``final``) and the main-head cross-entropy on a fixed held-out batch
of the validation split after the last step (``heldout``). A run whose loss went non-finite
records inf. fp32 parameters; on the GPU the Triton GDN kernel and TF32 matmuls, no compile.

Every finished run is appended to ``<out>.json`` (a run already there, same settings, is not
repeated: a call cut by a time limit resumes; ``--shard I/N`` gives N processes of one call
every N-th run of the grid each, appended to the same file under a lock), then ``<out>.md`` (per
parametrization a table of ``final`` by width and lr, the best lr per width and its spread in
grid points) and ``<out>.png`` (final loss against lr, one line per width, a panel per
parametrization).

Criterion (the issue's): under muP the best lr moves by at most one grid point from the narrowest
to the widest width; without muP it moves. Exit 0 when both parametrizations ran, muP's best lr
spans at most one grid point and SP's at least one; 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.mup_coord_check import model_args_at, optimizer_config
from hymo_recipes.model import HymoModel, hymo_flavors
from hymo_recipes.model.mtp import shift_for_head
from hymo_recipes.scheduler import WSDSchedule
from hymo_recipes.titan.optimizers import optimizers_for_part

REPO = Path(__file__).resolve().parents[1]
PARAMETRIZATIONS = ("muP", "SP")


def brown_windows(split: str, n: int, seq: int, tokenizer_dir: Path, data_dir: Path, repeat: bool = False
                  ) -> torch.Tensor:
    """The first ``n`` windows of seq + 1 tokens of the split's documents, each framed by BOS/EOS;
    ``repeat``: the split read again from its start as often as ``n`` needs (else too few is an error)."""
    import pyarrow.parquet as pq

    from hymo_recipes.titan.datasets import load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))  # TorchTitan's tokenizer: the framing training uses
    need = n * (seq + 1)
    ids: list[int] = []
    for text in pq.read_table(data_dir / f"{split}.parquet").column("text").to_pylist():
        ids += tok.encode(text, add_bos=True, add_eos=True)
        if len(ids) >= need:
            break
    if repeat and ids and len(ids) < need:
        ids = ids * -(-need // len(ids))
    if len(ids) < need:
        raise ValueError(f"the {split} split holds {len(ids):,} tokens, the sweep needs {need:,}: fewer "
                         "--steps, a smaller --batch or --seq")
    return torch.tensor(ids[:need]).view(n, seq + 1)


def losses(model, tokens: torch.Tensor, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """(training loss: main + weighted MTP heads, main-head CE) of windows [B, seq + 1]."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits, mtp_logits = model(inputs)
    V = logits.shape[-1]
    main = F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1))
    loss = main
    for k, (w, lg) in enumerate(zip(weights, mtp_logits), start=1):
        lk, tk = shift_for_head(lg, labels, k)
        loss = loss + w * F.cross_entropy(lk.reshape(-1, V).float(), tk.reshape(-1))
    return loss, main


def run_one(args, batches: torch.Tensor, heldout: torch.Tensor, opt_cfg, *, steps: int, batch: int,
            max_norm: float, seed: int, device: torch.device, curve: bool = False) -> dict:
    """One training run; {"final": ..., "heldout": ..., "seconds": ...}, and with ``curve`` the
    main-head CE of every step ("curve", read once at the end: no host sync per step)."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = HymoModel(args)
    model.init_weights()
    model.train()
    optimizers = list(optimizers_for_part(model, opt_cfg).values())
    schedule = WSDSchedule.from_fractions(steps)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda e: schedule.factor(e + 1)) for o in optimizers]
    params = [p for p in model.parameters() if p.requires_grad]
    tail = max(1, steps // 10)
    mains = []
    for step in range(steps):
        x = batches[step * batch:(step + 1) * batch].to(device, non_blocking=True)
        loss, main = losses(model, x, args.mtp_loss_weights)
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        for o in optimizers:
            o.step()
        for s in scheds:
            s.step()
        if curve or step >= steps - tail:
            mains.append(main.detach())
    every = torch.stack(mains).float().cpu()
    final = float(every[-tail:].mean())
    model.eval()
    with torch.no_grad():
        held = float(losses(model, heldout.to(device), args.mtp_loss_weights)[1])
    bad = not (math.isfinite(final) and math.isfinite(held))
    out = {"final": math.inf if bad else final, "heldout": math.inf if bad else held,
           "seconds": time.perf_counter() - t0}
    if curve:
        out["curve"] = [round(float(v), 5) for v in every]
    return out


def run_device(parser: argparse.ArgumentParser, dry: bool, report_only: bool) -> torch.device:
    """The CPU for a dry run (2 threads); else the GPU (TF32 matmuls), which a report-only call
    only names (its runs' setting) and puts nothing on; without one, a parser error."""
    if dry:
        torch.set_num_threads(min(torch.get_num_threads(), 2))
        return torch.device("cpu")
    if report_only:
        return torch.device("cuda")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU; --dry runs the code paths on the CPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    return torch.device("cuda")


def shard_arg(spec: str) -> tuple[int, int]:
    """``--shard I/N`` -> (I, N): this process runs every N-th run from the I-th on."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {spec!r}: I/N with 0 <= I < N") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard {spec!r}: I/N with 0 <= I < N")
    return i, n


def stored_runs(store: Path) -> list[dict]:
    return json.loads(store.read_text()) if store.exists() else []


def append_run(store: Path, row: dict) -> list[dict]:
    """Adds ``row`` to the runs stored in ``store`` and returns them all. Under an exclusive lock
    and through a rename, so that the shards of one call (several processes sharing the GPU,
    ``--shard``) can write one file and a kill never leaves half a file."""
    import fcntl
    import os

    with open(store.with_name(store.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = stored_runs(store) + [row]
        tmp = store.with_name(store.name + ".tmp")
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        os.replace(tmp, store)
    return rows


def best_lrs(results: list[dict], parametrization: str) -> dict[int, float]:
    """{width: the lr multiplier of the lowest ``final``} over the runs of one parametrization."""
    best: dict[int, tuple[float, float]] = {}
    for r in results:
        if r["parametrization"] != parametrization or not math.isfinite(r["final"]):
            continue  # a width whose every run diverged has no best lr
        w, loss = r["width"], r["final"]
        if w not in best or loss < best[w][0]:
            best[w] = (loss, r["lr_mult"])
    return {w: m for w, (_, m) in sorted(best.items())}


def spread(best: dict[int, float], grid: list[float]) -> int:
    """How many grid points the best lr spans over the widths (0: the same lr at every width)."""
    idx = [sorted(grid).index(m) for m in best.values()]
    return max(idx) - min(idx) if idx else 0


def markdown(results: list[dict], grid: list[float], meta: str) -> str:
    lines = [f"# muP lr transfer\n\n{meta}\n"]
    for p in PARAMETRIZATIONS:
        runs = [r for r in results if r["parametrization"] == p]
        if not runs:
            continue
        widths = sorted({r["width"] for r in runs})
        by = {(r["width"], r["lr_mult"]): r for r in runs}
        lines.append(f"## {p}: mean main-head CE of the last 10 % of the steps (held-out CE after the last step)\n")
        lines.append("| width | " + " | ".join(f"lr x {m:g}" for m in grid) + " | best |")
        lines.append("|---|" + "---|" * (len(grid) + 1))
        best = best_lrs(results, p)
        for w in widths:
            cells = []
            for m in grid:
                r = by.get((w, m))
                cells.append("–" if r is None else f"{r['final']:.4f} ({r['heldout']:.4f})")
            lines.append(f"| {w} | " + " | ".join(cells) + (f" | x {best[w]:g} |" if w in best else " | – |"))
        lines.append(f"\nBest lr spans {spread(best, grid)} grid point(s) from width {widths[0]} to {widths[-1]}.\n")
    return "\n".join(lines)


def plot(results: list[dict], grid: list[float], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    present = [p for p in PARAMETRIZATIONS if any(r["parametrization"] == p for r in results)]
    fig, axes = plt.subplots(1, len(present), figsize=(6 * len(present), 4.5), squeeze=False)
    for ax, p in zip(axes[0], present):
        runs = [r for r in results if r["parametrization"] == p]
        for w in sorted({r["width"] for r in runs}):
            pts = sorted((r["lr_mult"], r["final"]) for r in runs if r["width"] == w and math.isfinite(r["final"]))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"width {w}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("lr multiplier (× the configured lrs)")
        ax.set_ylabel("final main-head CE")
        ax.set_title(p)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="CPU: widths 32 64, 4 layers, 3 lrs, 4 steps, seq 32")
    p.add_argument("--flavor", default="small", choices=sorted(hymo_flavors))
    p.add_argument("--widths", type=int, nargs="+", default=None, help="default 128 256 512 1024")
    p.add_argument("--lr-mults", type=float, nargs="+", default=None, help="default 0.25 0.5 1 2 4")
    p.add_argument("--parametrizations", nargs="+", choices=PARAMETRIZATIONS, default=list(PARAMETRIZATIONS))
    p.add_argument("--steps", type=int, default=None, help="default 200")
    p.add_argument("--batch", type=int, default=None, help="default 8")
    p.add_argument("--seq", type=int, default=None, help="default 512")
    p.add_argument("--layers", type=int, default=None, help="depth (default: the flavor's; MLA every 4th)")
    p.add_argument("--optimizer", default="NorMuon", choices=["NorMuon", "CautiousAdamW", "AdamW"])
    p.add_argument("--lr", type=float, default=3e-4, help="(Cautious)AdamW lr before the multiplier")
    p.add_argument("--normuon-lr", type=float, default=0.02, help="NorMuon lr before the multiplier")
    p.add_argument("--moe-on-normuon", action=argparse.BooleanOptionalAction, default=False,
                   help="the MoE router and experts on NorMuon (the shipped split); default off: the seed's split, "
                        "which the stored results ran with")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/mup_lr_sweep", help="output prefix (.json, .md, .png)")
    p.add_argument("--report-only", action="store_true",
                   help="write .md and .png from the GPU runs already in .json (any machine); run nothing")
    p.add_argument("--shard", type=shard_arg, default=(0, 1), metavar="I/N",
                   help="run every N-th run of the grid from the I-th on (those not stored yet): N processes of "
                        "one call share the GPU (its small runs leave it mostly idle) and one .json")
    a = p.parse_args(argv)
    dry = a.dry
    widths = a.widths or ([32, 64] if dry else [128, 256, 512, 1024])
    grid = sorted(a.lr_mults or ([0.5, 1.0, 2.0] if dry else [0.25, 0.5, 1.0, 2.0, 4.0]))
    steps = a.steps or (4 if dry else 200)
    batch = a.batch or (2 if dry else 8)
    seq = a.seq or (32 if dry else 512)
    layers = a.layers or (4 if dry else None)
    device = run_device(p, dry, a.report_only)

    from hymo_recipes.titan.datasets import load_tokenizer

    tokenizer_dir, data_dir = REPO / "assets" / "tokenizer", REPO / "data" / "brown"
    vocab = load_tokenizer(str(tokenizer_dir)).get_vocab_size()
    overrides = dict(vocab_size=vocab, max_seq_len=max(seq, 16),
                     gdn_backend="triton" if device.type == "cuda" else "torch_chunk")
    if layers is not None:
        overrides.update(n_layers=layers, mla_layers=tuple(range(3, layers, 4)), nope_layers=())
    base = dataclasses.replace(hymo_flavors[a.flavor], **overrides)
    cfg = lambda m: optimizer_config(a.optimizer, lr=a.lr * m, normuon_lr=a.normuon_lr * m,  # noqa: E731
                                     normuon_ortho_dtype="float32" if dry else "bfloat16",
                                     moe_on_normuon=a.moe_on_normuon)
    if not a.report_only:
        batches = brown_windows("train", steps * batch, seq, tokenizer_dir, data_dir)
        heldout = brown_windows("validation", batch, seq, tokenizer_dir, data_dir)

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    store = out.with_suffix(".json")
    results = stored_runs(store)
    setting = dict(flavor=a.flavor, optimizer=a.optimizer, lr=a.lr, normuon_lr=a.normuon_lr,
                   moe_on_normuon=a.moe_on_normuon, steps=steps,
                   batch=batch, seq=seq, layers=base.n_layers, seed=a.seed, max_norm=a.max_norm,
                   base_width=min(widths), device=device.type)
    done = {(r["parametrization"], r["width"], r["lr_mult"]) for r in results if r["setting"] == setting}
    machine = (f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}"
               if not a.report_only else None)
    t0 = time.perf_counter()
    shard, shards = a.shard
    grid_runs = [(par, w, m) for par in ([] if a.report_only else a.parametrizations) for w in widths for m in grid]
    # a shard's share is fixed by the whole grid, so that a resumed call picks up where it stopped
    for par, w, m in [k for k in grid_runs[shard::shards] if k not in done]:
        args = model_args_at(base, w, mup=par == "muP", base_width=min(widths))
        r = run_one(args, batches, heldout, cfg(m), steps=steps, batch=batch, max_norm=a.max_norm,
                    seed=a.seed, device=device)
        results = append_run(store, dict(parametrization=par, width=w, lr_mult=m, setting=setting, machine=machine,
                                         **r))
        print(f"mup_lr_sweep: {par} width {w} lr x {m:g}: final {r['final']:.4f}, held-out "
              f"{r['heldout']:.4f} ({r['seconds']:.1f} s)", flush=True)
    results = [r for r in stored_runs(store) if r["setting"] == setting]  # the other shards' runs too
    grid = sorted(set(grid) | {r["lr_mult"] for r in results})  # runs of earlier calls' grids too
    machines = "; ".join(sorted({r.get("machine") or "GPU" for r in results}))
    meta = (f"Flavor {a.flavor} at widths {widths} (muP base width {min(widths)}), {base.n_layers} layers, vocab "
            f"{vocab}; {a.optimizer} (NorMuon lr {a.normuon_lr}, AdamW lr {a.lr}) x the multiplier, WSD "
            f"2/83/15 %, clipping {a.max_norm}; {steps} steps of {batch} x {seq} Brown tokens, seed {a.seed}; "
            f"{machines}; this call {time.perf_counter() - t0:.0f} s. Command: "
            "python -m benchmarks.mup_lr_sweep " + " ".join(argv if argv is not None else sys.argv[1:]))
    text = markdown(results, grid, meta)
    out.with_suffix(".md").write_text(text + "\n")
    plotted = plot(results, grid, out.with_suffix(".png"))
    print(text)
    print(f"wrote {store}, {out.with_suffix('.md')}" + (f" and {out.with_suffix('.png')}" if plotted else ""))
    have = {r["parametrization"] for r in results}
    if have != set(PARAMETRIZATIONS):
        return 1
    mup, sp = spread(best_lrs(results, "muP"), grid), spread(best_lrs(results, "SP"), grid)
    print(f"mup_lr_sweep: best lr spans {mup} grid point(s) with muP, {sp} without: "
          f"{'transfers' if mup <= 1 and sp >= 1 else 'criterion not met'}")
    return 0 if mup <= 1 and sp >= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
