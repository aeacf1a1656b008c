"""The Triton GDN op's plumbing: the eager autograd.Function and the torch.library custom ops
(what torch.compile traces) run the same launches, the op's arguments reach every launch, and
torch.compile(fullgraph=True) traces it (aot_eager on the CPU)."""

from __future__ import annotations

import pytest
import torch

from gdn_parity import DEVICE, make_inputs
from hymo_kernels.gdn import backward, gated_delta_rule, output, prep, wy
from hymo_kernels.gdn import chunk as gdn_chunk
from hymo_kernels.gdn import config as gdn_config
from hymo_kernels.gdn.chunk import chunk_gated_delta_rule
from hymo_kernels.gdn.naive import naive_recurrent_gated_delta_rule

pytestmark = pytest.mark.usefixtures("nan_poison")

# the stage modules whose launchers read the problem's precisions (problem._geom)
GEOM_USERS = (wy, prep, output, backward)


def spy_geom(monkeypatch, record):
    """Calls record(p) at every launch that reads the problem's precisions."""
    for mod in GEOM_USERS:
        real = mod._geom

        def spy(p, _real=real):
            record(p)
            return _real(p)

        monkeypatch.setattr(mod, "_geom", spy)


class _OpNames:
    """Records the aten / custom op names dispatched inside a `with` block (`fills`: the ones
    that write a constant other than nan_poison's NaN)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        names = self.names = []
        fills = self.fills = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                names.append(name)
                poison = "fill_" in name and len(args) > 1 and args[1] != args[1]  # NaN
                if ("zero" in name or "fill" in name or "full" in name) and not poison:
                    fills.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _via_custom_op(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None):
    """The public op's math through the registered custom ops (the path torch.compile takes)."""
    o, ht, _, _ = torch.ops.hymo_kernels.gdn_chunk_fwd(q, k, v, g, beta, initial_state, cu_seqlens,
                                                        q.shape[-1] ** -0.5, False)
    return o, (ht if output_final_state else None)


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_backward_fills_no_zero_gradients(path):
    """The backward gets None, not zero tensors filled by autograd, for the outputs nobody
    differentiates (final state, saved states, T): ~60 MB of fill per call at the HyMo shape."""
    fn = chunk_gated_delta_rule if path == "eager" else _via_custom_op
    x = make_inputs(1, 20, 1, 16, 16, n_states=0, dtype=torch.float32)
    t = [x[n].requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    o, _ = fn(*t)
    with _OpNames() as ops:
        o.sum().backward()
    assert all(t_.grad is not None for t_ in t)
    assert ("hymo_kernels.gdn_chunk_bwd.default" in ops.names) == (path == "custom_op"), ops.names
    assert not ops.fills, ops.names


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
def test_eager_path_equals_custom_op_path(varlen, bwd_path):
    """Eager calls skip the custom ops' dispatch (host time, DESIGN.md) and run the same
    launches: outputs, final state and every gradient equal the custom-op path's bit for bit."""
    x = make_inputs(1 if varlen else 2, 41, 2, 16, 32, n_states=3 if varlen else 2, dtype=torch.float32)
    cu = torch.tensor([0, 7, 30, 41], dtype=torch.int32, device=DEVICE) if varlen else None
    names = ("q", "k", "v", "g", "beta", "h0")
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(x["v"].shape, generator=gen).to(DEVICE)
    dht = torch.randn(x["h0"].shape, generator=gen).to(DEVICE)
    res = []
    for fn in (chunk_gated_delta_rule, _via_custom_op):
        t = [x[n].clone().requires_grad_() for n in names]
        with _OpNames() as ops:
            o, ht = fn(*t[:5], initial_state=t[5], output_final_state=True, cu_seqlens=cu)
        assert ("hymo_kernels.gdn_chunk_fwd.default" in ops.names) == (fn is _via_custom_op)
        torch.autograd.backward([o, ht], [do, dht])
        res.append([o, ht] + [a.grad for a in t])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("field", ["dot_bf16", "t_bf16"])
@pytest.mark.parametrize("table", [False, True], ids=["table-off", "table-on"])
@pytest.mark.parametrize("arg", [None, True, False])
@pytest.mark.parametrize("via_custom_op", [False, True], ids=["eager", "custom-op"])
def test_precision_arguments_reach_every_launch(field, arg, table, via_custom_op, monkeypatch):
    """chunk_gated_delta_rule(dot_bf16=..., t_bf16=...) overrides the table in the forward and
    the backward, on the eager path and through the custom ops; None keeps the table's setting."""
    monkeypatch.setitem(gdn_config.TABLE, (32, 32), dict(gdn_config.TABLE[(32, 32)], **{field: table}))
    assert getattr(gdn_config.get_config(16, 16), field) == table
    expected = table if arg is None else arg
    seen = []
    spy_geom(monkeypatch, lambda p: seen.append(getattr(p.cfg, field)))
    if via_custom_op:  # what torch.compile traces
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = make_inputs(1, 20, 1, 16, 16, n_states=0, dtype=torch.float32)
    t = [x[n].requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    with _OpNames() as ops:
        o, _ = chunk_gated_delta_rule(*t, **{field: arg})
    assert ("hymo_kernels.gdn_chunk_fwd.default" in ops.names) == via_custom_op
    n_fwd = len(seen)
    o.sum().backward()
    assert n_fwd >= 3 and len(seen) > n_fwd and set(seen) == {expected}


@pytest.mark.parametrize("arg", [None, "local", "local_sub"])
@pytest.mark.parametrize("via_custom_op", [False, True], ids=["eager", "custom-op"])
def test_bwd_path_argument_reaches_every_launch(arg, via_custom_op, monkeypatch):
    """chunk_gated_delta_rule(bwd_path=...) picks the backward (and what the forward saves for it)
    in the forward and the backward, eager and through the custom ops; None keeps the table's."""
    assert gdn_config.get_config(16, 16).local_sub_states  # the table's choice
    seen, saved = [], []
    spy_geom(monkeypatch, lambda p: seen.append(p.cfg.local_sub_states))
    real = gdn_chunk.run_bwd_local

    def bwd_local(p, tinv, do, states, dstates):
        saved.append(states.shape[0] // p.NC)
        return real(p, tinv, do, states, dstates)

    monkeypatch.setattr(gdn_chunk, "run_bwd_local", bwd_local)
    if via_custom_op:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = make_inputs(1, 40, 1, 16, 16, n_states=0, dtype=torch.float32)
    t = [x[n].requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    with _OpNames() as ops:
        o, _ = chunk_gated_delta_rule(*t, bwd_path=arg)
    assert ("hymo_kernels.gdn_chunk_fwd.default" in ops.names) == via_custom_op
    o.sum().backward()
    sub = gdn_config.BWD_PATHS[arg or "local_sub"]["local_sub_states"]
    cfg = gdn_config.get_config(16, 16, 1)
    assert set(seen) == {sub} and saved == [cfg.BT // cfg.BC if sub else 1]
    ref = make_inputs(1, 40, 1, 16, 16, n_states=0, dtype=torch.float32)
    r = [ref[n].requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    o_ref, _ = naive_recurrent_gated_delta_rule(*r)
    o_ref.sum().backward()
    for a, b in zip(t, r):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_dispatcher_uses_the_kernel():
    x = make_inputs(1, 20, 1, 16, 16, n_states=0, dtype=torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o1, _ = gated_delta_rule(*args, backend="triton")
    o2, _ = chunk_gated_delta_rule(*args)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)


@pytest.mark.parametrize("precisions", [(), (True, True), (None, None, "local")],
                         ids=["table", "precision-args", "bwd-path-arg"])
def test_opcheck(bwd_path, precisions):
    x = make_inputs(1, 19, 1, 16, 16, n_states=1, dtype=torch.float32)
    args = ([x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
            + [x["h0"].clone().requires_grad_(), None, 0.25, False, *precisions])
    torch.library.opcheck(torch.ops.hymo_kernels.gdn_chunk_fwd.default, args)


PRECISION_ARGS = pytest.mark.parametrize("precisions", [{}, dict(dot_bf16=True, t_bf16=True)],
                                         ids=["table", "precision-args"])


@PRECISION_ARGS
def test_compile_fullgraph_matches_eager(bwd_path, precisions):
    """torch.compile(fullgraph=True) traces through the custom ops (no graph break), also with
    the op's keyword arguments (gdn_dot_precision other than "table"), on every backward path."""
    _compile_matches_eager(precisions)


def _compile_matches_eager(precisions):
    x = make_inputs(1, 33, 2, 16, 16, n_states=1, dtype=torch.float32)

    def f(q, k, v, g, beta, h0):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, **precisions)
        return (o * o).sum() + ht.sum()

    names = ("q", "k", "v", "g", "beta", "h0")
    eager = [x[n].clone().requires_grad_() for n in names]
    comp = [x[n].clone().requires_grad_() for n in names]
    torch._dynamo.reset()
    # aot_eager on CPU (Inductor would need a C++ toolchain); the GPU test uses Inductor
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    loss_c = torch.compile(f, fullgraph=True, backend=backend)(*comp)
    loss_e = f(*eager)
    loss_c.backward()
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(comp, eager):
        torch.testing.assert_close(a.grad, b.grad)


def test_varlen_tables_are_built_once_per_packed_batch():
    """The per-chunk tables of a packed batch are reused while the same, unmodified cu_seqlens
    tensor comes back (every layer and backward of one batch); another tensor or an in-place
    change rebuilds them, and the reused ones equal a fresh build."""
    from hymo_kernels.gdn import problem

    cu = torch.tensor([0, 5, 70, 71, 130], dtype=torch.int32, device=DEVICE)
    NC, BT = problem._num_chunks(1, 130, 4, True, 64), 64
    first = problem._varlen_tables(cu, NC, BT)
    assert problem._varlen_tables(cu, NC, BT) is first
    fresh = problem._build_varlen_tables(cu, NC, BT)
    assert all(torch.equal(a, b) for a, b in zip(first, fresh))
    other = problem._varlen_tables(cu.clone(), NC, BT)
    assert other is not first and all(torch.equal(a, b) for a, b in zip(other, fresh))
    cu[1] = 6  # in place: the version changes
    moved = problem._varlen_tables(cu, NC, BT)
    assert moved is not first and not torch.equal(moved[0], fresh[0])
    assert all(torch.equal(a, b) for a, b in zip(moved, problem._build_varlen_tables(cu, NC, BT)))
    with torch.inference_mode():  # inference tensors have no version counter: built each time
        cu_inf = cu.clone()
        built = problem._varlen_tables(cu_inf, NC, BT)
        assert all(torch.equal(a, b) for a, b in zip(built, moved))
