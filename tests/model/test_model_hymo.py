"""The whole model: causality, packed batches, MTP, meta-device init, contract names, counts."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from hymo_recipes.model import HymoModel, count_params, hymo_flavors, training_flops_per_token
from hymo_recipes.model import model as model_mod
from hymo_recipes.model.mtp import shift_for_head


def test_model_is_causal_for_main_and_mtp_logits(tiny_model):
    model = tiny_model(moe_capacity_factor=1.0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 97, (2, 90), generator=gen)
    with torch.no_grad():
        logits, mtp = model(tokens)
        for t in (0, 30, 64, 88):
            other = tokens.clone()
            other[:, t + 1 :] = torch.randint(0, 97, other[:, t + 1 :].shape, generator=gen)
            logits2, mtp2 = model(other)
            torch.testing.assert_close(logits2[:, : t + 1], logits[:, : t + 1], rtol=1e-5, atol=1e-5)
            for a, b in zip(mtp2, mtp):
                torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=1e-5, atol=1e-5)
            assert not torch.allclose(logits2[:, t + 1 :], logits[:, t + 1 :])


@pytest.mark.parametrize("backend", ["naive", "torch_chunk"])
def test_packed_batch_equals_separate_documents(tiny_model, backend):
    # dropless: with a capacity, packing documents together changes who gets dropped
    model = tiny_model(moe_capacity_factor=0.0, gdn_backend=backend)
    lengths = [5, 70, 1, 30] if backend == "torch_chunk" else [5, 20, 1, 9]
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 97, (1, n), generator=gen) for n in lengths]
    cu = torch.tensor([0] + lengths).cumsum(0)
    with torch.no_grad():
        logits, mtp = model(torch.cat(docs, dim=1), cu_seqlens=cu)
        for doc, s, e in zip(docs, cu[:-1].tolist(), cu[1:].tolist()):
            ref_logits, ref_mtp = model(doc)
            torch.testing.assert_close(logits[:, s:e], ref_logits, rtol=1e-5, atol=1e-5)
            for a, b in zip(mtp, ref_mtp):
                torch.testing.assert_close(a[:, s:e], b, rtol=1e-5, atol=1e-5)


BOS = 1


def _rows_with_documents(gen, B, T, starts):
    """[B, T] random tokens (never BOS) with BOS at the given (row, column) starts."""
    tokens = torch.randint(2, 97, (B, T), generator=gen)
    for r, c in starts:
        tokens[r, c] = BOS
    return tokens


def test_documents_of_marks_row_starts_and_bos_or_after_eos():
    tokens = torch.tensor([[5, 1, 6, 7, 1], [8, 9, 1, 2, 3]])
    cu, pos = model_mod.documents_of(tokens, start_id=1)
    assert cu.tolist() == [0, 1, 4, 5, 7, 10] and cu.dtype == torch.int32
    assert pos.tolist() == [0, 0, 1, 2, 0, 0, 1, 0, 1, 2]
    cu, pos = model_mod.documents_of(tokens, end_id=7)  # a document starts after each EOS
    assert cu.tolist() == [0, 4, 5, 10] and pos.tolist() == [0, 1, 2, 3, 0, 0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="exactly one"):
        model_mod.documents_of(tokens)


@pytest.mark.parametrize("backend", ["naive", "torch_chunk"])
def test_packed_rows_give_each_document_its_own_logits_and_gradients(tiny_model, backend):
    """B = 3 rows, documents from BOS tokens (one spans a row end: the packing makes it two);
    every document's logits and every parameter's gradient equal those of the documents run
    one by one (fp32); without the boundaries the later documents' logits differ."""
    model = tiny_model(moe_capacity_factor=0.0, gdn_backend=backend, mtp_depth=1, mtp_loss_weights=(0.3,))
    gen = torch.Generator().manual_seed(2)
    B, T = 3, 48
    tokens = _rows_with_documents(gen, B, T, [(0, 0), (0, 17), (0, 18), (1, 30), (2, 0), (2, 5)])
    cu, pos = model_mod.documents_of(tokens, start_id=BOS)
    w = torch.randn(B, T, 97, generator=gen)  # a loss that weighs every logit differently
    logits, mtp = model(tokens, cu_seqlens=cu, positions=pos)
    ((logits * w).sum() + (mtp[0] * w).sum()).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    flat_w = w.view(B * T, 97)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        r, c0 = divmod(s, T)
        doc_logits, doc_mtp = model(tokens[r:r + 1, c0:c0 + e - s])
        torch.testing.assert_close(logits.view(B * T, -1)[s:e], doc_logits[0].detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mtp[0].view(B * T, -1)[s:e], doc_mtp[0][0].detach(), rtol=1e-5, atol=1e-5)
        ((doc_logits[0] * flat_w[s:e]).sum() + (doc_mtp[0][0] * flat_w[s:e]).sum()).backward()
    assert packed_grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if n in packed_grads:
            torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
    with torch.no_grad():
        plain, _ = model(tokens)
    assert not torch.allclose(plain[0, 17:], logits[0, 17:].detach(), atol=1e-3)
    torch.testing.assert_close(plain[0, :17], logits[0, :17].detach(), rtol=1e-5, atol=1e-5)


def test_forward_rejects_bad_inputs(tiny_model):
    model = tiny_model()
    with pytest.raises(ValueError, match="exceeds max_seq_len 256"):
        model(torch.zeros(1, 257, dtype=torch.long))
    with pytest.raises(ValueError, match="end at T = 16"):
        model(torch.zeros(2, 8, dtype=torch.long), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="every row of the batch must start a document"):
        model(torch.zeros(2, 8, dtype=torch.long), cu_seqlens=torch.tensor([0, 5, 16]))
    with pytest.raises(ValueError, match="with cu_seqlens only"):
        model(torch.zeros(1, 8, dtype=torch.long), positions=torch.arange(8))


def test_mtp_heads_leave_main_logits_unchanged(tiny_model):
    with_mtp = tiny_model(seed=3, mtp_depth=2, mtp_loss_weights=(0.3, 0.1))
    without = tiny_model(seed=4, mtp_depth=0, mtp_loss_weights=())
    missing, unexpected = without.load_state_dict(with_mtp.state_dict(), strict=False)
    assert not missing and unexpected and all(k.startswith("mtp_heads.") for k in unexpected)
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, mtp = with_mtp(tokens)
        logits0, mtp0 = without(tokens)
    assert torch.equal(logits, logits0)
    assert mtp0 == [] and len(mtp) == 2 and all(m.shape == logits.shape for m in mtp)
    assert not torch.allclose(mtp[0], logits) and not torch.allclose(mtp[0], mtp[1])


def test_shift_for_head_pairs_each_position_with_the_token_k_further():
    # An oracle: logits_k at position t put all mass on token t+1+k of the sequence.
    V, T, depth = 11, 9, 2
    seq = torch.randint(0, V, (2, T + 1 + depth), generator=torch.Generator().manual_seed(0))
    tokens, labels = seq[:, :T], seq[:, 1 : T + 1]  # what the dataloader gives the main head
    for k in range(depth + 1):
        oracle = F.one_hot(seq[:, 1 + k : T + 1 + k], V).float() * 50  # predicts token t+1+k
        logits, targets = shift_for_head(oracle, labels, k)
        assert logits.shape[1] == targets.shape[1] == T - k
        assert F.cross_entropy(logits.flatten(0, 1), targets.flatten()) < 1e-6
    with pytest.raises(ValueError, match="head offset"):
        shift_for_head(oracle, labels, T)


def _poisoned_meta_model(args) -> HymoModel:
    with torch.device("meta"):
        model = HymoModel(args)
    model.to_empty(device="cpu")
    with torch.no_grad():  # whatever init_weights does not set stays NaN (or -1 for ints)
        for t in list(model.parameters()) + list(model.buffers()):
            t.fill_(float("nan") if t.is_floating_point() else -1)
    return model


def test_meta_init_sets_every_parameter_and_buffer(tiny_args):
    args = tiny_args(gdn_ffn_dim=48)
    model = _poisoned_meta_model(args)
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert torch.isfinite(t).all(), f"{name} left uninitialised"
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            assert p.std() > 1e-3, f"{name} is (nearly) constant"
        elif name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
    for name, b in model.named_buffers():
        if name.split(".")[-1] in ("expert_bias", "load_ema", "tokens_per_expert", "dropped_tokens"):
            assert torch.equal(b, torch.zeros_like(b)), name
    # the RoPE table: (cos, sin) of position · θ^(−2i/d)
    pos, i = 37, 3
    angle = pos * args.rope_theta ** (-2 * i / args.qk_rope_head_dim)
    torch.testing.assert_close(model.rope_cache[pos, i], torch.tensor([math.cos(angle), math.sin(angle)]))

    # built directly on CPU, then initialised from the same seed: identical tensors
    direct = HymoModel(args)
    torch.manual_seed(0)
    direct.init_weights()
    for (name, a), (name_b, b) in zip(list(model.named_parameters()) + list(model.named_buffers()),
                                      list(direct.named_parameters()) + list(direct.named_buffers()), strict=True):
        assert name == name_b and torch.equal(a, b), name


def test_gdn_decays_start_in_the_intended_range():
    """A ∈ (0, 16], softplus(dt_bias) ∈ [1e-3, 0.1] and, on real inputs at step 0, most heads
    remember: the seed's A_log = log(1..H), dt_bias = 0 would make α = exp(g) ≈ 0 for most heads."""
    args = hymo_flavors["debugmodel"]
    torch.manual_seed(0)
    model = _poisoned_meta_model(args)
    model.init_weights()
    seen = []
    gdn_layers = [layer.attn for layer in model.layers.values() if not layer.moe_enabled]
    for attn in gdn_layers:
        A, dt = attn.A_log.exp(), F.softplus(attn.dt_bias)
        assert (A > 0).all() and (A <= 16).all()
        assert (dt >= 1e-3 * (1 - 1e-5)).all() and (dt <= 0.1 * (1 + 1e-5)).all()
        rule = attn._rule
        attn._rule = lambda q, k, v, g, beta, rule=rule, **kw: (seen.append(g), rule(q, k, v, g, beta, **kw))[1]
    with torch.no_grad():
        model(torch.randint(0, args.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0)))
    alpha = torch.cat([g.flatten() for g in seen]).exp()
    assert len(seen) == len(gdn_layers)
    assert (alpha < 0.01).float().mean() < 0.01, "heads that forget everything every token"
    assert alpha.median() > 0.5 and alpha.max() < 1


CONTRACT_NAMES = {
    "tok_embeddings.weight", "norm.weight",
    "layers.0.attn_norm.weight", "layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight",
    "layers.0.attn.v_proj.weight", "layers.0.attn.a_proj.weight", "layers.0.attn.b_proj.weight",
    "layers.0.attn.g_proj.weight", "layers.0.attn.o_proj.weight", "layers.0.attn.q_conv1d.weight",
    "layers.0.attn.k_conv1d.weight", "layers.0.attn.v_conv1d.weight", "layers.0.attn.A_log",
    "layers.0.attn.dt_bias", "layers.0.attn.o_norm.weight",
    "layers.3.attn_norm.weight", "layers.3.ffn_norm.weight", "layers.3.attn.wq_a.weight",
    "layers.3.attn.q_norm.weight", "layers.3.attn.wq_b.weight", "layers.3.attn.wkv_a.weight",
    "layers.3.attn.kv_norm.weight", "layers.3.attn.wkv_b.weight", "layers.3.attn.wo.weight",
    "layers.3.moe.router.gate.weight", "layers.3.moe.experts.w1", "layers.3.moe.experts.w2",
    "layers.3.moe.experts.w3", "layers.3.moe.shared_experts.w1.weight",
    "layers.3.moe.shared_experts.w2.weight", "layers.3.moe.shared_experts.w3.weight",
    "mtp_heads.1.norm.weight", "mtp_heads.1.w_in.weight", "mtp_heads.1.w_out.weight",
    "mtp_heads.2.norm.weight", "mtp_heads.2.w_in.weight", "mtp_heads.2.w_out.weight",
}


def test_parameter_names_shapes_and_buffers_follow_the_contract(tiny_args):
    with torch.device("meta"):
        model = HymoModel(tiny_args())
    params = dict(model.named_parameters())
    assert CONTRACT_NAMES <= set(params), sorted(CONTRACT_NAMES - set(params))
    assert not any("output" in n for n in params)  # the head is the tied embedding
    assert list(model.layers) == ["0", "1", "2", "3"]
    assert [layer.moe_enabled for layer in model.layers.values()] == [False, False, False, True]
    assert params["layers.0.attn.q_conv1d.weight"].shape == (2 * 16, 1, 4)
    assert params["layers.0.attn.A_log"].shape == params["layers.0.attn.dt_bias"].shape == (2,)
    assert params["layers.3.moe.router.gate.weight"].shape == (4, 64)
    assert params["layers.3.moe.experts.w1"].shape == (4, 32, 64)
    assert params["layers.3.moe.experts.w2"].shape == (4, 64, 32)
    persistent = set(model.state_dict())
    assert {"layers.3.moe.expert_bias", "layers.3.moe.load_ema"} <= persistent
    assert not any(k.endswith(("tokens_per_expert", "dropped_tokens", "rope_cache")) for k in persistent)


def test_750m_counts_match_the_design_table(capsys):
    # the recurrence backend holds no parameters; "naive" needs no GPU kernel to import
    args = dataclasses.replace(hymo_flavors["750m"], gdn_backend="naive")
    with torch.device("meta"):
        model = HymoModel(args)
    c = count_params(model, args)

    # DESIGN.md §2, written out by hand
    V, D = 64_256, 896
    gdn = 4 * D * 1280 + 1280 * D + 2 * D * 40 + 3 * 1280 * 4 + 2 * 40 + 32 + D
    mla = D * 224 + 224 + 224 * 16 * 128 + D * (128 + 32) + 128 + 128 * 4 * (96 + 128) + 16 * 128 * D + 2 * D
    expert = 3 * D * 2304
    moe = 16 * D + 16 * expert + expert
    mtp = 2 * (D + 2 * D * 2304)
    stored = V * D + 24 * gdn + 8 * (mla + moe) + mtp + D
    active = stored - 8 * 14 * expert
    assert (c.stored, c.active, c.routed_experts) == (stored, active, 8 * 16 * expert)
    assert 1.0e9 < c.stored < 1.2e9 and 0.35e9 < c.active < 0.45e9  # "about 1.1 B" / "about 0.4 B"

    nparams, flops = args.get_nparams_and_flops(model, 4096)
    assert nparams == c.stored
    with capsys.disabled():
        print(f"\n750m: stored {c.stored / 1e9:.3f} B, active {c.active / 1e9:.3f} B, "
              f"training FLOPs/token at seq 4096: {flops / 1e9:.3f} G")


def test_flops_formula_matches_a_flop_counter():
    """3 × the forward FLOPs that torch's counter sees (attention in the math backend, so its
    matmuls are counted over the full sequence, as TorchTitan's convention does)."""
    args = dataclasses.replace(hymo_flavors["debugmodel"], moe_capacity_factor=0.0)
    torch.manual_seed(0)
    model = HymoModel(args)
    model.init_weights()
    B, T = 2, 128
    tokens = torch.randint(0, args.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        model(tokens)
    measured = 3 * counter.get_total_flops() / (B * T)
    formula = training_flops_per_token(args, count_params(model, args), T)
    # the counter misses the triangular solves and elementwise work (conv taps, norms)
    assert 0.97 < measured / formula < 1.01, (measured, formula)


def test_debugmodel_trains_and_reports_step_time(capsys):
    args = hymo_flavors["debugmodel"]
    torch.manual_seed(0)
    model = HymoModel(args)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seq = torch.randint(0, args.vocab_size, (2, 129), generator=torch.Generator().manual_seed(0))
    tokens, labels = seq[:, :-1], seq[:, 1:]
    losses, times = [], []
    for _ in range(8):
        t0 = time.perf_counter()
        logits, mtp = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        for k, (w, head_logits) in enumerate(zip(args.mtp_loss_weights, mtp), start=1):
            lk, yk = shift_for_head(head_logits, labels, k)
            loss = loss + w * F.cross_entropy(lk.flatten(0, 1), yk.flatten())
        loss.backward()
        times.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()
        for layer in model.layers.values():
            if layer.moe_enabled:
                layer.moe.update_expert_bias(layer.moe.tokens_per_expert)
                layer.moe.reset_load_counters()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] > 1.3 * math.log(args.vocab_size)  # main CE ≈ ln V, plus 0.4 of it for MTP
    assert losses[-1] < losses[0] - 1.0, losses  # memorising one batch
    with capsys.disabled():
        print(f"\ndebugmodel ({count_params(model, args).stored / 1e6:.2f} M params) fwd+bwd at B=2, T=128 "
              f"on {torch.get_num_threads()} threads: median {sorted(times)[len(times) // 2] * 1e3:.0f} ms")


@pytest.mark.parametrize("wrap", ["checkpoint", "compile"])
def test_wrapped_attention_blocks_get_the_models_document_mask(tiny_model, monkeypatch, wrap):
    """AC and torch.compile wrap the blocks (the class seen is no longer MLABlock): the attention
    blocks must still get the model's one document mask, not build a dense one each."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from hymo_recipes.model import mla

    model = tiny_model(moe_capacity_factor=0.0, gdn_backend="naive", n_layers=8, mla_layers=(3, 7))
    assert len(model.model_args.mla_layers) >= 2
    for layer_id, block in list(model.layers.items()):
        wrapped = checkpoint_wrapper(block) if wrap == "checkpoint" else torch.compile(block, backend="eager")
        model.layers.register_module(layer_id, wrapped)
    built = []
    dense = mla.document_causal_mask
    monkeypatch.setattr(mla, "document_causal_mask", lambda positions: built.append(1) or dense(positions))
    tokens = _rows_with_documents(torch.Generator().manual_seed(3), 2, 24, [(0, 9), (1, 5)])
    cu, pos = model_mod.documents_of(tokens, start_id=BOS)
    with torch.no_grad():
        model(tokens, cu_seqlens=cu, positions=pos)
    assert len(built) == 1  # document_attention_mask's, on the CPU; none inside the blocks


@pytest.mark.gpu
def test_gpu_packed_rows_give_each_document_its_own_logits_and_gradients(tiny_model):
    """On the GPU path: the Triton GDN mixer's varlen kernels and the MLA's flex attention with a
    block mask (no T × T tensor): packed rows against the documents one by one, fp32."""
    from torch.nn.attention.flex_attention import BlockMask

    model = tiny_model(moe_capacity_factor=0.0, gdn_backend="triton").cuda()
    gen = torch.Generator().manual_seed(2)
    B, T = 2, 200
    tokens = _rows_with_documents(gen, B, T, [(0, 0), (0, 70), (0, 71), (1, 150)]).cuda()
    cu, pos = model_mod.documents_of(tokens, start_id=BOS)
    assert isinstance(model_mod.document_attention_mask(pos), BlockMask)
    w = torch.randn(B * T, 97, generator=gen).cuda()
    logits, _ = model(tokens, cu_seqlens=cu, positions=pos)
    (logits.view(B * T, -1) * w).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    flat = tokens.view(-1)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone, _ = model(flat[s:e][None])
        torch.testing.assert_close(logits.view(B * T, -1)[s:e], alone[0].detach(), rtol=2e-3, atol=2e-3)
        (alone[0] * w[s:e]).sum().backward()
    for n, p in model.named_parameters():
        if n in packed:
            torch.testing.assert_close(packed[n], p.grad, rtol=1e-2, atol=1e-2 * float(p.grad.abs().max()), msg=n)
