"""benchmarks/ns_bench.py: its CPU dry mode end to end (Triton's interpreter), and its check (a
kernel further from the fp64 iteration than the torch chain fails the run)."""

import pytest

from benchmarks import ns_bench

pytestmark = pytest.mark.bench


def test_dry_run_prints_each_batch_and_the_total(capsys):
    assert ns_bench.main(["--dry"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("[")]
    assert len(rows) >= 2 and "flavor debugmodel" in out
    assert out.splitlines()[-1].split()[0] == "total"


def test_a_worse_kernel_fails_the_run(monkeypatch, capsys):
    real = ns_bench.ns.iterate
    monkeypatch.setattr(ns_bench.ns, "iterate", lambda X, inv, coeffs: real(X, inv, coeffs[:-1]))  # one step short
    assert ns_bench.main(["--dry"]) == 1
    assert "exceeds 1.25x the chain's" in capsys.readouterr().err
