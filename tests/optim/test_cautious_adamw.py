"""CautiousAdamW: equals torch AdamW with the flags off; masks against hand-computed cases."""

import math

import pytest
import torch

from hymo_recipes.optim import CautiousAdamW


def params_and_grads(seed=0, steps=5):
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8,), (3, 5, 4), ()]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    return params, grads


def run(opt_fn, params0, grads):
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = opt_fn(params)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


def test_flags_off_equals_torch_adamw():
    params0, grads = params_and_grads()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, _ = run(lambda ps: CautiousAdamW(ps, cautious_update=False, cautious_wd=False, **kw),
                  params0, grads)
    ref, _ = run(lambda ps: torch.optim.AdamW(ps, foreach=True, **kw), params0, grads)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert max((a - p).abs().max() for a, p in zip(ours, params0)) > 1e-3


# Hand-computed step 2 with β1 = β2 = 0.5, eps = 0, lr = 0.1, wd = 0.5:
#   p = [1, −1, 2, −2], m_prev = [1, −1, 1, 4], v_prev = 1, g = [1, 1, −3, −2]
#   m = [1, 0, −1, 1]; v = [1, 1, 5, 2.5]; bias corrections 1 − 0.5² = 0.75 for both
#   u = m̂/sqrt(v̂) = [sqrt(4/3), 0, −(4/3)/sqrt(20/3), (4/3)/sqrt(10/3)]
#   cautious update: u·g > 0 only at 0 and 2 (at 1 u = 0, at 3 they disagree) → φ = [1,0,1,0],
#     scale n/(nnz+1) = 4/3 → u = [(4/3)sqrt(4/3), 0, −(16/9)/sqrt(20/3), 0]
#   cautious wd: u·p ≥ 0 at 0, 1, 3 (u = 0 counts as agreement) → decay there only
P0 = [1.0, -1.0, 2.0, -2.0]
M_PREV = [1.0, -1.0, 1.0, 4.0]
G = [1.0, 1.0, -3.0, -2.0]
U_PLAIN = [math.sqrt(4 / 3), 0.0, -(4 / 3) / math.sqrt(20 / 3), (4 / 3) / math.sqrt(10 / 3)]
HAND_CASES = {
    # (cautious_update, cautious_wd): expected p after the step
    (True, True): [
        1 - 0.1 * ((4 / 3) * math.sqrt(4 / 3) + 0.5 * 1),
        -1 - 0.1 * (0.5 * -1),
        2 - 0.1 * (-(16 / 9) / math.sqrt(20 / 3)),
        -2 - 0.1 * (0.5 * -2),
    ],
    (True, False): [
        1 - 0.1 * ((4 / 3) * math.sqrt(4 / 3) + 0.5 * 1),
        -1 - 0.1 * (0.5 * -1),
        2 - 0.1 * (-(16 / 9) / math.sqrt(20 / 3) + 0.5 * 2),
        -2 - 0.1 * (0.5 * -2),
    ],
    # plain u: u·p ≥ 0 at 0, 1 only (at 3, u > 0 and p < 0)
    (False, True): [
        1 - 0.1 * (U_PLAIN[0] + 0.5 * 1),
        -1 - 0.1 * (0.5 * -1),
        2 - 0.1 * U_PLAIN[2],
        -2 - 0.1 * U_PLAIN[3],
    ],
    (False, False): [p - 0.1 * (u + 0.5 * p) for p, u in zip(P0, U_PLAIN)],
}


@pytest.mark.parametrize("flags", list(HAND_CASES), ids=lambda f: f"cu{int(f[0])}-cwd{int(f[1])}")
def test_hand_computed_masks(flags):
    cautious_update, cautious_wd = flags
    p = torch.nn.Parameter(torch.tensor(P0, dtype=torch.float64))
    opt = CautiousAdamW([p], lr=0.1, betas=(0.5, 0.5), eps=0.0, weight_decay=0.5,
                        cautious_update=cautious_update, cautious_wd=cautious_wd)
    st = opt.state[p]
    st["exp_avg"].copy_(torch.tensor(M_PREV, dtype=torch.float64))
    st["exp_avg_sq"].fill_(1.0)
    st["step"].fill_(1.0)
    p.grad = torch.tensor(G, dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor(HAND_CASES[flags], dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)
    assert st["step"].item() == 2.0


def test_lr_and_wd_as_tensors_match_floats():
    params0, grads = params_and_grads(seed=1, steps=3)
    a, _ = run(lambda ps: CautiousAdamW(ps, lr=3e-3, weight_decay=0.1), params0, grads)
    b, _ = run(lambda ps: CautiousAdamW(ps, lr=torch.tensor(3e-3), weight_decay=torch.tensor(0.1)),
               params0, grads)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_state_precreated_and_none_grad_is_zero_grad():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = CautiousAdamW([p], lr=0.1, weight_decay=0.5)
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
    opt.step()  # no grad: zero gradient → the cautious mask removes the update, decay remains
    torch.testing.assert_close(p.detach(), torch.tensor([1.0, -2.0]) * (1 - 0.1 * 0.5))
    assert opt.state[p]["step"].item() == 1.0


def test_none_grad_after_a_real_step_equals_a_zero_grad():
    """Step 2 with no gradient does what a zero gradient does (the moments decay, the cautious
    mask and the decay act), and the step counts."""
    g = torch.tensor([0.5, 0.25, -1.0])
    twins = []
    for second in (None, torch.zeros(3)):
        p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
        opt = CautiousAdamW([p], lr=0.1, weight_decay=0.5)
        p.grad = g.clone()
        opt.step()
        p.grad = second
        opt.step()
        twins.append((p.detach().clone(), *(opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq", "step"))))
    for a, b in zip(*twins, strict=True):
        assert torch.equal(a, b)
    assert twins[0][3].item() == 2.0
    assert twins[0][1].abs().min() > 0  # the first gradient's momentum is still there


def test_rejects_low_precision_params():
    with pytest.raises(ValueError, match="fp32"):
        CautiousAdamW([torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))])


def test_compiled_step_equals_eager():
    """The torch.compile'd step (fullgraph: a graph break is an error) matches eager, with a
    changing tensor lr (no recompile per step: the lr is a 0-d tensor input)."""
    import torch._dynamo
    import torch._inductor.config

    # compile in this process: a pool of compile workers would outlive the test and compete
    # with the next tests for the 2 cores. (config.patch, not monkeypatch: monkeypatch's undo
    # deletes the setting, and every later compile in the process then fails.)
    with torch._inductor.config.patch(compile_threads=1):
        _compiled_step_equals_eager()


def _compiled_step_equals_eager():
    import torch._dynamo

    torch._dynamo.reset()
    params0, grads = params_and_grads(seed=4, steps=3)
    lrs = [1e-2, 5e-3, 2e-3]

    def run_with_lr(compiled):
        params = [torch.nn.Parameter(p.clone()) for p in params0]
        opt = CautiousAdamW(params, lr=torch.tensor(lrs[0]), compiled=compiled)
        for lr, gs in zip(lrs, grads):
            opt.param_groups[0]["lr"].fill_(lr)
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        return params

    from torch._dynamo.utils import counters

    counters.clear()
    compiled = run_with_lr(True)
    eager = run_with_lr(False)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1


def test_mask_count_exact_beyond_2_pow_24():
    """Regression: a single-threaded fp32 L1 norm of 0/1 values stops at 2^24 = 16,777,216,
    which doubled the update of a 33 M-entry embedding. Counts are fp64."""
    from hymo_recipes.optim.cautious_adamw import _moments

    n = 2**24 + 1001
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.ones(n)
        g[:7] = -1.0
        m = torch.zeros(n)
        m[:7] = 1.0
        _, counts = _moments([g], [m], [torch.zeros(n)], 0.5, 0.5, True)
    finally:
        torch.set_num_threads(threads)
    # m = 0.5·m_prev + 0.5·g: coordinates 0..6 give 0.5 − 0.5 = 0 (no agreement), the rest 0.5·1
    assert counts[0].item() == n - 7
