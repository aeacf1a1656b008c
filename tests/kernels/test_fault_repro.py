"""The fault reproducer's own code paths, on the CPU (Triton's interpreter, bounds-checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hymo_kernels.gdn import fault_repro as fr

TINY = "K=32,V=32,BT=16,BV=16,T=37"  # three chunks, the last one partial


def test_parse_case():
    assert fr.parse_case("") == fr.DEFAULTS
    assert fr.DEFAULTS["stage"] == "pass" and (fr.DEFAULTS["warps"], fr.DEFAULTS["BV"], fr.DEFAULTS["K"]) == (4, 32, 128)
    case = fr.parse_case("stage=t_dot,warps=8,BV=64,prec=bf16")
    assert (case["stage"], case["warps"], case["BV"], case["prec"], case["K"]) == ("t_dot", 8, 64, "bf16", 128)
    for bad, msg in [("bogus=1", "bad case item"), ("warps=four", "whole number"), ("stage=", "bad case item"),
                     ("stage=fwd", "stage from"), ("prec=fp8", "prec from"), ("BV=48", "power of two"),
                     ("BV=8", "power of two"), ("V=32,BV=64", "BV must divide V"), ("T=0", "T ≥ 1"), ("ykmajor=2", "ykmajor 0 or 1"),
                     ("sprec=fp8", "sprec from")]:
        with pytest.raises(ValueError, match=msg):
            fr.parse_case(bad)


@pytest.mark.parametrize("stage", fr.STAGES)
@pytest.mark.parametrize("prec, ykmajor, sprec", [("tf32", 0, "same"), ("ieee", 0, "same"), ("ieee", 1, "same"),
                                                  ("tf32", 0, "ieee")])
def test_each_stage_matches_float64(stage, prec, ykmajor, sprec):
    res = fr.run_case(fr.parse_case(f"{TINY},stage={stage},prec={prec},ykmajor={ykmajor},sprec={sprec}"))
    assert res["result"] == "PASS", res
    assert max(res["errors"].values()) < 1e-5  # the interpreter's dots are fp32


def test_wrong_numbers_fail_and_a_raising_launch_is_an_error(monkeypatch):
    case = fr.parse_case(f"{TINY},stage=pass")
    reference = fr.reference
    monkeypatch.setattr(fr, "reference", lambda c, x: tuple(1.01 * t for t in reference(c, x)))
    res = fr.run_case(case)
    assert res["result"] == "FAIL" and 9e-3 < res["errors"]["u"] < 1.1e-2, res

    class Faulting:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return launch

    monkeypatch.setattr(fr, "_repro_kernel", Faulting())
    res = fr.run_case(case)
    assert res["result"] == "ERROR" and "illegal memory access" in res["error"], res


def test_cli_runs_each_case_in_a_child_process(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = tmp_path / "rows.json"
    p = subprocess.run([sys.executable, "-m", "hymo_kernels.gdn.fault_repro", "--json", str(out), "--cases",
                        f"{TINY},stage=t_dot", f"{TINY},stage=pass,warps=8"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["stage"], r["warps"], r["result"]) for r in rows] == [("t_dot", 4, "PASS"), ("pass", 8, "PASS")]
    summary = p.stdout.splitlines()[-2:]
    assert summary[0].startswith(f"{TINY},stage=t_dot") and " PASS " in summary[0]
    bad = subprocess.run([sys.executable, "-m", "hymo_kernels.gdn.fault_repro", "--cases", "BV=48"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "power of two" in bad.stderr
