"""The fused decoding step (hymo_kernels.gdn.recurrent) against the PyTorch step it replaces: the
short conv over the cached window, SiLU, the q/k L2 norm and ``gated_delta_rule_step``, chained
over several tokens, with the cache (conv window and state) carried by each. CPU: Triton's
interpreter in fp32 on tiny shapes (K and V not powers of two, W = 2 and 4); bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hymo_kernels.gdn.mixer_torch import l2_normalize
from hymo_kernels.gdn.recurrent import gdn_decode_step
from hymo_kernels.gdn.recurrent_torch import gated_delta_rule_step

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference_step(xs, conv, w, g, beta, state, K, V):
    """The PyTorch step on copies: (o, new conv window, new state)."""
    B, C = xs.shape
    H = g.shape[-1]
    window = torch.cat([conv, xs[:, None]], dim=1)  # [B, W, C], the current token last
    y = F.silu((window.float() * w.float().t()[None]).sum(1))
    q, k, v = y.split([H * K, H * K, H * V], dim=-1)
    q = l2_normalize(q.view(B, H, K))
    k = l2_normalize(k.view(B, H, K))
    o, new_state = gated_delta_rule_step(q, k, v.reshape(B, H, V), g, beta, state)
    return o.to(xs.dtype), window[:, 1:], new_state


def inputs(B, H, K, V, W, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    C = H * (2 * K + V)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEV)

    xs = [rand(B, C).to(dtype) for _ in range(4)]  # four tokens per sequence
    conv = rand(B, W - 1, C).to(dtype)
    w = rand(C, W, scale=0.5).to(dtype)
    gates = [(-torch.rand(B, H, generator=gen).to(DEV), torch.rand(B, H, generator=gen).to(DEV))
             for _ in range(4)]
    state = rand(B, H, K, V, scale=0.3)
    return xs, conv, w, gates, state


@pytest.mark.parametrize("B, H, K, V, W", [(3, 2, 6, 5, 4), (2, 3, 8, 8, 2), (1, 1, 4, 4, 3)],
                         ids=["K6-V5-W4", "K8-V8-W2", "K4-V4-W3"])
def test_fused_step_matches_the_pytorch_step(B, H, K, V, W):
    xs, conv, w, gates, state = inputs(B, H, K, V, W, torch.float32, seed=B + W)
    ref_conv, ref_state = conv.clone(), state.clone()
    for x, (g, beta) in zip(xs, gates):
        o = gdn_decode_step(x, conv, w, g, beta, state, K, V)  # conv and state in place
        ref_o, ref_conv, ref_state = reference_step(x, ref_conv, w, g, beta, ref_state, K, V)
        torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)
        assert torch.equal(conv, ref_conv)  # the window moved on by exactly one token


def test_fused_step_rejects_bad_shapes():
    xs, conv, w, gates, state = inputs(2, 2, 4, 4, 4, torch.float32, seed=0)
    g, beta = gates[0]
    with pytest.raises(ValueError, match="xs must be"):
        gdn_decode_step(xs[0][:, :-1], conv, w, g, beta, state, 4, 4)
    with pytest.raises(ValueError, match="conv must be"):
        gdn_decode_step(xs[0], conv[:, 1:], w, g, beta, state, 4, 4)
    with pytest.raises(ValueError, match="contiguous float32"):
        gdn_decode_step(xs[0], conv, w, g, beta, state.double(), 4, 4)
    xs5, conv5, w5, _, _ = inputs(2, 2, 4, 4, 5, torch.float32, seed=0)
    with pytest.raises(ValueError, match="conv sizes 2-4, got 5"):
        gdn_decode_step(xs5[0], conv5, w5, g, beta, state, 4, 4)


@pytest.mark.gpu
def test_gpu_fused_step_bf16():
    """bf16 projections and conv cache, fp32 state: within the PyTorch step's own bf16 rounding
    of the conv output and the normalised q and k."""
    B, H, K, V, W = 4, 40, 32, 32, 4
    xs, conv, w, gates, state = inputs(B, H, K, V, W, torch.bfloat16, seed=1)
    ref_conv, ref_state = conv.clone(), state.clone()
    for x, (g, beta) in zip(xs, gates):
        o = gdn_decode_step(x, conv, w, g, beta, state, K, V)
        ref_o, ref_conv, ref_state = reference_step(x, ref_conv, w, g, beta, ref_state, K, V)
        assert ((o.float() - ref_o.float()).norm() / ref_o.float().norm()).item() < 2e-2
        assert ((state - ref_state).norm() / ref_state.norm()).item() < 1e-2
        assert torch.equal(conv, ref_conv)
