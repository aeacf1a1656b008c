"""muP coordinate check for HyMo: activation size vs width over the first optimizer steps.

    python -m benchmarks.mup_coord_check                        # small flavor, widths 64..512
    python -m benchmarks.mup_coord_check --widths 32 64 128 --layers 4 --vocab 2048 --seq 32

For each width (``hymo_recipes.mup.scale_args_to_width`` of a flavor: dim, head counts, LoRA
ranks and inner dims scaled together, head dims, depth and vocab kept) and each parametrization
(muP with base width = the narrowest width, and the standard parametrization "SP" = muP off),
it builds the model, builds the optimizers with HyMo's own builder
(``hymo_recipes.titan.optimizers.optimizers_for_part``: the partition table, and muP's lr
multipliers when on), and trains ``--steps`` steps on one fixed batch of random tokens at a
constant lr (no schedule, no clipping: both would hide what the parametrization does). At every
forward (step 0 is the initial model) it records the mean |·| of

- ``block<i>``: each block's output (the residual stream after layer i),
- ``gdn_o<i>``: each GDN layer's recurrent output o = S_tᵀ q_t / √K (the input of its gated
  norm; a proxy for the state S, which the chunked kernel does not return),
- ``logits``: the main logits, and ``dlogits``: their change since step 0, |logits_t − logits_0|.

Criterion: for every tracked quantity at every step t ≥ ``--from-step``, the least-squares slope
of log(mean |·|) against log(width), the seeds averaged first. muP passes when every |slope| <
``--tol`` (0.15 by default): flat in width. SP is expected to exceed it (non-flat). Tracked for
the criterion: block outputs, GDN outputs and dlogits. The raw logits are recorded but not
tracked: with a tied head they start at (1/m)·0.02·√d ∝ m^-1/2 under muP (a readout that
vanishes at init, as muP prescribes); their change is what muP keeps Θ(1).

Writes ``<out>.md`` (slopes per quantity and step, both parametrizations, and the verdict) and
``<out>.png`` (mean |·| vs width, one panel per quantity group, one line per step) if
matplotlib is installed (pip install matplotlib; the dev extra lists it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from hymo_recipes.model import HymoModel, hymo_flavors
from hymo_recipes.model.gdn import GatedDeltaNet
from hymo_recipes.model.mtp import shift_for_head
from hymo_recipes.mup import scale_args_to_width
from hymo_recipes.titan.job_config import Optimizer as _OptimizerFields
from hymo_recipes.titan.optimizers import optimizers_for_part

TRACKED_PREFIXES = ("block", "gdn_o", "dlogits")


def optimizer_config(name: str = "NorMuon", lr: float | None = None, normuon_lr: float | None = None, **overrides):
    """An ``[optimizer]`` section: HyMo's field defaults (the lrs too, unless given) plus
    TorchTitan's built-in fields."""
    fields = dataclasses.asdict(_OptimizerFields())
    fields.update(name=name, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, implementation="foreach")
    fields.update({k: v for k, v in dict(lr=lr, normuon_lr=normuon_lr).items() if v is not None})
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def model_args_at(base, width: int, *, mup: bool, base_width: int, **overrides):
    """``base`` scaled to ``width``; muP on (base width ``base_width``) or off."""
    return scale_args_to_width(base, width, mup_base_width=base_width if mup else 0, **overrides)


def _loss(logits, mtp_logits, labels, weights):
    V = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1))
    for k, (w, lg) in enumerate(zip(weights, mtp_logits), start=1):
        lk, tk = shift_for_head(lg, labels, k)
        loss = loss + w * F.cross_entropy(lk.reshape(-1, V).float(), tk.reshape(-1))
    return loss


def run_one(args, tokens: torch.Tensor, steps: int, opt_cfg, seed: int) -> dict[str, list[float]]:
    """Train ``steps`` steps on ``tokens`` [B, T+1]; {quantity: [mean |·| at forward 0..steps]}."""
    torch.manual_seed(seed)
    model = HymoModel(args)
    model.init_weights()
    model.train()
    optimizers = list(optimizers_for_part(model, opt_cfg).values())
    records: dict[str, list[float]] = {}
    current: dict[str, float] = {}

    def put(name, t):
        current[name] = float(t.detach().float().abs().mean())

    hooks = []
    for i, layer in model.layers.items():
        hooks.append(layer.register_forward_hook(lambda mod, inp, out, i=i: put(f"block{i}", out)))
        if isinstance(layer.attn, GatedDeltaNet):
            # o_norm(o, gate): o is the recurrence's output [B, T, H, V]
            hooks.append(layer.attn.o_norm.register_forward_pre_hook(
                lambda mod, inp, i=i: put(f"gdn_o{i}", inp[0])))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits0 = None
    try:
        for step in range(steps + 1):
            current.clear()
            logits, mtp_logits = model(inputs)
            put("logits", logits)
            if logits0 is None:
                logits0 = logits.detach().clone()
            else:
                put("dlogits", logits.detach() - logits0)
            for k, v in current.items():
                records.setdefault(k, [math.nan] * step).append(v)
            if step == steps:
                break
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            _loss(logits, mtp_logits, labels, args.mtp_loss_weights).backward()
            for opt in optimizers:
                opt.step()
    finally:
        for h in hooks:
            h.remove()
    records.setdefault("dlogits", [math.nan])  # step 0 has no change
    return records


def coord_check(base, widths, *, mup: bool, steps: int = 5, seeds=(0,), batch: int = 2, seq: int = 64,
                opt_cfg=None, base_width: int | None = None, **arg_overrides):
    """{width: {quantity: [mean over seeds of mean |·| at step 0..steps]}}."""
    opt_cfg = opt_cfg if opt_cfg is not None else optimizer_config()
    base_width = base_width if base_width is not None else min(widths)
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, base.vocab_size, (batch, seq + 1), generator=g)
    out = {}
    for w in widths:
        args = model_args_at(base, w, mup=mup, base_width=base_width, **arg_overrides)
        per_seed = [run_one(args, tokens, steps, opt_cfg, seed) for seed in seeds]
        out[w] = {k: [sum(r[k][t] for r in per_seed) / len(per_seed) for t in range(steps + 1)]
                  for k in per_seed[0]}
    return out


def slope(xs, ys) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def slopes(result) -> dict[str, list[float]]:
    """{quantity: [log-log slope vs width at step 0..steps]} (nan where undefined)."""
    widths = sorted(result)
    names = list(result[widths[0]])
    n = len(result[widths[0]][names[0]])
    out = {}
    for k in names:
        row = []
        for t in range(n):
            ys = [result[w][k][t] for w in widths]
            row.append(slope(widths, ys) if all(y > 0 and math.isfinite(y) for y in ys) else math.nan)
        out[k] = row
    return out


def tracked(name: str) -> bool:
    return name.startswith(TRACKED_PREFIXES)


def worst_slope(s: dict[str, list[float]], from_step: int) -> tuple[float, str, int]:
    """(largest |slope|, its quantity, its step) over tracked quantities at steps ≥ from_step."""
    best = (0.0, "", -1)
    for k, row in s.items():
        if not tracked(k):
            continue
        for t, v in enumerate(row):
            if t >= from_step and math.isfinite(v) and abs(v) > best[0]:
                best = (abs(v), k, t)
    return best


def markdown(results: dict[str, dict], from_step: int, tol: float, meta: str) -> str:
    lines = ["# muP coordinate check", "", meta, "",
             f"Log-log slope of mean |·| against width, per step (step 0 = init). Criterion: "
             f"|slope| < {tol} for {', '.join(TRACKED_PREFIXES)}* at steps ≥ {from_step}.", ""]
    for label, res in results.items():
        s = slopes(res)
        worst, name, step = worst_slope(s, from_step)
        verdict = "flat" if worst < tol else "NOT flat"
        lines += [f"## {label}: {verdict} (max |slope| {worst:.3f}, {name} at step {step})", ""]
        n = len(next(iter(s.values())))
        lines.append("| quantity | " + " | ".join(f"step {t}" for t in range(n)) + " |")
        lines.append("|---|" + "---|" * n)
        for k, row in s.items():
            lines.append(f"| {k} | " + " | ".join("—" if not math.isfinite(v) else f"{v:+.3f}" for v in row) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    groups = [("block", "block outputs (mean over layers)"), ("gdn_o", "GDN recurrent output"),
              ("logits", "logits"), ("dlogits", "|logits − logits₀|")]
    fig, axes = plt.subplots(len(results), len(groups), figsize=(4 * len(groups), 3.2 * len(results)),
                             squeeze=False)
    for r, (label, res) in enumerate(results.items()):
        widths = sorted(res)
        names = list(res[widths[0]])
        n = len(res[widths[0]][names[0]])
        for c, (prefix, title) in enumerate(groups):
            ax = axes[r][c]
            keys = [k for k in names if (k == prefix if prefix in ("logits", "dlogits") else k.startswith(prefix))]
            for t in range(n):
                ys = [sum(res[w][k][t] for k in keys) / len(keys) for w in widths]
                if all(math.isfinite(y) and y > 0 for y in ys):
                    ax.plot(widths, ys, marker="o", label=f"step {t}", color=plt.cm.viridis(t / max(1, n - 1)))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{label}: {title}", fontsize=9)
            ax.set_xlabel("width (dim)")
            if c == 0:
                ax.set_ylabel("mean |·|")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="small", choices=sorted(hymo_flavors))
    p.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--base-width", type=int, default=None, help="muP base width (default: the narrowest)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--from-step", type=int, default=3, help="first step the criterion looks at")
    p.add_argument("--tol", type=float, default=0.15)
    p.add_argument("--seeds", type=int, default=4, help="seeds averaged per width (few heads are noisy)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=None, help="depth (default: the flavor's); MLA every 4th")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the flavor's)")
    p.add_argument("--optimizer", default="NorMuon", choices=["NorMuon", "CautiousAdamW", "AdamW"])
    p.add_argument("--lr", type=float, default=3e-3,
                   help="(Cautious)AdamW lr: 10x the training default, so that within a few steps the "
                        "updates, not the init, set the logits")
    p.add_argument("--normuon-lr", type=float, default=0.02)
    p.add_argument("--ortho-dtype", default="float32", choices=["bfloat16", "float32", "float64"],
                   help="NorMuon's orthogonalisation dtype (training default bfloat16: slow on CPUs)")
    p.add_argument("--moe-on-normuon", action=argparse.BooleanOptionalAction, default=False,
                   help="the MoE router and experts on NorMuon (the shipped split); default off: the seed's split, "
                        "which the committed tables ran with")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/mup_coord_check", help="output prefix (.md, .png)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    base = hymo_flavors[a.flavor]
    overrides = dict(gdn_backend="torch_chunk", gdn_dot_precision="table", gdn_bwd_path="table",
                     max_seq_len=max(a.seq, 16))
    if a.layers is not None:
        overrides.update(n_layers=a.layers, mla_layers=tuple(range(3, a.layers, 4)), nope_layers=())
    if a.vocab is not None:
        overrides["vocab_size"] = a.vocab
    base = dataclasses.replace(base, **overrides)
    cfg = optimizer_config(a.optimizer, lr=a.lr, normuon_lr=a.normuon_lr, normuon_ortho_dtype=a.ortho_dtype,
                           moe_on_normuon=a.moe_on_normuon)
    base_width = a.base_width or min(a.widths)
    seeds = tuple(range(a.seeds))
    t0 = time.perf_counter()
    results = {}
    for label, mup in (("muP", True), ("SP", False)):
        results[label] = coord_check(base, a.widths, mup=mup, steps=a.steps, seeds=seeds, batch=a.batch,
                                     seq=a.seq, opt_cfg=cfg, base_width=base_width)
    meta = (f"Flavor {a.flavor} scaled to widths {a.widths} (muP base width {base_width}); "
            f"{base.n_layers} layers, vocab {base.vocab_size}, batch {a.batch}×{a.seq} random tokens "
            f"(the same batch every step), optimizer {a.optimizer} (lr {a.lr}, normuon_lr {a.normuon_lr}, "
            f"constant, no clipping), {a.steps} steps, seeds {list(seeds)}; "
            f"{time.perf_counter() - t0:.0f} s. Command: python -m benchmarks.mup_coord_check "
            + " ".join(argv if argv is not None else sys.argv[1:]))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(results, a.from_step, a.tol, meta)
    out.with_suffix(".md").write_text(text + "\n")
    plotted = plot(results, out.with_suffix(".png"))
    print(text)
    print(f"wrote {out.with_suffix('.md')}" + (f" and {out.with_suffix('.png')}" if plotted else ""))
    mup_ok = worst_slope(slopes(results["muP"]), a.from_step)[0] < a.tol
    sp_flat = worst_slope(slopes(results["SP"]), a.from_step)[0] < a.tol
    return 0 if mup_ok and not sp_flat else 1


if __name__ == "__main__":
    sys.exit(main())
