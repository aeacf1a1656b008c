"""HymoModelArgs: validation errors, flavors, update_from_config."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from hymo_recipes.model import HymoModelArgs, hymo_flavors
from hymo_recipes.model.args import parse_flex_options

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
    (dict(gdn_backend="triton", gdn_mixer_saves="all"), "unknown gdn_mixer_saves 'all'"),
    (dict(gdn_A_init_range=(16.0, 1.0)), "gdn_A_init_range"),
    (dict(gdn_dt_min=0.2, gdn_dt_max=0.1), "gdn_dt_min <= gdn_dt_max"),
    (dict(n_layers=4, mla_layers=(4,)), r"mla_layers \(4,\) must lie in \[0, n_layers = 4\)"),
    (dict(n_layers=8, mla_layers=(3, 3)), "strictly increasing"),
    (dict(n_layers=8, mla_layers=(7, 3)), "strictly increasing"),
    (dict(n_layers=8, mla_layers=(3, 7), nope_layers=(2,)), "nope_layers .* subset of mla_layers"),
    (dict(norm_eps=0.0), "norm_eps must be positive"),
    (dict(mla_flex_options="bwd_num_stages"), "mla_flex_options: options are KEY=VALUE"),
    (dict(mla_flex_options="fwd_BLOCK_M=big"), "mla_flex_options: fwd_BLOCK_M takes an integer, got 'big'"),
    (dict(mla_flex_options="USE_TMA=3"), "mla_flex_options: USE_TMA takes true or false"),
    (dict(mla_flex_options="bwd_num_stage=2"), "mla_flex_options: 'bwd_num_stage' is not a flex attention option"),
    (dict(mla_flex_options="BACKEND=flash"), "mla_flex_options: BACKEND takes one of AUTO, TRITON, FLASH"),
    (dict(mla_flex_options="fwd_BACKEND=FLASH"), "mla_flex_options: BACKEND applies to both directions"),
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


def _hymo(**knobs):
    """A [hymo] section: every knob "flavor" (vocab_size 0: the flavor's), except ``knobs``."""
    return SimpleNamespace(**{"vocab_size": 0, "gdn_backend": "flavor", "gdn_dot_precision": "flavor",
                              "gdn_bwd_path": "flavor", "gdn_mixer_saves": "flavor", **knobs})


def _job_config(seq_len: int, cp: int = 1, validation_seq_len: int | None = None, assets: str = "",
                **knobs) -> SimpleNamespace:
    """What update_from_config reads of a job config: TorchTitan's sections are not needed."""
    return SimpleNamespace(
        training=SimpleNamespace(seq_len=seq_len),
        validation=SimpleNamespace(enable=validation_seq_len is not None, seq_len=validation_seq_len),
        parallelism=SimpleNamespace(context_parallel_degree=cp),
        model=SimpleNamespace(hf_assets_path=assets),
        hymo=_hymo(**knobs),
    )


def test_update_from_config_takes_the_longest_seq_len_and_the_hymo_vocab_size():
    args = dataclasses.replace(hymo_flavors["debugmodel"])
    args.update_from_config(_job_config(1024, validation_seq_len=2048, vocab_size=301))
    assert (args.max_seq_len, args.vocab_size) == (2048, 301)
    assert hymo_flavors["debugmodel"].vocab_size == 2048  # the flavor table is untouched by the copy
    args.update_from_config(_job_config(128))  # vocab_size 0 keeps what the args have
    assert (args.max_seq_len, args.vocab_size) == (128, 301)


def test_update_from_config_takes_the_flex_options_unless_flavor():
    args = dataclasses.replace(hymo_flavors["debugmodel"])
    args.update_from_config(_job_config(128, mla_flex_options="bwd_num_stages=2, USE_TMA=true"))
    assert args.mla_flex_options == "bwd_num_stages=2, USE_TMA=true"
    assert parse_flex_options(args.mla_flex_options) == {"bwd_num_stages": 2, "USE_TMA": True}
    args.update_from_config(_job_config(128, mla_flex_options="flavor"))
    assert args.mla_flex_options == "bwd_num_stages=2, USE_TMA=true"  # "flavor" keeps what the args have
    args.update_from_config(_job_config(128, mla_flex_options=""))
    assert args.mla_flex_options == "" and parse_flex_options("") == {}


def test_update_from_config_reads_no_file_and_probes_no_device(tmp_path, monkeypatch):
    """A pure config hook: with a tokenizer in hf_assets_path and every way to open a file or
    ask torch about devices made to fail, it still applies the config (the preflight reads the
    tokenizer and probes the machine)."""
    import builtins
    import io
    import os

    import torch

    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {}}}))

    def refuse(*args, **kwargs):
        raise AssertionError("update_from_config touched a file or a device")

    for module, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "listdir"), (os, "stat"),
                         (torch.cuda, "is_available"), (torch.accelerator, "is_available")):
        monkeypatch.setattr(module, name, refuse)
    args = dataclasses.replace(hymo_flavors["750m"])
    args.update_from_config(_job_config(256, assets=str(tmp_path), gdn_backend="triton", gdn_bwd_path="local"))
    monkeypatch.undo()
    assert (args.max_seq_len, args.vocab_size, args.gdn_backend, args.gdn_bwd_path) == (256, 64_256, "triton", "local")


def test_update_from_config_rejects_short_sequences_and_context_parallelism():
    args = dataclasses.replace(hymo_flavors["debugmodel"])
    with pytest.raises(ValueError, match="training.seq_len = 2 leaves no target for MTP head 2"):
        args.update_from_config(_job_config(2))
    with pytest.raises(NotImplementedError, match="context parallelism"):
        args.update_from_config(_job_config(128, cp=2))


def test_update_from_config_applies_the_hymo_gdn_backend_knob():
    args = dataclasses.replace(hymo_flavors["debugmodel"])
    args.update_from_config(_job_config(128))
    assert args.gdn_backend == hymo_flavors["debugmodel"].gdn_backend
    args.update_from_config(_job_config(128, gdn_backend="naive"))
    assert args.gdn_backend == "naive"
    with pytest.raises(ValueError, match="unknown gdn_backend 'bogus'"):
        args.update_from_config(_job_config(128, gdn_backend="bogus"))


@pytest.mark.parametrize("knob, value, refusal", [
    ("gdn_dot_precision", "bf16", "sets the Triton kernel's dots"),
    ("gdn_bwd_path", "local", "picks the Triton kernel's backward"),
])
def test_update_from_config_applies_the_hymo_kernel_knobs(knob, value, refusal):
    args = dataclasses.replace(hymo_flavors["750m"])
    args.update_from_config(_job_config(128))
    assert getattr(args, knob) == HymoModelArgs().__dataclass_fields__[knob].default
    args.update_from_config(_job_config(128, **{knob: value}))
    assert getattr(args, knob) == value
    # a CPU backend with a kernel setting is refused before anything is built
    with pytest.raises(ValueError, match=refusal):
        args.update_from_config(_job_config(128, gdn_backend="torch_chunk", **{knob: value}))


@pytest.mark.parametrize("knob, table", [("gdn_backend", "BACKENDS"), ("gdn_dot_precision", "GDN_DOT_PRECISIONS"),
                                         ("gdn_bwd_path", "GDN_BWD_PATHS")])
def test_each_hymo_knob_takes_exactly_the_kernel_packages_values(knob, table):
    """One name and one set of values per knob, from the TOML to the kernel: every value of the
    kernel package's table passes, anything else ("split" included) is
    refused naming the choices."""
    import hymo_kernels.gdn as gdn

    for value in getattr(gdn, table):
        args = dataclasses.replace(hymo_flavors["750m"])
        args.update_from_config(_job_config(128, **{"gdn_backend": "triton", knob: value}))
        assert getattr(args, knob) == value
    for value in ("split", "fast"):
        with pytest.raises(ValueError, match=f"unknown {knob} '{value}'; choose one of"):
            dataclasses.replace(hymo_flavors["750m"]).update_from_config(
                _job_config(128, **{"gdn_backend": "triton", knob: value}))
