"""Every optimizer's step as one CUDA graph, replayed once per training step.

Why: the step is thousands of small kernels (NorMuon's per-shape batches, CautiousAdamW's
multi-tensor passes). Launched eagerly after the NaN guard's host read of the gradients'
finiteness, which waits for the backward, they left the GPU idle while the host launched them
one by one (hymo_small: 42 % busy inside the step, BENCHMARKS.md). Replayed as one graph they
run back to back.

How: each step's host half runs first (``stage``, which the optimizers' container calls before
the NaN guard's verdict, so that it overlaps the backward still running on the GPU): each
optimizer's ``prepare_graph_step`` computes the scalars of the step about to run (the scheduled
lr, CautiousAdamW's bias corrections) into 0-d device tensors, advancing no host counter, and,
after the warm-up, the gradients are copied into static buffers (one multi-tensor copy; a
parameter without a gradient gets zeros, as the eager step gives it), except those an optimizer
reads through device tables of addresses (``grads_by_address``: NorMuon's fused kernels), whose
tables are pointed at the step's own gradients instead (``prepare_capture``, rewriting a table
in place where an address changed): no copy of them is made or kept. A step the guard skips thus
changes nothing. The first ``warmup_steps`` steps run eagerly on a side stream, reading those
tensors as the capture will (torch.compile compiles the optimizers' compiled maths for them
here, since no compile can run inside a capture; the libraries' workspaces are set up on the
capture's stream). After that, the first time, the optimizers' steps are captured with the
parameters' ``.grad`` pointing at the static buffers (or the gradients read by address); then
the graph is replayed (``launch``). After a warm-up step, or once the host knows a replayed step
was good (``commit``), ``commit_graph_step`` advances the host counters (CautiousAdamW's step
counts). Parameters and optimizer states are updated in place, so their addresses stay the
graph's; the scalars are the eager step's values, so the updates are the eager step's (a CPU
test checks the host half, a GPU test the graph).

The skip decided on the device: after the warm-up, the optimizers' container launches the
replay right behind the NaN guard's device-side verdict (``launch(go)``) and reads the verdict
on the host only at the next step (hymo_recipes/titan/optimizers.py), so neither the GPU nor the
host waits for the other at the update. Every state write of the captured step (parameters,
momenta, second moments) keeps the old value where the flag ``go`` says the step is skipped
(``GroupStepOptimizer.graph_mode(go)``): a skipped replay runs and changes nothing; ``commit``
advances the host counters only for a step the host found good.

Streams: param groups share no parameter and no state, so with ``streams`` > 1 the step's groups
run as parallel branches (``StreamLanes``): each group whole on one stream, the groups assigned
greedily, dearest first within each optimizer, by an estimate of their GPU time
(``_group_cost``). With the MoE on NorMuon the expert matrices are a group of their own, so
their orthogonalisation runs beside the small matrices' short launches, which leave most of the
GPU idle one after the other, and beside the memory-bound passes. The kernels are the ones a
single stream runs. The price is memory: the caching allocator, the graph's pool included,
reuses a freed block only on its own stream, and groups running together hold their
temporaries together.

Limits, refused up front (hymo_recipes/titan/preflight.py): one CUDA device and one rank (the
optimizers' collectives are not captured) and HyMo's own optimizers (torch's AdamW has no host
half here); ``GraphedStep`` refuses them too. The static gradient buffers are a second copy of
the gradients not read by address (4 bytes per fp32 parameter). After ``load_state_dict``
replaces the state tensors the graph is dropped (``reset``) and captured again after the
warm-up. The graph's private memory pool keeps the step's temporaries allocated between steps.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hymo_recipes.optim._base import GroupStepOptimizer
from hymo_recipes.optim._dist import local, shard_spec

__all__ = ["GraphedStep", "StreamLanes"]


class StreamLanes:
    """``n`` CUDA streams that independent pieces of work are spread over: ``take(cost)`` runs its
    body on the lane with the least estimated work so far (the first such lane), after
    everything queued on the opening stream up to that point; closing joins the lanes that ran
    something back into the opening stream (a lane that never forked from a capturing stream
    must not be joined into it). Inside a CUDA graph's capture the lanes become parallel
    branches of the graph. A piece must allocate what it uses on its lane (inside ``take``) or
    use tensors that outlive the lanes: a temporary of the opening stream could be reused there
    while a lane still reads it. The assignment depends only on the costs in their order, so a
    warm-up and the capture after it put each piece on the same lane (and the libraries'
    per-stream workspaces the warm-up set up are the capture's)."""

    def __init__(self, device: torch.device, n: int):
        if n < 1:
            raise ValueError(f"StreamLanes takes at least one stream, got {n}")
        self.device = device
        self.streams = [torch.cuda.Stream(device) for _ in range(n)]
        self._origin = None
        self.load = [0.0] * n
        self.used: list[int] = []  # the lanes the last open() ran something on, in first-use order

    @contextlib.contextmanager
    def open(self):
        if self._origin is not None:
            raise RuntimeError("StreamLanes.open: already open")
        self._origin = torch.cuda.current_stream(self.device)
        self.load = [0.0] * len(self.streams)
        self.used = []
        try:
            yield self
        finally:
            origin, self._origin = self._origin, None
            for i in self.used:
                origin.wait_stream(self.streams[i])

    @contextlib.contextmanager
    def take(self, cost: float):
        if self._origin is None:
            raise RuntimeError("StreamLanes.take outside open()")
        i = min(range(len(self.streams)), key=self.load.__getitem__)
        self.load[i] += cost
        lane = self.streams[i]
        lane.wait_stream(self._origin)
        if i not in self.used:
            self.used.append(i)
        with torch.cuda.stream(lane):
            yield


class GraphedStep:
    """Runs ``step()`` of ``optimizers`` (HyMo's GroupStepOptimizers, every parameter on one CUDA
    device) through one captured CUDA graph after ``warmup_steps`` eager steps."""

    def __init__(self, optimizers: list[GroupStepOptimizer], warmup_steps: int = 1, streams: int = 1):
        bad = [type(o).__name__ for o in optimizers if not isinstance(o, GroupStepOptimizer)]
        if bad:
            raise ValueError(f"a CUDA graph of the optimizer step takes HyMo's NorMuon and CautiousAdamW, not {bad}")
        self.optimizers = list(optimizers)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("a CUDA graph of the optimizer step runs on one rank only (the optimizers' collectives "
                             "are not captured)")
        self.params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        if any(shard_spec(p).sharded for p in self.params):
            raise ValueError("a CUDA graph of the optimizer step takes parameters sharded over one rank at most")
        self.warmup_steps = warmup_steps
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
            raise ValueError(f"a CUDA graph of the optimizer step runs on one stream or more, got {streams!r}")
        self.streams = streams
        self._lanes = None
        # the parameters (indices into params) whose gradients the step reads by address: no
        # static copy for them; a zero gradient kept for those without one
        self._address_readers = [o for o in self.optimizers if o.grads_by_address()]
        by_address = {id(p) for o in self._address_readers for p in o.grads_by_address()}
        self._by_address = {i for i, p in enumerate(self.params) if id(p) in by_address}
        self._zeros: dict[int, torch.Tensor] = {}
        self.captures = 0  # how many times a graph was captured (a test reads it)
        # the device is checked at the first step, not here: a run that builds the optimizers and
        # never steps them (TorchTitan's seed checkpoint, on the CPU) must not be refused
        self.device = self._stream = None
        self.reset()

    def _find_device(self) -> None:
        devices = {local(p).device for p in self.params}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"a CUDA graph of the optimizer step needs every parameter on one CUDA device, "
                             f"got {sorted(str(d) for d in devices)}")
        self.device = next(iter(devices))
        self._stream = torch.cuda.Stream(self.device)
        if self.streams > 1:
            self._lanes = StreamLanes(self.device, self.streams)

    def reset(self) -> None:
        """Drop the graph (the optimizer state tensors were replaced, e.g. by a checkpoint load):
        the next ``warmup_steps`` steps run eagerly, then the step is captured anew."""
        self._graph = None
        self._static = None
        self._seen: dict[int, tuple] = {}  # (shape, dtype) of each gradient read by address
        self._go = None  # the device flag the step's state writes follow (launch)
        self._eager_left = self.warmup_steps
        for o in self.optimizers:
            o.end_graph()

    @torch.no_grad()
    def stage(self) -> None:
        """The step's host half now: the optimizers' scalars for the step about to run
        (``prepare_graph_step``, which advances no counter) and, after the warm-up, this step's
        gradients copied into the graph's static buffers, or, for those read by address, the
        tables pointed at them (``prepare_capture``). The optimizers' container calls it
        before the NaN guard's verdict, so that this host work and its launches run while the
        GPU still works through the backward; a step the guard then skips changes nothing (the
        next stage overwrites both). ``step(staged=True)`` (the warm-up) or ``launch`` runs it."""
        if self.device is None:
            self._find_device()
        for o in self.optimizers:
            o.prepare_graph_step()
        if self._eager_left > 0:
            return
        grads = [p.grad for p in self.params]
        if self._graph is None:  # until the capture, the buffers follow this step's gradients
            self._static = [None if i in self._by_address else torch.zeros_like(local(p) if g is None else local(g))
                            for i, (p, g) in enumerate(zip(self.params, grads))]
        self._load_grads(grads)
        self._point_tables(grads)

    @torch.no_grad()
    def step(self, staged: bool = False) -> None:
        """One optimizer step: eager during the warm-up, then the captured graph. ``staged``: this
        step's ``stage()`` already ran (else it runs here)."""
        if not staged:
            self.stage()
        if self._eager_left > 0:
            # the captured code path run eagerly: compiled maths compiles here for the device
            # scalars it will see in the capture, where a compile could not run
            self._eager_left -= 1
            self._on_side_stream(self._step_in_graph_mode)
        else:
            self.launch(None)
        self.commit()

    def decides_on_device(self) -> bool:
        """Whether the next step replays the graph, whose state writes a device flag can keep
        unchanged (``launch``): after the warm-up steps."""
        return self._eager_left == 0

    def launch(self, go: torch.Tensor | None) -> None:
        """Replays the captured step (capturing it the first time). ``go``: a 0-d device bool,
        False to keep every parameter and optimizer state as it was (the NaN guard's verdict, read
        on the host after this launch, so that the GPU runs the replay without waiting for the
        host); None updates. Advances no host counter: ``commit`` does, once the host knows the
        step updated."""
        if self._eager_left > 0:
            raise RuntimeError("GraphedStep.launch before the warm-up steps ran (use step)")
        self._flag()  # before any capture: the graph reads this tensor
        if self._graph is None:
            self._capture([p.grad for p in self.params])
        if go is None:
            self._go.fill_(True)
        else:
            self._go.copy_(go)
        self._graph.replay()

    def commit(self) -> None:
        """The host counters (CautiousAdamW's step counts) advanced by the step that ran; after
        the launch, so this host work overlaps the replay."""
        for o in self.optimizers:
            o.commit_graph_step()

    def _flag(self) -> torch.Tensor:
        """The device flag the step's state writes follow; made true after each ``reset``, so
        that the warm-up steps update."""
        if self._go is None:
            self._go = torch.ones((), dtype=torch.bool, device=self.device)
        return self._go

    def _step_in_graph_mode(self) -> None:
        with contextlib.ExitStack() as modes:
            lanes = None if self._lanes is None else modes.enter_context(self._lanes.open())
            for o in self.optimizers:
                modes.enter_context(o.graph_mode(self._flag(), lanes))
            for o in self.optimizers:
                o.step()

    def _on_side_stream(self, fn) -> None:
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            fn()
        current.wait_stream(self._stream)

    def _load_grads(self, grads) -> None:
        dst, src, zero = [], [], []
        for s, g in zip(self._static, grads):
            if s is None:  # read where it is (grads_by_address)
                continue
            if g is None:
                zero.append(s)
                continue
            g = local(g)
            if g.shape != s.shape or g.dtype != s.dtype:
                raise RuntimeError(f"a gradient changed from {tuple(s.shape)} {s.dtype} to {tuple(g.shape)} {g.dtype} "
                                   "between CUDA-graphed optimizer steps")
            dst.append(s)
            src.append(g)
        if dst:
            torch._foreach_copy_(dst, src)
        if zero:
            torch._foreach_zero_(zero)

    def _graph_grads(self, grads) -> list[torch.Tensor]:
        """What the graph reads as each parameter's gradient: its static buffer, or, read by
        address, the step's own gradient (a zero tensor kept for the graph where there is none)."""
        out = []
        for i, (p, s, g) in enumerate(zip(self.params, self._static, grads)):
            if s is None:
                if g is None:
                    s = self._zeros.get(i)
                    if s is None:
                        s = self._zeros[i] = torch.zeros_like(local(p))
                else:
                    s = local(g)
                seen = self._seen.setdefault(i, (s.shape, s.dtype))
                if seen != (s.shape, s.dtype):  # the captured kernels are specialised to it
                    raise RuntimeError(f"a gradient changed from {tuple(seen[0])} {seen[1]} to {tuple(s.shape)} "
                                       f"{s.dtype} between CUDA-graphed optimizer steps")
            out.append(s)
        return out

    @contextlib.contextmanager
    def _grads_as(self, tensors, only=None):
        """``p.grad`` of every parameter (``only``: of those indices) set to ``tensors[i]``
        (wrapped like p) inside, restored after."""
        idx = range(len(self.params)) if only is None else sorted(only)
        saved = [(i, self.params[i].grad) for i in idx]
        try:
            for i in idx:
                p, s = self.params[i], tensors[i]
                p.grad = (DTensor.from_local(s, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                             stride=p.stride()) if isinstance(p, DTensor) else s)
            yield
        finally:
            for i, g in saved:
                self.params[i].grad = g

    def _point_tables(self, grads) -> None:
        """The address tables of the gradients read by address, pointed at this step's (rewritten
        in place where an address changed: the captured graph reads the tables)."""
        if not self._by_address:
            return
        with self._grads_as(self._graph_grads(grads), only=self._by_address):
            for o in self._address_readers:
                o.prepare_capture()

    def _capture(self, grads) -> None:
        # the optimizers read p.grad while they are captured: the static buffers, or for those
        # read by address this step's gradients, wrapped like p
        with self._grads_as(self._graph_grads(grads)):
            for o in self.optimizers:
                o.prepare_capture()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the data prefetch thread keeps copying batches while the step is captured
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                self._step_in_graph_mode()
        self._graph = graph
        self.captures += 1
