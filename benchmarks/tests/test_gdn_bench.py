"""benchmarks.gdn.bench and its tuner (benchmarks.gdn.tune): the code paths of a GPU run, on tiny
shapes in Triton's CPU interpreter (``--smoke``), and the tuner's config round trips."""

import os

import torch

if not torch.cuda.is_available():  # before the kernels are imported: triton.jit reads it then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

from benchmarks.gdn import bench, tune  # noqa: E402
from hymo_kernels.gdn import backward, output  # noqa: E402
from hymo_kernels.gdn import chunk as gdn_chunk  # noqa: E402
from hymo_kernels.gdn import config as gdn_config  # noqa: E402
from hymo_kernels.gdn.config import BWD_PATHS, KERNELS, Config, KernelCfg  # noqa: E402

pytestmark = pytest.mark.bench
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
smoke = pytest.mark.skipif(not gdn_chunk._INTERPRET,
                           reason="the smoke mode runs the kernels in Triton's CPU interpreter")


@pytest.fixture(autouse=True)
def device_restored():
    """bench.main(["--smoke", ...]) sets the module's DEVICE to "cpu"; each test starts from "cuda"."""
    yield
    bench.DEVICE = "cuda"


def test_config_round_trip():
    """The tuner's JSON / worker round trip keeps every kernel's launch."""
    cfg = Config(BT=64, BV=32, bwd_local=KernelCfg(2, 3, 16), fwd_out=KernelCfg(8, 2, 32, 128), prefetch_t=True)
    assert bench.config_from_dict(dataclasses.asdict(cfg)) == cfg


def test_register_cap_variants_and_table_entry():
    """The nreg variants set the cap on every launched kernel and keep the tiles; the tuner's
    TABLE entry parses back to the same launches."""
    entry = dict(gdn_config.TABLE[(32, 32)], fwd_out=(1, 3, 32, 96), wy_inverse=(1, 1, 0, 64))
    cfg = gdn_config.config_from_entry(32, 32, 256, entry)
    capped = bench.variant_config(cfg, "nreg128")
    assert {getattr(capped, k).maxnreg for k in capped.kernels()} == {128} and capped.fwd_out.block == 32
    fwd = bench.variant_config(cfg, "fwd_nreg168")  # the two forward chunk kernels alone
    assert {k: getattr(fwd, k).maxnreg for k in fwd.kernels()} == {
        k: 168 if k in ("fwd_prep", "fwd_out") else getattr(cfg, k).maxnreg for k in cfg.kernels()}
    assert fwd.fwd_out.block == 32 and fwd.bwd_local == cfg.bwd_local
    text = tune.table_entry(cfg, 32, 32, 256)
    parsed = eval(text.split(": ", 1)[1].rstrip(","), {"dict": dict})  # noqa: S307 - our own output
    again = gdn_config.config_from_entry(32, 32, 256, parsed)
    assert again == cfg
    with pytest.raises(ValueError, match="unknown variant 'split'"):
        bench.variant_config(cfg, "split")


def test_launch_variants_replace_the_named_kernels_only():
    """A variant's ``launches`` replace those kernels' launches and keep the rest of the table's
    config (precisions, tiles, the other kernels)."""
    cfg = gdn_config.config_from_entry(32, 32, 256, gdn_config.TABLE[(32, 32)])
    v = bench.variant_config(cfg, "bc32_bwd4")
    assert (v.BC, v.fwd_prep, v.bwd_local, v.wy_inverse) == (32, KernelCfg(2, 3, 64), KernelCfg(4, 3, 32),
                                                            KernelCfg(2, 1))
    assert (v.state_pass, v.BT, v.dot_bf16, v.inverse_prec) == (cfg.state_pass, cfg.BT, cfg.dot_bf16, cfg.inverse_prec)


def test_tune_variants_full_grid():
    """--tune tries the stage counts at the best 1-stage launch only; --full-grid times every
    warps × tile × stages launch (no stages for the loop-free inverse)."""
    cfg = gdn_config.get_config(32, 32)
    a, b, _ = tune.kernel_variants("fwd_prep", cfg, 32, 32, [1, 2], [1, 2, 3])
    assert b == [1, 2, 3] and {(v.num_warps, v.num_stages, v.block) for v in a[1:]} == {
        (w, 1, t) for w in (1, 2) for t in (32, 64)}
    a, b, _ = tune.kernel_variants("fwd_prep", cfg, 32, 32, [1, 2], [1, 2, 3], full_grid=True)
    assert b == [] and {(v.num_warps, v.num_stages, v.block) for v in a[1:]} == {
        (w, s, t) for w in (1, 2) for s in (1, 2, 3) for t in (32, 64)}
    assert a[0] == cfg.fwd_prep  # the table's launch first: the speed-ups are against it
    a, b, _ = tune.kernel_variants("wy_inverse", cfg, 32, 32, [1, 2], [1, 2, 3], full_grid=True)
    assert b == [] and {v.num_stages for v in a[1:]} == {1}


@pytest.mark.parametrize("path", list(BWD_PATHS))
def test_case_hands_over_the_saved_states_of_its_path(path, monkeypatch):
    """The tuner's per-kernel Case gives _fwd_out and _bwd_local the per-sub-chunk states buffer
    when the config saves one state per sub-chunk (a per-chunk buffer would be read past its end)."""
    seen = {}
    monkeypatch.setattr(output, "run_fwd_out", lambda p, tinv, states: seen.setdefault("fwd_out", states.shape[0]))
    monkeypatch.setattr(backward, "run_bwd_local",
                        lambda p, tinv, do, states, dstates: seen.setdefault("bwd_local", states.shape[0]))
    monkeypatch.setattr(bench, "DEVICE", DEVICE)
    cfg = dataclasses.replace(gdn_config.get_config(16, 16, 1), **BWD_PATHS[path])
    case = tune.Case((1, 64, 1, 16, 16), torch.float32, cfg)
    case.fn("fwd_out", cfg)()
    case.fn("bwd_local", cfg)()
    assert seen["fwd_out"] == seen["bwd_local"] == case.p.NC * cfg.slots


@smoke
def test_tune_smoke(tmp_path, capsys):
    """--tune's code path (Case, per-kernel launches, parity, TABLE entry, JSON) on a tiny shape,
    so the GPU run does not fail for a trivial reason."""
    out = tmp_path / "tune.json"
    bench.main(["--smoke", "--tune", "--shapes", "1,20,1,16,16", "--warps", "1", "--stages", "1,2",
                "--nregs", "0,128", "--bts", "16,32", "--no-fla", "--jobs", "0", "--json", str(out)])
    rec = json.loads(out.read_text())["shapes"]["1,20,1,16,16"]
    assert all(r["ok"] for r in rec["parity_default"] + rec["parity_tuned"] if "float32" in r["dtype"])
    # the tuned launches are checked in both dtypes (fp32 inputs compile other kernels)
    assert {r["dtype"] for r in rec["parity_tuned"]} == {"torch.bfloat16", "torch.float32"}
    assert set(rec["kernels"]) == set(KERNELS)
    for k, rows in rec["kernels"].items():  # round C timed the register cap for every kernel
        assert {r["cfg"]["maxnreg"] for r in rows} == {0, 128}, k
    assert rec["table_entry"].startswith("(16, 16): dict(BT=") and "local_sub_states=" in rec["table_entry"]
    gdn_config.config_from_entry(16, 16, 256, eval(rec["table_entry"].split(": ", 1)[1].rstrip(",")))  # noqa: S307
    assert "tune summary" in capsys.readouterr().out


@smoke
def test_bench_smoke_and_failed_parity_exit(tmp_path, monkeypatch):
    """The timing run on a tiny shape writes its JSON; a failed parity ends it with a non-zero
    exit naming the shape, not a table that merely says FAILED."""
    out = tmp_path / "bench.json"
    argv = ["--smoke", "--shapes", "1,20,1,16,16", "--no-fla", "--no-eager", "--fast-ref", "--json", str(out)]
    bench.main(argv)
    rec = json.loads(out.read_text())["shapes"]["(1, 20, 1, 16, 16)"]
    assert rec["parity_ok"] == {"ours": True} and rec["times"]["ours"]["fwdbwd_ms"] > 0
    assert len(rec["rounds"]["ours"]) == 3  # --rounds' default: timed in alternating order
    real = bench.parity
    monkeypatch.setattr(bench, "parity", lambda *a, **k: [r[:3] + (False,) for r in real(*a, **k)])
    with pytest.raises(SystemExit, match=r"benchmark failed .*\(1, 20, 1, 16, 16\)"):
        bench.main(argv)


@smoke
def test_bench_reports_gpu_time(tmp_path, monkeypatch, capsys):
    """The summary and the JSON carry the GPU time of ours (the sum of the profiled kernels)
    beside the wall time; here from a stand-in profile, since the CPU has none."""
    monkeypatch.setattr(bench, "kernel_breakdown", lambda impl, shape: [(0.5, "_bwd_local_kernel"), (0.25, "_fwd_out")])
    out = tmp_path / "bench.json"
    bench.main(["--smoke", "--shapes", "1,20,1,16,16", "--no-fla", "--no-eager", "--no-parity", "--rounds", "1",
                "--json", str(out)])
    rec = json.loads(out.read_text())["shapes"]["(1, 20, 1, 16, 16)"]
    assert rec["gpu_ms"] == {"ours": 0.75}
    assert [k["kernel"] for k in rec["kernels"]["ours"]] == ["_bwd_local_kernel", "_fwd_out"]
    text = capsys.readouterr().out
    header, row = [ln for ln in text.splitlines() if ln.startswith("shape ") or ln.startswith("(1, 20, 1, 16, 16) ")][-2:]
    assert "ours GPU" in header and "GPU vs fla" in header
    assert row.split()[-4] == "0.750"  # ours GPU; then fla GPU (nan: no fla), the ratio and "ok"


@smoke
def test_bench_warm_up(monkeypatch, capsys):
    """--warm-procs: each shape's first calls (ours per config in bf16 and fp32, with and without
    the state arguments; fla in bf16) run in child processes before the timing run; a failed
    child is reported, not hidden."""
    calls = []

    def recording(name, impl):
        def run(q, k, v, g, beta, initial_state=None, output_final_state=False):
            calls.append((name, q.dtype, initial_state is not None, gdn_config.TUNING.get((16, 16))))
            return impl(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state)
        return run

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    real_ours = bench.ours
    monkeypatch.setattr(bench, "ours", recording("ours", real_ours))
    cfgs = [Config(BT=32, BZ=32, BV=16, BV_PASS=16), Config(BT=64, BZ=32, BV=16, BV_PASS=16)]
    bench.warm_shape((1, 20, 1, 16, 16), cfgs, recording("fla", real_ours))
    f32, bf16 = torch.float32, torch.bfloat16
    assert sorted((n, str(d), s, c is not None and c.BT) for n, d, s, c in calls) == sorted(
        [("ours", str(d), s, c.BT) for d in (bf16, f32) for c in cfgs for s in (True, False)]
        + [("fla", str(bf16), s, False) for s in (True, False)])

    capsys.readouterr()
    bench.main(["--smoke", "--shapes", "1,20,1,16,16", "1,37,2,16,16", "--no-fla", "--no-eager", "--no-parity",
                "--rounds", "1", "--warm-procs", "2"])
    out = capsys.readouterr().out
    for shape in ("(1, 20, 1, 16, 16)", "(1, 37, 2, 16, 16)"):
        assert any(ln.startswith(f"  warm-up {shape}: exit 0 after ") for ln in out.splitlines()), out
    assert "warm-up: 2 shapes in " in out and out.index("warm-up: 2 shapes") < out.index("## (1, 20, 1, 16, 16)")

    monkeypatch.setattr(bench.sys, "executable", "false")  # every child fails at once
    bench.warm_up([(1, 20, 1, 16, 16)], argparse.Namespace(warm_procs=1, variants="default", no_fla=True, smoke=True,
                                                           tuning=None))
    assert "warm-up (1, 20, 1, 16, 16): exit 1 after" in capsys.readouterr().out
