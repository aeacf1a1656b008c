"""GDN and MLA blocks: causality, backends, conv, RoPE, GQA grouping, packed documents."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hymo_kernels.gdn.naive import naive_recurrent_gated_delta_rule
from hymo_recipes.model import gdn as gdn_module
from hymo_recipes.model import mla as mla_module
from hymo_recipes.model.gdn import GatedDeltaNet, short_causal_conv
from hymo_recipes.model.mla import MLA, apply_rope, document_causal_mask, precompute_rope_cache
from hymo_recipes.model.model import GDNBlock, MLABlock, positions_in_documents


def init_block(block, seed=0):
    torch.manual_seed(seed)
    block.init_weights()
    return block


def assert_causal(fn, x: torch.Tensor, cuts=(0, 17, 63, 64, 98)):
    """fn(x)[:, :t+1] must not change when x[:, t+1:] is replaced by large noise."""
    base = fn(x)
    gen = torch.Generator().manual_seed(1)
    for t in cuts:
        x2 = x.clone()
        x2[:, t + 1 :] = 10 * torch.randn(x2[:, t + 1 :].shape, generator=gen)
        out = fn(x2)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"future tokens leak into position <= {t}: {m}")
        # and the test is not vacuous: the perturbed tail does change
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])


@pytest.mark.parametrize("backend", ["naive", "torch_chunk"])
def test_gdn_block_is_causal(tiny_args, backend):
    block = init_block(GDNBlock(0, tiny_args(gdn_backend=backend)))
    x = torch.randn(2, 101, 64)
    rope = precompute_rope_cache(8, 256, 1e4)
    assert_causal(lambda x: block(x, rope), x)


def test_gdn_block_with_dense_ffn_is_causal_and_has_ffn_params(tiny_args):
    block = init_block(GDNBlock(0, tiny_args(gdn_ffn_dim=48)))
    names = {n for n, _ in block.named_parameters()}
    assert {"ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"} <= names
    rope = precompute_rope_cache(8, 256, 1e4)
    assert_causal(lambda x: block(x, rope), torch.randn(2, 70, 64), cuts=(5, 40))


@pytest.mark.parametrize("use_rope", [True, False], ids=["rope", "nope"])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_mla_moe_block_is_causal(tiny_args, use_rope, capacity_factor):
    args = tiny_args(moe_capacity_factor=capacity_factor, nope_layers=() if use_rope else (3,))
    block = init_block(MLABlock(3, args))
    assert block.attn.use_rope == use_rope
    rope = precompute_rope_cache(8, 256, 1e4)
    # Input-dependent routing (large router weights) with a lean toward expert 0: the capacity
    # bites, and which tokens are dropped depends on the other tokens' routes.
    with torch.no_grad():
        block.moe.router.gate.weight.normal_(0.0, 0.3)
    block.moe.expert_bias[0] = 0.2
    x = torch.randn(2, 101, 64)
    assert_causal(lambda x: block(x, rope), x)
    if capacity_factor > 0:
        assert block.moe.dropped_tokens.sum() > 0, "the capacity path was not exercised"


@pytest.mark.parametrize("knob, value, kwargs", [
    ("gdn_dot_precision", "table", {}), ("gdn_dot_precision", "bf16", {"dot_bf16": True, "t_bf16": False}),
    ("gdn_dot_precision", "bf16_t", {"dot_bf16": True, "t_bf16": True}),
    ("gdn_dot_precision", "tf32", {"dot_bf16": False}),
    ("gdn_bwd_path", "table", {}), ("gdn_bwd_path", "local", {"bwd_path": "local"}),
    ("gdn_bwd_path", "local_sub", {"bwd_path": "local_sub"}),
])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_gdn_kernel_knobs_reach_the_kernel_call(tiny_args, monkeypatch, knob, value, kwargs, fused):
    """gdn_dot_precision becomes the Triton op's dot_bf16 / t_bf16 arguments, gdn_bwd_path its
    bwd_path ("table": none passed), on the fused path (hymo_kernels.gdn.mixer) and without it."""
    layer = GatedDeltaNet(tiny_args(gdn_backend="triton", gdn_fused_mixer=fused, **{knob: value}))
    layer.init_weights(0.02, 0.01)
    seen = []

    def spy(q, k, v, g, beta, **kw):
        seen.append(kw)
        return naive_recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens=kw.get("cu_seqlens"))

    def fused_spy(qkv, wq, wk, wv, g, beta, *, head_k, head_v, positions, **kw):
        seen.append(kw)
        return torch.zeros(*qkv.shape[:2], wq.shape[0] // head_k, head_v)

    if fused:
        monkeypatch.setattr(gdn_module, "conv_gated_delta_rule", fused_spy)
    else:
        monkeypatch.setattr(layer, "_rule", spy)
    layer(torch.randn(1, 9, 64))
    assert seen == [dict(cu_seqlens=None, **kwargs, **({"keep": False} if fused else {}))]


def test_gdn_mixer_saves_leaves_the_pytorch_path_alone(tiny_args):
    """On the PyTorch path the knob changes nothing: the same output and gradients either way."""
    results = []
    for saves in ("inputs", "outputs"):
        torch.manual_seed(0)
        layer = GatedDeltaNet(tiny_args(gdn_backend="torch_chunk", gdn_mixer_saves=saves))
        layer.init_weights(0.02, 0.01)
        x = torch.randn(2, 9, 64, requires_grad=True)
        layer(x).sum().backward()
        results.append((x.grad, [p.grad for p in layer.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize("saves, keep", [("inputs", False), ("outputs", True)])
def test_gdn_mixer_saves_reaches_the_fused_ops(tiny_args, monkeypatch, saves, keep):
    """gdn_mixer_saves becomes the ``keep`` argument of both fused ops."""
    layer = GatedDeltaNet(tiny_args(gdn_backend="triton", gdn_mixer_saves=saves))
    layer.init_weights(0.02, 0.01)
    seen = []

    def conv_spy(qkv, wq, wk, wv, g, beta, *, head_k, head_v, positions, keep, **kw):
        seen.append(("conv", keep))
        return torch.zeros(*qkv.shape[:2], wq.shape[0] // head_k, head_v)

    def norm_spy(o, gate, norm_w, out_w, eps, keep):
        seen.append(("norm", keep))
        return torch.zeros(*o.shape[:2], out_w.shape[0])

    monkeypatch.setattr(gdn_module, "conv_gated_delta_rule", conv_spy)
    monkeypatch.setattr(gdn_module, "gated_norm_linear", norm_spy)
    layer(torch.randn(1, 9, 64))
    assert seen == [("conv", keep), ("norm", keep)]


@pytest.mark.parametrize("spec, options", [("", None), ("bwd_num_stages=2,USE_TMA=true",
                                                           {"bwd_num_stages": 2, "USE_TMA": True})])
def test_mla_flex_options_reach_flex_attention(tiny_args, monkeypatch, spec, options):
    """mla_flex_options become flex attention's kernel_options on the packed path (None: the defaults)."""
    attn = MLA(tiny_args(mla_flex_options=spec))
    attn.init_weights(0.02, 0.01)
    seen = []

    def flex_spy(q, k, v, block_mask, scale, kernel_options=None):
        seen.append((block_mask, kernel_options))
        return torch.zeros(*q.shape[:3], v.shape[-1])

    monkeypatch.setattr(mla_module, "_flex_attention", flex_spy)
    block_mask = object()  # not a tensor: the GPU's BlockMask path
    T = 9
    attn(torch.randn(1, T, 64), precompute_rope_cache(attn.qk_rope_head_dim, T, 10_000.0),
         positions=positions_in_documents(torch.tensor([0, 4, T]), T), attn_mask=block_mask)
    assert seen == [(block_mask, options)]


def test_gdn_backends_agree_through_the_layer(tiny_args):
    torch.manual_seed(0)
    naive = GatedDeltaNet(tiny_args(gdn_backend="naive"))
    naive.init_weights(0.02, 0.01)
    chunk = GatedDeltaNet(tiny_args(gdn_backend="torch_chunk"))
    chunk.load_state_dict(naive.state_dict())
    x = torch.randn(2, 77, 64)
    outs, grads = [], []
    for layer in (naive, chunk):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.pow(2).sum().backward()
        outs.append(y)
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for g_chunk, g_naive in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_chunk, g_naive, rtol=1e-4, atol=1e-6)


def test_short_conv_matches_left_padded_conv1d_and_respects_documents():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 30, 6, generator=gen)
    w = torch.randn(6, 1, 4, generator=gen)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), w, groups=6).transpose(1, 2)
    torch.testing.assert_close(short_causal_conv(x, w, None), ref)

    cu = torch.tensor([0, 2, 11, 30])  # a document shorter than the kernel
    packed = short_causal_conv(x[:1], w, positions_in_documents(cu, 30))
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(packed[:, s:e], short_causal_conv(x[:1, s:e], w, None))


def test_positions_and_document_mask_match_brute_force():
    cu = torch.tensor([0, 3, 3, 7, 8])
    pos = positions_in_documents(cu, 8)
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    doc = [0, 0, 0, 2, 2, 2, 2, 3]
    expected = torch.tensor([[j <= i and doc[i] == doc[j] for j in range(8)] for i in range(8)])
    assert torch.equal(document_causal_mask(pos), expected)
    with pytest.raises(ValueError, match="end at T = 8"):
        positions_in_documents(torch.tensor([0, 3, 9]), 8)


BLOCK_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("T", [128, 200, 1024, 1500])
def test_document_block_mask_is_create_block_masks(T):
    """The GPU path's BlockMask, built from the document starts block by block, against flex
    attention's own create_block_mask evaluating the mask at every (query, key) pair: every
    index table equal. Layouts: one document, random cuts, a cut on a block edge, documents
    shorter than a block, and a row that starts inside a document (positions not from 0)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from hymo_recipes.model.mla import document_block_mask

    gen = torch.Generator().manual_seed(T)
    layouts = [([], 0), ([min(128, T - 1)], 0), (list(range(1, T, 37)), 0)]
    for trial in range(6):
        cuts = torch.randint(1, T, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)
        layouts.append((sorted(set(cuts.tolist())), 0 if trial % 2 else 1 + trial * 50))
    for cuts, offset in layouts:
        cu = torch.tensor([0, *cuts, T])
        pos = positions_in_documents(cu, T)
        pos[: cu[1]] += offset

        def causal_in_document(b, h, q, kv):
            return (kv <= q) & (kv >= q - pos[q])

        want = create_block_mask(causal_in_document, None, None, T, T, device="cpu", _compile=False)
        got = document_block_mask(pos)
        assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
        for field in BLOCK_MASK_FIELDS:
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == b.dtype and torch.equal(a, b), (cuts, offset, field)
        assert got.mask_mod(0, 0, torch.tensor(T - 1), torch.tensor(0)) == bool(pos[T - 1] >= T - 1)


def test_rope_scores_depend_only_on_relative_position():
    cache = precompute_rope_cache(8, 64, 1e4)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 8, generator=gen).unbind(0)

    def score(m, n):
        qm = apply_rope(q.expand(1, 64, 1, 8), cache, None)[0, m, 0]
        kn = apply_rope(k.expand(1, 64, 1, 8), cache, None)[0, n, 0]
        return (qm * kn).sum()

    torch.testing.assert_close(score(10, 3), score(40, 33))
    torch.testing.assert_close(score(0, 0), (q * k).sum())  # position 0 is the identity
    assert not torch.allclose(score(10, 3), score(10, 4))
    # norm-preserving rotation, frequencies theta^(-2i/d)
    angle = cache[5, 2]
    torch.testing.assert_close(angle, torch.tensor([math.cos(5 * 1e4 ** (-4 / 8)), math.sin(5 * 1e4 ** (-4 / 8))]))


def mla_reference(mla: MLA, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """MLA written out per head with an explicit softmax, independent of the module's forward."""
    B, T, _ = x.shape
    H, G = mla.n_heads, mla.n_kv_heads
    dn, dr, dv = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    q = mla.wq_b(mla.q_norm(mla.wq_a(x))).view(B, T, H, dn + dr)
    ckv = mla.wkv_a(x)
    c, k_rope = ckv[..., : mla.kv_lora_rank], ckv[..., mla.kv_lora_rank :]
    kv = mla.wkv_b(mla.kv_norm(c)).view(B, T, G, dn + dv)
    k_rope = apply_rope(k_rope[:, :, None], rope, None)[:, :, 0]  # [B, T, dr], one per token
    q_rope = apply_rope(q[..., dn:], rope, None)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    heads = []
    for h in range(H):
        grp = h // (H // G)  # query heads 0..H/G-1 read group 0, and so on
        k_h = torch.cat([kv[:, :, grp, :dn], k_rope], dim=-1)
        q_h = torch.cat([q[:, :, h, :dn], q_rope[:, :, h]], dim=-1)
        s = (q_h @ k_h.transpose(1, 2)) / math.sqrt(dn + dr)
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        heads.append(p @ kv[:, :, grp, dn:])
    return mla.wo(torch.cat(heads, dim=-1))


def test_mla_matches_per_head_reference_with_gqa_grouping(tiny_args):
    args = tiny_args(n_heads=4, n_kv_heads=2)
    torch.manual_seed(0)
    mla = MLA(args)
    mla.init_weights(0.2, 0.2)  # large weights so that a wrong grouping cannot hide
    assert mla.wq_b.weight.shape == (4 * (16 + 8), 32)
    assert mla.wkv_a.weight.shape == (32 + 8, 64)
    assert mla.wkv_b.weight.shape == (2 * (16 + 16), 32)
    assert mla.wo.weight.shape == (64, 4 * 16)
    rope = precompute_rope_cache(8, 256, 1e4)
    x = torch.randn(2, 19, 64)
    out = mla(x, rope)
    assert out.shape == (2, 19, 64)
    torch.testing.assert_close(out, mla_reference(mla, x, rope), rtol=1e-4, atol=1e-5)

    # the reference would notice an interleaved grouping (head h -> group h % G)
    swapped = MLA(args)
    swapped.load_state_dict(mla.state_dict())
    with torch.no_grad():  # swap query heads 1 and 2: same heads, other groups
        w = swapped.wq_b.weight.view(4, 24, 32)
        w[[1, 2]] = w[[2, 1]].clone()
    assert not torch.allclose(swapped(x, rope), out, atol=1e-3)


def test_mla_gradients_match_the_per_head_reference(tiny_args):
    """The MLA's backward (q's rope slice rotated in place in the projection's output) gives
    the per-head reference's gradients, for x and every weight."""
    torch.manual_seed(0)
    mla = MLA(tiny_args(n_heads=4, n_kv_heads=2))
    mla.init_weights(0.2, 0.2)
    rope = precompute_rope_cache(8, 256, 1e4)
    x = torch.randn(2, 19, 64)
    cot = torch.randn(2, 19, 64)
    grads = []
    for fn in (lambda a: mla(a, rope), lambda a: mla_reference(mla, a, rope)):
        xa = x.clone().requires_grad_()
        mla.zero_grad()
        (fn(xa) * cot).sum().backward()
        grads.append([xa.grad] + [p.grad.clone() for p in mla.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_mla_packed_documents_equal_separate_documents(tiny_args):
    torch.manual_seed(0)
    mla = MLA(tiny_args())
    mla.init_weights(0.1, 0.1)
    rope = precompute_rope_cache(8, 256, 1e4)
    cu = torch.tensor([0, 9, 10, 40])
    x = torch.randn(1, 40, 64)
    packed = mla(x, rope, positions_in_documents(cu, 40))
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(packed[:, s:e], mla(x[:, s:e], rope), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["", "BACKEND=FLASH"])
def test_gpu_mla_flex_backends_match_dense_attention(spec):
    """The 750m's MLA on packed documents, bf16: flex attention with its block mask (Triton's
    kernels, or flash-attn-4's with BACKEND=FLASH where that is installed) against the dense
    document mask through SDPA: outputs, the input's and every weight's gradients."""
    import dataclasses

    from hymo_recipes.model import hymo_flavors
    from hymo_recipes.model.mla import document_attention_mask

    if "FLASH" in spec:
        pytest.importorskip("flash_attn.cute", reason="BACKEND=FLASH needs flash-attn-4 (the flash extra)")
    args = dataclasses.replace(hymo_flavors["750m"], mla_flex_options=spec)
    torch.manual_seed(0)
    attn = MLA(args).cuda()
    attn.init_weights(0.02, 0.02)
    attn.bfloat16()
    T = 1536
    cu = torch.tensor([0, 700, 701, 1200, T], device="cuda")
    positions = positions_in_documents(cu, T)
    rope = precompute_rope_cache(args.qk_rope_head_dim, T, args.rope_theta).cuda()
    x = torch.randn(1, T, args.dim, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    results = []
    for mask in (document_attention_mask(positions), document_causal_mask(positions)):
        xa = x.clone().requires_grad_()
        y = attn(xa, rope, positions, attn_mask=mask)
        attn.zero_grad()
        y.backward(dy)
        results.append([y.detach().float(), xa.grad.float()] + [p.grad.float() for p in attn.parameters()])
    def rel(got, want):
        return float((got - want).norm() / want.norm())

    (y_flex, *grads_flex), (y_dense, *grads_dense) = results
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):  # each document's outputs, the one-token one too
        assert rel(y_flex[:, s:e], y_dense[:, s:e]) < 2e-2, f"document [{s}, {e})"
    for i, (got, want) in enumerate(zip(grads_flex, grads_dense)):
        assert rel(got, want) < 2e-2, f"gradient {i} (0: the input's, then the weights')"
