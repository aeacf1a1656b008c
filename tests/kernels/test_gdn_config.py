"""The Triton GDN kernel's launch table and Config (hymo_kernels.gdn.config), the precisions and
saved dtypes each config gives its launches (hymo_kernels.gdn.problem), and the checks between
the forward's saved tensors and the backward's config."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gdn_parity import make_inputs
from hymo_kernels.gdn import chunk as gdn_chunk
from hymo_kernels.gdn import config as gdn_config
from hymo_kernels.gdn import problem
from hymo_kernels.gdn.chunk import chunk_gated_delta_rule
from hymo_kernels.gdn.config import BWD_PATHS, KERNELS, TABLE, Config, KernelCfg, get_config

pytestmark = pytest.mark.usefixtures("nan_poison")

HEAD_DIMS = (16, 32, 64, 128, 256)
TILED = {"fwd_prep": "BZ", "bwd_prep": "BZ", "fwd_out": "BV", "bwd_local": "BV", "state_pass": "BV_PASS"}


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("key", sorted(TABLE), ids=str)
@pytest.mark.parametrize("NH", [1, 256], ids=["few-heads", "many-heads"])
def test_every_table_entry_builds_a_valid_config_for_its_class(key, NH):
    """Each entry, at every (K, V) of its class (the dims no earlier class holds), gives a Config
    whose chunk is whole sub-chunks, whose tiles are powers of two of at least 16 (tl.dot) that
    fit the head dims, and that sets a launch for every kernel it runs."""
    entry = TABLE[key]
    earlier = [k for k in sorted(TABLE) if k < key]
    dims = [(K, V) for K in HEAD_DIMS for V in HEAD_DIMS
            if K <= key[0] and V <= key[1] and not any(K <= a and V <= b for a, b in earlier)]
    assert dims, f"class {key} is shadowed by earlier entries"
    for K, V in dims:
        cfg = gdn_config.config_from_entry(K, V, NH, entry)
        assert cfg.BT == (entry.get("BT", 64) if NH >= 128 else entry.get("BT_FEW", entry.get("BT", 64)))
        assert cfg.BC in (16, 32) and cfg.BT % cfg.BC == 0 and _is_pow2(cfg.BT // cfg.BC)
        for kernel, shared in TILED.items():
            tile = cfg.tile(kernel)
            limit = gdn_config.triton_next_pow2(K + V) if shared == "BZ" else V
            assert _is_pow2(tile) and 16 <= tile <= limit, (kernel, tile, K, V)
            assert limit % tile == 0  # whole tiles over the (padded) columns
        assert cfg.tile("wy_inverse") == 0
        assert cfg.kernels() == KERNELS and all(isinstance(getattr(cfg, k), KernelCfg) for k in KERNELS)
        assert cfg.slots == (cfg.BT // cfg.BC if cfg.local_sub_states else 1)
        assert cfg.bwd_path in BWD_PATHS


@pytest.mark.parametrize("K", HEAD_DIMS)
@pytest.mark.parametrize("V", HEAD_DIMS)
def test_chosen_config_is_the_first_class_covering_the_head_dims(K, V):
    """get_config picks the first entry, in key order, whose class holds (K, V): every supported
    head dim has one."""
    first = next(key for key in sorted(TABLE) if K <= key[0] and V <= key[1])
    assert get_config(K, V, 256) == gdn_config.config_from_entry(K, V, 256, TABLE[first])
    assert get_config(K, V, 1) == gdn_config.config_from_entry(K, V, 1, TABLE[first])


def test_entries_clamp_tiles_and_reject_unknown_fields():
    """A pasted entry's explicit tiles are clamped to the head dims, its per-kernel blocks apply
    to their kernel only, and a field the table does not know is an error (not ignored)."""
    entry = dict(BT=64, BT_FEW=128, BC=16, BZ=128, BV=64, BV_PASS=32, wy_inverse=(2, 1),
                 fwd_prep=(4, 2, 128), state_pass=(2, 3, 16), fwd_out=(4, 1, 64), bwd_prep=(4, 2, 64),
                 bwd_local=(8, 1, 32))
    cfg = gdn_config.config_from_entry(16, 16, 256, entry)
    assert (cfg.BZ, cfg.BV, cfg.BV_PASS) == (32, 16, 16)
    assert cfg.fwd_prep == KernelCfg(4, 2, 32) and cfg.tile("bwd_local") == 16 and cfg.tile("state_pass") == 16
    big = gdn_config.config_from_entry(128, 128, 256, entry)
    assert big.tile("fwd_prep") == 128 and big.tile("bwd_prep") == 64 and big.tile("bwd_local") == 32
    assert gdn_config.config_from_entry(128, 128, 1, entry).BT == 128
    with pytest.raises(ValueError, match=r"unknown launch table fields \['bwd_split'\]"):
        gdn_config.config_from_entry(32, 32, 256, dict(entry, bwd_split=True))


def test_config_rejects_bad_tiles_and_unsafe_inverse_precision():
    with pytest.raises(ValueError, match="BC must be 16 or 32 and divide BT"):
        Config(BT=40, BC=16)
    with pytest.raises(ValueError, match="inverse_prec"):
        Config(inverse_prec="tf32")


def test_tuning_overrides_the_table(tuning):
    tuning[(128, 128)] = Config(BT=32)
    assert get_config(128, 128).BT == 32
    assert get_config(32, 32) != Config(BT=32)


def test_get_config_follows_table_edits(monkeypatch):
    """get_config caches its Config, yet a replaced or edited TABLE entry takes effect at once."""
    first = get_config(32, 32, 256)
    assert get_config(32, 32, 256) is first  # cached
    entry = dict(TABLE[(32, 32)])
    monkeypatch.setitem(TABLE, (32, 32), dict(entry, BT=entry["BT"] * 2))
    assert get_config(32, 32, 256).BT == 2 * first.BT
    TABLE[(32, 32)]["BT"] = entry["BT"] // 2  # the same dict, edited in place
    assert get_config(32, 32, 256).BT == first.BT // 2
    assert get_config(32, 32, 1).BT == entry["BT_FEW"]  # few sequences x heads: its own entry


def test_bwd_paths_pick_the_saved_states():
    """local_sub saves a state per sub-chunk for _bwd_local; local one per chunk."""
    for BT, BC in ((64, 16), (128, 16), (128, 32), (256, 16)):
        cfg = Config(BT=BT, BC=BC)
        assert dataclasses.replace(cfg, **BWD_PATHS["local_sub"]).slots == BT // BC
        assert dataclasses.replace(cfg, **BWD_PATHS["local"]).slots == 1
    assert all(dataclasses.replace(Config(), **f).bwd_path == n for n, f in BWD_PATHS.items())


def test_gdn_bwd_paths_match_the_kernel_table():
    """hymo_kernels.gdn.GDN_BWD_PATHS (importable without Triton) lists the op's bwd_path values."""
    from hymo_kernels.gdn import GDN_BWD_PATHS

    assert GDN_BWD_PATHS == ("table", *BWD_PATHS) == ("table", "local", "local_sub")


@pytest.mark.parametrize("dtype, dot_bf16, prec", [
    (torch.bfloat16, True, "bf16"), (torch.bfloat16, False, "tf32"),
    (torch.float16, True, "tf32"), (torch.float32, True, "tf32x3"),
])
def test_dot_precision_choice(dtype, dot_bf16, prec):
    """Config.dot_bf16 rounds dot operands to bf16 only for bf16 inputs; the dots with
    T = (I + A)⁻¹ (TPREC), whose entries cancel when keys collapse, only with Config.t_bf16 too."""
    x = make_inputs(1, 20, 1, 16, 16, n_states=1, dtype=dtype)
    p = problem.make_problem(x["q"], x["k"], x["v"], x["g"], x["beta"], None, 0.25, False,
                             dataclasses.replace(get_config(16, 16), dot_bf16=dot_bf16, t_bf16=False))
    geom = problem._geom(p)
    assert geom["PREC"] == prec
    assert geom["TPREC"] == ("tf32x3" if dtype == torch.float32 else "tf32")
    assert gdn_config.config_from_entry(16, 16, 256, dict(dot_bf16=True)).dot_bf16
    # Config.t_bf16 takes T's dots to bf16 along with the others (dot_bf16, bf16 inputs) only
    for t_bf16 in (False, True):
        tb = problem._geom(dataclasses.replace(p, cfg=dataclasses.replace(p.cfg, t_bf16=t_bf16)))
        assert tb["TPREC"] == ("bf16" if t_bf16 and prec == "bf16" else geom["TPREC"]) and tb["PREC"] == prec
    assert gdn_config.config_from_entry(16, 16, 256, dict(t_bf16=True)).t_bf16


def test_register_cap_reaches_the_launch_only_when_set():
    """KernelCfg.maxnreg reaches the launch only when set and is read from a table entry's
    fourth element."""
    assert problem._kw(KernelCfg(1, 2, 32, 128)) == dict(num_warps=1, num_stages=2, maxnreg=128)
    assert problem._kw(KernelCfg(1, 2, 32)) == dict(num_warps=1, num_stages=2)
    entry = dict(TABLE[(32, 32)], fwd_out=(1, 3, 32, 96), wy_inverse=(1, 1, 0, 64))
    cfg = gdn_config.config_from_entry(32, 32, 256, entry)
    assert (cfg.fwd_out, cfg.wy_inverse.maxnreg, cfg.bwd_local.maxnreg) == (KernelCfg(1, 3, 32, 96), 64, 0)


@pytest.mark.parametrize("dtype, t_bf16, want", [
    (torch.bfloat16, True, torch.bfloat16),    # T rounded to bf16 in every dot with it
    (torch.bfloat16, False, torch.float32),    # gdn_dot_precision "bf16": T's dots stay tf32
    (torch.float32, True, torch.float32),
], ids=["bf16-t-bf16", "bf16-t-tf32", "fp32"])
def test_saved_t_dtype(dtype, t_bf16, want):
    """The saved T is stored in bf16 exactly where its dots round it to bf16; the fake
    implementation (what torch.compile traces) agrees with the launcher's choice."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = problem._overridden(get_config(32, 32), True, t_bf16)
    assert problem.saved_t_dtype(cfg, dtype) == want
    with FakeTensorMode():
        q, k = (torch.empty(1, 64, 2, 32, dtype=dtype) for _ in range(2))
        v = torch.empty(1, 64, 2, 32, dtype=dtype)
        g, beta = torch.empty(1, 64, 2), torch.empty(1, 64, 2, dtype=dtype)
        *_, tinv = torch.ops.hymo_kernels.gdn_chunk_fwd(q, k, v, g, beta, None, None, 0.2, True, True, t_bf16)
    assert tinv.dtype == want and tinv.shape[-1] == cfg.BC


@pytest.mark.parametrize("dtype, fields, want", [
    (torch.bfloat16, dict(states_bf16=True, dot_bf16=True), torch.bfloat16),
    (torch.bfloat16, dict(states_bf16=True, dot_bf16=False), torch.float32),  # tf32 dots read fp32 states
    (torch.float32, dict(states_bf16=True, dot_bf16=True), torch.float32),
    (torch.bfloat16, dict(states_bf16=False, dot_bf16=True), torch.float32),
], ids=["bf16", "bf16-tf32-dots", "fp32", "off"])
@pytest.mark.parametrize("path", list(BWD_PATHS))
def test_saved_states_dtype(dtype, fields, want, path, tuning):
    """Config.states_bf16 stores the saved start states in bf16 only where every dot on them rounds
    them to bf16; the fake implementation agrees, and the backward refuses states of the other dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = dataclasses.replace(get_config(32, 32), **BWD_PATHS[path], **fields)
    tuning[(32, 32)] = cfg
    assert problem.saved_states_dtype(cfg, dtype) == want
    with FakeTensorMode():
        q, k = (torch.empty(1, 64, 2, 32, dtype=dtype) for _ in range(2))
        v = torch.empty(1, 64, 2, 32, dtype=dtype)
        g, beta = torch.empty(1, 64, 2), torch.empty(1, 64, 2, dtype=dtype)
        _, ht, states, _ = torch.ops.hymo_kernels.gdn_chunk_fwd(q, k, v, g, beta, None, None, 0.2, True)
    assert states.dtype == want and ht.dtype == torch.float32
    # the real launcher allocates the same (the interpreter's bf16 values are wrong, its dtypes are not)
    x = make_inputs(1, 40, 1, 32, 32, n_states=0, dtype=dtype)
    _, ht, states, _ = torch.ops.hymo_kernels.gdn_chunk_fwd(*(x[n] for n in ("q", "k", "v", "g", "beta")), None,
                                                             None, 0.2, True)
    assert states.dtype == want and ht.dtype == torch.float32
    assert states.shape[0] == problem._num_chunks(1, 40, 1, False, cfg.BT) * cfg.slots
    if want == torch.bfloat16:
        x = make_inputs(1, 40, 1, 16, 16, n_states=0, dtype=torch.float32)
        p = problem.make_problem(*(x[n] for n in ("q", "k", "v", "g", "beta")), None, 0.25, False, cfg)
        wrong = torch.zeros(p.NC * cfg.slots, 1, 16, 16, dtype=torch.bfloat16)  # fp32 inputs save fp32 states
        tinv = torch.zeros(1, 40, 1, cfg.BC, dtype=problem.saved_t_dtype(cfg, torch.float32))
        with pytest.raises(RuntimeError, match="do not match the launch config"):
            gdn_chunk._backward(*(x[n] for n in ("q", "k", "v", "g", "beta")), None, None, wrong, tinv,
                                torch.zeros_like(x["v"]), None, 0.25, False)


@pytest.mark.parametrize("saved, later", [("local_sub", "local"), ("local", "local_sub")])
def test_config_change_between_forward_and_backward_raises(saved, later, tuning):
    x = make_inputs(1, 40, 1, 16, 16, n_states=0, dtype=torch.float32)
    t = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    cfg = get_config(16, 16, 1)
    tuning[(16, 16)] = dataclasses.replace(cfg, **BWD_PATHS[saved])
    o, _ = chunk_gated_delta_rule(*t)
    tuning[(16, 16)] = dataclasses.replace(cfg, **BWD_PATHS[later])
    with pytest.raises(RuntimeError, match="do not match the launch config"):
        o.sum().backward()


def test_clear_error_without_cuda_or_triton(monkeypatch):
    x = make_inputs(1, 4, 1, 16, 16, n_states=0, dtype=torch.float32, device="cpu")
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    monkeypatch.setattr(gdn_chunk, "_INTERPRET", False)
    with pytest.raises(RuntimeError, match="torch_chunk"):
        chunk_gated_delta_rule(*args)
    monkeypatch.setattr(gdn_chunk, "_TRITON_ERROR", ImportError("no triton"))
    with pytest.raises(RuntimeError, match="needs Triton"):
        chunk_gated_delta_rule(*args)


def test_rejects_unsupported_head_dim():
    x = make_inputs(1, 4, 1, 24, 16, n_states=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        chunk_gated_delta_rule(*(x[n] for n in ("q", "k", "v", "g", "beta")))


def test_bwd_path_argument_rejects_unknown_values():
    x = make_inputs(1, 4, 1, 16, 16, n_states=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown bwd_path 'split'"):
        chunk_gated_delta_rule(*(x[n] for n in ("q", "k", "v", "g", "beta")), bwd_path="split")
