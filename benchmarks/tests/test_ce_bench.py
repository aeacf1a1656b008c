"""benchmarks/ce_bench.py: its CPU dry mode end to end, and its check (a kernel whose gradient
is wrong fails the run)."""

import pytest

from benchmarks import ce_bench

pytestmark = pytest.mark.bench


def test_dry_run_prints_the_kernel_beside_the_reference(capsys):
    assert ce_bench.main(["--dry"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 100 ")]
    assert [r[2].strip() for r in rows] == ["Triton kernel", "reference, compiled", "reference, eager"]
    assert all(float(r[6]) < 1e-5 for r in rows)


def test_a_wrong_gradient_fails_the_run(monkeypatch, capsys):
    real = ce_bench.ce_chunk_triton

    def doubled(logits, targets, want_grad):
        loss, grad = real(logits, targets, want_grad)
        return loss, 2 * grad

    monkeypatch.setattr(ce_bench, "ce_chunk_triton", doubled)
    assert ce_bench.main(["--dry"]) == 1
    assert "a gradient error above" in capsys.readouterr().err
