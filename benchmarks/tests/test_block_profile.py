"""benchmarks/block_profile.py: its CPU dry mode for both block kinds, and its refusals."""

import pytest

from benchmarks import block_profile

pytestmark = pytest.mark.bench


@pytest.mark.parametrize("block, layer", [("gdn", 0), ("mla", 3)])
def test_dry_run_profiles_the_block(block, layer, capsys):
    assert block_profile.main(["--dry", "--block", block, "--top", "4", "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert f"{block} block (layer {layer} of debugmodel), 1 x 64 tokens" in out
    fwd = [line for line in out.splitlines() if line.startswith("| fwd+bwd ms |")]
    assert len(fwd) == 1 and float(fwd[0].split("|")[2]) > 0
    head = out.index("| ms | share | launches | category | name |")
    rows = out[head:].splitlines()[2:6]
    assert len(rows) == 4 and all(len(r.split("|")) == 7 for r in rows)  # ms, share, launches, category, name
    times = [float(r.split("|")[1]) for r in rows]
    assert times == sorted(times, reverse=True)  # ranked by time
    assert "| by category | ms | share |" in out


@pytest.mark.parametrize("argv, message", [(["--flavor", "nope"], "unknown flavor 'nope'"),
                                           (["--batch", "0"], "must be >= 1")])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        block_profile.main(["--dry", *argv])
    assert message in capsys.readouterr().err
