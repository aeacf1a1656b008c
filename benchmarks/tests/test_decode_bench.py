"""benchmarks/decode_bench.py: the table's ratios, and the CPU dry mode end to end (both models,
both HyMo prefill paths, the guards, the table: the code paths the GPU run takes)."""

import math

import pytest

from benchmarks import decode_bench

pytestmark = pytest.mark.bench


def test_table_ratios_per_batch_and_context():
    rows = [decode_bench.Row("hymo", 64, 1024, prefill_ms=50.0, decode_ms=10.0, cache_mib=100.0, peak_gib=8.0),
            decode_bench.Row("hf", 64, 1024, prefill_ms=100.0, decode_ms=20.0, cache_mib=400.0, peak_gib=16.0)]
    text = decode_bench.table(rows)
    assert "| hymo | 64 | 1024 | 50.00 | 10.000 | 6400.0 | 100.00 | 8.00 |" in text
    assert "| HyMo/HF | 64 | 1024 | 0.50x | 0.50x | 2.00x | 0.25x | 0.50x | |" in text


def test_decode_bench_dry_run(capsys):
    assert decode_bench.main(["--dry"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| model")]
    keys = [(r[0], int(r[1]), int(r[2])) for r in rows]
    assert keys == [(m, b, c) for b in (1, 2) for c in (16, 32) for m in ("hymo", "hf", "HyMo/HF")]
    for r in rows:  # prefill, decode, tokens/s, cache: finite and positive; no peak on the CPU
        values = [float(x.removesuffix("x")) for x in r[3:7]]
        assert all(math.isfinite(v) and v > 0 for v in values), r
        assert r[7] == "–", r
    notes = {k: r[8] for k, r in zip(keys, rows)}
    assert notes[("hymo", 1, 16)] == "packed, guard ok" and notes[("hf", 1, 16)] == "guard ok"
    assert notes[("hymo", 2, 16)] == "packed" and notes[("hymo", 2, 32)] == "1 per forward"  # --packed-max-tokens 32
    assert "guard hymo per-seq prefill" in out
    assert "parameters: hymo " in out and ", hf " in out
