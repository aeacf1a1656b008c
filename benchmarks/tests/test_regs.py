"""benchmarks.gdn.regs: the fused mixer's launches recorded in the interpreter, then compiled for
sm_90 by the installed Triton (no GPU needed); a register cap shows in the registers it reports."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench

# every Triton kernel of the fused GDN mixer's forward and backward (kernels/gdn/DESIGN.md)
MIXER_KERNELS = {"_conv3_fwd_rows_kernel", "_wy_inverse_kernel", "_fwd_prep_kernel", "_state_pass_kernel",
                 "_fwd_out_kernel", "_gnorm_fwd_kernel", "_gnorm_bwd_kernel", "_bwd_prep_kernel",
                 "_bwd_local_kernel", "_conv3_bwd_rows_kernel"}


def run_regs(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.gdn.regs", *args], capture_output=True, text=True, env=env,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| _")]
    return [dict(name=r[0].strip(), warps=int(r[2]), regs=int(r[4]), stack=int(r[5]), progs=int(r[9])) for r in rows]


def test_every_mixer_kernel_is_compiled_and_read():
    rows = run_regs()
    assert {r["name"] for r in rows} == MIXER_KERNELS
    assert all(0 < r["regs"] <= 255 and r["progs"] >= 1 for r in rows)


def test_a_register_cap_shows_and_spills():
    rows = run_regs("--maxnreg", "64")
    assert all(r["regs"] <= 64 for r in rows)
    assert next(r for r in rows if r["name"] == "_bwd_local_kernel")["stack"] > 0  # its chain does not fit in 64


def test_the_interpreter_is_refused():
    out = subprocess.run([sys.executable, "-m", "benchmarks.gdn.regs"], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1"), timeout=120)
    assert out.returncode == 2 and re.search(r"unset TRITON_INTERPRET", out.stderr)
