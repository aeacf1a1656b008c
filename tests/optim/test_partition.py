"""The optimizer table: per-name assignments on the real 750m model (meta device) and errors."""

import dataclasses
import re

import pytest
import torch
import torch.nn as nn

from hymo_recipes.model.args import hymo_flavors
from hymo_recipes.model.model import HymoModel
from hymo_recipes.optim.partition import (
    CAUTIOUS_ADAMW,
    NORMUON,
    assign_parameters,
    build_param_groups,
    canonical_name,
    hymo_param_table,
)

WD = dict(normuon_weight_decay=0.1, adamw_weight_decay=0.05, embed_weight_decay=0.01)


@pytest.fixture(scope="module")
def model_750m():
    # The GDN backend does not matter here; "naive" needs no kernel build.
    args = dataclasses.replace(hymo_flavors["750m"], gdn_backend="naive")
    with torch.device("meta"):
        return HymoModel(args)


def table(model, **kw):
    rules = hymo_param_table(**{**WD, **kw})
    return {n: (r.optimizer, r.weight_decay, r.lr_mult) for n, (r, _) in
            assign_parameters(model.named_parameters(), rules).items()}


# name → (optimizer, weight decay) with moe_on_normuon=False (the seed's split); layer 0 is GDN, layer 3 MLA + MoE
EXPECTED_SEED_SPLIT = {
    "tok_embeddings.weight": (CAUTIOUS_ADAMW, 0.01),
    "norm.weight": (CAUTIOUS_ADAMW, 0.0),
    "layers.0.attn_norm.weight": (CAUTIOUS_ADAMW, 0.0),
    "layers.0.attn.q_proj.weight": (NORMUON, 0.1),
    "layers.0.attn.k_proj.weight": (NORMUON, 0.1),
    "layers.0.attn.v_proj.weight": (NORMUON, 0.1),
    "layers.0.attn.a_proj.weight": (NORMUON, 0.1),
    "layers.0.attn.b_proj.weight": (NORMUON, 0.1),
    "layers.0.attn.g_proj.weight": (NORMUON, 0.1),
    "layers.0.attn.o_proj.weight": (NORMUON, 0.1),
    "layers.0.attn.q_conv1d.weight": (CAUTIOUS_ADAMW, 0.0),
    "layers.0.attn.k_conv1d.weight": (CAUTIOUS_ADAMW, 0.0),
    "layers.0.attn.v_conv1d.weight": (CAUTIOUS_ADAMW, 0.0),
    "layers.0.attn.A_log": (CAUTIOUS_ADAMW, 0.0),
    "layers.0.attn.dt_bias": (CAUTIOUS_ADAMW, 0.0),
    "layers.0.attn.o_norm.weight": (CAUTIOUS_ADAMW, 0.0),
    "layers.3.attn.wq_a.weight": (NORMUON, 0.1),
    "layers.3.attn.q_norm.weight": (CAUTIOUS_ADAMW, 0.0),
    "layers.3.attn.wq_b.weight": (NORMUON, 0.1),
    "layers.3.attn.wkv_a.weight": (NORMUON, 0.1),
    "layers.3.attn.kv_norm.weight": (CAUTIOUS_ADAMW, 0.0),
    "layers.3.attn.wkv_b.weight": (NORMUON, 0.1),
    "layers.3.attn.wo.weight": (NORMUON, 0.1),
    "layers.3.ffn_norm.weight": (CAUTIOUS_ADAMW, 0.0),
    "layers.3.moe.router.gate.weight": (CAUTIOUS_ADAMW, 0.0),
    "layers.3.moe.experts.w1": (CAUTIOUS_ADAMW, 0.05),
    "layers.3.moe.experts.w2": (CAUTIOUS_ADAMW, 0.05),
    "layers.3.moe.experts.w3": (CAUTIOUS_ADAMW, 0.05),
    "layers.3.moe.shared_experts.w1.weight": (CAUTIOUS_ADAMW, 0.05),
    "layers.3.moe.shared_experts.w2.weight": (CAUTIOUS_ADAMW, 0.05),
    "layers.3.moe.shared_experts.w3.weight": (CAUTIOUS_ADAMW, 0.05),
    "layers.31.moe.experts.w2": (CAUTIOUS_ADAMW, 0.05),
    "mtp_heads.1.norm.weight": (CAUTIOUS_ADAMW, 0.0),
    "mtp_heads.1.w_in.weight": (NORMUON, 0.1),
    "mtp_heads.2.w_out.weight": (NORMUON, 0.1),
}
# by default (moe_on_normuon=True) every MoE matrix is on NorMuon (the router keeps no decay)
MOE_SWITCHED = {
    name: ((NORMUON, 0.0) if "router" in name else (NORMUON, 0.1))
    for name in EXPECTED_SEED_SPLIT
    if ".moe." in name
}
assert len(MOE_SWITCHED) == 8


def test_750m_seed_split_assignments(model_750m):
    got = table(model_750m, moe_on_normuon=False)
    for name, (opt, wd) in EXPECTED_SEED_SPLIT.items():
        assert got[name][:2] == (opt, wd), name
    assert all(m == 1.0 for _, _, m in got.values())


def test_750m_default_assignments_put_the_moe_on_normuon(model_750m):
    got = table(model_750m)
    assert got == table(model_750m, moe_on_normuon=True)
    for name, expected in {**EXPECTED_SEED_SPLIT, **MOE_SWITCHED}.items():
        assert got[name][:2] == expected, name


def test_750m_every_parameter_in_exactly_one_group(model_750m):
    names = {n for n, _ in model_750m.named_parameters()}
    for switch in (False, True):
        groups = build_param_groups(model_750m.named_parameters(),
                                    hymo_param_table(**WD, moe_on_normuon=switch))
        ids = [id(p) for gs in groups.values() for g in gs for p in g["params"]]
        assert len(ids) == len(set(ids)) == len(names)
        assert all(g["params"] for gs in groups.values() for g in gs)  # no empty groups
    # counts by pattern class: 24 GDN layers × 7 projections + 8 MLA × 5 + 2 MTP × 2, and by
    # default the 8 MoE layers' router, 3 expert stacks and 3 shared-expert matrices
    n_normuon = sum(1 for opt, _, _ in table(model_750m, moe_on_normuon=False).values() if opt == NORMUON)
    assert n_normuon == 24 * 7 + 8 * 5 + 2 * 2
    n_normuon = sum(1 for opt, _, _ in table(model_750m).values() if opt == NORMUON)
    assert n_normuon == 24 * 7 + 8 * 5 + 2 * 2 + 8 * 7


def test_normuon_params_are_matrices_with_output_rows(model_750m):
    params = dict(model_750m.named_parameters())
    got = table(model_750m, moe_on_normuon=True)
    for name, (opt, _, _) in got.items():
        if opt == NORMUON:
            assert params[name].ndim == (3 if ".moe.experts." in name else 2), name
    # the stored layout is [out, in]: q_proj maps dim 896 → 40 heads × 32
    assert tuple(params["layers.0.attn.q_proj.weight"].shape) == (1280, 896)
    assert tuple(params["layers.3.moe.experts.w2"].shape) == (16, 896, 2304)


def test_unmatched_parameter_is_named():
    m = nn.Module()
    m.layers = nn.ModuleDict({"0": nn.Module()})
    m.layers["0"].attn = nn.Module()
    m.layers["0"].attn.q_proj = nn.Linear(4, 4, bias=False)
    m.layers["0"].mystery = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=re.escape("layers.0.mystery (3,)")):
        assign_parameters(m.named_parameters(), hymo_param_table())


def test_non_matrix_routed_to_normuon_is_named():
    m = nn.Module()
    m.mtp_heads = nn.ModuleDict({"1": nn.Module()})
    m.mtp_heads["1"].w_in = nn.Module()
    m.mtp_heads["1"].w_in.weight = nn.Parameter(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match=r"mtp_heads\.1\.w_in\.weight \(2, 3, 4\).*2-D"):
        assign_parameters(m.named_parameters(), hymo_param_table())


def test_wrapper_segments_are_ignored_and_frozen_params_skipped():
    assert canonical_name("layers.0._orig_mod._checkpoint_wrapped_module.attn.wo.weight") == \
        "layers.0.attn.wo.weight"
    p = nn.Parameter(torch.zeros(3), requires_grad=False)
    assert assign_parameters([("unknown.frozen", p)], hymo_param_table()) == {}
