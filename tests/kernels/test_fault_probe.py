"""The large-head fault probe's own code paths, on the CPU (Triton's interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hymo_kernels.gdn import chunk as gdn_chunk
from hymo_kernels.gdn import fault_probe as fp
from hymo_kernels.gdn.chunk import KernelCfg


def test_parse_launches():
    cfg = fp.parse_launches("lh_fwd_h=8,warps=4,BV=64,lh_wu")
    assert cfg.large_head and cfg.lh_wu and cfg.BV == 64 and cfg.BT == 64
    # warps replaced, the rest of each launch (stages, the large-head register cap) kept
    assert cfg.lh_fwd_h == KernelCfg(8, 2, 0, 255) and cfg.lh_bwd_grads == KernelCfg(4, 1, 0, 255)
    assert cfg.lh_inverse.num_warps == 4
    assert fp.parse_launches("") == fp.parse_launches("warps=2")  # the Config defaults are 2 warps
    assert not cfg.t_bf16 and fp.parse_launches("t_bf16").t_bf16
    split = fp.parse_launches("warps=4,lh_split,BK=32")
    assert split.large_head and split.lh_split and split.lh_bwd_dqk == KernelCfg(4, 1, 32, 255)
    assert split.lh_bwd_dv.num_warps == split.lh_bwd_finish.num_warps == 4
    table = fp.parse_launches("default_path,BK=16")
    assert not table.large_head and table.lh_split and table.lh_bwd_dqk == KernelCfg(2, 1, 16, 255)
    for bad in ("warps=four", "bogus=3", "lh_wu=1", "BV", "t_bf16=1", "BK=x", "default_path=1", "lh_split=0"):
        with pytest.raises(ValueError, match="bad launch-set item"):
            fp.parse_launches(bad)


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_probe_passes_and_reports_a_failing_launcher(packed, tuning, monkeypatch):
    shape = (1, 70, 2, 16, 16)
    res = fp.probe(shape, packed, "warps=4,BV=16", "fp32")  # 4 warps: the launch check is bypassed
    assert res["ok"], res
    assert set(res["errors"]) == {"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
    assert max(res["errors"].values()) < 1e-5
    with pytest.raises(RuntimeError, match=">= 4 warps"):  # the launch check is back in place
        gdn_chunk.check_large_head_launch(gdn_chunk.Config(large_head=True, lh_fwd_o=KernelCfg(4, 2)), (9, 0))

    class Faulting:  # the reverse pass's kernel, launched as kernel[grid](...), faults
        def __getitem__(self, grid):
            def launch(*a, **k):
                raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
            return launch

    monkeypatch.setattr(gdn_chunk._lh, "_lh_bwd_dh_kernel", Faulting())
    res = fp.probe(shape, packed, "warps=2,BV=16", "fp32")
    assert not res["ok"] and res["where"] == ["run_lh_bwd_dh"] and "illegal memory access" in res["error"]
    # the table's path with the split gradient stage does not run the large-head reverse pass
    res = fp.probe(shape, packed, "default_path,warps=4,BV=16,BK=16", "fp32")
    assert res["ok"] and max(res["errors"].values()) < 1e-5, res


def test_cli_runs_each_launch_set_in_a_child_process(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-m", "hymo_kernels.gdn.fault_probe", "--shape", "1,40,1,16,16",
                        "--dtypes", "fp32", "--launches", "BV=16", "warps=4,BV=16,lh_wu"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(s) for s in p.stdout.splitlines() if s.startswith("{")]
    assert [(r["launches"], r["ok"]) for r in rows] == [("BV=16", True), ("warps=4,BV=16,lh_wu", True)]
    assert "PASS" in p.stdout.splitlines()[-1]
    bad = subprocess.run([sys.executable, "-m", "hymo_kernels.gdn.fault_probe", "--launches", "warps=x"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "bad launch-set item" in bad.stderr


def test_cli_sanitizer_wraps_each_child_and_reports(tmp_path):
    # a stand-in for NVIDIA's compute-sanitizer: records how it was called, prints a report, then
    # runs the child it wraps (the real one is GPU-only)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f"echo \"$1 $2 caching=${{PYTORCH_NO_CUDA_MEMORY_CACHING:-}}\" >> {calls}\n"
        "echo '========= COMPUTE-SANITIZER'\n"
        "echo '========= Invalid __shared__ write of size 16 bytes'\n"
        "echo '=========     at _lh_fwd_h_kernel+0x1a30 in large_head_kernels.py:183'\n"
        "shift 6\n"
        "exec \"$@\"\n")
    fake.chmod(0o755)
    env = dict(os.environ, TRITON_INTERPRET="1", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    p = subprocess.run([sys.executable, "-m", "hymo_kernels.gdn.fault_probe", "--shape", "1,40,1,16,16",
                        "--dtypes", "fp32", "--launches", "BV=16", "--sanitizer", "memcheck"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(s) for s in p.stdout.splitlines() if s.startswith("{")]
    assert len(rows) == 1 and rows[0]["ok"], rows
    assert rows[0]["sanitizer"] == ["Invalid __shared__ write of size 16 bytes",
                                    "at _lh_fwd_h_kernel+0x1a30 in large_head_kernels.py:183"]
    assert "    memcheck: Invalid __shared__ write of size 16 bytes" in p.stdout.splitlines()
    # one child, under the tool asked for, with PyTorch's caching allocator off
    assert calls.read_text().splitlines() == ["--tool memcheck caching=1"]

    # asked to sanitize where there is no compute-sanitizer: refused before any child runs
    empty = tmp_path / "empty"
    empty.mkdir()
    calls.unlink()
    bad = subprocess.run([sys.executable, "-m", "hymo_kernels.gdn.fault_probe", "--shape", "1,40,1,16,16",
                          "--launches", "BV=16", "--sanitizer", "memcheck"],
                         env=dict(env, PATH=str(empty)), capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "needs NVIDIA's compute-sanitizer" in bad.stderr
    assert not calls.exists()
