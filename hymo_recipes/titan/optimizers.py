"""TorchTitan containers for two optimizers per model part, and the optimizer and lr-scheduler builders.

TorchTitan 0.2.2's ``OptimizersContainer`` pairs optimizers with model parts by ``zip`` (one
optimizer per part) and its ``LRSchedulersContainer`` saves only the first scheduler and loads
it into all of them (with NorMuon at 0.02 and CautiousAdamW at 2.4e-3, CautiousAdamW silently inherits NorMuon's
base lr after a resume). The subclasses here keep (part, optimizer) pairs explicitly and save
one scheduler state per optimizer name.

Checkpoints: optimizer state goes through DCP as TorchTitan's does, flattened and keyed by
parameter FQN (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``), so it reshards to another
number of ranks; NorMuon and CautiousAdamW pre-create their state for every parameter, so the
keys are identical on every rank and torch's "zero-grad step at lr 0" on load never runs.
The NaN guard's counters (train steps, skipped steps) ride along as ``nan_guard.<key>`` ints.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from hymo_recipes.mup import apply_mup_to_param_groups, part_width_mult
from hymo_recipes.optim._dist import local as _local
from hymo_recipes.optim.cautious_adamw import CautiousAdamW
from hymo_recipes.optim.graph import GraphedStep
from hymo_recipes.optim.nan_guard import NonFiniteGuard
from hymo_recipes.optim.normuon import NorMuon
from hymo_recipes.optim.partition import (
    CAUTIOUS_ADAMW,
    NORMUON,
    build_param_groups,
    hymo_param_table,
)
from hymo_recipes.scheduler import make_wsd_lambda, wsd_schedule
from hymo_recipes.titan.api import LRSchedulersContainer, OptimizersContainer, logger

__all__ = [
    "HymoOptimizersContainer",
    "HymoLRSchedulersContainer",
    "build_hymo_lr_schedulers",
    "build_hymo_optimizers",
    "optimizers_for_part",
]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class HymoOptimizersContainer(OptimizersContainer):
    """Several named optimizers per model part (e.g. ``normuon`` + ``cautious_adamw``).

    Args:
        model_parts (list[nn.Module]):
            The model parts (one unless pipeline parallel).
        build_part (Callable[[nn.Module], dict[str, Optimizer]]):
            Builds the optimizers of one part, keyed by name; a name may be absent from a part
            (e.g. a pipeline stage without matrices), never empty.
        nan_guard (NonFiniteGuard, optional):
            If given, ``step`` first asks it whether this step's losses and gradients are
            finite on every rank (nan_guard.py) and skips the whole step when not: no
            parameter or optimizer state changes, ``last_step_skipped`` is set (the scheduler
            container then skips its step too; step post-hooks must check it, and
            ``pending_go`` after a replayed step, whose verdict is read later), and after
            ``consecutive_limit`` skips in a row it raises NonFiniteTrainingError. Its counters
            are saved with the optimizer state. Default: ``None``.
        cuda_graph (bool):
            Replay every optimizer's step as one CUDA graph after a warm-up step
            (hymo_recipes/optim/graph.py; ``[optimizer] cuda_graph``): the same updates without
            the GPU waiting for the host's launches nor, after the warm-up, for the NaN guard's
            host read: the replay is launched right behind the guard's device-side verdict,
            which its state writes follow, and the host reads that verdict at the next step
            (``resolve``; also before a checkpoint's state and on logging steps), when its copy
            has long landed, so a step between logging steps does not wait for the GPU. Until
            then ``verdict_pending`` holds, the schedule's step waits and the MoE update follows
            ``pending_go``. Default: ``False``.
        cuda_graph_streams (int):
            With ``cuda_graph``: the CUDA streams the captured step spreads its param groups
            over (``graph.StreamLanes``; ``[optimizer] cuda_graph_streams``). Default: ``1``.

    ``optimizers`` lists them part by part; ``optimizer_names[i]`` and ``optimizer_parts[i]``
    say which name and part ``optimizers[i]`` belongs to. ``step``/``zero_grad`` run every
    optimizer; step hooks registered on the container fire once per train step (also on a
    skipped one). ``step_timer`` measures each ``step`` (guard and optimizers, not the hooks),
    in all and per optimizer name (one ``graph`` lap for a replayed step).
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        build_part: Callable[[nn.Module], dict[str, Optimizer]],
        nan_guard: NonFiniteGuard | None = None,
        cuda_graph: bool = False,
        cuda_graph_streams: int = 1,
    ) -> None:
        # Not OptimizersContainer.__init__: it builds exactly one optimizer per part.
        self.model_parts = model_parts
        self.optimizers: list[Optimizer] = []
        self.optimizer_names: list[str] = []
        self.optimizer_parts: list[nn.Module] = []
        all_params: list[nn.Parameter] = []
        for part in model_parts:
            for name, opt in build_part(part).items():
                self.optimizers.append(opt)
                self.optimizer_names.append(name)
                self.optimizer_parts.append(part)
                all_params.extend(p for g in opt.param_groups for p in g["params"])
        if not self.optimizers:
            raise ValueError("no trainable parameters: nothing to optimize")
        self.nan_guard = nan_guard
        self.last_step_skipped = False
        self.step_timer = StepTimer(all_params[0].device)
        self.graphed = GraphedStep(self.optimizers, streams=cuda_graph_streams) if cuda_graph else None
        # a replayed step whose verdict the host has not read yet: (read, step number, go)
        self._unread: tuple[Callable[[], torch.Tensor], int, torch.Tensor] | None = None
        self._verdict_listeners: list[Callable[[bool], None]] = []
        # Optimizer.__init__ on the container itself: TorchTitan's hooks machinery needs it.
        self._post_init(all_params, {})

    @torch.no_grad()  # the host loops over every parameter: DTensor.to_local is cheap only without autograd
    def step(self, *args, **kwargs) -> None:
        self.step_timer.start()
        try:
            self.last_step_skipped = False
            self.resolve()  # the last replay's verdict, copied out a whole forward and backward ago
            if self.graphed is not None:
                if args or kwargs:
                    raise ValueError("optimizer.cuda_graph replays the step: a closure cannot run in it")
                self.graphed.stage()  # before the guard's host sync (graph.py)
                self.step_timer.lap("stage")
            if self.nan_guard is not None:
                grads = [_local(p.grad) for o in self.optimizers for g in o.param_groups
                         for p in g["params"] if p.grad is not None]
                bad = self.nan_guard.flag(grads)
                if self.graphed is not None and self.graphed.decides_on_device():
                    # the replay queued right behind the device verdict, which its state writes
                    # follow (a bad step changes nothing); the host reads the verdict at the next
                    # step (``resolve``), so nothing here waits for the GPU
                    go = bad == 0
                    verdict = _read_ahead(bad)
                    self.step_timer.lap("nan_check")
                    self.graphed.launch(go)
                    self.step_timer.lap("graph")
                    self._unread = (verdict, self.nan_guard.count(), go)
                    return
                if not self._decide(bad):
                    return
                self.step_timer.lap("nan_check")
            if self.graphed is not None:
                self.graphed.step(staged=True)
                self.step_timer.lap("graph")
                return
            for name, optimizer in zip(self.optimizer_names, self.optimizers):
                optimizer.step(*args, **kwargs)
                self.step_timer.lap(name)
        finally:
            self.step_timer.stop()

    def _decide(self, bad: torch.Tensor, step: int | None = None) -> bool:
        """The NaN guard's host read of its verdict ``bad``; on a skip, sets
        ``last_step_skipped`` and logs what was non-finite. True if the step updates. ``step``:
        the number of a replayed step read late (its gradients are gone by then)."""
        if self.nan_guard.decide(bad, step):
            return True
        guard = self.nan_guard
        if step is None:
            self.last_step_skipped = True
            where = self.describe_nonfinite()
        else:
            where = "its gradients were not inspected (the verdict of a replayed step is read a step later)"
        logger.warning(
            f"step {guard.last_skipped_step}: non-finite loss or gradient; optimizer "
            f"step skipped, nothing updated ({guard.consecutive} in a row, "
            f"{guard.skipped_total} so far); {where}"
        )
        return False

    @property
    def verdict_pending(self) -> bool:
        """Whether the last step was a replay whose NaN verdict the host has not read yet: its
        host-side consequences (the schedule, the step counts, the guard's counters) wait for
        ``resolve``."""
        return self._unread is not None

    @property
    def pending_go(self) -> torch.Tensor | None:
        """The device flag (0-d bool) of the unread replayed step: what follows it on the device
        (the MoE balancing's update) must keep its state where it holds False."""
        return None if self._unread is None else self._unread[2]

    def add_verdict_listener(self, fn: Callable[[bool], None]) -> None:
        """``fn(updated)`` after each late verdict is read (the lr schedule's deferred step)."""
        self._verdict_listeners.append(fn)

    def resolve(self) -> None:
        """Reads the verdict of the last replayed step if it is still unread: the guard counts
        and judges it (raising at its limit), a good step's host counters advance, the listeners
        hear it. The next step's ``step`` calls it (its copy landed long before: no wait), and so
        do checkpoints and the logging steps."""
        if self._unread is None:
            return
        read, step, _ = self._unread
        self._unread = None
        updated = self._decide(read(), step)
        if updated:
            self.graphed.commit()
        for fn in self._verdict_listeners:
            fn(updated)

    def describe_nonfinite(self, limit: int = 5) -> str:
        """Names this rank's parameters whose gradient or value is non-finite.

        Only called on a skipped step (it syncs per parameter): a NaN loss with finite
        gradients everywhere points at the forward or the data, a non-finite parameter at an
        earlier update.
        """
        bad_grad, bad_param = [], []
        for part in self.model_parts:
            for name, p in part.named_parameters():
                if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all()):
                    bad_grad.append(name)
                if not bool(torch.isfinite(_local(p.detach())).all()):
                    bad_param.append(name)

        def listed(names: list[str]) -> str:
            more = f" and {len(names) - limit} more" if len(names) > limit else ""
            return ", ".join(names[:limit]) + more if names else "none"

        return (f"on this rank, non-finite gradients: {listed(bad_grad)}; "
                f"non-finite parameters: {listed(bad_param)}")

    def state_dict(self) -> dict[str, Any]:
        self.resolve()
        sd: dict[str, Any] = {}
        for part, opt in zip(self.optimizer_parts, self.optimizers):
            sd.update(get_optimizer_state_dict(part, opt, options=_FLAT))
        if self.nan_guard is not None:
            # Plain ints beside the flat ``state.<fqn>`` / ``param_groups.<fqn>`` keys; the
            # same on every rank (the skip decision is global), so DCP stores them once.
            sd.update({f"{_GUARD}.{k}": v for k, v in self.nan_guard.state_dict().items()})
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.resolve()
        guard_state = {k[len(_GUARD) + 1:]: v for k, v in state_dict.items()
                       if k.startswith(_GUARD + ".")}
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith(_GUARD + ".")}
        if self.nan_guard is not None:
            self.nan_guard.load_state_dict(guard_state)
        # Each optimizer picks its own parameters' keys out of the merged flat dict.
        for part, opt in zip(self.optimizer_parts, self.optimizers):
            set_optimizer_state_dict(part, opt, optim_state_dict=state_dict, options=_FLAT)
        if self.graphed is not None:
            self.graphed.reset()  # the loaded state tensors are not the ones the graph writes

    def lrs(self) -> dict[str, float]:
        """Current lr of the first group of each optimizer name (groups differ by lr_mult)."""
        out: dict[str, float] = {}
        for name, opt in zip(self.optimizer_names, self.optimizers):
            out.setdefault(name, float(opt.param_groups[0]["lr"]))
        return out


_GUARD = "nan_guard"


def _read_ahead(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Starts a host copy of the small tensor ``t`` now, ahead of the work queued after it on the
    stream; the returned function returns it, waiting only if that copy has not landed yet."""
    if t.device.type != "cuda":
        return lambda: t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> torch.Tensor:
        if not copied.query():
            copied.synchronize()
        return host

    return wait


class StepTimer:
    """Time spent in the optimizer container's ``step``, summed until ``collect()``, in all and
    per named lap (``lap(name)`` closes the interval since the step's start or the last lap:
    a CUDA graph's stage, the NaN check, then each optimizer or the graph's replay, so the
    distributed NorMuon step has its own number).

    On CUDA it records events on the current stream (no host sync; an interval is the GPU
    timeline between two marks, including idle gaps while the host launches kernels or waits
    for the NaN check). On CPU it uses ``time.perf_counter``. ``collect()`` synchronises on the
    last event: call it only where the host syncs anyway (TorchTitan's logging step).
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._pending: list = []  # CUDA: per step [(lap name or None, event), ...]
        self._marks: list = []
        self._seconds = 0.0
        self._laps: dict[str, float] = {}
        self._steps = 0
        self.last_laps: dict[str, float] = {}  # seconds per lap name, as of the last collect

    def _mark(self, name):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((name, event))
        else:
            self._marks.append((name, time.perf_counter()))

    def start(self) -> None:
        self._marks = []
        self._mark(None)

    def lap(self, name: str) -> None:
        """Close the interval since the last mark under ``name`` (summed over a step's laps)."""
        self._mark(name)

    def stop(self) -> None:
        self._mark(None)
        if self.cuda:
            self._pending.append(self._marks)
        else:
            self._add(self._marks, lambda a, b: b - a)
        self._marks = []
        self._steps += 1

    def _add(self, marks, seconds_between) -> None:
        self._seconds += seconds_between(marks[0][1], marks[-1][1])
        for (_, before), (name, after) in zip(marks, marks[1:]):
            if name is not None:
                self._laps[name] = self._laps.get(name, 0.0) + seconds_between(before, after)

    def collect(self) -> tuple[float, int]:
        """(seconds, steps) since the last collect; the per-lap seconds land in last_laps."""
        if self._pending:
            self._pending[-1][-1][1].synchronize()
            for marks in self._pending:
                self._add(marks, lambda a, b: a.elapsed_time(b) / 1e3)
            self._pending.clear()
        out = (self._seconds, self._steps)
        self.last_laps = self._laps
        self._seconds, self._laps, self._steps = 0.0, {}, 0
        return out


class HymoLRSchedulersContainer(LRSchedulersContainer):
    """One LambdaLR per inner optimizer, all with the same factor; every scheduler is saved.

    The checkpoint holds one entry per optimizer *name* (every part of one optimizer follows
    the same schedule, so this reshards across pipeline layouts like TorchTitan's). On load only
    the position (``last_epoch``, ``_step_count``) is restored; each scheduler keeps its own
    base lrs (its optimizer's configured lr × lr_mult per group) and resets its groups' lr to
    base × factor, so one optimizer's lr can never leak into another's.
    """

    def __init__(self, optimizers: HymoOptimizersContainer, lr_lambda: Callable, schedule=None):
        self.schedulers = [LambdaLR(opt, lr_lambda) for opt in optimizers.optimizers]
        self.names = list(optimizers.optimizer_names)
        self.lr_lambda = lr_lambda
        self.schedule = schedule
        self._optimizers = optimizers
        self._owed = False  # a step owed to a replayed step whose verdict is unread
        if hasattr(optimizers, "add_verdict_listener"):
            optimizers.add_verdict_listener(self._on_verdict)

    def step(self) -> None:
        # A step the optimizer container skipped (non-finite gradients) does not advance the
        # schedule either; after a replayed step the schedule waits for its verdict.
        if getattr(self._optimizers, "verdict_pending", False):
            self._owed = True
            return
        if getattr(self._optimizers, "last_step_skipped", False):
            return
        for scheduler in self.schedulers:
            scheduler.step()

    def _on_verdict(self, updated: bool) -> None:
        if self._owed:
            self._owed = False
            if updated:
                for scheduler in self.schedulers:
                    scheduler.step()

    def _resolve(self) -> None:
        # a deferred step taken or dropped before the position is read or replaced
        resolve = getattr(self._optimizers, "resolve", None)
        if resolve is not None:
            resolve()

    def state_dict(self) -> dict[str, Any]:
        self._resolve()
        out: dict[str, Any] = {}
        for name, sched in zip(self.names, self.schedulers):
            if name not in out:
                sd = sched.state_dict()
                sd.pop("lr_lambdas", None)  # callables are rebuilt from the config
                out[name] = sd
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resolve()
        if "last_epoch" in state_dict:
            raise ValueError(
                "lr_scheduler checkpoint has TorchTitan's single-scheduler layout; HyMo saves "
                "one entry per optimizer name"
            )
        for name, sched in zip(self.names, self.schedulers):
            if name not in state_dict:
                raise KeyError(f"lr_scheduler checkpoint has no entry for optimizer {name!r}")
            sd = copy.deepcopy(state_dict[name])
            sched.last_epoch = int(sd["last_epoch"])
            sched._step_count = int(sd.get("_step_count", sched.last_epoch + 1))
            factor = self.lr_lambda(sched.last_epoch)
            for group, base in zip(sched.optimizer.param_groups, sched.base_lrs):
                _set_lr(group, base * factor)
            sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]


def _set_lr(group: dict, value) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(float(value))
    else:
        group["lr"] = float(value)


# ------------------------------------------------------------------------------------------
_REQUIRED_FIELDS = (
    "name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "normuon_lr",
    "normuon_momentum", "normuon_beta2", "normuon_eps", "normuon_weight_decay",
    "normuon_cautious_wd", "normuon_neuron_norm", "normuon_nesterov", "normuon_ns_steps",
    "normuon_orthogonalizer", "normuon_update_scale", "normuon_ortho_dtype", "normuon_compiled", "normuon_fused",
    "adamw_cautious_update", "adamw_cautious_wd", "adamw_compiled", "embed_weight_decay",
    "moe_on_normuon", "consecutive_nan_limit", "inject_nan_steps",
)


def _check_fields(cfg) -> None:
    missing = [f for f in _REQUIRED_FIELDS if not hasattr(cfg, f)]
    if missing:
        raise ValueError(
            f"[optimizer] lacks HyMo's fields {missing}: the custom JobConfig must declare "
            "`optimizer: hymo_recipes.titan.job_config.Optimizer` (TOML: [job] "
            'custom_config_module = "hymo_recipes.titan.job_config")'
        )


def optimizers_for_part(part: nn.Module, cfg) -> dict[str, Optimizer]:
    """The optimizers of one model part, from an ``[optimizer]`` config (job_config.py)."""
    _check_fields(cfg)
    if cfg.name == "AdamW":
        # TorchTitan's own baseline (components/optimizer.py, build_optimizers): torch's AdamW
        # over every trainable parameter in one group with one weight decay. HyMo's table
        # (no decay on norms, gates, ...) is deliberately not applied: this is the reference.
        params = [p for p in part.parameters() if p.requires_grad]
        if not params:
            return {}
        impl = cfg.implementation
        m = part_width_mult(part)
        if m is not None:
            # muP: the same single weight decay, one group per role for its lr multiplier
            groups = apply_mup_to_param_groups(
                {"adamw": [dict(params=params, group="all", lr_mult=1.0)]},
                [(n, p) for n, p in part.named_parameters() if p.requires_grad], m)["adamw"]
            params = [{**g, "lr": cfg.lr * g["lr_mult"]} for g in groups]
        return {"adamw": torch.optim.AdamW(
            params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
            weight_decay=cfg.weight_decay, foreach=impl == "foreach", fused=impl == "fused",
        )}

    rules = hymo_param_table(
        normuon_weight_decay=cfg.normuon_weight_decay,
        adamw_weight_decay=cfg.weight_decay,
        embed_weight_decay=cfg.embed_weight_decay,
        # the CautiousAdamW baseline takes the MoE at its own weight decay, wherever NorMuon would
        moe_on_normuon=cfg.moe_on_normuon and cfg.name == "NorMuon",
    )
    groups = build_param_groups(part.named_parameters(), rules)
    if cfg.name == "CautiousAdamW":
        # Baseline: every group of the table to CautiousAdamW, same decay per group.
        groups = {CAUTIOUS_ADAMW: [g for gs in groups.values() for g in gs]}
    elif cfg.name != "NorMuon":
        raise ValueError(
            f"optimizer.name must be NorMuon, CautiousAdamW or AdamW, got {cfg.name!r}"
        )
    m = part_width_mult(part)
    if m is not None:
        # muP (model_args.mup_base_width > 0): per-role lr multipliers of the optimizer each
        # group ended up on (hymo_recipes/mup.py); nothing changes with muP off
        groups = apply_mup_to_param_groups(groups, part.named_parameters(), m)

    def with_lr(gs, base_lr):
        return [{**g, "lr": base_lr * g["lr_mult"]} for g in gs]

    out: dict[str, Optimizer] = {}
    if groups.get(NORMUON):
        out[NORMUON] = NorMuon(
            with_lr(groups[NORMUON], cfg.normuon_lr),
            lr=cfg.normuon_lr,
            momentum=cfg.normuon_momentum,
            beta2=cfg.normuon_beta2,
            eps=cfg.normuon_eps,
            weight_decay=cfg.normuon_weight_decay,
            cautious_wd=cfg.normuon_cautious_wd,
            neuron_norm=cfg.normuon_neuron_norm,
            nesterov=cfg.normuon_nesterov,
            ns_steps=cfg.normuon_ns_steps,
            orthogonalizer=cfg.normuon_orthogonalizer,
            update_scale=cfg.normuon_update_scale,
            ortho_dtype=cfg.normuon_ortho_dtype,
            compiled=cfg.normuon_compiled,
            fused=cfg.normuon_fused,
        )
    if groups.get(CAUTIOUS_ADAMW):
        out[CAUTIOUS_ADAMW] = CautiousAdamW(
            with_lr(groups[CAUTIOUS_ADAMW], cfg.lr),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            cautious_update=cfg.adamw_cautious_update,
            cautious_wd=cfg.adamw_cautious_wd,
            compiled=cfg.adamw_compiled,
        )
    return out


def build_hymo_optimizers(
    model_parts: list[nn.Module],
    optimizer_config,
    parallel_dims=None,
    ft_manager=None,
) -> HymoOptimizersContainer:
    """TorchTitan's ``build_optimizers_fn`` for HyMo (signature of torchtitan's builder).

    Reads ``[optimizer]`` with HyMo's fields (hymo_recipes/titan/job_config.py), including the
    NaN guard's ``consecutive_nan_limit`` and ``inject_nan_steps``: every HyMo container skips
    non-finite steps. Step hooks (MoE balancing, metrics) are the caller's to register on the
    returned container (``hymo_recipes.titan.step_hooks``); they must change nothing but the MoE
    counters when ``last_step_skipped``. The loss function must pass each training loss
    through ``container.nan_guard.on_loss`` for non-finite losses to count (loss.py).
    """
    if getattr(optimizer_config, "early_step_in_backward", False):
        raise NotImplementedError("optimizer.early_step_in_backward is not supported by HyMo")
    if ft_manager is not None and getattr(ft_manager, "enabled", False):
        raise NotImplementedError("TorchFT is not supported by HyMo's optimizers")
    _check_fields(optimizer_config)
    guard = NonFiniteGuard(optimizer_config.consecutive_nan_limit,
                           optimizer_config.inject_nan_steps)
    return HymoOptimizersContainer(
        model_parts, lambda part: optimizers_for_part(part, optimizer_config), guard,
        cuda_graph=getattr(optimizer_config, "cuda_graph", False),
        cuda_graph_streams=getattr(optimizer_config, "cuda_graph_streams", 1),
    )


def build_hymo_lr_schedulers(optimizers, lr_scheduler_config, training_steps: int):
    """TorchTitan's ``build_lr_schedulers_fn``: one WSD LambdaLR per inner optimizer.

    Reads from ``[lr_scheduler]`` (HyMo's fields, job_config.py):
    ``warmup_fraction``, ``stable_fraction``, ``decay_fraction``, ``decay_type``,
    ``min_lr_factor``, ``total_steps`` (None: ``training.steps``). The built-in
    ``warmup_steps`` / ``decay_ratio`` must stay unset: two ways to say one thing.
    """
    schedule = wsd_schedule(lr_scheduler_config, training_steps)
    return HymoLRSchedulersContainer(optimizers, make_wsd_lambda(schedule), schedule=schedule)
