"""The config check's activation estimate (hymo_recipes/titan/check.py ``activation_bytes``): a
meta-device probe of one block of each kind, checked against a real CPU forward of the whole
debug model, and against how batch, sequence length, activation checkpointing and the fused GDN
mixer's saves must move it."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch


def _config(B=4, T=256, dtype="float32", mode="none", option="2"):
    return SimpleNamespace(training=SimpleNamespace(local_batch_size=B, seq_len=T, mixed_precision_param=dtype,
                                                    mixed_precision_reduce="float32", global_batch_size=-1),
                           activation_checkpoint=SimpleNamespace(mode=mode, selective_ac_option=option),
                           parallelism=SimpleNamespace(fsdp_reshard_after_forward="default"),
                           hymo=SimpleNamespace(fsdp_units="auto", fsdp_sync_once_per_step=False))


def _meta_model(flavor="debugmodel", **changes):
    from hymo_recipes.model import HymoModel, hymo_flavors

    args = copy.deepcopy(hymo_flavors[flavor])
    for name, value in changes.items():
        setattr(args, name, value)
    with torch.device("meta"):
        return HymoModel(args)


def test_the_debug_estimate_matches_a_real_cpu_forward_of_the_whole_model():
    """The printed estimate equals the bytes of the distinct storages a real forward + loss of
    the debug model saves on the CPU (counted by data_ptr, every block run, real routing), under
    the same GPU-kernel stand-ins for SDPA and RMSNorm, and the same stand-in for the recomputed
    regions in both (their checkpoint's storage is invisible to the hooks; what they keep is
    tested in tests/model/test_recompute.py)."""
    from hymo_recipes.model import HymoModel, hymo_flavors
    from hymo_recipes.titan.check import _gpu_kernels, _probe_recompute, _size, activation_bytes, memory_lines
    from hymo_recipes.titan.loss import head_ce_sums

    torch.manual_seed(0)
    args = copy.deepcopy(hymo_flavors["debugmodel"])
    model = HymoModel(args)
    model.init_weights()
    config = _config()
    B, T = config.training.local_batch_size, config.training.seq_len
    tokens = torch.randint(0, args.vocab_size, (B, T))
    fixed = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        saved.setdefault(s.data_ptr(), (s.nbytes(), t))
        return t

    with _gpu_kernels(), _probe_recompute(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head_ce_sums(*model(tokens), tokens)
    real = sum(n for ptr, (n, _) in saved.items() if ptr not in fixed)

    meta = _meta_model()
    act = activation_bytes(meta, config)
    assert act["kept"] == real, (act, real)
    assert act["blocks"].keys() == {"GDN block", "MLA+MoE block"}
    assert [count for count, _ in act["blocks"].values()] == [3, 1]
    assert f"; {_size(real)}, " in memory_lines(meta, {}, config, 1)[1]


def test_the_estimate_grows_linearly_with_batch_and_sequence_length():
    from hymo_recipes.titan.check import activation_bytes

    model = _meta_model()
    by_b = [activation_bytes(model, _config(B=b, T=128)) for b in (1, 2, 4)]
    by_t = [activation_bytes(model, _config(B=2, T=t)) for t in (128, 256, 512)]
    # a few saved tensors do not scale with the tokens (the gates' concatenated weight, fp32 copies
    # of A_log and dt_bias [H], the loss's per-head sums): affine in the tokens, kept = c + s·tokens,
    # with c small (the differences to 1e-3: the MoE's capacity and its padded groups round per batch)
    slope = by_b[1]["kept"] - by_b[0]["kept"]
    assert by_b[2]["kept"] - by_b[1]["kept"] == pytest.approx(2 * slope, rel=1e-3)
    assert 0 <= by_b[0]["kept"] - slope < 0.01 * by_b[0]["kept"]
    for kind, (count, saved) in by_t[0]["blocks"].items():
        assert [b["blocks"][kind][0] for b in by_t] == [count] * 3
        step = by_t[1]["blocks"][kind][1] - saved
        assert by_t[2]["blocks"][kind][1] - by_t[1]["blocks"][kind][1] == pytest.approx(2 * step, rel=1e-3)
        assert 0 <= saved - step < 0.01 * saved
    # the MTP heads score T - k positions each: the heads' part is linear only to first order
    assert by_t[1]["kept"] == pytest.approx(2 * by_t[0]["kept"], rel=0.01)


def test_activation_checkpointing_keeps_the_block_inputs_and_one_recompute():
    """A checkpointed block is probed as parallelize.py leaves it: its SwiGLUs without their own
    product recompute (the outer checkpoint recomputes them whole), so its recompute keeps what
    plain autograd keeps of a SwiGLU (four [tokens, hidden] tensors) instead of what the region
    keeps (its two projections and its output, [tokens, dim]); here the shared experts, in fp32
    (the routed experts' CPU loop has no such region)."""
    from hymo_recipes.titan.check import activation_bytes

    model = _meta_model(moe_inter_dim=384)  # unlike dim (256), so the two sizes are told apart
    a = model.model_args
    config = _config()
    B, T = config.training.local_batch_size, config.training.seq_len
    none, full = activation_bytes(model, config), activation_bytes(model, _config(mode="full"))
    every2 = activation_bytes(model, _config(mode="selective", option="2"))
    op = activation_bytes(model, _config(mode="selective", option="op"))
    (gdn_n, gdn), (mla_n, mla) = none["blocks"]["GDN block"], none["blocks"]["MLA+MoE block"]
    assert full["blocks"].keys() == {"GDN block, checkpointed", "MLA+MoE block, checkpointed"}
    gdn_c, mla_c = full["blocks"]["GDN block, checkpointed"][1], full["blocks"]["MLA+MoE block, checkpointed"][1]
    assert gdn_c == gdn  # no SwiGLU in the debug model's GDN blocks
    assert mla_c - mla == (2 * a.moe_inter_dim * a.moe_num_shared_experts - a.dim) * B * T * 4
    assert full["kept"] == 4 * none["input"] + max(gdn_c, mla_c) + none["heads"] < none["kept"]
    # blocks 2 and 4 (TorchTitan counts from 1) are checkpointed: GDN layer 1 and MLA layer 3
    assert every2["kept"] == 2 * gdn + 2 * none["input"] + max(gdn_c, mla_c) + none["heads"]
    # per-op selective: every block wrapped, counted as keeping all it saves (an upper bound)
    assert op["kept"] == 3 * gdn_c + mla_c + none["heads"]
    assert full["kept"] < every2["kept"] < none["kept"] < op["kept"]


def test_the_fused_mixer_keeping_its_outputs_costs_four_tensors_per_gdn_block():
    """With the Triton backend the GDN block's saves come from the fused ops' fake kernels:
    "outputs" keeps the conv outputs q, k, v and the gated norm's product too."""
    pytest.importorskip("triton")
    from hymo_recipes.titan.check import activation_bytes

    config = _config(B=2, T=512, dtype="bfloat16")
    inputs = activation_bytes(_meta_model("small", gdn_mixer_saves="inputs"), config)
    outputs = activation_bytes(_meta_model("small", gdn_mixer_saves="outputs"), config)
    a = _meta_model("small").model_args
    n, lo = inputs["blocks"]["GDN block"]
    more = 2 * 512 * (2 * a.gdn_n_heads * a.gdn_head_dim + 2 * a.gdn_n_heads * a.gdn_v_head_dim) * 2
    assert outputs["blocks"]["GDN block"] == (n, lo + more)
    assert outputs["kept"] - inputs["kept"] == n * more
    assert outputs["blocks"]["MLA+MoE block"] == inputs["blocks"]["MLA+MoE block"]
