"""The pure-PyTorch GDN backends against each other and against a float64 recurrence.

The float64 reference is ``naive_recurrent_gated_delta_rule`` on ``.double()`` inputs. Each
case backpropagates random cotangents for o and the final state and compares o, the final
state and the gradients of q, k, v, g, beta and the initial state, each with its own bound on
the relative RMS error (fla's style, with tolerances hard, not warnings).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hymo_kernels.gdn import BACKENDS, gated_delta_rule, get_backend
from hymo_kernels.gdn.chunk_torch import chunk_gated_delta_rule_torch
from hymo_kernels.gdn.naive import naive_recurrent_gated_delta_rule

NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")
# relative RMS error of an fp32 backend against the fp64 recurrence
# (measured on this CPU: <= 1.2e-6; a 0.1% error in g shows up as >= 2.6e-4)
TOL_VS_FP64 = {"o": 1e-5, "ht": 1e-5, "dq": 1e-5, "dk": 1e-5, "dv": 1e-5, "dg": 2e-5, "dbeta": 1e-5, "dh0": 1e-5}


def make_inputs(B, T, H, K, V, n_states, seed, g_zero=False):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    # log decays from ~0 (remember) to ~-5 (forget): both regimes inside one chunk
    g = torch.zeros(B, T, H) if g_zero else F.logsigmoid(2 * torch.randn(B, T, H, generator=gen) + 1)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = 0.5 * torch.randn(n_states, H, K, V, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    dht = torch.randn(n_states, H, K, V, generator=gen)
    return (q, k, v, g, beta, h0), (do, dht)


def run(fn, inputs, cotangents, dtype, cu_seqlens=None, **kw):
    """Returns {name: tensor} for the output, final state and every input gradient (as float64)."""
    leaves = [x.to(dtype).requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = leaves
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, **kw)
    do, dht = cotangents
    loss = (o * do.to(o.dtype)).sum() + (ht * dht.to(ht.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return {n: t.detach().double() for n, t in zip(NAMES, (o, ht, *grads))}


def rel_rms(actual, expected):
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def assert_all_close(actual: dict, expected: dict, tol: dict, label: str):
    errors = {n: rel_rms(actual[n], expected[n]) for n in NAMES}
    bad = {n: e for n, e in errors.items() if not e <= tol[n]}
    assert not bad, f"{label}: relative RMS errors over tolerance: {bad} (all: {errors})"


CASES = [
    # B, T, H, K, V
    (2, 1, 2, 16, 8),
    (2, 63, 2, 16, 16),
    (1, 65, 3, 32, 32),
    (2, 130, 2, 16, 8),
]


@pytest.mark.parametrize("B,T,H,K,V", CASES, ids=[f"{B}-{T}-{H}-{K}-{V}" for B, T, H, K, V in CASES])
def test_chunk_and_naive_match_fp64_recurrence(B, T, H, K, V):
    inputs, cot = make_inputs(B, T, H, K, V, n_states=B, seed=T)
    ref = run(naive_recurrent_gated_delta_rule, inputs, cot, torch.float64)
    naive = run(naive_recurrent_gated_delta_rule, inputs, cot, torch.float32)
    chunk = run(chunk_gated_delta_rule_torch, inputs, cot, torch.float32)
    assert_all_close(naive, ref, TOL_VS_FP64, "naive fp32 vs fp64")
    assert_all_close(chunk, ref, TOL_VS_FP64, "chunk fp32 vs fp64")
    assert_all_close(chunk, naive, TOL_VS_FP64, "chunk vs naive, fp32")


def test_chunk_matches_fp64_without_decay():
    # g ≡ 0 is a known accuracy trap for chunked kernels (fla): no decay, state only grows
    inputs, cot = make_inputs(2, 100, 2, 16, 16, n_states=2, seed=7, g_zero=True)
    ref = run(naive_recurrent_gated_delta_rule, inputs, cot, torch.float64)
    chunk = run(chunk_gated_delta_rule_torch, inputs, cot, torch.float32)
    assert_all_close(chunk, ref, TOL_VS_FP64, "chunk fp32 vs fp64, g = 0")


@pytest.mark.parametrize("chunk_size", [1, 4, 16])
def test_other_chunk_sizes_match_fp64(chunk_size):
    inputs, cot = make_inputs(1, 37, 2, 8, 8, n_states=1, seed=chunk_size)
    ref = run(naive_recurrent_gated_delta_rule, inputs, cot, torch.float64)
    chunk = run(chunk_gated_delta_rule_torch, inputs, cot, torch.float32, chunk_size=chunk_size)
    assert_all_close(chunk, ref, TOL_VS_FP64, f"chunk_size {chunk_size}")


VARLEN = [
    [0, 5, 70, 70, 71, 130],  # short, crossing a chunk boundary, empty, single token, tail
    [0, 64, 128],  # documents aligned with chunks
    [0, 0, 3, 67, 67],  # empty first and last documents, one ending a chunk past a boundary
]


@pytest.mark.parametrize("bounds", VARLEN, ids=["ragged", "aligned", "empty_ends"])
def test_varlen_matches_fp64_recurrence(bounds):
    cu = torch.tensor(bounds)
    inputs, cot = make_inputs(1, bounds[-1], 2, 16, 8, n_states=len(bounds) - 1, seed=len(bounds))
    ref = run(naive_recurrent_gated_delta_rule, inputs, cot, torch.float64, cu_seqlens=cu)
    naive = run(naive_recurrent_gated_delta_rule, inputs, cot, torch.float32, cu_seqlens=cu)
    chunk = run(chunk_gated_delta_rule_torch, inputs, cot, torch.float32, cu_seqlens=cu)
    assert_all_close(naive, ref, TOL_VS_FP64, "naive varlen vs fp64")
    assert_all_close(chunk, ref, TOL_VS_FP64, "chunk varlen vs fp64")


@pytest.mark.parametrize("backend", ["naive", "torch_chunk"])
def test_varlen_equals_separate_documents(backend):
    bounds = [0, 5, 70, 71, 130]
    cu = torch.tensor(bounds)
    (q, k, v, g, beta, h0), _ = make_inputs(1, bounds[-1], 2, 16, 8, n_states=len(bounds) - 1, seed=3)
    o, ht = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                             backend=backend)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        o_i, ht_i = gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                     initial_state=h0[i : i + 1], output_final_state=True, backend=backend)
        torch.testing.assert_close(o[:, s:e], o_i, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ht[i : i + 1], ht_i, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["naive", "torch_chunk"])
def test_delta_rule_by_hand(backend):
    """Two tokens, values worked out on paper from DESIGN.md §2 (S = hᵀ, h ∈ R^{K×V})."""
    K = V = 2
    e0, e1 = torch.eye(2)
    h0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # key e0 holds (1, 2), key e1 holds (3, 4)
    q = torch.stack([e0, e1])[None, :, None]  # t=0 reads e0, t=1 reads e1
    k = torch.stack([e0, e1])[None, :, None]
    v = torch.tensor([[5.0, 6.0], [7.0, 8.0]])[None, :, None]
    g = torch.log(torch.tensor([0.5, 1.0]))[None, :, None]
    beta = torch.tensor([1.0, 0.25])[None, :, None]
    o, ht = get_backend(backend)(q, k, v, g, beta, scale=1.0, initial_state=h0[None, None],
                                 output_final_state=True)
    # t=0: decay by 0.5 -> rows (0.5, 1), (1.5, 2); β=1 replaces key e0's value by (5, 6)
    # t=1: no decay; β=0.25 moves key e1's value (1.5, 2) a quarter of the way to (7, 8)
    expected_h = torch.tensor([[5.0, 6.0], [1.5 + 0.25 * 5.5, 2.0 + 0.25 * 6.0]])
    torch.testing.assert_close(ht[0, 0], expected_h)
    torch.testing.assert_close(o[0, :, 0], torch.stack([expected_h[0], expected_h[1]]))


def test_outputs_keep_input_dtype_and_state_is_fp32():
    (q, k, v, g, beta, _), _ = make_inputs(1, 70, 2, 16, 16, n_states=1, seed=0)
    q, k, v, beta = (x.to(torch.bfloat16) for x in (q, k, v, beta))
    o, ht = chunk_gated_delta_rule_torch(q, k, v, g, beta, output_final_state=True)
    ref, ref_ht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    torch.testing.assert_close(o.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ht, ref_ht, rtol=1e-4, atol=1e-4)


def test_bad_shapes_and_backend_raise():
    (q, k, v, g, beta, h0), _ = make_inputs(2, 10, 2, 8, 8, n_states=2, seed=0)
    with pytest.raises(ValueError, match="B = 1"):
        chunk_gated_delta_rule_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10]))
    one = (q[:1], k[:1], v[:1], g[:1], beta[:1])
    for bounds, message in (([0, 9], "end at T"), ([1, 10], "start at 0"), ([0, 6, 4, 10], "non-decreasing")):
        with pytest.raises(ValueError, match=message):
            chunk_gated_delta_rule_torch(*one, cu_seqlens=torch.tensor(bounds))
    assert chunk_gated_delta_rule_torch(*one, cu_seqlens=torch.tensor([0, 4, 4, 10]))[0].shape == v[:1].shape
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0[:1])
    with pytest.raises(ValueError, match="g must be"):
        chunk_gated_delta_rule_torch(q, k, v, g[:, :5], beta)
    with pytest.raises(ValueError, match="unknown GDN backend"):
        gated_delta_rule(q, k, v, g, beta, backend="cuda_magic")
    assert {"naive", "torch_chunk", "triton"} <= set(BACKENDS)
