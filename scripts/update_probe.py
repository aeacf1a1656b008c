"""Debugging probe: what the optimizer step does to every parameter at chosen train steps.

Imported by a training wrapper (scripts/gpu_scaling.sh's does when HYMO_PROBE_STEPS is set), it
wraps ``HymoOptimizersContainer.step``. At each train step in ``HYMO_PROBE_STEPS`` (comma list,
1-based, e.g. "21") it writes one row per parameter to
``$HYMO_PROBE_DIR/probe_<world size>gpu_step<N>.tsv``: the optimizer and group lr, ||W||,
||dW|| / ||W|| of this step's update, ||grad||, and the norm of each optimizer-state tensor
after the step (momentum_buffer, neuron_v, exp_avg, exp_avg_sq; step). Norms are global: local
shards' squared sums all-reduced over the default group (FSDP2 shards every parameter, so each
element is counted once). Rank 0 also logs the 12 largest relative updates.

Two runs that should train alike (an uninterrupted run and a resume of its checkpoint on another
number of GPUs) can then be compared row by row (scripts/probe_compare.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from hymo_recipes._titan import logger
from hymo_recipes.optim._dist import local
from hymo_recipes.optim.container import HymoOptimizersContainer

STEPS = {int(s) for s in os.environ.get("HYMO_PROBE_STEPS", "").split(",") if s.strip()}
OUT_DIR = Path(os.environ.get("HYMO_PROBE_DIR", "."))
STATE_KEYS = ("momentum_buffer", "neuron_v", "exp_avg", "exp_avg_sq", "step")
_original_step = HymoOptimizersContainer.step


def _sq(t) -> torch.Tensor:
    return local(t).detach().float().pow(2).sum() if isinstance(t, torch.Tensor) else torch.zeros(())


def _probe_step(self, *args, **kwargs):
    step = self.nan_guard.current_step if self.nan_guard is not None else None
    if step not in STEPS:
        return _original_step(self, *args, **kwargs)
    names = {id(p): n for part in self.model_parts for n, p in part.named_parameters()}
    entries = [(opt_name, group, p) for opt_name, opt in zip(self.optimizer_names, self.optimizers)
               for group in opt.param_groups for p in group["params"]]
    before = [local(p).detach().clone() for _, _, p in entries]
    grads = [_sq(p.grad) if p.grad is not None else torch.zeros(()) for _, _, p in entries]
    _original_step(self, *args, **kwargs)
    opt_of = {id(p): opt for opt in self.optimizers for g in opt.param_groups for p in g["params"]}
    rows = []
    for (opt_name, group, p), w0, g2 in zip(entries, before, grads):
        w = local(p).detach()
        state = opt_of[id(p)].state.get(p, {})
        device = w.device
        rows.append(torch.stack([
            w.float().pow(2).sum(), (w.float() - w0.float()).pow(2).sum(), g2.to(device),
            *[_sq(state[k]).to(device) if k in state and k != "step" else torch.zeros((), device=device)
              for k in STATE_KEYS[:-1]]]))
    table = torch.stack(rows)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    table = table.sqrt().cpu()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and dist.get_rank() != 0:
        return None
    lines = ["name\toptimizer\tlr\tw_norm\trel_update\tgrad_norm\t" + "\t".join(STATE_KEYS)]
    for (opt_name, group, p), r in zip(entries, table.tolist()):
        step_state = opt_of[id(p)].state.get(p, {}).get("step")
        lr = float(group["lr"])
        lines.append("\t".join([names.get(id(p), "?"), opt_name, f"{lr:.6g}", f"{r[0]:.6g}",
                                f"{r[1] / max(r[0], 1e-30):.6g}", f"{r[2]:.6g}",
                                *[f"{x:.6g}" for x in r[3:]],
                                f"{float(step_state):g}" if step_state is not None else "-"]))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"probe_{world}gpu_step{step}.tsv"
    path.write_text("\n".join(lines) + "\n")
    top = sorted(lines[1:], key=lambda line: -float(line.split("\t")[4]))[:12]
    logger.info(f"[probe] step {step}: largest relative updates ({path}):\n" + "\n".join(top))
    return None


HymoOptimizersContainer.step = _probe_step
