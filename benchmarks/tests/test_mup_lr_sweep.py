"""benchmarks/mup_lr_sweep.py: the verdict's arithmetic, and the CPU dry mode end to end with its resume."""

import json

from benchmarks import mup_lr_sweep


def _runs(parametrization, finals):
    """finals: {width: [final loss per lr multiplier 0.5, 1, 2]}."""
    return [dict(parametrization=parametrization, width=w, lr_mult=m, final=f)
            for w, fs in finals.items() for m, f in zip([0.5, 1.0, 2.0], fs)]


def test_best_lr_and_its_spread_in_grid_points():
    grid = [0.5, 1.0, 2.0]
    runs = _runs("muP", {32: [3.0, 2.0, 2.5], 64: [3.0, 2.1, 2.2]}) + _runs("SP", {32: [1.0, 2.0, 3.0],
                                                                                  64: [3.0, 2.0, 1.0]})
    assert mup_lr_sweep.best_lrs(runs, "muP") == {32: 1.0, 64: 1.0}
    assert mup_lr_sweep.best_lrs(runs, "SP") == {32: 0.5, 64: 2.0}
    assert mup_lr_sweep.spread(mup_lr_sweep.best_lrs(runs, "muP"), grid) == 0
    assert mup_lr_sweep.spread(mup_lr_sweep.best_lrs(runs, "SP"), grid) == 2
    # a diverged run (inf) is never the best; a width where every run diverged has none
    inf = float("inf")
    assert mup_lr_sweep.best_lrs(_runs("SP", {32: [inf, 2.0, 1.5], 64: [inf, inf, inf]}), "SP") == {32: 2.0}


def test_dry_run_writes_every_run_once_and_resumes(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = mup_lr_sweep.main(["--dry", "--out", str(out)])
    runs = json.loads(out.with_suffix(".json").read_text())
    assert sorted((r["parametrization"], r["width"], r["lr_mult"]) for r in runs) == sorted(
        (p, w, m) for p in ("muP", "SP") for w in (32, 64) for m in (0.5, 1.0, 2.0))
    assert all(r["final"] > 0 and r["heldout"] > 0 for r in runs)
    md = out.with_suffix(".md").read_text()
    assert "## muP" in md and "## SP" in md and "grid point(s) from width 32 to 64" in md
    spans = [mup_lr_sweep.spread(mup_lr_sweep.best_lrs(runs, p), [0.5, 1.0, 2.0]) for p in ("muP", "SP")]
    assert code == (0 if spans[0] <= 1 and spans[1] >= 1 else 1)
    assert f"best lr spans {spans[0]} grid point(s) with muP, {spans[1]} without" in capsys.readouterr().out
    capsys.readouterr()
    mup_lr_sweep.main(["--dry", "--out", str(out)])  # everything is there: no run again
    assert "final" not in capsys.readouterr().out.split("# muP lr transfer")[0]
    assert len(json.loads(out.with_suffix(".json").read_text())) == len(runs)
    # the report alone, from the runs stored (as after a call cut by its time limit)
    out.with_suffix(".md").unlink()
    table = md.split("Command:")[0].rsplit("this call", 1)[0]
    assert mup_lr_sweep.main(["--dry", "--out", str(out), "--report-only"]) == code
    again = out.with_suffix(".md").read_text()
    assert again.split("Command:")[0].rsplit("this call", 1)[0] == table
    assert md.split("Command:")[1].split("\n", 1)[1] == again.split("Command:")[1].split("\n", 1)[1]
    assert len(json.loads(out.with_suffix(".json").read_text())) == len(runs)
    assert all(r["machine"].startswith("CPU, torch ") for r in runs)


def test_report_only_needs_no_gpu_for_stored_gpu_runs(tmp_path, capsys):
    """The default (GPU) settings' runs, stored by a GPU call, reported on this CPU machine."""
    setting = dict(flavor="small", optimizer="NorMuon", lr=3e-4, normuon_lr=0.02, moe_on_normuon=False, steps=200, batch=8, seq=512,
                   layers=16, seed=0, max_norm=1.0, base_width=128, device="cuda")
    runs = [dict(parametrization=p, width=w, lr_mult=m, setting=setting, machine="NVIDIA H200, torch 2.11.0+cu130",
                 final=6.0 + abs(m - (1.0 if p == "muP" else w / 256)) + w / 1e4, heldout=6.5, seconds=30.0)
            for p in ("muP", "SP") for w in (128, 256, 512, 1024) for m in (0.25, 0.5, 1.0, 2.0, 4.0)]
    out = tmp_path / "sweep"
    out.with_suffix(".json").write_text(json.dumps(runs))
    assert mup_lr_sweep.main(["--out", str(out), "--report-only"]) == 0
    md = out.with_suffix(".md").read_text()
    assert "NVIDIA H200, torch 2.11.0+cu130" in md and "## SP" in md
    assert "best lr spans 0 grid point(s) with muP, 3 without: transfers" in capsys.readouterr().out
    assert json.loads(out.with_suffix(".json").read_text()) == runs  # nothing ran, nothing added


def _append_many(args):
    store, worker = args
    for i in range(20):
        mup_lr_sweep.append_run(store, dict(worker=worker, i=i))


def test_shards_append_to_one_file_without_losing_a_run(tmp_path):
    """Four processes appending at once (as the shards of one call do): every row is stored."""
    import multiprocessing

    store = tmp_path / "runs.json"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_append_many, [(store, w) for w in range(4)])
    rows = json.loads(store.read_text())
    assert sorted((r["worker"], r["i"]) for r in rows) == [(w, i) for w in range(4) for i in range(20)]


def test_dry_run_in_two_shards_stores_each_run_once(tmp_path):
    out = tmp_path / "sweep"
    mup_lr_sweep.main(["--dry", "--out", str(out), "--shard", "1/2"])
    half = json.loads(out.with_suffix(".json").read_text())
    assert len(half) == 6
    mup_lr_sweep.main(["--dry", "--out", str(out), "--shard", "0/2"])
    runs = json.loads(out.with_suffix(".json").read_text())
    keys = [(r["parametrization"], r["width"], r["lr_mult"]) for r in runs]
    assert len(keys) == len(set(keys)) == 12


def test_a_bad_shard_is_a_parser_error():
    import pytest

    for spec in ("2/2", "1", "a/b", "-1/2"):
        with pytest.raises(SystemExit):
            mup_lr_sweep.main(["--dry", "--shard", spec])
