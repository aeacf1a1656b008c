"""hymo_kernels.accum: every pair's fp32 sum += gradient in one Triton launch, against the
PyTorch loop (bitwise: the same one fp32 add per element). On CPU in Triton's interpreter (fp32
and fp16 gradients, blocks shrunk so that many programs and pairs are walked); bf16 at
parameter-like sizes on the GPU (marked gpu)."""

from __future__ import annotations

import re

import pytest
import torch

import hymo_kernels.accum.add as accum_triton
from hymo_kernels.accum import accumulate_

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pairs(sizes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    sums = [torch.randn(n, generator=g).to(DEV) for n in sizes]
    grads = [torch.randn(n, generator=g).mul(3).to(dtype).to(DEV) for n in sizes]
    return sums, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_every_pair_is_summed_bitwise_like_the_loop(dtype, monkeypatch):
    monkeypatch.setattr(accum_triton, "BLOCK", 16)  # many programs, whole and partial blocks
    # 37 pairs: the binary search over the pairs' first blocks takes 6 steps
    sizes = [1, 15, 16, 17, 48, 5, 33, 2, 31, 64, 100, 7] * 3 + [3]
    sums, grads = _pairs(sizes, dtype)
    ref = [s.clone() for s in sums]
    accumulate_(ref, grads)
    before = [s.clone() for s in sums]
    grads_before = [g.clone() for g in grads]
    accum_triton.accumulate_(sums, grads)
    for i, (s, r, b) in enumerate(zip(sums, ref, before)):
        assert torch.equal(s, r), (i, sizes[i])
        assert not torch.equal(s, b), i  # every pair was added to, its last block too
    assert all(torch.equal(g, b) for g, b in zip(grads, grads_before))  # read, never written


@pytest.mark.parametrize("sizes", [[40, 9], [16] * 8, [0, 20, 0, 33, 0], [5, 0], [0, 0]],
                         ids=["two", "eight-whole", "empty-between", "empty-last", "all-empty"])
def test_pair_counts_and_empty_tensors(sizes, monkeypatch):
    # the binary search at a power-of-two count, and pairs of no block (found by no program)
    monkeypatch.setattr(accum_triton, "BLOCK", 16)
    sums, grads = _pairs(sizes, torch.float16, seed=len(sizes))
    ref = [s.clone() for s in sums]
    accumulate_(ref, grads)
    accum_triton.accumulate_(sums, grads)
    assert all(torch.equal(s, r) for s, r in zip(sums, ref))


def test_one_pair_and_no_pair(monkeypatch):
    monkeypatch.setattr(accum_triton, "BLOCK", 32)
    sums, grads = _pairs([70], torch.float16)
    ref = sums[0] + grads[0].float()
    accum_triton.accumulate_(sums, grads)
    assert torch.equal(sums[0], ref)
    accum_triton.accumulate_([], [])  # nothing to add: no launch


@pytest.mark.parametrize("bad, message", [
    (lambda s, g: ([s[0]], g), "1 sums and 2 gradients"),
    (lambda s, g: ([s[0].double(), s[1]], g), "not fp32 += torch.float16 of one size"),
    (lambda s, g: (s, [g[0], g[1][:-1]]), "not fp32 += torch.float16 of one size"),
    (lambda s, g: (s, [g[0], g[1].float()]), "not fp32 += torch.float16 of one size"),
    (lambda s, g: (s, [g[0], g[1].view(2, -1).t()]), "contiguous and 16-byte aligned"),
    (lambda s, g: ([s[0], torch.zeros(65, device=DEV)[1:]], g), "contiguous and 16-byte aligned"),
    (lambda s, g: (s, [x.to(torch.int32) for x in g]), "gradients in torch.int32"),
], ids=["count", "sum-dtype", "size", "mixed-dtypes", "strided", "unaligned", "int-grads"])
def test_bad_pairs_are_refused_before_the_launch(bad, message):
    sums, grads = _pairs([64, 64], torch.float16)
    before = [s.clone() for s in sums]
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        accum_triton.accumulate_(*bad(sums, grads))
    assert all(torch.equal(s, b) for s, b in zip(sums, before))


@pytest.mark.gpu
def test_gpu_bf16_parameter_sizes():
    # a 750m-like mix: large matrices, an embedding-sized one, norm weights, per-head vectors
    sizes = [896 * 3840, 64_256 * 896, 896, 40, 16 * 2304 * 896, 1280 * 896, 32, 4099]
    sums, grads = _pairs(sizes, torch.bfloat16)
    ref = [s.clone() for s in sums]
    accumulate_(ref, grads)
    accum_triton.accumulate_(sums, grads)
    torch.cuda.synchronize()
    assert all(torch.equal(s, r) for s, r in zip(sums, ref))
