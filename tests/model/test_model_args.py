"""HymoModelArgs: validation errors, flavors, update_from_config."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from hymo_recipes._titan import JobConfig
from hymo_recipes.model import HymoModelArgs, hymo_flavors

BAD = [
    # (overrides, message fragment)
    (dict(n_heads=16, n_kv_heads=3), "n_kv_heads .3. must divide n_heads .16."),
    (dict(n_heads=0), "n_heads must be positive"),
    (dict(gdn_n_heads=0), "gdn_n_heads must be positive"),
    (dict(dim=0), "dim must be positive"),
    (dict(qk_rope_head_dim=31), "qk_rope_head_dim must be even"),
    (dict(mtp_depth=2, mtp_loss_weights=(0.3,)), "mtp_loss_weights has 1 entries for mtp_depth = 2"),
    (dict(mtp_depth=1, mtp_loss_weights=(-0.1,)), "mtp_loss_weights must be >= 0"),
    (dict(mtp_depth=-1, mtp_loss_weights=()), "mtp_depth must be >= 0"),
    (dict(moe_capacity_factor=-0.5), "moe_capacity_factor must be >= 0"),
    (dict(moe_top_k=5, moe_num_experts=4), "moe_top_k .5. exceeds moe_num_experts .4."),
    (dict(moe_load_ema_alpha=0.0), "moe_load_ema_alpha must lie in"),
    (dict(moe_balance_band=1.0), "moe_balance_band must lie in"),
    (dict(moe_bias_update_speed=-1e-3), "moe_bias_update_speed must be >= 0"),
    (dict(moe_num_shared_experts=-1), "moe_num_shared_experts must be >= 0"),
    (dict(gdn_backend="cuda_magic"), "unknown gdn_backend 'cuda_magic'"),
    (dict(gdn_backend="triton", gdn_dot_precision="fp8"), "unknown gdn_dot_precision 'fp8'"),
    (dict(gdn_backend="torch_chunk", gdn_dot_precision="bf16"), "sets the Triton kernel's dots; gdn_backend is"),
    (dict(gdn_backend="triton", gdn_bwd_path="fast"), "unknown gdn_bwd_path 'fast'"),
    (dict(gdn_backend="torch_chunk", gdn_bwd_path="local"), "picks the Triton kernel's backward; gdn_backend is"),
    (dict(gdn_A_init_range=(16.0, 1.0)), "gdn_A_init_range"),
    (dict(gdn_dt_min=0.2, gdn_dt_max=0.1), "gdn_dt_min <= gdn_dt_max"),
    (dict(n_layers=4, mla_layers=(4,)), r"mla_layers \(4,\) must lie in \[0, n_layers = 4\)"),
    (dict(n_layers=8, mla_layers=(3, 3)), "strictly increasing"),
    (dict(n_layers=8, mla_layers=(7, 3)), "strictly increasing"),
    (dict(n_layers=8, mla_layers=(3, 7), nope_layers=(2,)), "nope_layers .* subset of mla_layers"),
    (dict(norm_eps=0.0), "norm_eps must be positive"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[m[:28] for _, m in BAD])
def test_invalid_args_raise_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        HymoModelArgs(**overrides)


def test_defaults_and_flavors_are_valid_and_debugmodel_has_every_part():
    HymoModelArgs()
    for name, args in hymo_flavors.items():
        args.validate()
    dbg = hymo_flavors["debugmodel"]
    assert dbg.gdn_layers and dbg.mla_layers, "debugmodel needs both block types"
    assert dbg.mtp_depth > 0 and dbg.moe_num_experts > 1 and dbg.gdn_backend != "triton"


def test_750m_flavor_has_the_design_numbers():
    a = hymo_flavors["750m"]
    assert (a.vocab_size, a.dim, a.n_layers) == (64_256, 896, 32)
    assert a.mla_layers == tuple(range(3, 32, 4)) and len(a.gdn_layers) == 24
    assert (a.gdn_n_heads, a.gdn_head_dim, a.gdn_v_head_dim, a.gdn_conv_size) == (40, 32, 32, 4)
    assert (a.n_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (16, 96, 32, 128)
    assert (a.q_lora_rank, a.kv_lora_rank, a.n_kv_heads) == (224, 128, 4)
    assert (a.moe_num_experts, a.moe_num_shared_experts, a.moe_top_k, a.moe_inter_dim) == (16, 1, 2, 2304)
    assert a.moe_capacity_factor == 1.5
    assert (a.mtp_depth, a.mtp_loss_weights, a.mtp_inter_dim) == (2, (0.3, 0.1), 2304)


def _job_config(seq_len: int, assets: str, cp: int = 1) -> JobConfig:
    jc = JobConfig()
    jc.training.seq_len = seq_len
    jc.model.hf_assets_path = assets
    jc.parallelism.context_parallel_degree = cp
    return jc


def test_update_from_config_takes_seq_len_and_tokenizer_vocab(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(300)}
    vocab["[UNK]"] = 300
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))

    args = dataclasses.replace(hymo_flavors["debugmodel"])
    args.update_from_config(_job_config(1024, str(tmp_path)))
    assert args.max_seq_len == 1024
    assert args.vocab_size == 301
    assert hymo_flavors["debugmodel"].vocab_size == 2048  # the flavor table is untouched by the copy


def test_update_from_config_logs_the_seq_len_change_unless_told_not_to(tmp_path, caplog):
    # the preflight check runs it on a copy with log=False, so a launch logs the change once
    caplog.set_level(logging.INFO)
    jc = _job_config(128, str(tmp_path / "missing"))
    dataclasses.replace(hymo_flavors["debugmodel"]).update_from_config(jc, log=False)
    assert "max_seq_len" not in caplog.text
    dataclasses.replace(hymo_flavors["debugmodel"]).update_from_config(jc)
    assert caplog.text.count("max_seq_len 512 -> 128") == 1


def test_update_from_config_without_tokenizer_keeps_vocab_and_rejects_cp(tmp_path):
    args = dataclasses.replace(hymo_flavors["debugmodel"])
    args.update_from_config(_job_config(128, str(tmp_path / "missing")))
    assert (args.max_seq_len, args.vocab_size) == (128, 2048)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        args.update_from_config(_job_config(128, str(tmp_path / "missing"), cp=2))


def _hymo(**knobs):
    """A [hymo] section with the defaults ("flavor" backend, "table" precision and backward) except knobs."""
    from types import SimpleNamespace

    return SimpleNamespace(**{"gdn_backend": "flavor", "gdn_dot_precision": "table", "gdn_bwd_path": "table", **knobs})


def test_update_from_config_applies_the_hymo_gdn_backend_knob(tmp_path):
    jc = _job_config(128, str(tmp_path / "missing"))
    args = dataclasses.replace(hymo_flavors["debugmodel"])
    jc.hymo = _hymo()
    args.update_from_config(jc)
    assert args.gdn_backend == hymo_flavors["debugmodel"].gdn_backend
    jc.hymo = _hymo(gdn_backend="naive")
    args.update_from_config(jc)
    assert args.gdn_backend == "naive"
    jc.hymo = _hymo(gdn_backend="bogus")
    with pytest.raises(ValueError, match="unknown gdn_backend 'bogus'"):
        args.update_from_config(jc)


@pytest.mark.parametrize("knob, value, refusal", [
    ("gdn_dot_precision", "bf16", "sets the Triton kernel's dots"),
    ("gdn_bwd_path", "local", "picks the Triton kernel's backward"),
])
def test_update_from_config_applies_the_hymo_kernel_knobs(tmp_path, knob, value, refusal):
    jc = _job_config(128, str(tmp_path / "missing"))
    args = dataclasses.replace(hymo_flavors["750m"])
    jc.hymo = _hymo()
    args.update_from_config(jc)
    assert getattr(args, knob) == "table"
    jc.hymo = _hymo(**{knob: value})
    args.update_from_config(jc)
    assert getattr(args, knob) == value
    # a CPU backend with a kernel setting is refused before anything is built
    jc.hymo = _hymo(gdn_backend="torch_chunk", **{knob: value})
    with pytest.raises(ValueError, match=refusal):
        args.update_from_config(jc)


def test_hymo_knob_choices_match_the_kernel_tables():
    """The [hymo] knobs' choices are the kernel package's tables (plus "flavor" for the backend)."""
    import typing

    from hymo_kernels.gdn import BACKENDS, GDN_BWD_PATHS, GDN_DOT_PRECISIONS
    from hymo_recipes.job_config import Hymo

    hints = typing.get_type_hints(Hymo)
    assert set(typing.get_args(hints["gdn_dot_precision"])) == set(GDN_DOT_PRECISIONS)
    assert set(typing.get_args(hints["gdn_bwd_path"])) == set(GDN_BWD_PATHS)
    assert set(typing.get_args(hints["gdn_backend"])) == set(BACKENDS) | {"flavor"}
