"""benchmarks.gdn.conv_bench: its code paths in Triton's CPU interpreter (``--dry``), and its
checks: a conv that computes the wrong function, or a backward tile whose outputs differ, fails
the run instead of being timed."""

import os

import torch

if not torch.cuda.is_available():  # before the kernels are imported: triton.jit reads it then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from benchmarks.gdn import conv_bench  # noqa: E402
from hymo_kernels.gdn import short_conv  # noqa: E402

pytestmark = [pytest.mark.bench,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the dry mode runs the interpreter")]


def test_dry_run_prints_every_row(capsys):
    assert conv_bench.main(["--dry"]) == 0
    out = capsys.readouterr().out
    for row in ("| ours, one launch |", "| ours, three launches |", "| ours, forward rows 16,32,1,2 |",
                "| ours, backward rows 16,32,1,2 |", "| ours, forward rows 32,32,1,4 |",
                "| ours, backward rows 32,32,1,4 |", "| floor at 4.3 TB/s |"):
        assert row in out, row
    # the sweeps leave the shipped tiles in place
    assert (short_conv.FWD_ROWS, short_conv.BWD_ROWS) == ((16, 256, 2, 2), (64, 256, 4, 4))


@pytest.mark.parametrize("spec", ["16,256,4,5", "16,0,4", "16,256", "16,48,4"])
def test_a_tile_the_kernels_cannot_walk_is_refused(spec, capsys):
    with pytest.raises(SystemExit) as e:
        conv_bench.main(["--dry", "--bwd-rows", spec])
    assert e.value.code == 2 and "--bwd-rows" in capsys.readouterr().err


def test_a_wrong_conv_fails_the_run(monkeypatch, capsys):
    real = short_conv.conv_silu_qkv_fwd
    monkeypatch.setattr(short_conv, "conv_silu_qkv_fwd", lambda *a: tuple(y * 1.01 for y in real(*a)))
    assert conv_bench.main(["--dry"]) == 1
    assert "FAILED: ours does not compute the reference's conv" in capsys.readouterr().out


def test_document_lengths_fill_the_row():
    lengths = conv_bench.document_lengths(32768)
    assert sum(lengths) == 32768 and all(0 < n <= 6000 for n in lengths) and len(lengths) > 5
    assert lengths == conv_bench.document_lengths(32768)  # a fixed draw


@pytest.mark.parametrize("direction, entry, tiles", [("backward", "conv_silu_qkv_bwd", "BWD_ROWS"),
                                                     ("forward", "conv_silu_qkv_fwd", "FWD_ROWS")])
def test_a_tile_whose_outputs_differ_fails_the_run(direction, entry, tiles, monkeypatch, capsys):
    real, shipped = getattr(short_conv, entry), getattr(short_conv, tiles)

    def wrong_off_the_shipped_tile(*args):
        out = real(*args)
        return out if getattr(short_conv, tiles) == shipped else (out[0] * 2, *out[1:])

    monkeypatch.setattr(short_conv, entry, wrong_off_the_shipped_tile)
    assert conv_bench.main(["--dry"]) == 1
    assert f"FAILED: the {direction} with rows (16, 32, 1, 2) differs" in capsys.readouterr().out
    assert getattr(short_conv, tiles) == shipped
