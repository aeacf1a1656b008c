"""Cached decoding (hymo_recipes/model/decode.py) against the full-sequence forward, and the
recurrent GDN step (hymo_kernels.gdn.recurrent_torch) against the per-token reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hymo_kernels.gdn.chunk_torch import chunk_gated_delta_rule_torch
from hymo_kernels.gdn.naive import naive_recurrent_gated_delta_rule
from hymo_kernels.gdn.recurrent_torch import gated_delta_rule_step
from hymo_recipes.model import HymoModel, hymo_flavors
from hymo_recipes.model.decode import GDNLayerCache, HymoDecoder, MLALayerCache, sample

RTOL = 1e-4  # of the largest |logit| of the reference, at every position


def _gdn_inputs(B, T, H, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.5
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_recurrent_step_equals_naive_token_by_token(dtype, tol):
    q, k, v, g, beta, h0 = _gdn_inputs(2, 11, 3, 8, 4, dtype)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    s = h0
    for t in range(q.shape[1]):
        o, s_new = gated_delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        assert o.dtype == dtype and s_new.dtype == dtype
        torch.testing.assert_close(o, o_ref[:, t], rtol=tol, atol=tol)
        # the states along the way: the naive reference over the first t + 1 tokens
        _, s_t = naive_recurrent_gated_delta_rule(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1],
                                                  beta[:, : t + 1], initial_state=h0, output_final_state=True)
        torch.testing.assert_close(s_new, s_t, rtol=tol, atol=tol)
        s = s_new
    torch.testing.assert_close(s, s_ref, rtol=tol, atol=tol)


def test_recurrent_step_keeps_bf16_outputs_and_fp32_state():
    q, k, v, g, beta, h0 = _gdn_inputs(1, 1, 2, 16, 16, torch.float32)
    o, s = gated_delta_rule_step(q[:, 0].bfloat16(), k[:, 0].bfloat16(), v[:, 0].bfloat16(), g[:, 0],
                                 beta[:, 0].bfloat16(), h0)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0[:, :1])


def test_chunked_prefill_state_then_steps_equal_naive():
    """The chunked reference's final state (over a chunk boundary, ragged packed documents)
    continued by recurrent steps equals the per-token recurrence over the whole sequences."""
    q, k, v, g, beta, _ = _gdn_inputs(2, 80, 2, 16, 8, torch.float64, seed=1)
    lens, extra = (70, 9), 10
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    # prefill: the two prompts packed into one row
    pack = lambda x: torch.cat([x[0, : lens[0]], x[1, : lens[1]]])[None]  # noqa: E731
    cu = torch.tensor([0, lens[0], lens[0] + lens[1]])
    o_pre, s = chunk_gated_delta_rule_torch(*(pack(x) for x in (q, k, v, g, beta)), output_final_state=True,
                                            cu_seqlens=cu)
    torch.testing.assert_close(o_pre[0, : lens[0]], o_ref[0, : lens[0]], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o_pre[0, lens[0]:], o_ref[1, : lens[1]], rtol=1e-10, atol=1e-10)
    pos = torch.tensor(lens)
    for i in range(extra):
        b = torch.arange(2)
        t = pos + i
        o, s = gated_delta_rule_step(q[b, t], k[b, t], v[b, t], g[b, t], beta[b, t], s)
        torch.testing.assert_close(o, o_ref[b, t], rtol=1e-10, atol=1e-10)
    _, s1 = naive_recurrent_gated_delta_rule(*(x[1:, : lens[1] + extra] for x in (q, k, v, g, beta)),
                                             output_final_state=True)
    torch.testing.assert_close(s[0], s_ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s[1], s1[0], rtol=1e-10, atol=1e-10)


# -- the model ----------------------------------------------------------------------------------

def _model(args, seed=0):
    # a wider init than the flavors' 0.02: every block then moves the logits enough that an
    # error in any part of the cached path (a conv tap, a RoPE position, a KV group, the MoE)
    # is far above the tolerance
    args = dataclasses.replace(args, init_std=0.1)
    torch.manual_seed(seed)
    model = HymoModel(args)
    model.init_weights()
    # trained-looking routing: a non-zero selection bias, so that the decoder must use it
    for layer in model.layers.values():
        if hasattr(layer, "moe"):
            layer.moe.expert_bias.copy_(torch.randn(layer.moe.num_experts) * 0.05)
    return model.eval()


def _dropless_reference(model):
    """The same model (shared parameters) whose forward never drops: what decoding computes."""
    for layer in model.layers.values():
        if hasattr(layer, "moe"):
            layer.moe.capacity_factor = 0
    return model


def _close(got, ref, what, rtol=RTOL):
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rtol * scale, f"{what}: max |diff| {err:.3g} > {rtol} x max |logit| {scale:.3g}"
    return err / scale


def _check_decoding(model, prompt_lens, n_steps, seed=0, capacity=None, rtol=RTOL):
    """Prefill a batch of prompts of different lengths, then teacher-forced steps; at every
    position the cached logits equal the full forward's on that sequence's prefix, alone."""
    V = model.model_args.vocab_size
    dev = model.tok_embeddings.weight.device
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in prompt_lens]
    conts = [torch.randint(0, V, (n_steps,), generator=gen).tolist() for _ in prompt_lens]
    decoder = HymoDecoder(model)
    logits, cache = decoder.prefill(prompts, capacity=capacity, all_logits=True)
    ref_model = _dropless_reference(model)
    worst = 0.0
    with torch.no_grad():
        for b, p in enumerate(prompts):
            ref = ref_model(torch.tensor([p], device=dev))[0][0]
            worst = max(worst, _close(logits[b], ref, f"prefill of prompt {b}", rtol))
        for s in range(n_steps):
            step_logits = decoder.step(torch.tensor([c[s] for c in conts], device=dev), cache)
            assert cache.lengths.tolist() == [n + s + 1 for n in prompt_lens]
            for b, p in enumerate(prompts):
                ref = ref_model(torch.tensor([p + conts[b][: s + 1]], device=dev))[0][0, -1]
                worst = max(worst, _close(step_logits[b], ref, f"step {s} of prompt {b}", rtol))
    return worst, cache


@pytest.mark.parametrize("prompt_lens", [(5, 17, 1), (70, 3)], ids=["short", "over_a_chunk"])
def test_debug_flavor_cached_logits_equal_forward(prompt_lens):
    args = dataclasses.replace(hymo_flavors["debugmodel"])
    assert args.n_kv_heads > 1 and args.n_heads > args.n_kv_heads  # GQA; capacity factor 1.5 (dropping in training)
    assert args.moe_capacity_factor > 0
    worst, cache = _check_decoding(_model(args), prompt_lens, n_steps=6)
    # the cache: fp32 GDN states, W - 1 conv inputs, the latent (not per-head) MLA cache
    for name, c in cache.layers.items():
        if int(name) in args.mla_layers:
            assert isinstance(c, MLALayerCache)
            assert c.kv.shape[-1] == args.kv_lora_rank and c.k_rope.shape[-1] == args.qk_rope_head_dim
        else:
            assert isinstance(c, GDNLayerCache)
            assert c.state.shape == (len(prompt_lens), args.gdn_n_heads, args.gdn_head_dim, args.gdn_v_head_dim)
            assert c.state.dtype == torch.float32 and c.conv.shape[1] == args.gdn_conv_size - 1
    # per sequence: a fixed GDN part (fp32 state + W - 1 conv inputs) and kv_lora_rank + rope dim per token
    n_gdn, n_mla = len(args.gdn_layers), len(args.mla_layers)
    conv = 2 * args.gdn_n_heads * args.gdn_head_dim + args.gdn_n_heads * args.gdn_v_head_dim
    assert cache.nbytes_per_sequence(100) == {
        "gdn": n_gdn * 4 * (args.gdn_n_heads * args.gdn_head_dim * args.gdn_v_head_dim
                            + (args.gdn_conv_size - 1) * conv),
        "mla": n_mla * 4 * 100 * (args.kv_lora_rank + args.qk_rope_head_dim)}


@pytest.mark.parametrize("overrides", [
    dict(n_kv_heads=1),  # MQA: one latent group for all heads
    dict(n_kv_heads=2),  # GQA
    dict(n_kv_heads=4),  # one group per head
    dict(nope_layers=(3,)),  # the NoPE-hybrid ablation: unrotated rope slices
    dict(gdn_ffn_dim=48, moe_num_shared_experts=0, mla_layers=(1, 3)),  # dense FFN on GDN blocks, two MLA layers
    dict(gdn_backend="naive", moe_capacity_factor=1.0),
    dict(mup_base_width=16),  # muP: the readout's logit multiplier and MLA's 1/d scale
], ids=["mqa", "gqa", "mha", "nope", "ffn_two_mla", "naive_backend", "mup"])
def test_tiny_cached_logits_equal_forward(tiny_args, overrides):
    _check_decoding(_model(tiny_args(**overrides)), (4, 9, 2), n_steps=5)


def test_triton_backend_decodes_through_the_fused_step(tiny_args, monkeypatch):
    """gdn_backend "triton" (Triton's interpreter on CPU): the steps run the fused decode kernel
    (conv, norms and recurrence in one launch per GDN layer) and still equal the forward."""
    from hymo_kernels.gdn import recurrent

    calls = []
    fused = recurrent.gdn_decode_step
    monkeypatch.setattr(recurrent, "gdn_decode_step", lambda *a, **k: calls.append(1) or fused(*a, **k))
    args = tiny_args(gdn_backend="triton")
    _check_decoding(_model(args), (3, 6), n_steps=2)
    assert len(calls) == 2 * len(args.gdn_layers)


@pytest.mark.gpu
def test_gpu_cached_logits_equal_forward(tiny_args):
    """The GPU path: the Triton GDN kernels' prefill, the prompts' attention through flex
    attention with a block mask, the recurrent steps; fp32 (the kernels' dots in tf32)."""
    torch.manual_seed(0)
    model = HymoModel(tiny_args(gdn_backend="triton"))
    model.init_weights()
    _check_decoding(model.cuda(), (40, 130, 3), n_steps=4, rtol=5e-3)


def test_cache_grows_and_rope_runs_past_max_seq_len(tiny_args):
    """A cache made with room for fewer tokens than generated grows; sequences longer than
    max_seq_len use the same RoPE angles as a model built with a longer table."""
    short = _model(tiny_args(max_seq_len=12))
    long = _model(tiny_args(max_seq_len=64))
    long.load_state_dict(short.state_dict())
    V = short.model_args.vocab_size
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12]]
    conts = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(3))
    dec = HymoDecoder(short)
    _, cache = dec.prefill(prompts, capacity=1)
    assert cache.capacity == 11
    for s in range(8):
        logits = dec.step(conts[:, s], cache)
    assert cache.capacity >= 18
    ref = _dropless_reference(long)
    with torch.no_grad():
        for b in range(2):
            r = ref(torch.tensor([prompts[b] + conts[b].tolist()]))[0][0, -1]
            _close(logits[b], r, f"prompt {b} at {len(prompts[b]) + 8} tokens")


def test_decoder_counts_no_moe_load_and_batch_equals_alone(tiny_model):
    model = tiny_model().eval()
    moe = model.layers["3"].moe
    before = moe.tokens_per_expert.clone()
    dec = HymoDecoder(model)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    together = dec.generate(prompts, 6, greedy=True)
    assert torch.equal(moe.tokens_per_expert, before)
    for b, p in enumerate(prompts):
        assert dec.generate([p], 6, greedy=True) == [together[b]]


def test_generate_stops_at_eos_and_streams(tiny_model):
    model = tiny_model().eval()
    dec = HymoDecoder(model)
    free = dec.generate([[3, 4]], 5, greedy=True)[0]
    eos = free[1]
    seen = []
    out = dec.generate([[3, 4], [3, 4]], 5, greedy=True, eos_id=eos, on_step=lambda s, ids, done: seen.append(done))
    assert out[0] == free[: free.index(eos) + 1]
    assert seen[-1] == [True, True] and len(seen) == free.index(eos) + 1
    with pytest.raises(ValueError, match="at least one token"):
        dec.prefill([[1], []])


def test_sample():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, greedy=True).tolist() == [1, 0]
    assert sample(logits, temperature=0).tolist() == [1, 0]
    assert sample(logits, top_k=1, generator=torch.Generator().manual_seed(0)).tolist() == [1, 0]
    assert sample(logits, top_p=1e-3, generator=torch.Generator().manual_seed(0)).tolist() == [1, 0]
    draws = lambda seed: sample(logits.expand(64, -1, -1).reshape(128, 4), top_k=2,  # noqa: E731
                                generator=torch.Generator().manual_seed(seed))
    a = draws(1)
    assert torch.equal(a, draws(1))
    assert set(a.view(64, 2)[:, 0].tolist()) <= {1, 3}  # top 2 of row 0
    # top_p = 0.9 on row 0 (probs ~ .64, .24, .09, .03): the first two reach 0.88 < 0.9, so three stay
    b = sample(logits[:1].expand(512, -1), top_p=0.9, generator=torch.Generator().manual_seed(2))
    assert set(b.tolist()) == {1, 3, 2}


def test_bf16_parameters_decode_with_fp32_state(tiny_args):
    """bf16 parameters (buffers kept fp32, as hymo_recipes.generate loads them): the GDN state
    stays fp32 and the logits stay near the fp32 decoder's."""
    model = _model(tiny_args())
    prompts, nxt = [[1, 2, 3, 4, 5], [6, 7]], torch.tensor([9, 10])
    d32 = HymoDecoder(model)
    _, c32 = d32.prefill(prompts)
    ref = d32.step(nxt, c32)
    for p in model.parameters():
        p.data = p.data.bfloat16()
    dbf = HymoDecoder(model)
    _, cbf = dbf.prefill(prompts)
    got = dbf.step(nxt, cbf)
    assert got.dtype == torch.bfloat16 and cbf.layers["0"].state.dtype == torch.float32
    assert (got.float() - ref).abs().max() <= 0.1 * ref.abs().max()


def test_prefill_past_max_tokens_runs_in_groups_that_decode_as_one_row(tiny_args):
    """Prompts over ``max_tokens`` go through several forwards of consecutive prompts (a prompt
    longer than the bound alone); the concatenated cache decodes as the one packed row's."""
    model = _model(tiny_args())
    dec = HymoDecoder(model)
    prompts = [[1, 2, 3, 4, 5], [6, 7], list(range(8, 20)), [20, 21, 22], [23]]
    calls = []
    forward = model.tok_embeddings.forward
    model.tok_embeddings.forward = lambda t: calls.append(t.shape[-1]) or forward(t)
    one, c1 = dec.prefill(prompts, capacity=30, max_tokens=None)
    assert calls == [23]
    calls.clear()
    grouped, cg = dec.prefill(prompts, capacity=30, max_tokens=8)
    assert calls == [7, 12, 4]  # (5 + 2), the 12-token prompt alone, (3 + 1)
    model.tok_embeddings.forward = forward
    assert cg.lengths.tolist() == [5, 2, 12, 3, 1] and cg.max_length == 12 and cg.capacity == c1.capacity
    _close(grouped, one, "prefill logits")
    nxt = torch.tensor([30, 31, 32, 33, 34])
    for s in range(3):
        a, b = dec.step(nxt + s, c1), dec.step(nxt + s, cg)
        _close(b, a, f"step {s}")
    every, _ = dec.prefill(prompts, all_logits=True, max_tokens=8)
    assert [x.shape[0] for x in every] == [5, 2, 12, 3, 1]
