"""The fused readout's per-chunk cross-entropy kernel (hymo_kernels.ce.chunk) against its PyTorch
reference (hymo_kernels.ce.chunk_torch) and a float64 log-softmax: loss and gradient, ignored
targets, rows kept whole and rows walked in tiles. On CPU in Triton's interpreter (fp32, fp16);
bf16 at the training shape on the GPU (marked gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hymo_kernels.ce.chunk as ce_triton
from hymo_kernels.ce import IGNORE_INDEX, ce_chunk

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(c, V, dtype, ignore=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(c, V, generator=g)).to(dtype)
    targets = torch.randint(0, V, (c,), generator=g)
    targets[0] = 0  # both ends of the row
    targets[-1] = V - 1
    targets[list(ignore)] = IGNORE_INDEX
    return logits.to(DEV), targets.to(DEV)


def _float64(logits, targets):
    """(loss sum, gradient) of the same logits from float64 log-softmax."""
    x = logits.double().requires_grad_()
    loss = F.cross_entropy(x, targets, reduction="sum", ignore_index=IGNORE_INDEX)
    return loss.detach(), torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("c, V, dtype, tiles", [
    (7, 53, torch.float32, None),  # one tile, masked past V
    (5, 64, torch.float16, None),
    (6, 200, torch.float32, (64, 32)),  # rows walked in tiles of 32 (ROW_MAX lowered to 64)
    (4, 130, torch.float16, (64, 64)),
    (2, 9000, torch.float32, "real"),  # past the real ROW_MAX: tiles of TILE
], ids=["fp32-whole", "fp16-whole", "fp32-tiled", "fp16-tiled", "fp32-V9000"])
def test_loss_and_gradient_match_the_reference(c, V, dtype, tiles, monkeypatch, nan_poison):
    if isinstance(tiles, tuple):
        monkeypatch.setattr(ce_triton, "ROW_MAX", tiles[0])
        monkeypatch.setattr(ce_triton, "TILE", tiles[1])
    logits, targets = _problem(c, V, dtype, ignore=(1,))
    loss, grad = ce_triton.ce_chunk(logits, targets, True)
    ref_loss, ref_grad = ce_chunk(logits.clone(), targets, True)
    exact_loss, exact_grad = _float64(logits, targets)
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(loss.double(), exact_loss, rtol=1e-6, atol=1e-4)
    # the gradient rounded to the logits' dtype, like the reference's
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, **tol)
    torch.testing.assert_close(grad.double(), exact_grad, **tol)
    assert grad[1].abs().max() == 0  # the ignored target's row
    assert grad[0].abs().max() > 0


@pytest.mark.parametrize("tiles", [None, (16, 8)], ids=["whole", "tiled"])
def test_without_a_gradient_and_with_every_target_ignored(tiles, monkeypatch):
    if tiles:
        monkeypatch.setattr(ce_triton, "ROW_MAX", tiles[0])
        monkeypatch.setattr(ce_triton, "TILE", tiles[1])
    logits, targets = _problem(5, 40, torch.float32)
    loss, grad = ce_triton.ce_chunk(logits, targets, False)
    assert grad is None
    torch.testing.assert_close(loss, ce_chunk(logits.clone(), targets, False)[0], rtol=1e-6, atol=1e-5)
    loss, grad = ce_triton.ce_chunk(logits, torch.full_like(targets, IGNORE_INDEX), True)
    assert loss.item() == 0.0 and grad.abs().max() == 0


def test_strided_logits_and_targets_and_an_empty_chunk():
    logits, targets = _problem(6, 48, torch.float32)
    wide = torch.cat([logits, logits], dim=1)[:, :48]  # rows 96 apart, the last dim contiguous
    spread = torch.stack([targets, torch.zeros_like(targets)], 1)[:, 0]  # every other element
    assert not spread.is_contiguous()
    loss, grad = ce_triton.ce_chunk(wide, spread, True)
    ref_loss, ref_grad = ce_chunk(logits.clone(), targets, True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)
    loss, grad = ce_triton.ce_chunk(logits[:0], targets[:0], True)
    assert loss.item() == 0.0 and grad.shape == (0, 48)


def test_a_target_outside_the_vocabulary_makes_the_loss_nan():
    logits, targets = _problem(4, 16, torch.float32)
    for bad in (16, -3):
        t = targets.clone()
        t[2] = bad
        loss, _ = ce_triton.ce_chunk(logits, t, True)
        assert loss.isnan()


def test_bad_input_and_an_unavailable_device_say_so(monkeypatch):
    logits, targets = _problem(4, 16, torch.float32)
    with pytest.raises(ValueError, match=r"expected logits \[c, V\] and targets \[c\]"):
        ce_triton.ce_chunk(logits, targets[:3], True)
    monkeypatch.setattr(ce_triton, "_INTERPRET", False)
    assert "TRITON_INTERPRET=1" in ce_triton.unavailable("cpu")
    assert ce_triton.unavailable("cuda") is None
    if DEV == "cpu":
        with pytest.raises(RuntimeError, match="the Triton cross-entropy kernel needs CUDA tensors"):
            ce_triton.ce_chunk(logits, targets, True)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [8192, 64256])
def test_gpu_bf16_at_the_training_shape(V):
    """A chunk of the fused loss as training runs it (bf16 logits; 8,192 tokens at the embedded
    tokenizer's vocabulary, rows kept whole; 1,024 at the flavors' default one, rows in tiles)."""
    logits, targets = _problem(8192 if V == 8192 else 1024, V, torch.bfloat16, ignore=(1, 2))
    loss, grad = ce_triton.ce_chunk(logits, targets, True)
    ref_loss, ref_grad = ce_chunk(logits.clone(), targets, True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-2)
    # both round the same fp32 values to bf16; an fp32 difference at a rounding edge moves one ulp
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2 ** -7, atol=1e-6)
