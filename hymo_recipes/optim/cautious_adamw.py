"""CautiousAdamW: AdamW with cautious update masking and cautious weight decay.

Per tensor p with gradient g (t counts steps from 1):

    m ← β1 m + (1−β1) g ;  v ← β2 v + (1−β2) g²
    u = (m / (1−β1^t)) / (sqrt(v / (1−β2^t)) + ε)           # AdamW's step direction
    cautious_update (Liang et al., arXiv 2411.16085):
        φ = [u ⊙ g > 0] ;  u ← u ⊙ φ · n / (Σφ + 1)           # n = numel(p), global counts
    cautious_wd (Chen et al., arXiv 2510.12402):
        p ← p − lr·wd · [u ⊙ p ≥ 0] ⊙ p                        # else the plain p ← p − lr·wd·p
    p ← p − lr · u

With both flags off this is torch.optim.AdamW (decoupled decay with the scheduled lr).

Speed: the step is written with ``torch._foreach_*`` ops over all tensors of a group (one
dispatch per op, not per tensor). Eager it makes ~23 passes over the tensors against AdamW's ~8
and is 2.5-5x slower than AdamW(foreach=True) on CPU. ``compiled=True`` runs the same function
under torch.compile (fullgraph), which fuses the passes into a few kernels and is faster than
AdamW(foreach=True) (BENCHMARKS.md). lr, weight decay and the bias corrections enter the
compiled function as 0-d tensors, so a scheduled lr does not trigger recompiles; each param
group compiles once (dynamo allows 8 graphs per function: HyMo's table makes at most 5
CautiousAdamW groups per model part).

FSDP2: all elementwise work runs on local shards. The mask normaliser n/(Σφ+1) uses the
*global* count (one all-reduce of the per-tensor counts), so a sharded step equals the
single-process step and checkpoints reshard to any number of ranks without changing the maths.
"""

from __future__ import annotations

import math

from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from hymo_recipes.optim._base import BYTES_PER_S, LAUNCH_S, GroupStepOptimizer, write_if
from hymo_recipes.optim._dist import all_reduce_sum, local, shard_spec

__all__ = ["CautiousAdamW"]


# The step in four multi-tensor pieces. AdamW's bias corrections are folded into two 0-d
# tensors, u = m · sqrt(bc2)/bc1 / (sqrt(v) + eps·sqrt(bc2)), which equals
# (m/bc1) / (sqrt(v/bc2) + eps) and saves a pass over v.


def _moments(
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    beta1: float,
    beta2: float,
    cautious_update: bool,
) -> tuple[list[Tensor] | None, list[Tensor] | None]:
    """m, v in place; with cautious_update also φ = [m·g > 0] and its local count per tensor."""
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    if not cautious_update:
        return None, None
    # sign(u) = sign(m): the denominator is positive, so the mask needs only m and g.
    agree = torch._foreach_mul(exp_avgs, grads)
    torch._foreach_sign_(agree)
    torch._foreach_clamp_min_(agree, 0.0)
    # Counts in fp64: an fp32 accumulator cannot count past 2^24 = 16.8 M (a 64,256 × 512
    # embedding has 33 M entries; single-threaded CPU sums of 0/1 stop exactly at 2^24).
    if torch.compiler.is_compiling():
        # inductor fuses the sum into the kernel that computes φ (a foreach_norm would be an
        # opaque per-tensor call)
        return agree, [a.sum(dtype=torch.float64) for a in agree]
    # eager: Σφ of a 0/1 tensor is its L1 norm, one multi-tensor reduction
    return agree, list(torch._foreach_norm(agree, 1, dtype=torch.float64))


# Inductor's loop reordering after fusion asserts when foreach ops are fused with per-tensor
# reductions over tensors of different shapes on CUDA (pytorch/pytorch#176591, open in 2026):
# the cautious mask counts above are such reductions. The pass only reorders loops, so it is
# turned off for these graphs alone (without it, adamw_compiled fails with an InductorError
# AssertionError before step 1 of the 750m on CUDA with torch 2.11).
_COMPILE_OPTIONS = {"loop_ordering_after_fusion": False}


def _mask_scales(counts: list[Tensor], numels: list[float], step_scale: Tensor) -> list[Tensor]:
    """n / (Σφ + 1) · sqrt(bc2)/bc1 per tensor (0-d tensors in the parameters' dtype)."""
    scales = torch._foreach_add(counts, 1.0)
    torch._foreach_reciprocal_(scales)
    torch._foreach_mul_(scales, numels)
    scales = [s.to(step_scale.dtype) for s in scales]
    torch._foreach_mul_(scales, step_scale)
    return scales


def _update(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    agree: list[Tensor] | None,
    scales: list[Tensor] | None,
    lr: Tensor,
    weight_decay: Tensor,
    step_scale: Tensor,
    eps_scaled: Tensor,
    cautious_wd: bool,
    apply_wd: bool,
) -> None:
    """p ← p − lr·(u + wd·[u·p ≥ 0]⊙p); u the (cautious) AdamW direction.

    At most two parameter-sized temporaries (u and the reused φ): in eager mode on CPU every
    fresh large allocation costs page faults, which dominated an earlier version.
    """
    u = torch._foreach_sqrt(exp_avg_sqs)
    # a list of the 0-d tensor: the single-tensor overload of _foreach_add_ makes dynamo read
    # the value on the host (a graph break)
    torch._foreach_add_(u, [eps_scaled] * len(u))
    torch._foreach_reciprocal_(u)
    torch._foreach_mul_(u, exp_avgs)  # m / (sqrt(v) + eps·sqrt(bc2))
    if agree is not None:
        torch._foreach_mul_(agree, scales)  # φ · n/(Σφ+1) · sqrt(bc2)/bc1
        torch._foreach_mul_(u, agree)
    else:
        torch._foreach_mul_(u, step_scale)
    if apply_wd and cautious_wd:
        # [u·p ≥ 0] = min(sign(u·p) + 1, 1); where the cautious mask zeroed u, decay applies
        if agree is not None:
            decay = agree  # φ is no longer needed: reuse its memory
            torch._foreach_copy_(decay, u)
            torch._foreach_mul_(decay, params)
        else:
            decay = torch._foreach_mul(u, params)
        torch._foreach_sign_(decay)
        torch._foreach_add_(decay, 1.0)
        torch._foreach_clamp_max_(decay, 1.0)
        torch._foreach_mul_(decay, params)
        torch._foreach_mul_(decay, lr * weight_decay)
        torch._foreach_sub_(params, decay)
    elif apply_wd:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)  # torch AdamW's decoupled decay
    torch._foreach_mul_(u, lr)
    torch._foreach_sub_(params, u)


def _fused_step(
    params, grads, exp_avgs, exp_avg_sqs, numels, lr, weight_decay, step_scale, eps_scaled,
    beta1: float, beta2: float, cautious_update: bool, cautious_wd: bool, apply_wd: bool,
    go: Tensor | None = None,
) -> None:
    """The whole step for unsharded tensors: one torch.compile graph when compiled. ``go``: a
    0-d bool (a CUDA graph's skip flag); the step then runs on copies of the parameters and
    states, which replace them only where it holds True (compiled, the copies and the select
    fuse into the step's kernels)."""
    if go is not None:
        targets = (params, exp_avgs, exp_avg_sqs)
        params, exp_avgs, exp_avg_sqs = ([t.clone() for t in ts] for ts in targets)
    agree, counts = _moments(grads, exp_avgs, exp_avg_sqs, beta1, beta2, cautious_update)
    scales = _mask_scales(counts, numels, step_scale) if cautious_update else None
    _update(params, exp_avgs, exp_avg_sqs, agree, scales, lr, weight_decay, step_scale,
            eps_scaled, cautious_wd, apply_wd)
    if go is not None:
        for dst, src in zip(targets, (params, exp_avgs, exp_avg_sqs)):
            write_if(go, dst, src)


class CautiousAdamW(GroupStepOptimizer):
    """AdamW with cautious update masking and cautious weight decay, each switchable.

    Args:
        params (iterable):
            Parameters or param groups (any shape).
        lr (float or Tensor):
            Learning rate. Default: ``3e-4``.
        betas (tuple[float, float]):
            β1, β2. Default: ``(0.9, 0.95)``.
        eps (float):
            Added to the bias-corrected sqrt(v). Default: ``1e-8``.
        weight_decay (float or Tensor):
            Decoupled decay, multiplied by the scheduled lr. Default: ``0.1``.
        cautious_update (bool):
            Mask update coordinates that disagree in sign with the gradient and rescale by
            n/(nnz+1). Default: ``True``.
        cautious_wd (bool):
            Decay only where update·param ≥ 0. Default: ``True``.
        compiled (bool):
            Run the multi-tensor step under ``torch.compile`` (fused kernels; a one-off compile
            per group). Default: ``False``.

    State, created for every parameter at construction (DCP-symmetric, sharded like the
    parameter, in the parameter's dtype): ``step`` (0-d fp32 on CPU, as torch.optim.AdamW
    keeps it), ``exp_avg``, ``exp_avg_sq``. A parameter whose ``grad`` is None takes a zero
    gradient (so the cautious mask removes its update; decoupled decay still applies).
    """

    def __init__(
        self,
        params,
        lr: float | Tensor = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float | Tensor = 0.1,
        cautious_update: bool = True,
        cautious_wd: bool = True,
        compiled: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            cautious_update=cautious_update,
            cautious_wd=cautious_wd,
        )
        self._check_hparams(defaults)
        self._compiled = compiled
        self._true: dict[torch.device, Tensor] = {}  # the compiled step's flag outside a graph
        self._fused_fn, self._moments_fn, self._update_fn = _fused_step, _moments, _update
        if compiled:
            # dynamic=False: shapes are fixed for a run; the scalars that change every step
            # (lr, wd, bias corrections) are 0-d tensors, so nothing recompiles.
            kw = dict(dynamic=False, fullgraph=True, options=_COMPILE_OPTIONS)
            self._fused_fn = torch.compile(_fused_step, **kw)
            self._moments_fn = torch.compile(_moments, **kw)
            self._update_fn = torch.compile(_update, **kw)
        super().__init__(params, defaults)

    @staticmethod
    def _check_hparams(g: dict[str, Any]) -> None:
        lr = g["lr"]
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must have one element")
        if not float(lr) >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        b1, b2 = g["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {g['betas']}")
        if not g["eps"] >= 0.0:
            raise ValueError(f"eps must be >= 0, got {g['eps']}")
        if not float(g["weight_decay"]) >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._check_hparams(group)
        for p in group["params"]:
            if p.dtype not in (torch.float32, torch.float64):
                # The foreach step runs in the parameter's dtype; FSDP2 keeps fp32 masters.
                raise ValueError(
                    f"CautiousAdamW needs fp32 (or fp64) parameters, got {p.dtype} for a "
                    f"parameter of shape {tuple(p.shape)}"
                )
            shard_spec(p)  # refuse unsupported layouts at construction
            state = self.state[p]
            if not state:
                # Pre-created: DCP-symmetric keys, and torch's lr-0 init step never runs.
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)

    @staticmethod
    def _batches(params: list[Tensor]) -> dict[tuple, list[Tensor]]:
        """The group's parameters by (device, dtype): foreach kernels take one of each."""
        batches: dict[tuple, list[Tensor]] = defaultdict(list)
        for p in params:
            batches[(local(p).device, local(p).dtype)].append(p)
        return batches

    def _step_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        index = self._group_index(group) if self.in_graph else None
        for key, params in self._batches(group["params"]).items():
            self._step_batch(group, params, beta1, beta2, None if index is None else (index, *key))

    def _group_cost(self, group: dict[str, Any]) -> float:
        # one read of parameter, gradient and both moments, one write of three: seven times
        # the parameter's bytes; a few multi-tensor launches per (device, dtype) batch
        nbytes = 7 * sum(local(p).numel() * local(p).element_size() for p in group["params"])
        return nbytes / BYTES_PER_S + 10 * LAUNCH_S * len(self._batches(group["params"]))

    def _advance(self, group, params: list[Tensor]) -> tuple[float, float]:
        """Counts one more step for the batch (host counters) and returns its bias-correction
        scalars (sqrt(bc2)/bc1, eps·sqrt(bc2))."""
        steps = [self.state[p]["step"] for p in params]
        torch._foreach_add_(steps, 1.0)
        # All steps of a group advance together; one bias correction for the batch (they can
        # only differ if a checkpoint mixed states, which load_state_dict never does). The
        # steps live on the CPU, so the corrections are host floats, handed to the device
        # without a copy (no host sync in the step).
        return self._bias_scalars(group, float(steps[0]))

    @staticmethod
    def _bias_scalars(group, t: float) -> tuple[float, float]:
        """(sqrt(bc2)/bc1, eps·sqrt(bc2)) of step t."""
        beta1, beta2 = group["betas"]
        bc1 = 1.0 - beta1**t
        bc2_sqrt = math.sqrt(1.0 - beta2**t)
        return bc2_sqrt / bc1, group["eps"] * bc2_sqrt

    def _prepare_host_step(self, index: int, group: dict[str, Any]):
        for (device, dtype), params in self._batches(group["params"]).items():
            # the step about to run: one past the count (the fp32 count + 1, as _advance forms it)
            step_scale, eps_scaled = self._bias_scalars(group, float(self.state[params[0]]["step"] + 1.0))
            key = (index, device, dtype)
            yield ("step_scale", *key), step_scale, device, dtype
            yield ("eps_scaled", *key), eps_scaled, device, dtype
            yield ("lr", *key), float(group["lr"]), device, dtype

    def _commit_host_step(self, index: int, group: dict[str, Any]) -> None:
        torch._foreach_add_([self.state[p]["step"] for p in group["params"]], 1.0)

    def _step_batch(self, group, params: list[Tensor], beta1: float, beta2: float, graph_key=None) -> None:
        """One (device, dtype) batch of a group; graph_key (group index, device, dtype): under a
        CUDA graph, whose scalars prepare_graph_step has written."""
        device = local(params[0]).device
        ps, gs, ms, vs = [], [], [], []
        for p in params:
            st = self.state[p]
            w = local(p)
            g = local(p.grad)
            if g is None:
                # Zero, not skip: keeps every rank in the count all-reduce.
                g = torch.zeros_like(w)
            ps.append(w)
            gs.append(g if g.dtype == w.dtype else g.to(w.dtype))
            ms.append(local(st["exp_avg"]))
            vs.append(local(st["exp_avg_sq"]))
        dtype = ps[0].dtype
        if graph_key is None:
            step_scale, eps_scaled = self._advance(group, params)
            step_scale = _scalar_tensor(step_scale, device, dtype)
            eps_scaled = _scalar_tensor(eps_scaled, device, dtype)
            lr = _scalar_tensor(group["lr"], device, dtype)
        else:
            step_scale, eps_scaled, lr = (self._graph_scalar((name, *graph_key))
                                          for name in ("step_scale", "eps_scaled", "lr"))
        wd = _scalar_tensor(group["weight_decay"], device, dtype)
        apply_wd = isinstance(group["weight_decay"], Tensor) or group["weight_decay"] != 0.0
        flags = (group["cautious_update"], group["cautious_wd"], apply_wd)
        numels = [float(p.numel()) for p in params]  # global sizes (DTensor.numel is global)

        if not (group["cautious_update"] and any(shard_spec(p).sharded for p in params)):
            go = self.go
            if go is None and self._compiled:
                # compiled, every step takes a flag (here always true): eager and graphed steps
                # then run one compiled kernel, with one rounding, and dynamo keeps one graph
                go = self._true.get(device)
                if go is None:
                    go = self._true[device] = torch.ones((), dtype=torch.bool, device=device)
            self._fused_fn(ps, gs, ms, vs, numels, lr, wd, step_scale, eps_scaled, beta1, beta2,
                           *flags, go)
            return
        if self.go is not None:  # GraphedStep refuses sharded parameters before this
            raise RuntimeError("CautiousAdamW: a step skipped on the device takes unsharded parameters")
        # Sharded: the mask normaliser needs global counts, summed between the two halves.
        agree, counts = self._moments_fn(gs, ms, vs, beta1, beta2, True)
        counts = self._global_counts(params, counts)
        scales = _mask_scales(counts, numels, step_scale)
        self._update_fn(ps, ms, vs, agree, scales, lr, wd, step_scale, eps_scaled,
                        group["cautious_wd"], apply_wd)

    @staticmethod
    def _global_counts(params: list[Tensor], counts: list[Tensor]) -> list[Tensor]:
        """Sum the local mask counts of sharded parameters over their shard groups."""
        counts = list(counts)
        by_groups: dict[tuple, list[int]] = defaultdict(list)
        specs = [shard_spec(p) for p in params]
        for i, spec in enumerate(specs):
            if spec.sharded:
                by_groups[spec.mesh_key].append(i)
        for idxs in by_groups.values():
            # fp64 (as computed): counts stay exact through the sum
            packed = torch.stack([counts[i] for i in idxs])
            all_reduce_sum(packed, specs[idxs[0]].groups)
            for j, i in enumerate(idxs):
                counts[i] = packed[j]
        return counts


def _scalar_tensor(x: float | Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """x as a 0-dim tensor on device. A host value becomes a fill kernel's argument: unlike a
    host-to-device copy of a pageable tensor, that does not synchronise the stream."""
    if isinstance(x, Tensor) and x.device == device:
        return x.to(dtype=dtype)
    return torch.full((), float(x), dtype=dtype, device=device)
