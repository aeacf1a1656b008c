"""benchmarks/block_profile.py: its CPU dry mode for both block kinds, and its refusals."""

import pytest

from benchmarks import block_profile

pytestmark = pytest.mark.bench


@pytest.mark.parametrize("block, layer", [("gdn", 0), ("mla", 3)])
def test_dry_run_profiles_the_block(block, layer, monkeypatch, capsys):
    built = []
    real_build = block_profile.build
    monkeypatch.setattr(block_profile, "build", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    assert block_profile.main(["--dry", "--block", block, "--top", "4", "--iters", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert f"{block} block (layer {layer} of debugmodel), 1 x 64 tokens" in out
    fwd = [line for line in out.splitlines() if line.startswith("| fwd+bwd ms |")]
    assert len(fwd) == 1 and float(fwd[0].split("|")[2]) > 0
    lines = out.splitlines()
    head = lines.index("| ms | share | calls | operator |")
    rows = lines[head + 2:]
    assert len(rows) == 4 and all(len(r.split("|")) == 6 for r in rows)  # --top 4: ms, share, calls, operator
    times = [float(r.split("|")[1]) for r in rows]
    assert times == sorted(times, reverse=True)  # ranked by time
    # every iteration's gradients cleared: none left to add into the next one's
    (m,) = built
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("argv, message", [(["--flavor", "nope"], "unknown flavor 'nope'"),
                                           (["--batch", "0"], "must be >= 1")])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        block_profile.main(["--dry", *argv])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]


def test_a_flavor_without_that_block_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(block_profile, "first_layer", lambda args, block: None)
    with pytest.raises(SystemExit):
        block_profile.main(["--dry", "--block", "mla"])
    assert "flavor 'debugmodel' has no mla block" in capsys.readouterr().err
