"""The optimizer step as one CUDA graph (hymo_recipes/optim/graph.py): its host half and its step
order (stand-ins for the stream and the graph) on the CPU, the graph against the eager step on a
GPU, and the refusals."""

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _tiny import loss_fn, batch, make_model, optim_config, sched_config, train_steps  # noqa: E402

from hymo_kernels.gdn import interpret_bounds  # noqa: E402
from hymo_recipes.optim.graph import GraphedStep  # noqa: E402
from hymo_recipes.titan.optimizers import build_hymo_lr_schedulers, build_hymo_optimizers  # noqa: E402


def build(model, **overrides):
    opts = build_hymo_optimizers([model], optim_config(**overrides), None)
    # a 10-step warmup-stable-decay schedule: the lr changes at every one of the steps below
    scheds = build_hymo_lr_schedulers(opts, sched_config(warmup_fraction=0.5, stable_fraction=0.0,
                                                         decay_fraction=0.5), 10)
    # every group its own lr (as muP's multipliers make them): a scalar of the wrong group shows
    for sched in scheds.schedulers:
        sched.base_lrs = [lr * (1 + 0.25 * i) for i, lr in enumerate(sched.base_lrs)]
        for group, lr in zip(sched.optimizer.param_groups, sched.base_lrs):
            group["lr"] = lr * sched.lr_lambdas[0](0)
    return opts, scheds


def assert_params_close(a, b):
    """Every parameter of model b close to a's (kernels captured in a graph may pick other GEMM
    algorithms than the eager ones)."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("compiled", [False, True, "both", "fused"],
                         ids=["eager", "adamw_compiled", "both_compiled", "normuon_fused"])
def test_host_half_then_graph_mode_step_equals_the_eager_step(compiled, monkeypatch):
    """What a replay does, without the graph: prepare_graph_step (this step's lr and bias
    corrections into device scalars), the step in graph mode (which reads them and advances
    nothing), then commit_graph_step (the host counters). It must give the eager step's parameters
    and state at every step of a schedule whose lr changes each step: a stale scalar or a counter
    advanced twice shows. The graph-mode steps run with a true skip flag (``go``), as a replay
    does. At step 3 a skipped step comes first: its host half and its kernels with gradients
    that hold NaN and a false flag, as the NaN guard skips a replay on the device. It must
    change nothing, bit for bit, parameters and states alike."""
    kw = (dict(normuon_fused=True) if compiled == "fused"
          else dict(adamw_compiled=bool(compiled), normuon_compiled=compiled == "both"))
    if compiled == "fused":
        # the fused passes around the orthogonalisation are what this checks; the iteration's own
        # kernel (tests/kernels/test_normuon_ns.py) writes no state and is the interpreter's
        # slowest part here, so both optimizers run its reference
        import hymo_kernels.normuon.ns_torch as ns_torch
        from hymo_recipes.optim import normuon
        monkeypatch.setattr(normuon.ns_kernels, "iterate", ns_torch.iterate)
    eager, graphed = make_model(), make_model()
    opts_e, scheds_e = build(eager, **kw)
    opts_g, scheds_g = build(graphed, **kw)
    for step in range(1, 6):
        for model, opts in ((eager, opts_e), (graphed, opts_g)):
            opts.zero_grad()
            loss_fn(model, batch(step)).backward()
        for o in opts_e.optimizers:
            o.step()
        for o in opts_g.optimizers:
            o.prepare_capture()  # the fused kernels' address tables, as before a capture
            if step == 3:
                skipped_step_changes_nothing(graphed, o)
            o.prepare_graph_step()
            assert not o.in_graph and o.go is None
            with o.graph_mode(torch.tensor(True)):
                assert o.in_graph and bool(o.go)
                o.step()
            assert not o.in_graph and o.go is None
            o.commit_graph_step()
        scheds_e.step()
        scheds_g.step()
        # the device scalars hold the values the eager step passes (host products rounded to
        # fp32 once): bitwise the same parameters
        for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
            assert torch.equal(p, q), (step, name)
    steps_e = [s["step"].item() for s in opts_e.optimizers[1].state.values()]
    steps_g = [s["step"].item() for s in opts_g.optimizers[1].state.values()]
    assert steps_e == steps_g == [5.0] * len(steps_e)
    for o in opts_g.optimizers:
        o.end_graph()
        with pytest.raises(RuntimeError, match="needs a prepare_graph_step"):
            with o.graph_mode():
                pass


def skipped_step_changes_nothing(model, opt):
    """A step of ``opt`` in graph mode with a false flag and NaN in every other gradient (the
    real gradients put back afterwards): every parameter and state must keep its bits."""
    def snapshot():
        return ([p.detach().clone() for p in model.parameters()],
                [t.clone() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)])

    before = snapshot()
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    grads = [p.grad.clone() for p in params]
    for p in params[::2]:
        p.grad.view(-1)[0] = float("nan")
    opt.prepare_graph_step()
    with opt.graph_mode(torch.tensor(False)):
        opt.step()
    for g, p in zip(grads, params):
        p.grad.copy_(g)
    after = snapshot()
    assert len(after[1]) >= 2 * len(after[0]) // 3 > 0
    for kind, xs, ys in (("parameter", before[0], after[0]), ("state", before[1], after[1])):
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert torch.equal(x, y), f"{type(opt).__name__}: {kind} {i} changed by a skipped step"


def test_graphed_container_stops_at_the_limit_when_it_reads_the_late_verdict():
    """Two replayed steps skipped in a row with a limit of two: the second one's verdict is
    read a step later, and that read stops the run, naming the step."""
    from hymo_recipes.optim.nan_guard import NonFiniteTrainingError

    model = make_model()
    opts, scheds = build(model, consecutive_nan_limit=2)
    opts.graphed = _ReplayedEagerly(opts.optimizers)
    train_steps(model, opts, scheds, range(1, 4), nan_grad_steps={2, 3})  # 1: the warm-up
    assert opts.verdict_pending and opts.nan_guard.skipped_total == 1 and opts.nan_guard.steps_done == 3
    with pytest.raises(NonFiniteTrainingError, match=r"2 consecutive training steps \(through step 3\)"):
        opts.resolve()


def test_graph_mode_refuses_a_flag_that_is_not_one_bool():
    opts, _ = build(make_model())
    o = opts.optimizers[0]
    o.prepare_graph_step()
    for bad in (torch.tensor(1.0), torch.ones(2, dtype=torch.bool)):
        with pytest.raises(TypeError, match="a 0-d bool tensor"):
            with o.graph_mode(bad):
                pass
    assert not o.in_graph and o.go is None


def test_graph_mode_step_reads_the_prepared_lr():
    """In graph mode the step takes the lr prepare_graph_step wrote, not the group's: the graph
    replays kernels that read device scalars, and the host value is what prepare refreshes."""
    model = make_model()
    opts, _ = build(model)
    loss_fn(model, batch(1)).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for o in opts.optimizers:
        o.prepare_graph_step()
        for g in o.param_groups:
            g["lr"] = 1e6  # a later host change that only a new prepare_graph_step would carry
        with o.graph_mode():
            o.step()
    moved = max((p - before[n]).abs().max().item() for n, p in model.named_parameters())
    assert 0 < moved < 1.0


class _RecordingLanes:
    """A stand-in for graph.StreamLanes on the CPU: records the cost of each piece and which
    group ran inside it."""

    def __init__(self):
        self.pieces, self.inside = [], None

    @contextlib.contextmanager
    def take(self, cost):
        self.pieces.append([cost, 0])
        self.inside = self.pieces[-1]
        try:
            yield
        finally:
            self.inside = None


def test_graph_mode_with_lanes_steps_each_group_inside_one_piece():
    """With lanes, every non-empty param group's step runs whole inside one ``take`` (the groups
    are what the streams run side by side), with a positive cost estimate; the update is the one
    without lanes, bit for bit."""
    plain, laned = make_model(), make_model()
    lanes = _RecordingLanes()
    for model, use in ((plain, None), (laned, lanes)):
        opts, _ = build(model, normuon_fused=False)
        loss_fn(model, batch(1)).backward()
        for o in opts.optimizers:
            o.prepare_graph_step()
            if use is not None:
                real = o._step_group

                def counted(group, real=real):
                    assert lanes.inside is not None, "a group's step ran outside a lane"
                    lanes.inside[1] += 1
                    real(group)

                o._step_group = counted
            with o.graph_mode(None, use):
                o.step()
    groups = sum(1 for o in opts.optimizers for g in o.param_groups if g["params"])
    assert len(lanes.pieces) == groups and all(n == 1 for _, n in lanes.pieces)
    assert all(cost > 0 for cost, _ in lanes.pieces)
    for (name, p), q in zip(plain.named_parameters(), laned.parameters()):
        assert torch.equal(p, q), name


class _FakeStream:
    """A CUDA stream stand-in that logs the waits between streams and which stream is current."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append((self.name, other.name))


def _fake_cuda_streams(monkeypatch):
    """torch.cuda's Stream, current_stream and stream as graph.py calls them, on the CPU."""
    import hymo_recipes.optim.graph as graph_mod

    log, current, made = [], [], []

    def new_stream(device):
        made.append(_FakeStream(log, f"lane{len(made)}"))
        return made[-1]

    @contextlib.contextmanager
    def use(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    origin = _FakeStream(log, "origin")
    monkeypatch.setattr(graph_mod.torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(graph_mod.torch.cuda, "current_stream", lambda device=None: current[-1] if current else origin)
    monkeypatch.setattr(graph_mod.torch.cuda, "stream", use)
    return log, current


def test_stream_lanes_fork_before_each_piece_and_join_only_the_lanes_used(monkeypatch):
    """Each piece runs on the least-loaded lane after waiting for the opening stream; closing
    joins exactly the lanes that ran something (joining a lane that never forked from a
    capturing stream would invalidate the capture), also when a piece raises; the same costs
    give the same lanes again (the warm-up's lanes are the capture's)."""
    from hymo_recipes.optim.graph import StreamLanes

    log, current = _fake_cuda_streams(monkeypatch)
    lanes = StreamLanes(torch.device("cpu"), 4)
    with pytest.raises(ValueError, match="at least one stream"):
        StreamLanes(torch.device("cpu"), 0)
    ran = []
    for _ in range(2):
        log.clear()
        with lanes.open():
            for cost in (5.0, 1.0, 1.0):
                with lanes.take(cost):
                    ran.append(current[-1].name)
        assert log == [("lane0", "origin"), ("lane1", "origin"), ("lane2", "origin"),
                       ("origin", "lane0"), ("origin", "lane1"), ("origin", "lane2")]
    assert ran == ["lane0", "lane1", "lane2"] * 2 and lanes.load == [5.0, 1.0, 1.0, 0.0]
    log.clear()
    with pytest.raises(RuntimeError, match="a piece failed"):
        with lanes.open():
            with lanes.take(1.0):
                raise RuntimeError("a piece failed")
    assert log == [("lane0", "origin"), ("origin", "lane0")] and not current
    with pytest.raises(RuntimeError, match="outside open"):
        with lanes.take(1.0):
            pass


def test_group_cost_grows_with_the_work():
    """The lanes' balance: a group of more or larger matrices is estimated dearer, for NorMuon and
    for CautiousAdamW; per added element NorMuon's (the orthogonalisation's products) is dearer."""
    from hymo_recipes.optim.cautious_adamw import CautiousAdamW
    from hymo_recipes.optim.normuon import NorMuon

    shapes = [(64, 128), (4, 512, 896), (8, 512, 896)]
    mu = NorMuon([{"params": [torch.nn.Parameter(torch.zeros(s))]} for s in shapes], lr=0.01)
    ad = CautiousAdamW([{"params": [torch.nn.Parameter(torch.zeros(s))]} for s in shapes], lr=0.01)
    c = [mu._group_cost(g) for g in mu.param_groups]
    a = [ad._group_cost(g) for g in ad.param_groups]
    assert c[0] < c[1] < c[2] and a[0] < a[1] < a[2]
    assert c[2] - c[1] > 3 * (a[2] - a[1])


def test_graphed_step_refuses_the_cpu_and_other_optimizers():
    model = make_model()
    opts, _ = build(model)
    graphed = GraphedStep(opts.optimizers)  # built without a step (a seed checkpoint): not refused
    with pytest.raises(ValueError, match=r"needs every parameter on one CUDA device, got \['cpu'\]"):
        graphed.step()
    with pytest.raises(ValueError, match=r"takes HyMo's NorMuon and CautiousAdamW, not \['AdamW'\]"):
        GraphedStep([torch.optim.AdamW(model.parameters())])
    with pytest.raises(ValueError, match=r"one stream or more, got 0"):
        GraphedStep(opts.optimizers, streams=0)


def _interpret_fused(monkeypatch):
    """NorMuon's fused passes (in Triton's interpreter on a CPU), the iteration by its reference:
    its own kernel (tests/kernels/test_normuon_ns.py) writes no state and is the interpreter's
    slowest part."""
    import hymo_kernels.normuon.ns_torch as ns_torch
    from hymo_recipes.optim import normuon

    monkeypatch.setattr(normuon.ns_kernels, "iterate", ns_torch.iterate)


class _ReplayedEagerly(GraphedStep):
    """GraphedStep's own step logic on the CPU: the side stream and the graph are stand-ins that
    run the captured code path eagerly (a replay is the step in graph mode with ``.grad`` at the
    static buffers and the launch's flag), so the order of stage, warm-up, capture, replay and a
    skip is checked without CUDA; the GPU test below runs the real graph."""

    def _find_device(self):
        self.device = torch.device("cpu")

    def _on_side_stream(self, fn):
        fn()

    def _capture(self, grads):
        outer = self

        class _Graph:
            def replay(self):
                # what the graph reads: the static buffers, and where gradients are read by
                # address only the tables the capture holds (pointed at this step's gradients
                # by the stage); p.grad is NaN there, so a read that bypasses them shows
                read = outer._graph_grads([p.grad for p in outer.params])
                tabled = [read[i] for i in outer._by_address]  # what the tables point at
                for i in outer._by_address:
                    read[i] = torch.full_like(read[i], float("nan"))
                readers = [o for o in outer.optimizers if o.grads_by_address()]
                for o in readers:
                    o._batch_tables = (lambda o: lambda group, j, b, *members: [
                        o._tables[(id(group), j, kind)][1] for kind in "gmwv"])(o)
                try:
                    # (the interpreter's bounds check: the kernels reach those through the tables)
                    with outer._grads_as(read), interpret_bounds.indirect(tabled):
                        outer._step_in_graph_mode()
                finally:
                    for o in readers:
                        del o._batch_tables

        with self._grads_as(self._graph_grads(grads)):
            for o in self.optimizers:
                o.prepare_capture()
        self._graph = _Graph()
        self.captures += 1


@pytest.mark.parametrize("skip,fused", [(1, False), (2, False), (3, False), (4, False), (5, False), (6, False),
                                        (8, False), (4, True)],
                         ids=["1", "2", "3", "4", "5", "6", "8", "4-normuon_fused"])
def test_graphed_container_with_a_skipped_step_equals_the_eager_one_on_the_cpu(skip, fused, monkeypatch):
    """The container's graphed step (stand-ins for the stream and the graph) against the eager
    container, with a NaN gradient that the guard skips at one step: the first warm-up (1), the
    first capture (2), a replay (3), the warm-up after a state load (5) or the capture after it
    (6), a replay whose verdict the state load reads (4) or the last step (8). The graph's stage
    runs before the guard's decision and, after the warm-up, its replay too, whose state writes
    follow the guard's device flag, so a skip must leave nothing behind: the same parameters
    bit for bit, the same step counts and schedule, two captures. ``fused``: NorMuon's fused
    kernels (interpreted), whose gradients the graph reads by address, through a state load."""
    if fused:
        _interpret_fused(monkeypatch)
    eager, graphed = make_model(), make_model()
    opts_e, scheds_e = build(eager, normuon_fused=fused)
    opts_g, scheds_g = build(graphed, normuon_fused=fused)
    opts_g.graphed = _ReplayedEagerly(opts_g.optimizers)
    launches = []
    launch = opts_g.graphed.launch
    opts_g.graphed.launch = lambda go: launches.append(go) or launch(go)
    losses = [train_steps(model, opts, scheds, range(1, 5), nan_grad_steps={skip})
              for model, opts, scheds in ((eager, opts_e, scheds_e), (graphed, opts_g, scheds_g))]
    for opts in (opts_e, opts_g):
        opts.load_state_dict(opts.state_dict())
    for model, opts, scheds, ls in ((eager, opts_e, scheds_e, losses[0]), (graphed, opts_g, scheds_g, losses[1])):
        ls += train_steps(model, opts, scheds, range(5, 9), nan_grad_steps={skip})
    assert losses[0] == losses[1]
    # the last replay's verdict is still unread (a checkpoint, a logging step or the next step
    # reads it): until then its step counts and the schedule's step wait
    assert opts_g.verdict_pending and opts_g.pending_go is not None
    if skip != 8:  # (a skipped last step: the eager schedule did not advance either)
        assert [s.get_last_lr() for s in scheds_g.schedulers] != [s.get_last_lr() for s in scheds_e.schedulers]
    opts_g.resolve()
    assert not opts_g.verdict_pending and opts_g.pending_go is None
    assert [s.get_last_lr() for s in scheds_g.schedulers] == [s.get_last_lr() for s in scheds_e.schedulers]
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(p, q), name
    assert opts_e.nan_guard.skipped_total == opts_g.nan_guard.skipped_total == 1
    assert opts_e.nan_guard.steps_done == opts_g.nan_guard.steps_done == 8
    counts = [[s["step"].item() for s in o.optimizers[1].state.values()] for o in (opts_e, opts_g)]
    assert counts[0] == counts[1] == [7.0] * len(counts[0])
    assert opts_g.graphed.captures == 2
    # the steps after each warm-up (one good eager step, again after the load before step 5)
    # replay, each launch with the guard's flag: False at the skipped step (the warm-up's host
    # decides first: a skipped warm-up step runs nothing)
    replayed, warmup_left = [], 1
    for step in range(1, 9):
        warmup_left = 1 if step == 5 else warmup_left
        if warmup_left:
            warmup_left -= step != skip
        else:
            replayed.append(step)
    assert [bool(go) for go in launches] == [s != skip for s in replayed]


def test_fused_normuon_gradients_are_read_by_address_without_a_copy(monkeypatch):
    """NorMuon's fused kernels read the gradients through address tables, so the graphed step
    keeps no static copy of them: the stage points the tables at each step's own gradients,
    rewriting the captured table tensors in place when the gradients moved (forced here: every
    step's gradients are fresh copies while the old ones are still alive). CautiousAdamW's
    gradients keep their copy. The updates equal the eager fused container's bit for bit."""
    _interpret_fused(monkeypatch)
    eager, graphed = make_model(), make_model()
    opts_e, scheds_e = build(eager, normuon_fused=True)
    opts_g, scheds_g = build(graphed, normuon_fused=True)
    graph = opts_g.graphed = _ReplayedEagerly(opts_g.optimizers)
    normuon = opts_g.optimizers[0]
    assert type(normuon).__name__ == "NorMuon" and normuon.grads_by_address()
    by_address = {id(p) for p in normuon.grads_by_address()}
    kept = []  # the earlier steps' gradients, alive, so that each step's land elsewhere
    tables_checked, tables = [], {}
    stage = graph.stage

    def stage_and_check():
        stage()
        if graph._static is None:
            return  # a warm-up step: no graph yet
        for p, s in zip(graph.params, graph._static):
            assert (s is None) == (id(p) in by_address)
        read = dict(zip(map(id, graph.params), graph._graph_grads([p.grad for p in graph.params])))
        for group in normuon.param_groups:
            gs = [read[id(p)] for p in group["params"]]  # a parameter without a gradient: the kept zeros
            for j, b in enumerate(normuon._batches(group["params"])):
                want = [gs[i].data_ptr() + e * b.rows * b.cols * gs[i].element_size()
                        for i in b.idxs for e in range(gs[i].numel() // (b.rows * b.cols))]
                table = normuon._tables[(id(group), j, "g")][1]
                assert table.tolist() == want
                # the same tensor as at the capture: the graph reads the tensor it captured
                assert tables.setdefault((id(group), j), table) is table
                tables_checked.append(j)

    graph.stage = stage_and_check
    step = opts_g.step

    def step_with_moved_grads(*a, **kw):
        for p in graphed.parameters():
            if p.grad is not None:
                kept.append(p.grad)
                p.grad = p.grad.clone()
        return step(*a, **kw)

    opts_g.step = step_with_moved_grads
    losses_e = train_steps(eager, opts_e, scheds_e, range(1, 5))
    losses_g = train_steps(graphed, opts_g, scheds_g, range(1, 5))
    assert losses_e == losses_g and graph.captures == 1 and tables_checked
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(p, q), name


def test_held_tables_are_rewritten_never_replaced():
    """Once a graph holds NorMuon's tables (prepare_capture until end_graph), gradients of
    another dtype would need new tables the graph does not read: refused in one line; after
    end_graph (the graph dropped) they are rebuilt."""
    model = make_model()
    opts, _ = build(model, normuon_fused=True)
    normuon = opts.optimizers[0]
    loss_fn(model, batch(1)).backward()
    normuon.prepare_capture()
    for p in normuon.grads_by_address():
        p.grad_dtype = None  # (a gradient of another dtype than its parameter's)
        p.grad = (torch.zeros_like(p) if p.grad is None else p.grad).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"changed count or dtype under a captured CUDA graph"):
        normuon.prepare_capture()
    normuon.end_graph()
    normuon.prepare_capture()
    assert {k[2] for k in normuon._tables} == {"g", "m", "w", "v"}


@pytest.mark.gpu
@pytest.mark.parametrize("compiled,streams", [(False, 1), (True, 1), ("fused", 1), ("fused", 3), ("fused", 8)],
                         ids=["eager", "compiled", "fused", "fused_3_streams", "fused_8_streams"])
def test_gpu_graphed_container_equals_the_eager_one(compiled, streams):
    """The container with cuda_graph on, against the same run without: a warm-up step, the capture,
    replays through a schedule whose lr changes each step, a parameter without a gradient, a state
    load in the middle (the graph is dropped and captured again) and a step the NaN guard skips
    after its gradients were staged into the graph's buffers (the next step stages its own). ``compiled``: both
    optimizers' maths under torch.compile, compiled in the warm-up for the graph's device scalars
    (a compile inside the capture would fail it). ``"fused"``: NorMuon's fused kernels, whose
    address tables are built before the capture and pointed at each step's gradients (read by
    address: no static copy of them); with
    ``streams`` 3 (and CautiousAdamW compiled, as hymo_small runs) the param groups' steps are
    parallel branches of the graph (with 8, more streams than the model has groups: the unused
    ones must stay out of the capture)."""
    kw = (dict(normuon_fused=True, adamw_compiled=streams > 1) if compiled == "fused"
          else dict(normuon_compiled=compiled, adamw_compiled=compiled))
    eager, graphed = make_model().cuda(), make_model().cuda()
    opts_e, scheds_e = build(eager, **kw)
    opts_g, scheds_g = build(graphed, cuda_graph=True, cuda_graph_streams=streams, **kw)
    assert opts_g.graphed.streams == streams
    assert opts_g.graphed is not None and opts_e.graphed is None
    losses_e = train_steps(eager, opts_e, scheds_e, range(1, 5))
    # a run compiles for one kind of scalars (the eager step's floats or the graph's device
    # tensors); two kinds in one process would double the graphs dynamo keeps per function
    torch._dynamo.reset()
    losses_g = train_steps(graphed, opts_g, scheds_g, range(1, 5))
    assert opts_g.graphed.captures == 1
    if streams > 1:  # the groups ran on several streams
        assert len(opts_g.graphed._lanes.used) == min(streams, sum(
            1 for o in opts_g.optimizers for g in o.param_groups if g["params"]))
    assert graphed.layers["0"].attn.unused_proj.weight.grad is None  # no gradient: zeros in the graph
    torch.testing.assert_close(torch.tensor(losses_g), torch.tensor(losses_e), rtol=1e-5, atol=0)
    assert_params_close(eager, graphed)
    for opts in (opts_e, opts_g):
        opts.load_state_dict(opts.state_dict())
    torch._dynamo.reset()
    losses_e += train_steps(eager, opts_e, scheds_e, range(5, 10), nan_grad_steps={7})
    torch._dynamo.reset()
    losses_g += train_steps(graphed, opts_g, scheds_g, range(5, 10), nan_grad_steps={7})
    opts_g.resolve()  # the last replay's verdict, as a checkpoint or a logging step reads it
    assert opts_g.graphed.captures == 2
    assert opts_e.nan_guard.skipped_total == opts_g.nan_guard.skipped_total == 1
    torch.testing.assert_close(torch.tensor(losses_g), torch.tensor(losses_e), rtol=1e-5, atol=0)
    assert_params_close(eager, graphed)
    assert all(torch.isfinite(p).all() for p in graphed.parameters())
    steps = {s["step"].item() for s in opts_g.optimizers[1].state.values()}
    assert steps == {8.0}
    assert opts_g.step_timer.collect()[1] == 9 and set(opts_g.step_timer.last_laps) == {"stage", "nan_check", "graph"}
