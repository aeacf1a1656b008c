"""benchmarks/attn_bench.py: its CPU dry mode end to end, its checks (a variant that computes
another attention fails the run), the kernel-option parsing and the FLOP count."""

import argparse
import itertools

import pytest

from benchmarks import attn_bench

pytestmark = pytest.mark.bench


def test_dry_run_prints_the_defaults_and_every_variant(capsys):
    assert attn_bench.main(["--dry"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| flex")]
    assert [r.split("|")[1].strip() for r in rows][:2] == ["flex, defaults", "flex, bwd_num_stages=2"]
    assert len(rows) == 6 and not any("failed" in r for r in rows)
    assert "forward only" in out


def test_every_variant_compiles_afresh(capsys):
    """Dynamo guards flex attention's kernel_options by their keys, not always by their values,
    so a variant could reuse another's compile; and past Dynamo's recompile limit (8) one would
    run eager flex attention. Twelve variants, two pairs differing only in values: each is
    compiled once of its own, none fails."""
    from torch._dynamo.utils import counters

    options = [f"fwd_num_warps={w},bwd_num_warps={w}" for w in (1, 2, 4, 8)] + \
              [f"fwd_num_stages={n},bwd_num_stages={n}" for n in (1, 2, 3, 4, 5, 6, 7)]
    counters.clear()
    assert attn_bench.main(["--dry", "--options", *options]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| flex")]
    assert len(rows) == 12 and not any("failed" in r for r in rows)
    assert counters["frames"]["ok"] == 12


def test_a_variant_that_computes_another_attention_fails_the_run(monkeypatch, capsys):
    real = attn_bench._flex_attention

    def wrong_with_options(q, k, v, mask, scale, kernel_options=None):
        out = real(q, k, v, mask, scale, kernel_options=kernel_options)
        return out if kernel_options is None else out * 1.5

    monkeypatch.setattr(attn_bench, "_flex_attention", wrong_with_options)
    assert attn_bench.main(["--dry"]) == 1
    assert "FAILED: flex, bwd_num_stages=2 computes another attention" in capsys.readouterr().out


def test_kernel_options_parse_ints_and_booleans():
    assert attn_bench.kernel_options("fwd_BLOCK_M=64, USE_TMA=true,bwd_num_stages=2") == {
        "fwd_BLOCK_M": 64, "USE_TMA": True, "bwd_num_stages": 2}
    for bad in ("fwd_BLOCK_M", "fwd_BLOCK_M=sixty", "=3", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            attn_bench.kernel_options(bad)


def test_documents_fill_each_sequence_and_the_flops_count_causal_pairs():
    lengths = attn_bench.packed_documents(3, 4096, 500, 6000)
    ends = set(itertools.accumulate(lengths))
    assert sum(lengths) == 3 * 4096 and {4096, 8192, 12288} <= ends  # every sequence starts a document
    # documents of 2 and 3 tokens: 3 + 6 causal pairs; per pair and head 2 · (d_qk + d_v) FLOPs forward
    assert attn_bench.attention_flops([2, 3], heads=4, d_qk=8, d_v=16) == (2 * 9 * 4 * 24, 2.5 * 2 * 9 * 4 * 24)
