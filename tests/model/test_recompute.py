"""The SwiGLU's product recomputed in the backward (hymo_recipes/model/recompute.py): the same
values and gradients as plain autograd, the matmuls not rerun, the elementwise ops rerun; off
inside a block that an outer activation checkpoint recomputes whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _swiglu(x, w1, w2, w3):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 8, generator=g, requires_grad=True)
    ws = [torch.randn(s, generator=g, requires_grad=True) for s in ((12, 8), (8, 12), (12, 8))]
    return x, ws


def test_keep_matmuls_gives_autograds_values_and_gradients():
    from hymo_recipes.model.recompute import keep_matmuls

    x, ws = _inputs()
    dy = torch.randn(2, 16, 8)
    ref = _swiglu(x, *ws)
    ref_grads = torch.autograd.grad(ref, (x, *ws), dy)
    out = keep_matmuls(_swiglu, x, *ws)
    grads = torch.autograd.grad(out, (x, *ws), dy)
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)


def test_the_backward_reruns_the_elementwise_ops_and_not_the_matmuls():
    from hymo_recipes.model.recompute import keep_matmuls

    def backward_ops(fn):
        x, ws = _inputs()
        out = fn(_swiglu, x, *ws)
        with _Ops() as mode:
            out.sum().backward()
        return mode.ops

    aten = torch.ops.aten
    plain = backward_ops(lambda f, *a: f(*a))
    recomputed = backward_ops(keep_matmuls)
    assert aten.silu.default not in plain and aten.silu.default in recomputed
    assert plain.count(aten.mm.default) == recomputed.count(aten.mm.default) == 6


def test_without_autograd_it_is_a_plain_call(monkeypatch):
    from hymo_recipes.model import recompute

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint called without autograd")

    monkeypatch.setattr(recompute, "checkpoint", refuse)
    x, ws = _inputs()
    with torch.no_grad():
        out = recompute.keep_matmuls(_swiglu, x, *ws)
    assert torch.equal(out, _swiglu(x, *ws).detach())
    x.requires_grad_(False)
    for w in ws:
        w.requires_grad_(False)
    assert torch.equal(recompute.keep_matmuls(_swiglu, x, *ws), out)


def test_the_shared_experts_and_the_grouped_experts_use_it(monkeypatch):
    """FeedForward (shared experts) and grouped_swiglu (routed experts, torch._grouped_mm runs on
    the CPU) go through keep_matmuls: with it swapped for a counter, both call it once."""
    from hymo_recipes.model import grouped_mm, moe

    calls = []

    def counting(fn, *args, enabled=True):
        calls.append(fn.__name__)
        return fn(*args)

    monkeypatch.setattr(moe, "keep_matmuls", counting)
    monkeypatch.setattr(grouped_mm, "keep_matmuls", counting)
    ff = moe.FeedForward(8, 12)
    ff(torch.randn(3, 8))
    E, D, H = 2, 8, 16
    w1, w3 = torch.randn(E, H, D), torch.randn(E, H, D)
    w2 = torch.randn(E, D, H)
    x = torch.randn(5, D)
    grouped_mm.grouped_swiglu(w1, w2, w3, x, torch.tensor([0, 2, 1, 3]), torch.tensor([2, 2]))
    assert len(calls) == 2


def _live(shape) -> int:
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == shape)


def _kept_after_forward(fn, x, hidden: int, outer: bool) -> int:
    """How many [rows, hidden] tensors stay alive between the forward of fn(x) and its backward."""
    from torch.utils.checkpoint import checkpoint

    y = checkpoint(fn, x, use_reentrant=False) if outer else fn(x)
    n = _live((x.shape[0], hidden))
    y.sum().backward()
    return n


def test_it_keeps_the_two_projections_and_defers_to_an_outer_checkpoint():
    """Plain autograd keeps four hidden-size tensors of a SwiGLU (w1 x, its SiLU, w3 x, the
    product); keep_matmuls two (the projections). An outer checkpoint drops all of them, unless
    keep_matmuls inside it still keeps its two: defer_to_outer_checkpoint turns it off there, and
    the gradients stay the same."""
    from hymo_recipes.model.moe import FeedForward, _swiglu
    from hymo_recipes.model.recompute import defer_to_outer_checkpoint

    torch.manual_seed(0)
    H = 1013  # a hidden size no other live tensor has
    ff = FeedForward(8, H)
    x = torch.randn(37, 8, requires_grad=True)
    params = (x, *ff.parameters())

    def run(fn, outer):
        for p in params:
            p.grad = None
        kept = _kept_after_forward(fn, x, H, outer)
        return kept, [p.grad for p in params]

    plain = lambda t: _swiglu(t, ff.w1.weight, ff.w2.weight, ff.w3.weight)  # noqa: E731
    kept_plain, grads = run(plain, outer=False)
    assert kept_plain == 4
    assert run(ff, outer=False)[0] == 2
    assert run(ff, outer=True)[0] == 2  # what nesting the two would keep
    assert defer_to_outer_checkpoint(ff) == 1 and not ff.recompute_products
    kept, deferred = run(ff, outer=True)
    assert kept == 0
    for g, ref in zip(deferred, grads):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)
