"""benchmarks/accum_bench.py: its CPU dry mode end to end, and its check (a kernel whose sums
differ from the loop's fails the run)."""

import pytest

from benchmarks import accum_bench

pytestmark = pytest.mark.bench


def test_dry_run_prints_the_kernel_beside_the_loop(capsys):
    assert accum_bench.main(["--dry"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| hymo") or line.startswith("| one")]
    assert [r[1].strip() for r in rows] == ["hymo_kernels.accum (one launch)", "one add per parameter (FSDP2's)"]
    assert float(rows[0][4]) == 1.0
    assert "debugmodel:" in out


def test_wrong_sums_fail_the_run(monkeypatch, capsys):
    real = accum_bench.accumulate_triton

    def off_by_one(sums, grads):
        real(sums, grads)
        sums[-1].add_(1)

    monkeypatch.setattr(accum_bench, "accumulate_triton", off_by_one)
    assert accum_bench.main(["--dry"]) == 1
    assert "differ from the loop's for 1 parameters" in capsys.readouterr().err
