"""hymo_kernels.normuon: NorMuon's four passes as Triton launches against their PyTorch
reference (fused_torch). On CPU in Triton's interpreter (fp32, and bf16 gradients read into
fp32, which the interpreter converts right; row blocks shrunk so that several programs and
partial blocks are walked); bf16 and real shapes on the GPU (marked gpu)."""

from __future__ import annotations

import pytest
import torch

import hymo_kernels.normuon.fused as fused
import hymo_kernels.normuon.fused_torch as ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _members(shapes, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * scale).to(dtype).to(DEV) for s in shapes]


# a 2-D member, a 3-D expert stack and another 2-D member: 1 + 3 + 1 = 5 matrices
SHAPES = {"wide": [(5, 9), (3, 5, 9), (5, 9)], "tall": [(9, 5), (3, 9, 5), (9, 5)], "square": [(6, 6), (2, 6, 6)]}


def _layout(name):
    """(members' shapes, m, k, transposed, matrices B) of a SHAPES entry."""
    shapes = SHAPES[name]
    m, k = shapes[0][-2:]
    return shapes, m, k, m > k, sum(s[0] if len(s) == 3 else 1 for s in shapes)


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(fused, "BLOCK_ROWS", 4)  # rows 9 = two whole blocks and a partial one
    monkeypatch.setattr(fused, "BLOCK_COLS", 4)  # the column walk too


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16], ids=["g_fp32", "g_bf16"])
@pytest.mark.parametrize("layout", list(SHAPES))
def test_momentum_pack_matches_the_reference(layout, gdtype, nesterov, small_blocks):
    shapes, m, k, transposed, B = _layout(layout)
    grads = _members(shapes, gdtype, seed=1)
    moms = _members(shapes, seed=2, scale=0.1)
    moms_ref = [t.clone() for t in moms]
    X_shape = (B, k, m) if transposed else (B, m, k)
    X = torch.full(X_shape, float("nan"), device=DEV)  # every element must be written
    X_ref = torch.empty(X_shape, device=DEV)
    sq = fused.momentum_pack_(grads, moms, X, 0.95, nesterov, transposed)
    sq_ref = ref.momentum_pack_(grads, moms_ref, X_ref, 0.95, nesterov, transposed)
    for a, b in zip(moms, moms_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(X, X_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sq, sq_ref, rtol=1e-5, atol=0)
    assert not torch.equal(moms[0], _members(shapes, seed=2, scale=0.1)[0])  # written in place


@pytest.mark.parametrize("layout", list(SHAPES))
def test_row_sumsq_matches_the_reference(layout, small_blocks):
    _, m, k, transposed, _ = _layout(layout)
    X = _members([(4, k, m) if transposed else (4, m, k)], seed=3)[0]
    out = fused.row_sumsq(X, transposed)
    assert out.shape == (4, m)
    torch.testing.assert_close(out, ref.row_sumsq(X, transposed), rtol=1e-5, atol=0)


@pytest.mark.parametrize("layout", list(SHAPES))
def test_neuron_factor_matches_the_reference(layout):
    shapes, m, k, transposed, B = _layout(layout)
    # the second moments: [m] per 2-D member, [c, m] per expert stack (NorMuon's neuron_v)
    vs = _members([s[:-1] for s in shapes], seed=6)
    vs = [v.abs() for v in vs]
    vs_ref = [v.clone() for v in vs]
    rowsq = _members([(B, m)], seed=7)[0].abs()
    rowsq[1] = 0.0  # an all-zero update: its factors are finite (the clamp)
    got = fused.neuron_factor_(rowsq, vs, 0.95, 1e-8, k)
    want = ref.neuron_factor_(rowsq, vs_ref, 0.95, 1e-8, k)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(vs, vs_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert torch.isfinite(got).all()
    assert not torch.equal(vs[-1], _members([s[:-1] for s in shapes], seed=6)[-1].abs())  # written in place


@pytest.mark.parametrize("wd", ["cautious", "plain_wd", "no_wd"])
@pytest.mark.parametrize("with_factor", [True, False], ids=["factor", "no_factor"])
@pytest.mark.parametrize("layout", list(SHAPES))
def test_apply_update_matches_the_reference(layout, with_factor, wd, small_blocks):
    shapes, m, k, transposed, B = _layout(layout)
    params = _members(shapes, seed=4)
    before = [p.clone() for p in params]
    params_ref = [p.clone() for p in params]
    X = _members([(B, k, m) if transposed else (B, m, k)], seed=5)[0]
    factor = torch.rand(B, m, device=DEV) + 0.5 if with_factor else None
    lr_s, lr_wd = torch.tensor(0.03, device=DEV), torch.tensor(0.2, device=DEV)
    args = (lr_s, lr_wd, wd != "no_wd", wd == "cautious", transposed)
    fused.apply_update_(X, factor, params, *args)
    ref.apply_update_(X, factor, params_ref, *args)
    for p, r, b in zip(params, params_ref, before):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
        assert not torch.equal(p, b)  # every member was updated, the expert stack's last matrix too
        assert not torch.equal(p.reshape(-1, m, k)[-1], b.reshape(-1, m, k)[-1])


def _same(a, b):
    """Bit for bit, NaN where the other has NaN."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("impl", [fused, ref], ids=["triton", "reference"])
def test_a_false_skip_flag_writes_no_parameter_or_state(impl, small_blocks):
    """The three passes that write members (momenta, second moments, weights) with ``go``, the
    flag a CUDA-graphed step skips by: True gives the unflagged call's members; False leaves them
    bit for bit, NaN gradients included, while X, the sums and the factors are computed as
    without the flag (the orthogonalisation between the passes runs all the same)."""
    shapes, m, k, transposed, B = _layout("tall")
    go = {v: torch.tensor(v, device=DEV) for v in (True, False)}
    X_shape = (B, k, m)

    grads = _members(shapes, seed=1)
    grads[1][2, 3, 1] = float("nan")
    outs = {}
    for flag in (None, True, False):
        moms, X = _members(shapes, seed=2, scale=0.1), torch.empty(X_shape, device=DEV)
        sq = impl.momentum_pack_(grads, moms, X, 0.9, True, transposed, go=go.get(flag))
        outs[flag] = (moms, X, sq)
    for a, b in zip(outs[True][0], outs[None][0]):
        _same(a, b)
    assert torch.isnan(outs[None][0][1]).any()
    for a, b in zip(outs[False][0], _members(shapes, seed=2, scale=0.1)):
        _same(a, b)
    for i in (1, 2):
        _same(outs[False][i], outs[None][i])

    rowsq = _members([(B, m)], seed=7)[0].abs()
    outs = {}
    for flag in (None, True, False):
        vs = [v.abs() for v in _members([s[:-1] for s in shapes], seed=6)]
        outs[flag] = (vs, impl.neuron_factor_(rowsq, vs, 0.95, 1e-8, k, go=go.get(flag)))
    for a, b, c in zip(outs[True][0], outs[None][0], (v.abs() for v in _members([s[:-1] for s in shapes], seed=6))):
        _same(a, b)
        assert not torch.equal(a, c)
    for a, c in zip(outs[False][0], (v.abs() for v in _members([s[:-1] for s in shapes], seed=6))):
        _same(a, c)
    _same(outs[False][1], outs[None][1])

    X = _members([X_shape], seed=5)[0]
    X[0, 0, 0] = float("nan")
    lr_s, lr_wd = torch.tensor(0.03, device=DEV), torch.tensor(0.2, device=DEV)
    outs = {}
    for flag in (None, True, False):
        params = _members(shapes, seed=4)
        impl.apply_update_(X, None, params, lr_s, lr_wd, True, True, transposed, go=go.get(flag))
        outs[flag] = params
    for a, b, c in zip(outs[True], outs[None], _members(shapes, seed=4)):
        _same(a, b)
        assert not torch.equal(a, c)
    assert torch.isnan(outs[None][0]).any()
    for a, c in zip(outs[False], _members(shapes, seed=4)):
        _same(a, c)


def test_the_cautious_mask_keeps_decay_only_where_the_update_agrees_with_the_weight(small_blocks):
    # O = +1 everywhere; W = +1 on the first row, -1 on the second: decay only on the first row
    X = torch.ones(1, 2, 3, device=DEV)
    W = torch.tensor([[1.0] * 3, [-1.0] * 3], device=DEV)
    fused.apply_update_(X, None, [W], torch.tensor(0.0, device=DEV), torch.tensor(0.5, device=DEV), True, True,
                        False)
    assert torch.equal(W, torch.tensor([[0.5] * 3, [-1.0] * 3], device=DEV))


def test_bad_inputs_are_refused_in_one_line():
    X = torch.zeros(2, 4, 6, device=DEV)
    with pytest.raises(ValueError, match="not contiguous"):
        fused.address_table([torch.zeros(6, 4, device=DEV).t()], 4, 6, X.device)
    with pytest.raises(ValueError, match=r"not \[\.\., 4, 6\]"):
        fused.address_table([torch.zeros(5, 6, device=DEV)], 4, 6, X.device)
    members = [torch.zeros(2, 4, 6, device=DEV), torch.zeros(4, 6, device=DEV)]
    table = fused.address_table(members, 4, 6, X.device)
    moved = [m.clone() for m in members]
    assert fused.address_table(moved, 4, 6, X.device, out=table) is table  # rewritten in place
    assert table.tolist() == [moved[0].data_ptr(), moved[0].data_ptr() + 96, moved[1].data_ptr()]
    with pytest.raises(ValueError, match="table of 1 addresses .* cannot be rewritten into \\(3,\\)"):
        fused.address_table(moved[1:], 4, 6, X.device, out=table)
    with pytest.raises(ValueError, match="contiguous \\[B, rows, cols\\]"):
        fused.row_sumsq(X.transpose(1, 2), False)
    with pytest.raises(TypeError, match="0-d fp32"):
        fused.apply_update_(X, None, [torch.zeros(4, 6, device=DEV)] * 2, torch.tensor(1.0, dtype=torch.float64),
                            torch.tensor(0.0), False, False, False)
    with pytest.raises(TypeError, match="go must be a 0-d bool tensor"):
        fused.apply_update_(X, None, [torch.zeros(4, 6, device=DEV)] * 2, torch.tensor(1.0, device=DEV),
                            torch.tensor(0.0, device=DEV), False, False, False, go=torch.tensor(1.0, device=DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["w_fp32", "w_bf16"])
@pytest.mark.parametrize("layout", ["wide", "tall"])
def test_gpu_passes_at_a_models_shapes_in_bf16(layout, wdtype):
    """The three passes at a 750m-like expert shape, bf16 gradients and orthogonalisation dtype,
    fp32 and bf16 weights (the interpreter's bf16 rounding is not the GPU's), against the
    reference on the same GPU."""
    m, k = (896, 2304) if layout == "wide" else (2304, 896)
    transposed = m > k
    shapes = [(m, k), (4, m, k)]
    grads = _members(shapes, torch.bfloat16, seed=1)
    moms = _members(shapes, seed=2, scale=0.1)
    moms_ref = [t.clone() for t in moms]
    X_shape = (5, k, m) if transposed else (5, m, k)
    X = torch.empty(X_shape, dtype=torch.bfloat16, device=DEV)
    X_ref = torch.empty_like(X)
    sq = fused.momentum_pack_(grads, moms, X, 0.95, True, transposed)
    sq_ref = ref.momentum_pack_(grads, moms_ref, X_ref, 0.95, True, transposed)
    for a, b in zip(moms, moms_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(X, X_ref, rtol=1e-2, atol=1e-6)  # one bf16 rounding apart at most
    torch.testing.assert_close(sq, sq_ref, rtol=1e-4, atol=0)
    torch.testing.assert_close(fused.row_sumsq(X, transposed), ref.row_sumsq(X, transposed), rtol=1e-4, atol=0)
    rowsq = ref.row_sumsq(X, transposed)
    vs = [torch.rand(s[:-1], device=DEV) for s in shapes]
    vs_ref = [v.clone() for v in vs]
    torch.testing.assert_close(fused.neuron_factor_(rowsq, vs, 0.95, 1e-8, k),
                               ref.neuron_factor_(rowsq, vs_ref, 0.95, 1e-8, k), rtol=1e-5, atol=1e-6)
    for a, b in zip(vs, vs_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    params = _members(shapes, wdtype, seed=4)
    params_ref = [p.clone() for p in params]
    factor = torch.rand(5, m, device=DEV) + 0.5
    args = (torch.tensor(0.03, device=DEV), torch.tensor(0.002, device=DEV), True, True, transposed)
    fused.apply_update_(X, factor, params, *args)
    ref.apply_update_(X, factor, params_ref, *args)
    for p, r in zip(params, params_ref):
        if wdtype == torch.bfloat16:  # the same fp32 maths rounded once: at most one bf16 step apart
            torch.testing.assert_close(p, r, rtol=1e-2, atol=1e-5)
            assert (p != r).float().mean() < 1e-3
        else:
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
