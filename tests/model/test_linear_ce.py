"""The chunked readout + cross-entropy against full logits: values and gradients, and the model's
labels path against the loss function's."""

import pytest
import torch
import torch.nn.functional as F

from hymo_recipes.model import HymoModel
from hymo_recipes.model.linear_ce import (IGNORE_INDEX, ce_chunk, linear_cross_entropy,
                                          linear_cross_entropy_reference)
from hymo_recipes.titan.api import IGNORE_INDEX as TITAN_IGNORE_INDEX
from hymo_recipes.titan.loss import MTPLoss
from hymo_recipes.titan.metrics import StepStats


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _problem(N=37, D=24, V=53, dtype=torch.float64, ignore=(3, 4, 36), seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, D, generator=g, dtype=dtype) / D ** 0.5).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[list(ignore)] = IGNORE_INDEX
    return h, w, targets


def test_ignore_index_is_torchtitans():
    assert IGNORE_INDEX == TITAN_IGNORE_INDEX


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_values_and_gradients_match_full_logits(chunk):
    h, w, t = _problem()
    ref = linear_cross_entropy_reference(h, w, t)
    gh_ref, gw_ref = torch.autograd.grad(3.5 * ref, (h, w))
    out = linear_cross_entropy(h, w, t, chunk)
    gh, gw = torch.autograd.grad(3.5 * out, (h, w))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.float(), rtol=1e-6, atol=1e-5)
    # float64 matmuls, the softmax in fp32 in both: they differ by fp32 rounding (exp(x - lse)
    # against log-softmax's backward) and the order of the sums
    torch.testing.assert_close(gh, gh_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-6)


def test_ignored_targets_contribute_nothing():
    h, w, t = _problem(ignore=(0, 5))
    gh, = torch.autograd.grad(linear_cross_entropy(h, w, t, 8), (h,))
    assert gh[0].abs().max() == 0 and gh[5].abs().max() == 0
    assert gh[1].abs().max() > 0
    all_ignored = torch.full_like(t, IGNORE_INDEX)
    out = linear_cross_entropy(h, w, all_ignored, 8)
    assert out.item() == 0.0
    assert torch.autograd.grad(out, (h,))[0].abs().max() == 0


def test_bf16_follows_the_reference_rounding():
    # bf16 operands (the GPU's training dtype; CPU matmuls here): logits and gradients rounded
    # where the reference rounds them, so the two agree to bf16 precision
    h, w, t = _problem(N=64, D=32, V=96, dtype=torch.float32)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    ref = linear_cross_entropy_reference(hb, wb, t)
    gh_ref, gw_ref = torch.autograd.grad(ref / 64, (hb, wb))
    hb2, wb2 = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    out = linear_cross_entropy(hb2, wb2, t, 16)
    gh, gw = torch.autograd.grad(out / 64, (hb2, wb2))
    assert gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    assert _rel(gh, gh_ref) < 1e-2 and _rel(gw, gw_ref) < 1e-2, (_rel(gh, gh_ref), _rel(gw, gw_ref))


def test_without_grad_nothing_is_kept_and_the_value_holds():
    h, w, t = _problem()
    with torch.no_grad():
        out = linear_cross_entropy(h, w, t, 8)
    assert not out.requires_grad
    torch.testing.assert_close(out, linear_cross_entropy_reference(h, w, t).float().detach())
    loss, grad = ce_chunk(h.detach() @ w.detach().t(), t, want_grad=False)
    assert grad is None


def test_only_the_weight_may_want_a_gradient():
    h, w, t = _problem()
    gw_ref, = torch.autograd.grad(linear_cross_entropy_reference(h.detach(), w, t), (w,))
    gw, = torch.autograd.grad(linear_cross_entropy(h.detach(), w, t, 8), (w,))
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, match", [
    (dict(chunk=0), "chunk must be positive"),
    (dict(targets=torch.zeros(5, dtype=torch.long)), "rows of h but 5 targets"),
    (dict(weight=torch.zeros(53, 7, dtype=torch.float64)), "features"),
])
def test_bad_input_names_the_problem(bad, match):
    h, w, t = _problem()
    kw = dict(h=h, weight=w, targets=t, chunk=8)
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(**kw)


@pytest.mark.parametrize("chunk", [0, 5, 4096])
@pytest.mark.parametrize("masking", [False, True])
def test_model_labels_path_equals_the_loss_on_its_logits(tiny_args, chunk, masking):
    """forward(labels=) -> HeadLosses through MTPLoss gives the loss and every parameter's gradient
    that the logits through MTPLoss give (the trainer's path without fusing)."""
    torch.manual_seed(0)
    args = tiny_args(fused_loss_chunk=chunk)
    model = HymoModel(args)
    model.init_weights()
    model.double()
    B, T = 2, 16
    tokens = torch.randint(0, args.vocab_size, (B, T))
    labels = torch.randint(0, args.vocab_size, (B, T))
    labels[1, 3] = IGNORE_INDEX
    extra = {}
    if masking:
        extra = dict(cu_seqlens=torch.tensor([0, 5, 16, 25, 32], dtype=torch.int32))
    loss_fn = MTPLoss(args.mtp_loss_weights, StepStats())

    ref = loss_fn(model(tokens, **extra), labels)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    out = loss_fn(model(tokens, labels=labels, **extra), labels)
    grads = torch.autograd.grad(out, list(model.parameters()), allow_unused=True)

    torch.testing.assert_close(out, ref.to(out.dtype), rtol=1e-6, atol=1e-6)
    checked = 0
    for (name, _), g, gr in zip(model.named_parameters(), grads, ref_grads):
        assert (g is None) == (gr is None), name
        if g is not None:
            torch.testing.assert_close(g, gr, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
            checked += 1
    assert checked > 20


def test_model_head_losses_count_each_heads_targets(tiny_args):
    args = tiny_args()
    model = HymoModel(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 9))
    labels = torch.randint(0, args.vocab_size, (2, 9))
    labels[0, 8] = IGNORE_INDEX
    out = model(tokens, labels=labels)
    # head k scores positions t < T - k against labels[:, t + k]
    assert out.counts.tolist() == [17.0, 15.0, 13.0]
    logits, mtp = model(tokens)
    k2 = F.cross_entropy(mtp[1][:, :7].reshape(-1, args.vocab_size).float(), labels[:, 2:].reshape(-1),
                         reduction="sum", ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(out.sums[2], k2, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="labels must be shaped like tokens"):
        model(tokens, labels=labels[:, :5])


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_bf16_at_the_750m_readout_shape(compiled):
    """8 x 4096 tokens, dim 896, vocab 8,192 in bf16 (the training dtype), the per-chunk work
    compiled as the parallelize function compiles it: the chunked loss and gradients are as
    close to an fp32 computation as the full-logits reference is, and keep far less memory."""
    torch.manual_seed(0)
    N, D, V = 8 * 4096, 896, 8192
    h32 = torch.randn(N, D, device="cuda")
    w32 = torch.randn(V, D, device="cuda") * 0.05
    t = torch.randint(0, V, (N,), device="cuda")
    t[::97] = IGNORE_INDEX
    exact = linear_cross_entropy_reference(h32.requires_grad_(), w32.requires_grad_(), t)
    gh32, gw32 = torch.autograd.grad(exact, (h32, w32))

    def run(fn):
        h = h32.detach().bfloat16().requires_grad_()
        w = w32.detach().bfloat16().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(h, w)
        kept = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
        gh, gw = torch.autograd.grad(out, (h, w))
        return out, gh, gw, kept

    chunk_fn = torch.compile(ce_chunk, dynamic=False) if compiled else ce_chunk
    ref, gh_ref, gw_ref, kept_ref = run(lambda h, w: linear_cross_entropy_reference(h, w, t))
    out, gh, gw, kept = run(lambda h, w: linear_cross_entropy(h, w, t, 8192, chunk_fn))
    assert abs(out.item() - exact.item()) <= 2 * abs(ref.item() - exact.item()) + 1e-4 * abs(exact.item())
    for name, g, g_ref, g32 in (("h", gh, gh_ref, gh32), ("weight", gw, gw_ref, gw32)):
        err, err_ref = _rel(g, g32), _rel(g_ref, g32)
        assert err <= 1.5 * err_ref + 1e-3, f"d{name}: chunked {err:.2e} vs reference {err_ref:.2e} from fp32"
    # kept for the backward: dh (bf16 [N, D]) and dW (fp32 [V, D]) against the logits' copies
    assert kept <= N * D * 2 + V * D * 4 + (1 << 20), kept
    assert kept * 8 < kept_ref, (kept, kept_ref)


def test_under_autocast_an_fp32_readout_input_meets_a_bf16_weight():
    """On one rank TorchTitan trains under autocast, where the norm before the readout may
    return fp32 while the (FSDP-cast) weight is bf16: both go to autocast's dtype, as F.linear
    casts them, and the gradients come back in each input's dtype."""
    h, w, t = _problem(N=48, D=32, V=64, dtype=torch.float32)
    wb = w.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = linear_cross_entropy_reference(h, wb, t)
        gh_ref, gw_ref = torch.autograd.grad(ref, (h, wb))
        out = linear_cross_entropy(h, wb, t, 16)
        gh, gw = torch.autograd.grad(out, (h, wb))
    assert gh.dtype == torch.float32 and gw.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-4)
    # bf16 products summed per chunk against one product: equal to bf16 rounding, as a whole
    assert _rel(gh, gh_ref) < 1e-2 and _rel(gw, gw_ref) < 1e-2, (_rel(gh, gh_ref), _rel(gw, gw_ref))


def test_no_gradient_is_computed_without_grad_mode():
    h, w, t = _problem()
    seen = []

    def spy(logits, targets, want_grad):
        seen.append(want_grad)
        return ce_chunk(logits, targets, want_grad)

    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out = linear_cross_entropy(h, w, t, 8, spy)
        torch.testing.assert_close(out, linear_cross_entropy_reference(h, w, t).float().detach())
    assert seen and not any(seen)
    linear_cross_entropy(h, w, t, 8, spy)
    assert seen[-1] is True


def test_second_order_gradients_are_refused():
    h, w, t = _problem()
    gh, = torch.autograd.grad(linear_cross_entropy(h, w, t, 8), (h,), create_graph=True)
    with pytest.raises(RuntimeError):
        gh.sum().backward()
