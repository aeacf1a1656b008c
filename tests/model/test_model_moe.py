"""DeepSeekMoE: routing, capacity, dropless mode, bias update, precision."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hymo_recipes.model.moe import MoE, GroupedExperts


def make_moe(tiny_args, seed=0, **overrides) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(tiny_args(**overrides))
    moe.init_weights(0.2, 0.2)  # large weights: routing and expert outputs clearly input-dependent
    return moe


def swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def reference_moe(moe: MoE, x: torch.Tensor, capacity: int | None):
    """Token-by-token MoE: returns (output, assignments per expert, drops per expert)."""
    B, T, D = x.shape
    E, k = moe.num_experts, moe.top_k
    out = torch.zeros(B, T, D)
    load, dropped = [0] * E, [0] * E
    # capacity is granted in order of position, then batch row
    for t in range(T):
        for b in range(B):
            xt = x[b, t]
            scores = torch.softmax(xt.double() @ moe.router.gate.weight.double().T, -1)
            chosen = torch.topk(scores + moe.expert_bias.double(), k).indices.tolist()
            y = torch.zeros(D, dtype=torch.float64)
            for e in chosen:
                load[e] += 1
                if capacity is not None and load[e] > capacity:
                    dropped[e] += 1
                    continue
                ex = moe.experts
                y += scores[e] * swiglu(xt.double(), ex.w1[e].double(), ex.w2[e].double(), ex.w3[e].double())
            if moe.shared_experts is not None:
                s = moe.shared_experts
                y += swiglu(xt.double(), s.w1.weight.double(), s.w2.weight.double(), s.w3.weight.double())
            out[b, t] = y.float()
    return out, load, dropped


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5, 1.0, 1.5])
def test_moe_matches_token_by_token_reference(tiny_args, capacity_factor):
    moe = make_moe(tiny_args, moe_capacity_factor=capacity_factor)
    moe.expert_bias.copy_(torch.tensor([0.3, 0.0, -0.1, 0.0]))  # skewed loads, so capacity bites
    x = torch.randn(2, 23, 64)
    capacity = None if capacity_factor == 0 else math.ceil(capacity_factor * 46 * 2 / 4)
    assert moe.capacity(46) == capacity
    ref, load, dropped = reference_moe(moe, x, capacity)
    with torch.no_grad():
        out = moe(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert moe.tokens_per_expert.tolist() == load
    assert moe.dropped_tokens.tolist() == dropped
    if capacity_factor in (0.5, 1.0):
        assert sum(dropped) > 0, "case meant to exercise dropping dropped nothing"


def test_selection_uses_bias_but_gate_weights_do_not(tiny_args):
    moe = make_moe(tiny_args)
    moe.expert_bias.copy_(torch.tensor([0.0, 5.0, 0.0, 5.0]))  # forces experts 1 and 3
    x = torch.randn(30, 64)
    weights, idx = moe.router(x, moe.expert_bias)
    assert sorted(set(idx.flatten().tolist())) == [1, 3]
    scores = torch.softmax(x @ moe.router.gate.weight.T, -1)
    order = idx.argsort(-1)
    torch.testing.assert_close(weights.gather(-1, order), scores[:, [1, 3]])
    assert (weights.sum(-1) < 1).all()  # unbiased softmax entries, not renormalised


def test_capacity_drops_later_positions_first_and_counts_them(tiny_args):
    moe = make_moe(tiny_args, moe_capacity_factor=1.0)
    moe.expert_bias.copy_(torch.tensor([5.0, 5.0, 0.0, 0.0]))  # every token -> experts 0 and 1
    B, T = 2, 10
    x = torch.randn(B, T, 64)
    with torch.no_grad():
        out = moe(x)
    # capacity = ceil(1.0 · 20 tokens · 2 / 4) = 10 per expert; 20 assignments each -> 10 dropped
    assert moe.tokens_per_expert.tolist() == [20, 20, 0, 0]
    assert moe.dropped_tokens.tolist() == [10, 10, 0, 0]
    # positions 0..4 of both rows are served (10 assignments); positions 5..9 get the shared expert only
    shared = moe.shared_experts(x)
    torch.testing.assert_close(out[:, 5:], shared[:, 5:])
    assert (out[:, :5] - shared[:, :5]).abs().amax(-1).min() > 1e-3


def test_dropless_mode_never_drops(tiny_args):
    moe = make_moe(tiny_args, moe_capacity_factor=0.0)
    moe.expert_bias.copy_(torch.tensor([5.0, 5.0, 0.0, 0.0]))
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        out = moe(x)
    assert moe.capacity(20) is None
    assert moe.dropped_tokens.sum() == 0 and moe.tokens_per_expert.tolist() == [20, 20, 0, 0]
    assert (out[:, 5:] - moe.shared_experts(x)[:, 5:]).abs().amax(-1).min() > 1e-3


def test_bias_update_direction_band_and_ema(tiny_args):
    moe = make_moe(tiny_args)  # α = 0.02, band 5%, step 0.001
    moe.update_expert_bias(torch.tensor([40.0, 10.0, 26.0, 24.0]))
    # shares .40 .10 .26 .24 -> EMA = 0.02·share = .008 .002 .0052 .0048, mean .005,
    # band (.00475, .00525): expert 0 over, 1 under, 2 and 3 inside
    torch.testing.assert_close(moe.load_ema, torch.tensor([0.008, 0.002, 0.0052, 0.0048]))
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.001, 0.001, 0.0, 0.0]))

    moe.update_expert_bias(torch.tensor([25.0, 25.0, 25.0, 25.0]))
    # EMA = .98·prev + .02·.25 = .01284 .00696 .010096 .009704, mean .01, band (.0095, .0105)
    torch.testing.assert_close(moe.load_ema, torch.tensor([0.01284, 0.00696, 0.010096, 0.009704]))
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.002, 0.002, 0.0, 0.0]))

    before = moe.expert_bias.clone(), moe.load_ema.clone()
    moe.update_expert_bias(torch.zeros(4))  # an empty step changes nothing
    assert torch.equal(moe.expert_bias, before[0]) and torch.equal(moe.load_ema, before[1])


@pytest.mark.parametrize("draw", [0, 1, 2])
def test_bias_update_balances_a_skewed_router(tiny_args, draw):
    """Closed loop: repeated steps of the rule even out a router that favours expert 0.

    The router's weights are drawn here, small, from a generator of their own (not the init's
    global stream, which differs between torch versions): the skew alone decides the start,
    and it is a logit lead of ~0.04 · 64 ≈ 2.6 for expert 0 (its share falls under 0.3 within
    ~40 of the 400 steps)."""
    moe = make_moe(tiny_args, moe_bias_update_speed=0.01)
    gen = torch.Generator().manual_seed(draw)
    x = torch.randn(256, 64, generator=gen) + 1.0  # a shared direction that the skew can use
    with torch.no_grad():
        moe.router.gate.weight.copy_(0.02 * torch.randn(moe.router.gate.weight.shape, generator=gen))
        moe.router.gate.weight[0] += 0.04

    def shares():
        _, idx = moe.router(x, moe.expert_bias)
        counts = torch.bincount(idx.flatten(), minlength=4).float()
        return counts, counts / counts.sum()

    start = shares()[1][0].item()
    late = []
    for step in range(400):
        counts, share = shares()
        if step >= 300:
            late.append(share)
        moe.update_expert_bias(counts)
    # the rule moves each bias by a fixed step, so the loads settle into a small cycle around
    # balance: judged by their mean over the last 100 steps
    end = torch.stack(late).mean(0)
    assert start > 0.4, start  # of a possible 0.5: expert 0 is in almost every top-2
    assert end.max() < 0.3 and end.min() > 0.2, end  # balanced is 0.25 each
    assert moe.expert_bias[0] < 0


def test_counters_accumulate_and_reset_and_buffers_checkpoint(tiny_args):
    moe = make_moe(tiny_args)
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        moe(x)
        moe(x)
    assert moe.tokens_per_expert.sum() == 2 * 8 * 2
    moe.reset_load_counters()
    assert moe.tokens_per_expert.sum() == 0 and moe.dropped_tokens.sum() == 0
    keys = set(moe.state_dict())
    assert {"expert_bias", "load_ema"} <= keys
    assert not {"tokens_per_expert", "dropped_tokens"} & keys


def test_gradients_reach_router_and_experts_but_not_the_bias(tiny_args):
    moe = make_moe(tiny_args)
    moe(torch.randn(2, 9, 64)).pow(2).sum().backward()
    for p in (moe.router.gate.weight, moe.experts.w1, moe.experts.w2, moe.experts.w3, moe.shared_experts.w1.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert not moe.expert_bias.requires_grad


@pytest.mark.parametrize("mixed_precision", [True, False])
def test_mixed_precision_flag_picks_the_matmul_dtype(mixed_precision):
    torch.manual_seed(0)
    ex = GroupedExperts(16, 24, 3, use_grouped_mm=False, mixed_precision=mixed_precision)
    for w in (ex.w1, ex.w2, ex.w3):
        torch.nn.init.normal_(w, std=0.3)
    ex.to(torch.bfloat16)
    x = torch.randn(10, 16)
    counts = torch.tensor([4, 0, 6])
    rows = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])  # any rows of x, sorted by expert
    out, at = ex(x, rows, counts)
    assert out.dtype == torch.float32 and at.tolist() == list(range(10))
    dtype = torch.bfloat16 if mixed_precision else torch.float32
    xs = x[rows].to(dtype)
    ref = torch.cat([swiglu(xs[:4], *(w[0].to(dtype) for w in (ex.w1, ex.w2, ex.w3))),
                     swiglu(xs[4:], *(w[2].to(dtype) for w in (ex.w1, ex.w2, ex.w3)))]).float()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.gpu
def test_grouped_mm_matches_expert_loop_on_cuda():
    torch.manual_seed(0)
    kw = dict(dim=64, hidden_dim=96, num_experts=4, mixed_precision=True)
    grouped = GroupedExperts(use_grouped_mm=True, **kw).cuda()
    loop = GroupedExperts(use_grouped_mm=False, **kw).cuda()
    for w in (grouped.w1, grouped.w2, grouped.w3):
        torch.nn.init.normal_(w, std=0.1)
    loop.load_state_dict(grouped.state_dict())
    grouped.to(torch.bfloat16)
    loop.to(torch.bfloat16)
    x = torch.randn(50, 64, device="cuda", dtype=torch.bfloat16)
    rows = torch.randperm(50, device="cuda")
    counts = torch.tensor([20, 0, 13, 17], device="cuda")
    out, at = grouped(x, rows, counts)
    ref, ref_at = loop(x, rows, counts)
    torch.testing.assert_close(out[at], ref[ref_at], rtol=2e-2, atol=2e-2)


def _grouped_and_loop_grads(counts, rows, x):
    """(outputs, grad x, grads w1 w2 w3) through grouped_swiglu and through the expert loop, for
    a loss that reads every assignment's output."""
    from hymo_recipes.model.grouped_mm import grouped_swiglu

    torch.manual_seed(1)
    E = len(counts)
    w = [torch.randn(E, 24, 16) * 0.2, torch.randn(E, 16, 24) * 0.2, torch.randn(E, 24, 16) * 0.2]
    w = [t.bfloat16().requires_grad_() for t in w]
    n = torch.tensor(counts)
    cot = torch.randn(rows.shape[0], 16, dtype=torch.bfloat16)
    results = []
    for grouped in (True, False):
        xg = x.clone().requires_grad_()
        if grouped:
            out, at = grouped_swiglu(w[0], w[1], w[2], xg, rows, n)
            out = out[at]
        else:
            out, at = GroupedExperts._loop(xg[rows], w[0], w[1], w[2], n)
            out = out[at]
        (out.float() * cot.float()).sum().backward()
        results.append((out.detach(), xg.grad, *(t.grad.clone() for t in w)))
        for t in w:
            t.grad = None
    return results


@pytest.mark.parametrize("counts", [[5, 0, 17, 8], [0, 0, 0, 3], [9, 1, 16, 2]])
def test_grouped_experts_gather_their_rows_once_and_match_the_loop(counts):
    """grouped_swiglu (torch._grouped_mm, which runs on the CPU too) gathers the padded layout
    straight from x's rows and leaves its outputs in that layout: read through ``at`` they are
    the expert loop's, and so are the gradients of x and of every expert's weights (the padding
    rows, those past the last group included, send nothing back to x)."""
    from hymo_recipes.model.grouped_mm import padded_indices

    M = sum(counts)
    torch.manual_seed(0)
    x = torch.randn(M // 2 + 3, 16).bfloat16()
    rows = torch.randint(0, x.shape[0], (M,))  # tokens repeat, as with top-k > 1
    index, _, at = padded_indices(torch.tensor(counts), M)
    assert torch.equal(index[at], torch.arange(M))  # at inverts the layout on the real rows
    assert int((index >= 0).sum()) == M
    (out, *grads), (ref, *ref_grads) = _grouped_and_loop_grads(counts, rows, x)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=2e-2)
    assert grads[0][rows.unique()].abs().sum() > 0


def test_gather_rows_backward_gathers_what_a_scatter_would_sum():
    """gather_rows: the plain indexed gather's values, and through the inverse map the same input
    gradient that autograd's scatter-add gives (rows read 0-3 times, zero rows at src -1)."""
    from hymo_recipes.model.grouped_mm import gather_rows

    torch.manual_seed(0)
    x = torch.randn(7, 5, dtype=torch.float64)
    src = torch.tensor([3, -1, 0, 3, 6, 3, 0, -1, 2])
    readers = torch.full((7, 3), -1)
    for r in range(7):
        users = (src == r).nonzero().flatten()
        readers[r, :len(users)] = users
    dout = torch.randn(len(src), 5, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain = torch.where((src >= 0)[:, None], xa[src.clamp_min(0)], 0)
    ours = gather_rows(xb, src, readers)
    assert torch.equal(plain, ours)
    plain.backward(dout)
    ours.backward(dout)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-12, atol=1e-12)
    assert xb.grad[[1, 4, 5]].abs().sum() == 0 and xb.grad[3].abs().sum() > 0  # rows no one read


@pytest.mark.parametrize("capacity", [None, 5])
def test_grouped_experts_gather_the_tokens_gradient_through_their_assignments(capacity):
    """grouped_swiglu with the MoE's ``assignments`` (each token's positions in the sorted rows:
    ``unsort``, as MoE.forward builds it) gives x the gradient it gets without them, values,
    x's and the weights' gradients alike, dropped assignments included."""
    from hymo_recipes.model.grouped_mm import grouped_swiglu

    torch.manual_seed(0)
    N, k, E = 13, 2, 4
    x = torch.randn(N, 16).bfloat16()
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])  # each token's k distinct experts
    flat = idx.reshape(-1)
    order = torch.argsort(flat * N + torch.arange(N * k) // k)
    token = torch.arange(N * k) // k
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(N * k)
    counts = torch.zeros(E, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
    w = [(torch.randn(E, 24, 16) * 0.2).bfloat16(), (torch.randn(E, 16, 24) * 0.2).bfloat16(),
         (torch.randn(E, 24, 16) * 0.2).bfloat16()]
    cot = torch.randn(N * k, 16)
    results = []
    for assignments in (None, unsort.view(N, k)):
        xg, wg = x.clone().requires_grad_(), [t.clone().requires_grad_() for t in w]
        out, at = grouped_swiglu(*wg, xg, token[order], counts, capacity, assignments=assignments)
        read = torch.where((at >= 0)[:, None], out[at.clamp_min(0)], 0)
        (read.float() * cot).sum().backward()
        results.append((read.detach(), xg.grad, *(t.grad for t in wg)))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert results[1][1].abs().sum() > 0


@pytest.mark.parametrize("capacity_factor", [0, 1.0, 0.5])
def test_moe_through_the_grouped_experts_gathers_the_gradients_a_scatter_would(tiny_args, monkeypatch,
                                                                                capacity_factor):
    """The whole MoE forward and backward through the grouped experts (torch._grouped_mm, which
    runs on the CPU in bf16), with the assignments MoE.forward hands them against without them
    (autograd's scatter-adds): the same outputs and the same gradients of x and every parameter,
    padding rows, rows past the last group and dropped assignments included."""
    from hymo_recipes.model.grouped_mm import grouped_swiglu

    results = []
    for use in (True, False):
        def grouped(self, x, rows, n, capacity=None, assignments=None, use=use):
            return grouped_swiglu(self.w1, self.w2, self.w3, x, rows, n, capacity,
                                  assignments=assignments if use else None)

        monkeypatch.setattr(GroupedExperts, "forward", grouped)
        moe = make_moe(tiny_args, moe_capacity_factor=capacity_factor)
        moe.expert_bias.copy_(torch.tensor([0.3, 0.0, -0.1, 0.0]))  # skewed loads, so capacity bites
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(2, 23, 64, generator=gen).requires_grad_()
        out = moe(x)
        out.backward(torch.randn(out.shape, generator=gen))
        results.append((out.detach(), x.grad, *(p.grad for p in moe.parameters())))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert results[0][1].abs().sum() > 0


@pytest.mark.parametrize("capacity", [3, 8, 100])
def test_the_layout_holds_only_the_assignments_the_capacity_keeps(capacity):
    """padded_indices with a capacity: the first ``capacity`` rows of each expert's group get a
    place (at inverts the layout on them), the rest get at = -1 and no row, so the grouped GEMMs
    never compute a dropped assignment."""
    from hymo_recipes.model.grouped_mm import ALIGN, padded_indices

    counts = torch.tensor([5, 0, 17, 9])
    M = int(counts.sum())
    index, sizes, at = padded_indices(counts, M, capacity)
    kept = counts.clamp(max=capacity)
    assert int((index >= 0).sum()) == int(kept.sum())
    assert torch.equal(sizes, (kept.clamp_min(ALIGN) + ALIGN - 1) // ALIGN * ALIGN)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(M) - start.repeat_interleave(counts)
    assert torch.equal(at >= 0, rank < capacity)
    assert torch.equal(index[at[at >= 0]], torch.arange(M)[at >= 0])


def test_grouped_and_loop_experts_skip_the_dropped_rows_alike():
    """Both expert paths, given a capacity, compute only the kept rows (the loop's output has
    one row per kept assignment) and mark the dropped ones at = -1; the kept rows' outputs and
    every gradient agree."""
    from hymo_recipes.model.grouped_mm import grouped_swiglu

    torch.manual_seed(0)
    counts, capacity = torch.tensor([6, 1, 13, 4]), 5
    M = int(counts.sum())
    x = torch.randn(20, 16).bfloat16()
    rows = torch.randint(0, 20, (M,))
    w = [(torch.randn(4, 24, 16) * 0.2).bfloat16().requires_grad_(), (torch.randn(4, 16, 24) * 0.2).bfloat16()
         .requires_grad_(), (torch.randn(4, 24, 16) * 0.2).bfloat16().requires_grad_()]
    cot = torch.randn(M, 16)
    results = []
    for grouped in (True, False):
        xg = x.clone().requires_grad_()
        if grouped:
            out, at = grouped_swiglu(w[0], w[1], w[2], xg, rows, counts, capacity)
        else:
            out, at = GroupedExperts._loop(xg[rows], w[0], w[1], w[2], counts, capacity)
            assert out.shape[0] == int(counts.clamp(max=capacity).sum())
        y = torch.where(at[:, None] >= 0, out[at.clamp_min(0)], 0)
        (y.float() * cot).sum().backward()
        results.append((at >= 0, y.detach(), xg.grad, *(t.grad.clone() for t in w)))
        for t in w:
            t.grad = None
    (kept, *got), (ref_kept, *want) = results
    assert torch.equal(kept, ref_kept) and int(kept.sum()) == int(counts.clamp(max=capacity).sum())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=2e-2)


def test_gradients_with_drops_match_the_token_by_token_reference(tiny_args):
    """With capacity biting, the MoE's gradients (input, router, routed and shared experts) are
    the reference's: a dropped assignment sends nothing back, its expert never ran on it."""
    moe = make_moe(tiny_args, moe_capacity_factor=0.5)
    moe.expert_bias.copy_(torch.tensor([0.3, 0.0, -0.1, 0.0]))
    x = torch.randn(2, 11, 64)
    cot = torch.randn(2, 11, 64)
    xa = x.clone().requires_grad_()
    (moe(xa) * cot).sum().backward()
    assert moe.dropped_tokens.sum() > 0
    got = {name: p.grad.clone() for name, p in moe.named_parameters()}
    moe.zero_grad()
    xb = x.clone().requires_grad_()
    ref, _, _ = reference_moe(moe, xb, moe.capacity(22))
    (ref * cot).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-4)
    assert {"router.gate.weight", "experts.w1", "shared_experts.w2.weight"} <= got.keys()
    for name, p in moe.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-4, msg=name)
