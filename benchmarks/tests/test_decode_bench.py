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
    main, cache = out.split("Per-sequence cache, computed")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in main.splitlines()
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
    # the computed per-sequence caches (checked against the rows' measured ones: no failed row)
    sizes = [[c.strip() for c in line.split("|")[1:-1]] for line in cache.splitlines() if line.startswith("| 16 |")
             or line.startswith("| 32 |")]
    assert [s[0] for s in sizes] == ["16", "32"] and "failed" not in out
    assert float(sizes[1][2]) == 2 * float(sizes[0][2])  # the all-MLA latent cache grows with the context


def test_cache_per_sequence_at_the_750m_shape():
    """hymo_750m at 32K tokens in bf16: 24 GDN layers of 40 x 32 x 32 fp32 state and 3 conv inputs
    of 3 x 1280 channels, 8 MLA layers of 128 + 32 latent values per token; the all-MLA model has
    32 such layers; its full K/V: 16 heads x (96 + 32 + 128) values per token and layer."""
    from hymo_recipes.model import hymo_flavors

    b = decode_bench.cache_per_sequence(hymo_flavors["750m"], 32768, 2)
    assert b["hymo"] == 24 * (40 * 32 * 32 * 4 + 3 * 3840 * 2) + 8 * 160 * 2 * 32768
    assert b["all_mla_latent"] == 32 * 160 * 2 * 32768
    assert b["all_mla_full_kv"] == 32 * 16 * 256 * 2 * 32768
