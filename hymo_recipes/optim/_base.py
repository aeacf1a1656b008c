"""The step loop that NorMuon and CautiousAdamW share: each non-empty group in one batched call;
and the host half of a step that a CUDA graph replays (hymo_recipes/optim/graph.py)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.optim import Optimizer


# What the groups' cost estimates (``_group_cost``) assume of a GPU: order of magnitude only,
# enough to tell a group of large matrix products from one of small elementwise passes.
GEMM_FLOPS_PER_S = 4e14
BYTES_PER_S = 2.5e12
LAUNCH_S = 5e-6


class GroupStepOptimizer(Optimizer):
    """``step`` runs the closure, then ``_step_group`` once per param group that has params.

    Under a CUDA graph (``graph.GraphedStep``) the step's kernels are captured once and replayed;
    what changes from step to step on the host (the scheduled lr, CautiousAdamW's step count and
    bias corrections) is then computed by ``prepare_graph_step`` before each replay, for the step
    about to run, and written into 0-d device tensors that the captured kernels read
    (``_graph_scalar``). Preparing advances no host counter, so it can run before the NaN guard
    decides the step (a skipped step leaves them as they were); ``commit_graph_step`` advances
    them once the step has run. A step run inside ``graph_mode()`` (the capture) neither
    advances host counters nor bakes per-step host values into the graph (what is fixed for a
    run, betas, eps and weight decay, is). ``graph_mode(go)`` also hands the step a 0-d device
    bool: every write to a parameter or an optimizer state then keeps the old value where ``go``
    holds False (``write_if``), so that the NaN guard can skip a replayed step on the device.
    ``graph_mode(go, lanes)`` also spreads the step's param groups over CUDA streams: groups touch
    disjoint parameters and states, so each runs whole on one stream (``graph.StreamLanes``)."""

    _graph_scalars: dict | None = None  # the device scalars prepare_graph_step writes
    _in_graph = False  # inside graph_mode(): the step reads them
    _go: torch.Tensor | None = None  # inside graph_mode(go): the state writes follow it
    _lanes = None  # inside graph_mode(go, lanes): the streams the groups' steps are spread over

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [g for g in self.param_groups if g["params"]]
        if self._lanes is None:
            for group in groups:
                self._step_group(group)
            return loss
        # dearest first (the groups are independent, so their order changes no value): the
        # greedy assignment then balances the lanes better
        for cost, n, group in sorted(((self._group_cost(g), n, g) for n, g in enumerate(groups)),
                                     key=lambda t: (-t[0], t[1])):
            with self._lanes.take(cost):
                self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError  # abstract: each optimizer supplies its update

    def _group_cost(self, group: dict[str, Any]) -> float:
        """A rough estimate of the GPU seconds of ``_step_group(group)``, by which
        ``graph_mode(lanes=...)`` balances the groups over its streams; no device work."""
        raise NotImplementedError  # abstract: each optimizer supplies its estimate

    def _prepare_host_step(self, index: int, group: dict[str, Any]) -> Iterator[tuple[tuple, float, torch.device, torch.dtype]]:
        """The host half of the next step of group ``index``, for a CUDA graph's replay: yields
        (key, value, device, dtype) of every per-step scalar the group's kernels read through
        ``_graph_scalar(key)``, computed for the step about to run, without advancing any host
        counter (``_commit_host_step`` does)."""
        raise NotImplementedError  # abstract: each optimizer supplies its per-step scalars

    def _commit_host_step(self, index: int, group: dict[str, Any]) -> None:
        """Advance group ``index``'s host counters by the step ``_prepare_host_step`` prepared (none by
        default)."""

    @torch.no_grad()
    def prepare_graph_step(self) -> None:
        """Before each replay of a captured step (and before the capture): the scalars of the
        step about to run written into the device tensors the graph reads. Advances nothing:
        preparing again (after a skipped step) writes the same values."""
        if self._graph_scalars is None:
            self._graph_scalars = {}
        for index, group in enumerate(self.param_groups):
            if group["params"]:
                for key, value, device, dtype in self._prepare_host_step(index, group):
                    t = self._graph_scalars.get(key)
                    if t is None:
                        t = self._graph_scalars[key] = torch.empty((), dtype=dtype, device=device)
                    t.fill_(value)

    @torch.no_grad()
    def commit_graph_step(self) -> None:
        """After a step that ran from the prepared scalars (a warm-up step in graph mode, or a
        replay, the first one right after the capture): advance the host counters as the eager
        step does."""
        for index, group in enumerate(self.param_groups):
            if group["params"]:
                self._commit_host_step(index, group)

    def grads_by_address(self) -> list[torch.Tensor]:
        """The parameters whose gradients the step reads through device tables of addresses that
        ``prepare_capture`` rewrites, rather than at fixed addresses: a CUDA graph of the step
        then reads each step's gradients where they are (none by default)."""
        return []

    def prepare_capture(self) -> None:
        """Right before the capture, with ``p.grad`` the graph's static buffers (or, for
        ``grads_by_address``, the step's own gradients), and, for an optimizer with such
        parameters, again before each replay: whatever the step would otherwise set up on the
        device from the host inside the capture (none by default)."""

    def end_graph(self) -> None:
        """Forget the device scalars (the graph was dropped, e.g. after a checkpoint load)."""
        self._graph_scalars = None

    @contextlib.contextmanager
    def graph_mode(self, go: torch.Tensor | None = None, lanes=None):
        """Steps inside read the scalars of the last ``prepare_graph_step`` and advance no host
        counter: what a CUDA graph captures (a step outside is the ordinary eager step). ``go``:
        a 0-d bool on the parameters' device; where it holds False when the step's kernels run,
        they change no parameter and no state. ``lanes``: an open ``graph.StreamLanes``; each
        param group's step then runs on the lane it assigns."""
        if self._graph_scalars is None:
            raise RuntimeError("graph_mode() needs a prepare_graph_step() first")
        if go is not None and (go.dtype != torch.bool or go.numel() != 1):
            raise TypeError(f"graph_mode(go): a 0-d bool tensor, got {tuple(go.shape)} {go.dtype}")
        self._in_graph, self._go, self._lanes = True, go, lanes
        try:
            yield
        finally:
            self._in_graph, self._go, self._lanes = False, None, None

    @property
    def in_graph(self) -> bool:
        return self._in_graph

    @property
    def go(self) -> torch.Tensor | None:
        """The flag of ``graph_mode(go)`` that the step's state writes follow; None: they update."""
        return self._go

    def _graph_scalar(self, key: tuple) -> torch.Tensor:
        return self._graph_scalars[key]

    def _group_index(self, group: dict[str, Any]) -> int:
        return next(i for i, g in enumerate(self.param_groups) if g is group)


def write_if(go: torch.Tensor | None, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i] ← src[i]`` in one multi-tensor copy; with ``go`` (a 0-d device bool) each ``dst``
    keeps its value where ``go`` holds False (a select, not a blend: NaN in ``src`` stays out),
    one tensor at a time, so that one select's temporary is alive at once."""
    if go is None:
        if dst:
            torch._foreach_copy_(dst, src)
        return
    for s, d in zip(src, dst):
        d.copy_(torch.where(go, s, d))
