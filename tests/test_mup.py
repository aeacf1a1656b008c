"""muP (hymo_recipes/mup.py): the role table, the rules, the wiring, muP off unchanged, and the
coordinate check (benchmarks/mup_coord_check.py) flat with muP and not without, at small widths."""

import dataclasses
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # benchmarks/

from benchmarks.mup_coord_check import coord_check, optimizer_config, slopes, worst_slope  # noqa: E402
from hymo_recipes import mup  # noqa: E402
from hymo_recipes.model import HymoModel, HymoModelArgs, hymo_flavors  # noqa: E402
from hymo_recipes.optim.partition import build_param_groups, hymo_param_table  # noqa: E402
from hymo_recipes.titan.optimizers import optimizers_for_part  # noqa: E402

# Every block type, MoE and MTP; widths 32..128 with 4..16 GDN heads of 8 (scale_args_to_width).
CC_BASE = HymoModelArgs(
    vocab_size=512, dim=32, n_layers=4, max_seq_len=64, mla_layers=(3,),
    gdn_n_heads=4, gdn_head_dim=8, gdn_v_head_dim=8, gdn_backend="torch_chunk",
    n_heads=4, n_kv_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=8, moe_num_experts=4, moe_top_k=2, moe_inter_dim=32, moe_capacity_factor=0.0,
    mtp_depth=1, mtp_loss_weights=(0.3,), mtp_inter_dim=32,
)
WIDTHS = (32, 64, 128)


def _cpu(args, **kw):
    return dataclasses.replace(args, gdn_backend="torch_chunk", gdn_dot_precision="table", gdn_bwd_path="table", **kw)


def _variants():
    for name, args in hymo_flavors.items():
        yield name, _cpu(args)
    # the optional parts: a dense FFN on GDN blocks, no shared expert, no MTP, NoPE layers
    d = hymo_flavors["debugmodel"]
    yield "debug+ffn", _cpu(d, gdn_ffn_dim=64)
    yield "debug-shared-mtp", _cpu(d, moe_num_shared_experts=0, mtp_depth=0, mtp_loss_weights=())
    yield "debug+nope", _cpu(d, nope_layers=(3,))


@pytest.mark.parametrize("name,args", list(_variants()), ids=[n for n, _ in _variants()])
def test_every_parameter_of_every_flavor_matches_exactly_one_row_of_the_role_table(name, args):
    with torch.device("meta"):
        model = HymoModel(args)
    import fnmatch

    for fqn, _ in model.named_parameters():
        rows = [role for pat, role in mup.MUP_ROLE_TABLE if fnmatch.fnmatchcase(fqn, pat)]
        assert len(rows) == 1, (fqn, rows)
    roles = mup.classify_params(model.named_parameters())
    assert roles["tok_embeddings.weight"] == "input"
    assert roles["norm.weight"] == "input"
    # every NorMuon matrix of the default partition is a hidden weight but the MoE routers (readouts)
    groups = build_param_groups(model.named_parameters(), hymo_param_table())
    ids = {id(p): n for n, p in model.named_parameters()}
    for g in groups["normuon"]:
        want = {"output"} if g["group"] == "router" else {"hidden"}
        assert {roles[ids[id(p)]] for p in g["params"]} == want, g["group"]
    for i in args.mla_layers:
        assert roles[f"layers.{i}.moe.router.gate.weight"] == "output"
        assert roles[f"layers.{i}.moe.experts.w1"] == "hidden"
    for i in args.gdn_layers:
        for n in ("A_log", "dt_bias", "q_conv1d.weight", "o_norm.weight"):
            assert roles[f"layers.{i}.attn.{n}"] == "input"
        assert roles[f"layers.{i}.attn.b_proj.weight"] == "hidden"


def test_an_unknown_parameter_has_no_role():
    with pytest.raises(ValueError, match="layers.0.attn.new_proj2.weight"):
        mup.mup_role("layers.0.attn.new_proj2.weight")
    model = HymoModel(_cpu(hymo_flavors["debugmodel"]))
    model.layers["0"].attn.extra = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="layers.0.attn.extra"):
        mup.classify_params(model.named_parameters())
    # wrapper segments (torch.compile, activation checkpointing) are dropped before matching
    assert mup.mup_role("layers.0._orig_mod.attn.q_proj.weight") == "hidden"
    assert mup.mup_role("layers.3._checkpoint_wrapped_module.moe.experts.w2") == "hidden"


def test_the_rules():
    m = 4.0
    assert [mup.init_std_multiplier(r, m) for r in mup.ROLES] == [1.0, 0.5, 0.25]
    assert [mup.lr_multiplier(r, m, "cautious_adamw") for r in mup.ROLES] == [1.0, 0.25, 0.25]
    assert [mup.lr_multiplier(r, m, "normuon") for r in mup.ROLES] == [2.0, 1.0, 0.5]
    assert mup.output_multiplier(m) == 0.25
    assert mup.attention_scale(16, True) == 1 / 16 and mup.attention_scale(16, False) == 0.25
    assert mup.transfer_lr(1e-3, 256, 1024) == pytest.approx(2.5e-4)
    assert mup.transfer_lr(0.02, 256, 1024, optimizer="normuon") == 0.02
    assert mup.transfer_init_std(0.02, 256, 1024) == pytest.approx(0.01)
    with pytest.raises(ValueError):
        mup.lr_multiplier("hidden", m, "sgd")


def test_scale_args_to_width_widens_every_width_dim_and_keeps_head_dims():
    small = dataclasses.replace(hymo_flavors["small"], mup_base_width=128)
    w = mup.scale_args_to_width(small, 1024)
    assert (w.dim, w.gdn_n_heads, w.n_heads, w.n_kv_heads) == (1024, 32, 16, 4)
    assert (w.q_lora_rank, w.kv_lora_rank, w.moe_inter_dim, w.mtp_inter_dim) == (256, 128, 1792, 1792)
    assert (w.gdn_head_dim, w.qk_nope_head_dim, w.v_head_dim, w.n_layers, w.vocab_size) == (
        small.gdn_head_dim, small.qk_nope_head_dim, small.v_head_dim, small.n_layers, small.vocab_size)
    assert w.mup_width_mult == 8.0 and mup.width_mult(w) == 8.0
    narrow = mup.scale_args_to_width(small, 64)  # 1 query head: the KV groups must divide it
    assert (narrow.n_heads, narrow.n_kv_heads) == (1, 1)


def _built(args, seed=0):
    torch.manual_seed(seed)
    model = HymoModel(args)
    model.init_weights()
    return model


def test_mup_off_changes_nothing_and_mup_at_the_base_width_is_the_plain_init():
    args = CC_BASE
    assert args.mup_base_width == 0 and args.mup_width_mult == 1.0
    off = _built(args)
    at_base = _built(dataclasses.replace(args, mup_base_width=args.dim))  # m = 1
    for (n, a), (_, b) in zip(off.state_dict().items(), at_base.state_dict().items()):
        assert torch.equal(a, b), n
    assert off.logit_multiplier == 1.0 and off.layers["3"].attn.softmax_scale == 12**-0.5
    # the forward differs from the plain one only by MLA's 1/d scale
    at_base.layers["3"].attn.softmax_scale = off.layers["3"].attn.softmax_scale
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    (la, ma), (lb, mb) = off(tokens), at_base(tokens)
    assert torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(ma, mb))

    # param groups: muP off gives the partition's groups untouched
    cfg = optimizer_config("NorMuon", lr=3e-4, normuon_lr=0.02)
    plain = build_param_groups(off.named_parameters(), hymo_param_table())
    opts = optimizers_for_part(off, cfg)
    for name, opt in opts.items():
        want = plain[name]
        assert len(opt.param_groups) == len(want)
        base_lr = cfg.normuon_lr if name == "normuon" else cfg.lr
        for g, w in zip(opt.param_groups, want):
            assert [id(p) for p in g["params"]] == [id(p) for p in w["params"]]
            assert g["lr"] == base_lr * w["lr_mult"] and g["weight_decay"] == w["weight_decay"]
            assert "mup_role" not in g
    # and muP at m = 1 gives the same lrs
    opts1 = optimizers_for_part(at_base, cfg)
    assert [[g["lr"] for g in o.param_groups] for o in opts1.values()] == [
        [g["lr"] for g in o.param_groups] for o in opts.values()]


def test_mup_init_scales_the_plain_draws_by_role():
    args = CC_BASE
    off = _built(args)
    on = _built(dataclasses.replace(args, mup_base_width=args.dim // 4))  # m = 4
    roles = mup.classify_params(on.named_parameters())
    for (n, a), (_, b) in zip(off.named_parameters(), on.named_parameters()):
        c = {"input": 1.0, "hidden": 0.5, "output": 0.25}[roles[n]]
        assert torch.equal(b, a * c), n
    assert on.logit_multiplier == 0.25
    assert on.layers["3"].attn.softmax_scale == 1 / 12
    logits_on, _ = on(torch.randint(0, args.vocab_size, (1, 8)))
    assert torch.isfinite(logits_on).all()


def test_the_optimizer_builder_applies_the_lr_multipliers():
    model = _built(dataclasses.replace(CC_BASE, mup_base_width=8))  # m = 4
    named = dict(model.named_parameters())
    names = {id(p): n for n, p in named.items()}

    def lrs(cfg):
        out = {}
        for opt_name, opt in optimizers_for_part(model, cfg).items():
            for g in opt.param_groups:
                for p in g["params"]:
                    out[names[id(p)]] = (opt_name, g["lr"])
        return out

    got = lrs(optimizer_config("NorMuon", lr=1e-3, normuon_lr=0.02, moe_on_normuon=False))
    assert got["layers.0.attn.q_proj.weight"] == ("normuon", 0.02)
    assert got["mtp_heads.1.w_in.weight"] == ("normuon", 0.02)
    assert got["tok_embeddings.weight"] == ("cautious_adamw", 1e-3)
    assert got["layers.0.attn.A_log"] == ("cautious_adamw", 1e-3)
    assert got["layers.3.moe.experts.w1"] == ("cautious_adamw", 2.5e-4)
    assert got["layers.3.moe.shared_experts.w2.weight"] == ("cautious_adamw", 2.5e-4)
    assert got["layers.3.moe.router.gate.weight"] == ("cautious_adamw", 2.5e-4)

    got = lrs(optimizer_config("NorMuon", lr=1e-3, normuon_lr=0.02, moe_on_normuon=True))
    assert got["layers.3.moe.router.gate.weight"] == ("normuon", 0.01)
    assert got["layers.3.moe.experts.w1"] == ("normuon", 0.02)

    for name in ("CautiousAdamW", "AdamW"):
        got = lrs(optimizer_config(name, lr=1e-3))
        assert got["layers.0.attn.q_proj.weight"][1] == 2.5e-4
        assert got["tok_embeddings.weight"][1] == 1e-3
        assert got["layers.3.attn.q_norm.weight"][1] == 1e-3


def test_the_hymo_knob_sets_the_base_width():
    def job(mup_base_width):
        return types.SimpleNamespace(
            training=types.SimpleNamespace(seq_len=64), validation=types.SimpleNamespace(enable=False),
            parallelism=types.SimpleNamespace(context_parallel_degree=1),
            hymo=types.SimpleNamespace(vocab_size=0, gdn_backend="flavor", gdn_dot_precision="flavor",
                                       gdn_bwd_path="flavor", gdn_mixer_saves="flavor",
                                       mup_base_width=mup_base_width))

    args = dataclasses.replace(CC_BASE, mup_base_width=16)
    args.update_from_config(job(-1))
    assert args.mup_base_width == 16  # -1 keeps the flavor's
    args.update_from_config(job(8))
    assert args.mup_base_width == 8
    args.update_from_config(job(0))
    assert args.mup_base_width == 0
    with pytest.raises(ValueError, match="mup_base_width"):
        dataclasses.replace(CC_BASE, mup_base_width=-2)


# The coordinate check: 3 widths x 2 parametrizations x seeds x 6 forwards of a 4-layer model
# (single-threaded: ~20 s on a free core). Criterion as in the tool: |log-log slope| < TOL for
# block outputs, GDN recurrent outputs and the change of the logits, at steps >= FROM_STEP.
FROM_STEP, TOL = 3, 0.15


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("optimizer,seeds", [("NorMuon", 6), ("CautiousAdamW", 3)])
def test_coordinate_check_is_flat_with_mup_and_not_without(optimizer, seeds, one_thread):
    cfg = optimizer_config(optimizer, lr=3e-3, normuon_lr=0.02, normuon_ortho_dtype="float32")
    kw = dict(steps=5, seeds=tuple(range(seeds)), batch=2, seq=16, opt_cfg=cfg)
    with_mup = worst_slope(slopes(coord_check(CC_BASE, WIDTHS, mup=True, **kw)), FROM_STEP)
    without = worst_slope(slopes(coord_check(CC_BASE, WIDTHS, mup=False, **kw)), FROM_STEP)
    assert with_mup[0] < TOL, f"muP not flat: |slope| {with_mup[0]:.3f} of {with_mup[1]} at step {with_mup[2]}"
    assert without[0] > 2 * TOL, f"SP looks flat: max |slope| {without[0]:.3f}"
