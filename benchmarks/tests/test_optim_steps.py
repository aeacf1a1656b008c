"""benchmarks/optim_steps.py: the steps-needed arithmetic, and the CPU dry mode end to end with its resume."""

import json

import pytest

from benchmarks import optim_steps


def test_trailing_mean():
    assert optim_steps.trailing_mean([5.0, 4.0, 3.0, 2.0, 1.0], 2) == [5.0, 4.5, 3.5, 2.5, 1.5]


def _run(recipe, seed, heldout, steps=20, final=None):
    return dict(recipe._asdict(), run_steps=steps, seed=seed, curve=[heldout] * steps,
                final=heldout if final is None else final, heldout=heldout, seconds=1.0)


def _normuon(normuon_lr, lr, moe=False):
    return optim_steps.Recipe("NorMuon", lr, normuon_lr, moe)


def test_verdict_is_the_shortest_run_at_adamws_held_out_loss():
    # 20 steps. AdamW at its best lr (2e-3) ends at held-out ~5.0; the tuned NorMuon recipe (its
    # lrs set apart, the MoE on NorMuon) at 4.6 after 20 steps, 4.9 after 14 and 5.2 after 10 (per-seed
    # values around those means); the seed's recipe never gets there
    adamw = optim_steps.Recipe("AdamW", 2e-3)
    tuned = _normuon(0.04, 2e-3, moe=True)
    results = [_run(optim_steps.Recipe("AdamW", 1e-3), s, 5.5) for s in (0, 1)]
    results += [_run(adamw, 0, 4.95), _run(adamw, 1, 5.05)]
    results += [_run(tuned, s, 4.6 + 0.1 * s) for s in (0, 1)]
    results += [_run(_normuon(0.04, 2e-3), 0, 4.9)]  # the same lrs, the MoE on CautiousAdamW: not the best
    results += [_run(optim_steps.SHIPPED, s, 5.3) for s in (0, 1)]
    results += [_run(optim_steps.SEED, s, 6.0) for s in (0, 1)]
    results += [_run(tuned, 0, 4.85, steps=14), _run(tuned, 1, 4.95, steps=14)]
    results += [_run(tuned, 0, 5.15, steps=10), _run(tuned, 1, 5.25, steps=10)]
    v = optim_steps.verdict(results, [0, 1], 20, [10, 14])
    assert v["adamw"]["recipe"] == adamw and v["normuon"]["recipe"] == tuned
    assert v["shipped"]["recipe"] == optim_steps.SHIPPED and v["seed"]["recipe"] == optim_steps.SEED
    assert v["seed"]["heldout"] == pytest.approx(6.0)
    assert v["target"] == pytest.approx(5.0)
    assert [round(v["lengths"][n]["heldout"], 6) for n in (10, 14, 20)] == [5.2, 4.9, 4.65]
    assert v["needed"] == 14 and v["ratio"] == pytest.approx(0.7)
    # AdamW better than every NorMuon length: not reached
    slow = [dict(r, heldout=r["heldout"] + 1.0) if r["optimizer"] == "NorMuon" else r for r in results]
    v = optim_steps.verdict(slow, [0, 1], 20, [10, 14])
    assert v["needed"] is None and v["ratio"] is None
    # a shorter run missing: no verdict
    assert optim_steps.verdict(results[:-1], [0, 1], 20, [10, 14]) is None


def test_dry_run_tunes_then_seeds_then_shortens_and_resumes(tmp_path, capsys):
    out = tmp_path / "os"
    code = optim_steps.main(["--dry", "--out", str(out)])
    runs = json.loads(out.with_suffix(".json").read_text())
    keys = [optim_steps.run_key(r) for r in runs]
    shipped, seed = optim_steps.SHIPPED, optim_steps.SEED
    double = _normuon(2 * seed.normuon_lr, 2 * seed.lr, seed.moe_on_normuon)  # --normuon-mults scale the seed's
    tune = {("AdamW", 1e-3, None, False, 12, 0), ("AdamW", 4e-3, None, False, 12, 0), (*shipped, 12, 0),
            (*seed, 12, 0), (*double, 12, 0)}
    assert tune <= set(keys) and len(keys) == len(set(keys))
    best = {n: optim_steps.recipe_of(min((r for r in runs if r["optimizer"] == n and r["seed"] == 0),
                                         key=lambda r: r["final"])) for n in ("AdamW", "NorMuon")}
    seeded = {(*best["AdamW"], 12, 1), (*best["NorMuon"], 12, 1), (*shipped, 12, 1), (*seed, 12, 1)}
    shorter = {(*best["NorMuon"], 6, 0), (*best["NorMuon"], 6, 1)}  # --fractions 0.5 in the dry mode
    assert set(keys) == tune | seeded | shorter
    assert all(len(r["curve"]) == r["run_steps"] and r["machine"].startswith("CPU") for r in runs)
    md = out.with_suffix(".md").read_text()
    v = optim_steps.verdict(runs, [0, 1], 12, [6])
    assert v is not None and "Steps NorMuon + CautiousAdamW (tuned) needs" in md and "| 6 | 0.50 |" in md
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
    """--shard: two processes of one call split each phase; a phase waits until the one before is
    stored (shard 0 first alone: its tuning share only), and the calls of each shard together
    store exactly the runs of one unsharded call."""
    out = tmp_path / "os"
    optim_steps.main(["--dry", "--out", str(out), "--shard", "0/2"])
    first = json.loads(out.with_suffix(".json").read_text())
    assert len(first) == 3 and all(r["seed"] == 0 for r in first)
    assert "the tuning runs of other shards are not all stored yet" in capsys.readouterr().out
    for shard in ("1/2", "0/2", "1/2", "0/2"):
        optim_steps.main(["--dry", "--out", str(out), "--shard", shard])
    runs = json.loads(out.with_suffix(".json").read_text())
    keys = [optim_steps.run_key(r) for r in runs]
    best = {n: optim_steps.recipe_of(min((r for r in runs if r["optimizer"] == n and r["seed"] == 0 and
                                          r["run_steps"] == 12), key=lambda r: r["final"]))
            for n in ("AdamW", "NorMuon")}
    seeded = {(*best["AdamW"], 12, 1), (*best["NorMuon"], 12, 1), (*optim_steps.SHIPPED, 12, 1),
              (*optim_steps.SEED, 12, 1)}
    shorter = {(*best["NorMuon"], 6, 0), (*best["NorMuon"], 6, 1)}
    assert len(keys) == len(set(keys))
    assert set(keys) == {k for k in keys if k[-1] == 0 and k[-2] == 12} | seeded | shorter
    assert len([k for k in keys if k[-1] == 0 and k[-2] == 12]) == 5
    capsys.readouterr()
    optim_steps.main(["--dry", "--out", str(out), "--shard", "1/2"])
    assert "optim_steps: " not in capsys.readouterr().out.split("# ")[0]  # nothing left to run


def test_dry_run_takes_recipes_with_the_lrs_set_apart(tmp_path, capsys):
    """--normuon-lrs (with ':moe') and --cautious-lrs add tuning runs with exactly those settings;
    a malformed pair or fraction is a parser error."""
    out = tmp_path / "os"
    optim_steps.main(["--dry", "--out", str(out), "--steps", "4", "--seeds", "0", "--adamw-lrs", "1e-3",
                      "--normuon-mults", "1", "--normuon-lrs", "0.04:2e-3:moe", "--cautious-lrs", "2e-3"])
    runs = json.loads(out.with_suffix(".json").read_text())
    keys = {optim_steps.run_key(r) for r in runs if r["run_steps"] == 4}
    assert keys == {("AdamW", 1e-3, None, False, 4, 0), (*optim_steps.SHIPPED, 4, 0), (*optim_steps.SEED, 4, 0),
                    ("NorMuon", 2e-3, 0.04, True, 4, 0), ("CautiousAdamW", 2e-3, None, False, 4, 0)}
    md = out.with_suffix(".md").read_text()
    assert "| NorMuon 0.04 + CautiousAdamW 0.002, MoE on NorMuon |" in md and "| CautiousAdamW 0.002 |" in md
    for bad in (["--normuon-lrs", "0.04"], ["--normuon-lrs", "0.04:x"], ["--normuon-lrs", "0.04:2e-3:dense"],
                ["--normuon-lrs", "0:2e-3"], ["--fractions", "1.2"]):
        with pytest.raises(SystemExit):
            optim_steps.main(["--dry", "--out", str(out), *bad])
    err = capsys.readouterr().err
    assert "NORMUON_LR:LR" in err and "--fractions" in err
