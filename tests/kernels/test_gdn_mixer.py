"""The GDN token mixer's fused ops (hymo_kernels.gdn.mixer: short conv + SiLU, gated RMSNorm, and
the two ops that wrap them around the chunked kernel and the output projection) against their
pure-PyTorch references (hymo_kernels.gdn.mixer_torch) and the float64 naive recurrence.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) in
fp32 on tiny shapes, odd lengths and packed documents included; bf16 and torch.compile run on
the GPU only (marked gpu).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hymo_kernels.gdn.mixer import conv_gated_delta_rule, gated_norm_linear
from hymo_kernels.gdn.mixer_torch import gated_rms_norm, l2_normalize, short_causal_conv, split_qkv
from hymo_kernels.gdn.naive import naive_recurrent_gated_delta_rule
from hymo_kernels.gdn.short_conv import conv_silu_bwd, conv_silu_fwd, conv_silu_qkv_bwd, conv_silu_qkv_fwd
from hymo_kernels.gdn.gated_norm import gated_norm_bwd, gated_norm_fwd

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def positions_of(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


@pytest.mark.parametrize("B, T, C, W, lengths",
                         [(2, 70, 40, 4, None), (1, 130, 96, 4, [17, 1, 42, 70]), (1, 3, 8, 4, None),
                          (2, 37, 24, 2, None), (1, 40, 24, 3, [2, 1, 37]), (1, 20, 24, 1, [3, 1, 16]),
                          (2, 45, 24, 5, None), (1, 50, 24, 5, [3, 1, 46])],
                         ids=["B2-T70", "packed-T130", "T3", "W2", "W3-packed", "W1-packed", "W5", "W5-packed"])
def test_short_conv(B, T, C, W, lengths, nan_poison):
    """W <= 4 runs the row-walking kernels (rows of several programs, the halo between them), W = 5
    the tile kernels; both against the float64 reference, values and both gradients."""
    torch.manual_seed(0)
    wide = torch.randn(B, T, C + 8, device=DEV)
    x = wide[..., 4:4 + C]  # a strided view, as the projections hand it in
    w = torch.randn(C, W, device=DEV)
    pos = positions_of(lengths).to(DEV) if lengths else None
    xr, wr = x.double().detach().requires_grad_(), w.double().requires_grad_()
    ref = F.silu(short_causal_conv(xr, wr[:, None, :], pos))
    dy = torch.randn_like(ref)
    ref.backward(dy)
    y = conv_silu_fwd(x, w, pos)
    dx, dw = conv_silu_bwd(x, w, dy.float(), pos)
    assert rel(y, ref) < 1e-6 and rel(dx, xr.grad) < 1e-6 and rel(dw, wr.grad) < 1e-6


@pytest.mark.parametrize("B, T, Cs, W, lengths",
                         [(2, 40, (40, 40, 24), 4, None), (1, 70, (24, 24, 40), 4, [17, 1, 52]),
                          (1, 30, (24, 24, 24), 3, None), (2, 20, (24, 24, 24), 5, None)],
                         ids=["B2-T40", "packed-T70", "W3", "W5-three-launches"])
def test_short_conv_qkv_in_one_launch(B, T, Cs, W, lengths, nan_poison):
    """The q, k, v convs in one launch (channel blocks of three tensors of different widths, the
    dw partials side by side) match the float64 reference; without positions they also give
    exactly what three single-tensor calls give (dw up to the order of its fp32 sum: the same
    kernel, launched over one tensor's channel blocks), and write into given buffers (out=).
    The packed case (two programs' rows and the halo between them, across documents) is the
    interpreter's slowest, so it checks the reference only. W = 5 takes one launch per tensor."""
    torch.manual_seed(2)
    xs = [torch.randn(B, T, c + 8, device=DEV)[..., 4:4 + c] for c in Cs]  # strided views
    ws = [torch.randn(c, W, device=DEV) for c in Cs]
    dys = [torch.randn(B, T, c, device=DEV) for c in Cs]
    pos = positions_of(lengths).to(DEV) if lengths else None
    ys = conv_silu_qkv_fwd(*xs, *ws, pos)
    grads = conv_silu_qkv_bwd(*xs, *ws, *dys, pos)
    for i, (x, w, dy) in enumerate(zip(xs, ws, dys)):
        assert grads[3 + i].shape == w.shape and grads[3 + i].is_contiguous()
        xr, wr = x.double().detach().requires_grad_(), w.double().requires_grad_()
        ref = F.silu(short_causal_conv(xr, wr[:, None, :], pos))
        ref.backward(dy.double())
        assert rel(ys[i], ref) < 1e-6 and rel(grads[i], xr.grad) < 1e-6 and rel(grads[3 + i], wr.grad) < 1e-6
        if pos is None:
            assert torch.equal(ys[i], conv_silu_fwd(x, w, pos))
            dx, dw = conv_silu_bwd(x, w, dy, pos)
            assert torch.equal(grads[i], dx) and torch.allclose(grads[3 + i], dw, rtol=1e-6, atol=1e-6)
    if pos is not None:
        return
    # out=: the input gradients written into column slices of one buffer, the same values; the
    # columns between and after them left as they were
    buf = torch.full((B, T, sum(Cs) + 8), float("nan"), device=DEV)
    outs = buf[..., 2:2 + sum(Cs)].split(list(Cs), dim=-1)
    got = conv_silu_qkv_bwd(*xs, *ws, *dys, pos, out=outs)
    for i in range(3):
        assert got[i] is outs[i] and torch.equal(outs[i], grads[i])
        assert torch.equal(got[3 + i], grads[3 + i])
    assert buf[..., :2].isnan().all() and buf[..., 2 + sum(Cs):].isnan().all()
    with pytest.raises(ValueError, match="out must be like the inputs"):
        conv_silu_qkv_bwd(*xs, *ws, *dys, pos, out=(outs[0].double(), outs[1], outs[2]))
    with pytest.raises(ValueError, match="memory of its own"):  # the gradients would overwrite x
        conv_silu_qkv_bwd(*xs, *ws, *dys, pos, out=xs)


@pytest.mark.parametrize("W, L, lengths", [(4, 8, None), (4, 8, [5, 1, 2, 13]), (3, 2, [5, 1, 2, 13]), (2, 2, None)],
                         ids=["W4-L8-causal", "W4-L8-packed", "W3-L2-packed", "W2-L2-causal"])
def test_short_conv_rows_loaded_ahead_change_nothing(W, L, lengths, monkeypatch, nan_poison):
    """Loading rows ahead (the row tiles' fourth field: 1 to 4 rows) reorders loads only:
    bitwise the same y, dx and dw as loading each row when it is used, over rows of several
    programs (a row run L as short as the rows loaded ahead included), through the q/k/v entry
    points (the one-tensor ones launch the same kernels over one tensor's channel blocks)."""
    from hymo_kernels.gdn import short_conv

    torch.manual_seed(3)
    T, Cs = 21, (24, 24, 40)
    xs = [torch.randn(1, T, c + 8, device=DEV)[..., 4:4 + c] for c in Cs]
    ws = [torch.randn(c, W, device=DEV) for c in Cs]
    dys = [torch.randn(1, T, c, device=DEV) for c in Cs]
    pos = positions_of(lengths).to(DEV) if lengths else None

    def outputs(a):
        monkeypatch.setattr(short_conv, "FWD_ROWS", (L, 32, 1, a))
        monkeypatch.setattr(short_conv, "BWD_ROWS", (L, 32, 1, a))
        return (*conv_silu_qkv_fwd(*xs, *ws, pos), *conv_silu_qkv_bwd(*xs, *ws, *dys, pos))

    each_when_used = outputs(0)
    for ahead in (1, 2, 3, 4):
        for i, (a, b) in enumerate(zip(each_when_used, outputs(ahead))):
            assert torch.equal(a, b), (ahead, i)


@pytest.mark.parametrize("lengths", [None, [5, 1, 2, 13]], ids=["causal", "packed"])
def test_short_conv_backward_runs_change_nothing(lengths, monkeypatch, nan_poison):
    """The backward walking a program's rows as a loop over runs (BWD_RUN rows unrolled each,
    everything carried from run to run) gives bitwise the dx of one run per program and its dw
    up to the order of the fp32 sum, with rows loaded ahead or not and with the sequence's end
    inside a run; rows per program that are not a multiple of a run are refused."""
    from hymo_kernels.gdn import short_conv

    torch.manual_seed(4)
    T, Cs = 21, (24, 24, 40)
    xs = [torch.randn(1, T, c, device=DEV) for c in Cs]
    ws = [torch.randn(c, 4, device=DEV) for c in Cs]
    dys = [torch.randn(1, T, c, device=DEV) for c in Cs]
    pos = positions_of(lengths).to(DEV) if lengths else None
    monkeypatch.setattr(short_conv, "BWD_RUN", 4)

    def grads(L, a):
        monkeypatch.setattr(short_conv, "BWD_ROWS", (L, 32, 1, a))
        return (*conv_silu_qkv_bwd(*xs, *ws, *dys, pos), *conv_silu_bwd(xs[0], ws[0], dys[0], pos))

    for a in (0, 3):
        one = grads(4, a)
        for L in (8, 12):
            runs = grads(L, a)
            for i in (0, 1, 2, 6):  # dx
                assert torch.equal(runs[i], one[i])
            for i in (3, 4, 5, 7):  # dw
                torch.testing.assert_close(runs[i], one[i], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(short_conv, "BWD_ROWS", (6, 32, 1, 0))
    with pytest.raises(ValueError, match="multiple of 4"):
        conv_silu_qkv_bwd(*xs, *ws, *dys, pos)


def test_short_conv_batch_offsets_past_int32(nan_poison):
    """A batch row that starts past 2³¹ elements (b · stride overflows int32; in training, B ≥ 19
    sequences of 32,768 tokens of the 3,840-wide q/k/v projection) is read and written at its own
    offset by the forward and backward kernels, row-walking (W = 4) and tile (W = 5) both. The
    storage is fp16 and almost all of it untouched (virtual memory only)."""
    B, T, C, S = 3, 8, 16, 32
    stride_b = 1_100_000_000  # 2 · stride_b > 2³¹
    storage = torch.empty(2 * stride_b + T * S, dtype=torch.float16, device=DEV)
    x = storage.as_strided((B, T, C), (stride_b, S, 1))
    torch.manual_seed(5)
    x.copy_(torch.randn(B, T, C))
    for W in (4, 5):
        w, dy = torch.randn(C, W, device=DEV).half(), torch.randn(B, T, C, device=DEV).half()
        xr, wr = x.double().detach().requires_grad_(), w.double().requires_grad_()
        ref = F.silu(short_causal_conv(xr, wr[:, None, :], None))
        ref.backward(dy.double())
        dx, dw = conv_silu_bwd(x, w, dy)
        assert rel(conv_silu_fwd(x, w), ref) < 2e-3
        assert rel(dx, xr.grad) < 2e-3 and rel(dw, wr.grad) < 2e-3


def test_short_conv_row_tiles_checked(monkeypatch):
    """A row tile with more rows loaded ahead than the walk carries, no rows, or channels Triton
    cannot tile is refused with the tile named."""
    from hymo_kernels.gdn import short_conv

    x, w = torch.randn(1, 8, 32, device=DEV), torch.randn(32, 4, device=DEV)
    for tile in [(0, 32, 1, 0), (16, 32, 1, 5), (16, 48, 1, 2)]:
        monkeypatch.setattr(short_conv, "FWD_ROWS", tile)
        with pytest.raises(ValueError, match=r"row tile \(" + ", ".join(map(str, tile))):
            conv_silu_fwd(x, w)


@pytest.mark.parametrize("shape", [(2, 37, 3, 32), (1, 300, 2, 16)], ids=["B2-T37-H3-V32", "T300-H2-V16"])
def test_gated_norm(shape, nan_poison):
    torch.manual_seed(1)
    o, gate = torch.randn(shape, device=DEV), torch.randn(shape, device=DEV)
    w = torch.randn(shape[-1], device=DEV)
    orr, gr, wr = (t.double().requires_grad_() for t in (o, gate, w))
    ref = gated_rms_norm(orr, gr, wr, 1e-6)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    y = gated_norm_fwd(o, gate, w, 1e-6)
    do, dg, dw = gated_norm_bwd(o, gate, w, 1e-6, dy.float())
    assert rel(y, ref) < 1e-6
    assert rel(do, orr.grad) < 1e-6 and rel(dg, gr.grad) < 1e-6 and rel(dw, wr.grad) < 1e-6


def mixer_inputs(B, T, H, K, V, D, dtype=torch.float64, device=DEV, seed=2):
    """The fused mixer's inputs: the q, k, v projection (one tensor), the conv weights, the gates,
    the output gate and the two weights after the recurrence."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def mk(*s, scale=1.0):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)

    return dict(qkv=mk(B, T, H * (2 * K + V)), wq=mk(H * K, 4, scale=0.5), wk=mk(H * K, 4, scale=0.5),
                wv=mk(H * V, 4, scale=0.5),
                g=(-torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.5).to(device=device, dtype=torch.float32
                                                                                  if dtype != torch.float64 else dtype),
                beta=torch.rand(B, T, H, generator=g, dtype=torch.float64).to(device=device, dtype=dtype),
                gate=mk(B, T, H * V), nw=mk(V), ow=mk(D, H * V, scale=0.2))


def mixer_reference(a, H, K, V, positions=None, cu_seqlens=None):
    """The unfused mixer in float64: conv, SiLU, L2 norm, the naive recurrence, gated norm, o_proj
    (the projection split by widths written out here, not by the code under test)."""
    B, T = a["qkv"].shape[:2]
    q_in, k_in, v_in = a["qkv"].split([H * K, H * K, H * V], dim=-1)
    q = l2_normalize(F.silu(short_causal_conv(q_in, a["wq"][:, None], positions)).view(B, T, H, K))
    k = l2_normalize(F.silu(short_causal_conv(k_in, a["wk"][:, None], positions)).view(B, T, H, K))
    v = F.silu(short_causal_conv(v_in, a["wv"][:, None], positions)).view(B, T, H, V)
    o, _ = naive_recurrent_gated_delta_rule(q, k, v, a["g"], a["beta"], cu_seqlens=cu_seqlens)
    y = gated_rms_norm(o, a["gate"].view(B, T, H, V), a["nw"], 1e-6)
    return F.linear(y.reshape(B, T, -1), a["ow"])


def mixer_fused(a, H, K, V, positions=None, cu_seqlens=None, bwd_path=None, keep=False):
    o = conv_gated_delta_rule(a["qkv"], a["wq"], a["wk"], a["wv"], a["g"], a["beta"], head_k=K, head_v=V,
                              positions=positions, cu_seqlens=cu_seqlens, bwd_path=bwd_path, keep=keep)
    return gated_norm_linear(o, a["gate"], a["nw"], a["ow"], 1e-6, keep=keep)


def check_mixer(B, T, H, K, V, D, dtype, tol, lengths=None, bwd_path=None, fn=mixer_fused):
    ref_in = {n: t.clone().requires_grad_() for n, t in mixer_inputs(B, T, H, K, V, D).items()}
    pos = cu = None
    if lengths:
        pos = positions_of(lengths).to(DEV)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEV)
    ref = mixer_reference(ref_in, H, K, V, pos, cu)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    tst = {n: t.detach().to(torch.float32 if n == "g" else dtype).requires_grad_() for n, t in ref_in.items()}
    out = fn(tst, H, K, V, pos, cu)
    out.backward(dout.to(dtype))
    errs = {"out": rel(out, ref), **{n: rel(tst[n].grad, ref_in[n].grad) for n in ref_in}}
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"relative errors over {tol}: {bad} (all: {errs})"
    return errs


@pytest.mark.parametrize("B, T, lengths", [(2, 37, None), (1, 70, [20, 1, 49])], ids=["B2-T37", "packed-T70"])
def test_fused_mixer_matches_reference(B, T, lengths, nan_poison):
    check_mixer(B, T, H=2, K=16, V=16, D=24, dtype=torch.float32, tol=1e-5, lengths=lengths)


@pytest.mark.parametrize("lengths", [None, [9, 1, 10]], ids=["rows", "packed"])
def test_fused_mixer_keeping_its_outputs_changes_nothing(lengths, nan_poison):
    """keep=True (the backward reads the conv outputs and the normalised product the forward
    kept) gives the same output and gradients, bit for bit, as recomputing them (two sub-chunks,
    the second partial; a document across their boundary)."""
    B, T, H, K, V, D = (1 if lengths else 2), 20, 2, 16, 16, 24
    pos = cu = None
    if lengths:
        pos = positions_of(lengths).to(DEV)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEV)
    results = []
    for keep in (False, True):
        a = {n: t.float().requires_grad_() for n, t in mixer_inputs(B, T, H, K, V, D).items()}
        out = mixer_fused(a, H, K, V, pos, cu, keep=keep)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), {n: t.grad for n, t in a.items()}))
    (out0, g0), (out1, g1) = results
    assert torch.equal(out0, out1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0), [n for n in g0 if not torch.equal(g0[n], g1[n])]


@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep"])
def test_gated_norm_linear_keeps_only_its_inputs(keep):
    """The gated norm + output projection saves o, gate and the two weights for its backward
    (and, with keep, the normalised product): no per-row statistics."""
    a = {n: t.float().requires_grad_() for n, t in mixer_inputs(1, 37, 2, 16, 16, 24).items()}
    o = torch.randn(1, 37, 2, 16, device=DEV, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = gated_norm_linear(o, a["gate"], a["nw"], a["ow"], 1e-6, keep=keep)
    expected = [o, a["gate"].view(o.shape), a["nw"], a["ow"]]
    if keep:  # and the normalised product
        expected.append(gated_norm_fwd(o.detach(), a["gate"].detach().view(o.shape), a["nw"].detach(), 1e-6))
    assert len(saved) == len(expected)
    for s, e in zip(saved, expected):
        assert s.shape == e.shape and torch.equal(s, e)
    out.sum().backward()
    assert o.grad is not None and a["nw"].grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("bwd_path", ["local", "local_sub"])
@pytest.mark.parametrize("B, T, lengths", [(2, 1000, None), (1, 2048, [700, 1, 300, 1047])],
                         ids=["B2-T1000", "packed-T2048"])
def test_gpu_fused_mixer_bf16(B, T, lengths, bwd_path):
    """bf16 against the float64 reference: every output and gradient within bf16 noise. The
    gradients of the conv's inputs and weights of q and k carry the L2 norm's backward, which
    removes their component along q and k and so amplifies the kernel's relative error (about
    2e-2 on an H200, against about 8e-3 for v's)."""
    check_mixer(B, T, H=8, K=32, V=32, D=256, dtype=torch.bfloat16, tol=3e-2, lengths=lengths,
                fn=lambda a, H, K, V, p, c: mixer_fused(a, H, K, V, p, c, bwd_path))


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep"])
def test_gpu_fused_mixer_compiles_fullgraph(keep):
    a = {n: t.detach() for n, t in mixer_inputs(2, 512, 4, 32, 32, 128, dtype=torch.bfloat16).items()}
    a["g"] = a["g"].float()
    eager_in = {n: t.clone().requires_grad_() for n, t in a.items()}
    comp_in = {n: t.clone().requires_grad_() for n, t in a.items()}

    def mixer(x):
        return mixer_fused(x, 4, 32, 32, keep=keep)

    eager = mixer(eager_in)
    compiled = torch.compile(mixer, fullgraph=True)(comp_in)
    dout = torch.randn_like(eager)
    eager.backward(dout)
    compiled.backward(dout)
    torch.testing.assert_close(compiled, eager)
    for n in a:
        torch.testing.assert_close(comp_in[n].grad, eager_in[n].grad, msg=n)


@pytest.mark.parametrize("lengths", [None, [5, 1, 24]], ids=["rows", "packed"])
def test_layer_fused_path_matches_unfused(lengths):
    """HyMo's GDN layer with the fused ops computes what the PyTorch path computes (same weights),
    gradients of every parameter included."""
    from hymo_recipes.model import HymoModelArgs
    from hymo_recipes.model.gdn import GatedDeltaNet

    def layer(fused):
        torch.manual_seed(3)
        m = GatedDeltaNet(HymoModelArgs(dim=48, gdn_n_heads=2, gdn_head_dim=16, gdn_v_head_dim=16,
                                        gdn_backend="triton", gdn_fused_mixer=fused)).to(DEV)
        m.init_weights(0.1, 0.1)
        return m

    fused, plain = layer(True), layer(False)
    assert fused.fused and not plain.fused
    B = 1 if lengths else 2
    x = torch.randn(B, 30, 48, device=DEV)
    kw = {}
    if lengths:
        kw = dict(positions=positions_of(lengths).to(DEV),
                  cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEV))
    outs = [m(x, **kw) for m in (fused, plain)]
    dy = torch.randn_like(outs[0])
    for o in outs:
        o.backward(dy)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_split_qkv_views_and_bad_width():
    H, K, V = 3, 4, 8
    qkv = torch.arange(2 * H * (2 * K + V), dtype=torch.float32).view(1, 2, -1)
    q, k, v = split_qkv(qkv, K, V)
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (H * K, H * K, H * V)
    assert q.data_ptr() == qkv.data_ptr() and k[0, 0, 0] == H * K and v[0, 1, -1] == qkv[0, 1, -1]
    with pytest.raises(ValueError, match="not H·"):
        split_qkv(qkv[..., :-1], K, V)
    with pytest.raises(ValueError, match="not H·"):
        split_qkv(qkv[..., :0], K, V)
