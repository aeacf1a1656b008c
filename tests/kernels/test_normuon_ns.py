"""hymo_kernels.normuon.ns: the orthogonalisation's iteration as batched-GEMM launches against
its PyTorch reference (ns_torch) and against NorMuon's eager orthogonalisation. On CPU in
Triton's interpreter (fp32; tiles shrunk so that the symmetric products mirror off-diagonal
tiles and every edge is partial); bf16 at the models' shapes on the GPU (marked gpu)."""

from __future__ import annotations

import pytest
import torch

import hymo_kernels.normuon.ns as ns
import hymo_kernels.normuon.ns_torch as ref
from hymo_recipes.optim.normuon import POLAR_EXPRESS_COEFFS, QUINTIC_COEFFS, orthogonalize

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PE = list(POLAR_EXPRESS_COEFFS)


def _case(B, m, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, m, n, generator=g).to(dtype).to(DEV)
    # the scale NorMuon starts from: 1 / (‖U‖_F · margin + eps), from the fp32 values
    inv = 1.0 / (X.float().square().sum(dim=(-2, -1)).sqrt() * 1.02 + 1e-6)
    return X, inv


@pytest.fixture
def small_tiles(monkeypatch):
    # 16-wide tiles: m = 20 gives two tile rows (one partial), n = 36 three columns
    monkeypatch.setattr(ns, "_tiles", lambda m, n, k: (16, 16, 16, 1, 1))


def test_iteration_matches_the_reference(small_tiles):
    X, inv = _case(2, 20, 36)
    before = X.clone()
    got = ns.iterate(X, inv, PE[:2])
    torch.testing.assert_close(got, ref.iterate(X, inv, PE[:2]), rtol=1e-5, atol=1e-6)
    assert torch.equal(X, before)  # the input is left as it was


def test_one_step_writes_both_halves_of_the_symmetric_products(small_tiles):
    # a single quintic step on [2, 20, 20]: A and B are symmetric, their lower tiles are the
    # mirrored writes; a missing mirror would leave garbage in X's lower rows
    X, inv = _case(2, 20, 20, seed=1)
    got = ns.iterate(X, inv, [QUINTIC_COEFFS])
    torch.testing.assert_close(got, ref.iterate(X, inv, [QUINTIC_COEFFS]), rtol=1e-5, atol=1e-6)


def test_the_scaled_iteration_is_normuons_orthogonalisation():
    # five Polar Express steps from the unscaled matrix: what orthogonalize computes in fp32
    X, inv = _case(3, 8, 24, seed=2)
    got = ns.iterate(X, inv, PE)
    want = orthogonalize(X, dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    s = torch.linalg.svdvals(got.double())
    assert s.min() > 0.5 and s.max() < 1.5  # near-orthogonal rows


def test_bad_inputs_are_refused_in_one_line():
    X, inv = _case(2, 8, 12)
    with pytest.raises(ValueError, match="wide"):
        ns.iterate(X.mT.contiguous(), inv, PE)
    with pytest.raises(ValueError, match="contiguous"):
        ns.iterate(X.mT, inv, PE)
    with pytest.raises(ValueError, match="inv must be fp32"):
        ns.iterate(X, inv.double(), PE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(60, 512, 512), (16, 512, 896), (8, 16, 512), (4, 896, 2304)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_bf16_at_the_models_shapes(shape):
    """bf16 as training runs it: against the fp64 iteration, no further off than the eager
    bf16 orthogonalisation (torch's baddbmm chain), and close to the reference run in bf16."""
    X, inv = _case(*shape, dtype=torch.bfloat16, seed=3)
    got = ns.iterate(X, inv, PE).double()
    exact = ref.iterate(X.double(), inv, PE)
    eager = orthogonalize(X, dtype=torch.bfloat16).double()
    err = (got - exact).norm() / exact.norm()
    err_eager = (eager - exact).norm() / exact.norm()
    assert err <= 1.25 * err_eager + 1e-3, (err.item(), err_eager.item())
    bf16_ref = ref.iterate(X, inv, PE).double()
    assert (got - bf16_ref).norm() / bf16_ref.norm() < 2e-2
