"""benchmarks/optim_steps.py: the steps-to-loss arithmetic, and the CPU dry mode end to end with its resume."""

import json

import pytest

from benchmarks import optim_steps


def test_trailing_mean_and_steps_to():
    curve = [5.0, 4.0, 3.0, 2.0, 1.0]
    assert optim_steps.trailing_mean(curve, 2) == [5.0, 4.5, 3.5, 2.5, 1.5]
    assert optim_steps.steps_to(curve, 3.5, 2) == 3  # the first full window at or below 3.5
    assert optim_steps.steps_to(curve, 5.0, 2) == 2  # a window needs its full length
    assert optim_steps.steps_to(curve, 1.0, 2) is None


def _run(recipe, seed, curve):
    return dict(recipe._asdict(), seed=seed, curve=curve, final=sum(curve[-2:]) / 2, heldout=0.0, seconds=1.0)


def _normuon(normuon_lr, lr, moe=False):
    return optim_steps.Recipe("NorMuon", lr, normuon_lr, moe)


def test_verdict_is_the_ratio_of_steps_to_each_seeds_adamw_final_loss():
    # 20 steps, window 2. AdamW (best lr 2e-3) falls linearly to ~1; a NorMuon recipe with its
    # two lrs set apart gets there in about half the steps, the shipped recipe never does
    adamw = [10 - 0.45 * i for i in range(20)]
    fast = [10 - 0.9 * i for i in range(10)] + [1.0] * 10
    tuned = _normuon(0.04, 2e-3, moe=True)
    results = [_run(optim_steps.Recipe("AdamW", 1e-3), s, [v + 0.5 for v in adamw]) for s in (0, 1)]
    results += [_run(optim_steps.Recipe("AdamW", 2e-3), s, adamw) for s in (0, 1)]
    results += [_run(tuned, s, fast) for s in (0, 1)]
    results += [_run(_normuon(0.04, 2e-3), 0, [v + 1 for v in fast])]  # the same lrs, the MoE on CautiousAdamW
    results += [_run(optim_steps.SHIPPED, s, [v + 3 for v in adamw]) for s in (0, 1)]
    v = optim_steps.verdict(results, [0, 1], window=2)
    assert v["adamw"]["recipe"] == optim_steps.Recipe("AdamW", 2e-3) and v["normuon"]["recipe"] == tuned
    assert v["default"]["recipe"] == optim_steps.SHIPPED
    target = (adamw[-1] + adamw[-2]) / 2
    assert v["targets"] == pytest.approx([target, target])
    assert v["adamw"]["steps"] == [20, 20]
    n = optim_steps.steps_to(fast, target, 2)
    assert v["normuon"]["steps"] == [n, n] and n == 11
    assert v["default"]["steps"] == [None, None] and v["default"]["mean_steps"] is None
    assert v["ratio"] == pytest.approx(11 / 20)
    # a seeded run missing: no verdict
    assert optim_steps.verdict(results[:-1], [0, 1], window=2) is None


def test_dry_run_tunes_then_seeds_and_resumes(tmp_path, capsys):
    out = tmp_path / "os"
    code = optim_steps.main(["--dry", "--out", str(out)])
    runs = json.loads(out.with_suffix(".json").read_text())
    keys = [optim_steps.run_key(r) for r in runs]
    shipped = optim_steps.SHIPPED
    double = _normuon(2 * shipped.normuon_lr, 2 * shipped.lr)
    tune = {("AdamW", 1e-3, None, False, 0), ("AdamW", 4e-3, None, False, 0), (*shipped, 0), (*double, 0)}
    assert tune <= set(keys) and len(keys) == len(set(keys))
    best = {n: optim_steps.recipe_of(min((r for r in runs if r["optimizer"] == n and r["seed"] == 0),
                                         key=lambda r: r["final"])) for n in ("AdamW", "NorMuon")}
    assert set(keys) - tune == {(*best["AdamW"], 1), (*best["NorMuon"], 1), (*shipped, 1)}
    assert all(len(r["curve"]) == 12 and r["machine"].startswith("CPU") for r in runs)
    md = out.with_suffix(".md").read_text()
    v = optim_steps.verdict(runs, [0, 1], window=1)
    assert v is not None and "Steps to tuned AdamW's final loss" in md
    assert code == (0 if v["ratio"] is not None and v["ratio"] <= 0.8 else 1)
    capsys.readouterr()
    assert optim_steps.main(["--dry", "--out", str(out)]) == code  # everything is there: nothing runs again
    assert "optim_steps: AdamW" not in capsys.readouterr().out
    assert len(json.loads(out.with_suffix(".json").read_text())) == len(runs)
    table = md.split("## Tuning")[1]
    out.with_suffix(".md").unlink()
    assert optim_steps.main(["--dry", "--out", str(out), "--report-only"]) == code
    assert out.with_suffix(".md").read_text().split("## Tuning")[1] == table


def test_dry_run_in_two_shards_runs_each_run_once(tmp_path, capsys):
    """--shard: two processes of one call split each phase; the seeded phase waits until every
    tuning run is stored (shard 0 first alone: its tuning share only), and the two calls of
    each shard together store exactly the runs of one unsharded call."""
    out = tmp_path / "os"
    optim_steps.main(["--dry", "--out", str(out), "--shard", "0/2"])
    first = json.loads(out.with_suffix(".json").read_text())
    assert len(first) == 2 and all(r["seed"] == 0 for r in first)
    assert "the seeded runs wait for the next call" in capsys.readouterr().out
    optim_steps.main(["--dry", "--out", str(out), "--shard", "1/2"])  # the rest of the tuning, then its seeded share
    optim_steps.main(["--dry", "--out", str(out), "--shard", "0/2"])
    runs = json.loads(out.with_suffix(".json").read_text())
    keys = [optim_steps.run_key(r) for r in runs]
    best = {n: optim_steps.recipe_of(min((r for r in runs if r["optimizer"] == n and r["seed"] == 0),
                                         key=lambda r: r["final"])) for n in ("AdamW", "NorMuon")}
    seeded = {(*best["AdamW"], 1), (*best["NorMuon"], 1), (*optim_steps.SHIPPED, 1)}
    assert len(keys) == len(set(keys)) and set(keys) == {k for k in keys if k[-1] == 0} | seeded
    assert len([k for k in keys if k[-1] == 0]) == 4
    capsys.readouterr()
    optim_steps.main(["--dry", "--out", str(out), "--shard", "1/2"])
    assert "optim_steps: " not in capsys.readouterr().out.split("# ")[0]  # nothing left to run


def test_dry_run_takes_recipes_with_the_lrs_set_apart(tmp_path, capsys):
    """--normuon-lrs (with ':moe') and --cautious-lrs add tuning runs with exactly those settings;
    a malformed pair is a parser error."""
    out = tmp_path / "os"
    optim_steps.main(["--dry", "--out", str(out), "--steps", "4", "--seeds", "0", "--adamw-lrs", "1e-3",
                      "--normuon-mults", "1", "--normuon-lrs", "0.04:2e-3:moe", "--cautious-lrs", "2e-3"])
    runs = json.loads(out.with_suffix(".json").read_text())
    keys = {optim_steps.run_key(r) for r in runs}
    assert keys == {("AdamW", 1e-3, None, False, 0), (*optim_steps.SHIPPED, 0), ("NorMuon", 2e-3, 0.04, True, 0),
                    ("CautiousAdamW", 2e-3, None, False, 0)}
    md = out.with_suffix(".md").read_text()
    assert "| NorMuon 0.04 + CautiousAdamW 0.002, MoE on NorMuon |" in md and "| CautiousAdamW 0.002 |" in md
    for bad in ("0.04", "0.04:x", "0.04:2e-3:dense", "0:2e-3"):
        with pytest.raises(SystemExit):
            optim_steps.main(["--dry", "--out", str(out), "--normuon-lrs", bad])
    assert "NORMUON_LR:LR" in capsys.readouterr().err
