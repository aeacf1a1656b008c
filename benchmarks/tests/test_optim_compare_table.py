"""benchmarks/optim_compare_table.py, the summary of benchmarks/optim_compare.sh and
benchmarks/ab_seeds.sh, on synthetic tensorboard events (the scripts are checked on CPU with DRY=1,
see test_ab_seeds.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench
REPO = Path(__file__).resolve().parents[2]


def write_run(folder: Path, steps: int, loss_of_step, opt_pct: float) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder / "tb" / "20261129-0000"))
    for s in range(1, steps + 1):
        for tag, value in {
            "loss_metrics/global_avg_loss": loss_of_step(s),
            "loss_metrics/main_ce": loss_of_step(s) - 1,
            "throughput(tps)": 1000.0 if s > 10 else 10.0,  # warm-up steps are left out
            "time_metrics/end_to_end(s)": 0.2,
            "time_metrics/optimizer_step(s)": 0.002 * opt_pct,
            "time_metrics/optimizer_step(%)": opt_pct,
            "optimizer/skipped_steps": 1.0 if s >= 7 else 0.0,
            "moe/max_load": 2.0,
            "moe/dropped_frac": 0.25,
        }.items():
            writer.add_scalar(tag, value, s)
    writer.close()


def test_table_reports_last_ten_step_means_and_timing(tmp_path):
    write_run(tmp_path / "a", 30, lambda s: float(s), 5.0)  # last 10 steps: 21..30, mean 25.5
    write_run(tmp_path / "b", 30, lambda s: 100.0 - s, 1.0)
    out = subprocess.run([sys.executable, "-m", "benchmarks.optim_compare_table",
                          f"NorMuon={tmp_path / 'a'}", f"AdamW={tmp_path / 'b'}"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "mean over steps 21-30" in out and "mean over steps 11-30" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("NorMuon", "AdamW"))}
    assert rows["NorMuon"][1:5] == ["25.5000", "24.5000", "1,000", "0.200"]
    assert rows["NorMuon"][5:] == ["10.0", "5.0%", "1", "2.00", "0.250"]
    assert rows["AdamW"][1] == "74.5000" and rows["AdamW"][6] == "1.0%"


def test_table_needs_every_step_logged(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb" / "x"))
    for s in (1, 10, 20):
        writer.add_scalar("loss_metrics/global_avg_loss", 1.0, s)
    writer.close()
    with pytest.raises(subprocess.CalledProcessError) as e:
        subprocess.run([sys.executable, "-m", "benchmarks.optim_compare_table", f"x={tmp_path}"],
                       cwd=REPO, capture_output=True, text=True, check=True)
    assert "log_freq 1" in e.value.stderr


def test_seed_labels_get_means_and_paired_differences(tmp_path):
    finals = {("base", "1"): 5.0, ("base", "2"): 6.0, ("try", "1"): 5.5, ("try", "2"): 5.9, ("try", "3"): 9.0}
    args = []
    for (name, seed), final in finals.items():
        write_run(tmp_path / f"{name}{seed}", 12, lambda s, f=final: f, 5.0)
        args.append(f"{name}@{seed}={tmp_path / f'{name}{seed}'}")
    out = subprocess.run([sys.executable, "-m", "benchmarks.optim_compare_table", *args],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    means = {line.split()[0]: line.split()[1:3] for line in out.split("mean over seeds:")[1].splitlines()[1:3]}
    assert means == {"base": ["5.5000", "4.5000"], "try": ["6.8000", "5.8000"]}
    # seed 3 ran only with "try": the paired differences use seeds 1 and 2
    assert "try minus base, final loss per seed: 1: +0.5000, 2: -0.1000; mean +0.2000" in out
    assert "(min -0.1000, max +0.5000); main CE mean +0.2000" in out
