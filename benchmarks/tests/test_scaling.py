"""benchmarks/scaling_table.py, the summary of benchmarks/scaling.sh, on synthetic tensorboard
events and console logs (the script itself is checked end to end on CPU with DRY=1, see its header)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench
REPO = Path(__file__).resolve().parents[2]


def write_tb(folder: Path, steps, loss_of_step, tps: float, opt_pct: float) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder / "tb" / "20261129-0000"))
    for s in steps:
        for tag, value in {
            "loss_metrics/global_avg_loss": loss_of_step(s),
            "throughput(tps)": tps if s > 2 else 10.0,  # warm-up steps are left out
            "time_metrics/end_to_end(s)": 0.5,
            "time_metrics/optimizer_step(s)": 0.005 * opt_pct,
            "time_metrics/optimizer_step(%)": opt_pct,
            # the container's parts: NorMuon 30 %, CautiousAdamW 60 % of its step
            "time_metrics/optimizer_step_normuon(s)": 0.3 * 0.005 * opt_pct,
            "time_metrics/optimizer_step_normuon(%)": 0.3 * opt_pct,
            "time_metrics/optimizer_step_cautious_adamw(s)": 0.6 * 0.005 * opt_pct,
            "memory/max_reserved(GiB)": 30.0 + s,
            "memory/max_active(GiB)": 20.0,
            "optimizer/skipped_steps": 0.0,
        }.items():
            writer.add_scalar(tag, value, s)
    writer.close()


def write_log(path: Path, steps, loss_of_step, tps: float, *, local=4, global_=8, accum=1,
              extra: str = "") -> None:
    lines = ["[rank0]:[titan] 2026-11-29 10:00:00,000 - root - INFO - Starting job: HyMo 750m",
             f"[rank0]:[titan] 2026-11-29 10:00:01,000 - root - INFO - Training starts at step "
             f"{steps[0]}, with local batch size {local}, global batch size {global_}, gradient "
             f"accumulation steps {accum}, sequence length 4096, total steps {steps[-1]}"]
    if extra:
        lines.append(f"[rank0]:[titan] 2026-11-29 10:00:01,500 - root - WARNING - {extra}")
    for i, s in enumerate(steps):
        lines.append(f"[rank0]:[titan] 2026-11-29 10:01:{30 + i:02d},000 - root - INFO - "
                     f"step: {s:2}  loss: {loss_of_step(s):8.5f}  grad_norm:  1.0000  "
                     f"memory: {40.0:5.2f}GiB(30.00%)  tps: {round(tps):,}  "
                     "tflops: 1.00  mfu: 1.00%")
    path.write_text("\n".join(lines) + "\n")


def table(tmp_path, *args):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scaling_table", "--warmup", "2",
                           "--save-step", "6", "--save-ngpu", "2",
                           "--json", str(tmp_path / "scalars.json"), *args],
                          cwd=REPO, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def write_resumed(tmp_path, name, loss, extra):
    """A run resumed on 1 GPU at steps 7-8 (2 microbatches), its log saying how the data resumed."""
    write_tb(tmp_path / name, (7, 8), loss, tps=950.0, opt_pct=1.0)
    write_log(tmp_path / f"{name}.log", [7, 8], loss, 950.0, accum=2, extra=extra)


def test_scaling_rows_and_resume_comparison(tmp_path):
    ref_loss = lambda s: 12.0 - 0.1 * s  # noqa: E731
    write_tb(tmp_path / "s2", range(1, 9), ref_loss, tps=900.0, opt_pct=2.0)
    write_log(tmp_path / "s2.log", list(range(1, 9)), ref_loss, 900.0)
    write_tb(tmp_path / "s1", range(1, 7), ref_loss, tps=1000.0, opt_pct=4.0)
    write_log(tmp_path / "s1.log", list(range(1, 7)), ref_loss, 1000.0, global_=4)
    # the resumed run: steps 7-8, 0.1 above the reference, other data (the fallback warning)
    res_loss = lambda s: ref_loss(s) + 0.1  # noqa: E731
    write_resumed(tmp_path, "r1", res_loss,
                  extra="Resuming with 1 data-parallel ranks from a checkpoint of 2: the exact data "
                        "position cannot carry over. Each rank restarts its shard and skips its "
                        "share of the 48 sequences consumed so far (48 on rank 0), i.e. continues")
    rc, out = table(tmp_path, "--scale", "2", str(tmp_path / "s2"), str(tmp_path / "s2.log"),
                    "--scale", "1", str(tmp_path / "s1"), str(tmp_path / "s1.log"),
                    "--resume", "1", str(tmp_path / "r1"), str(tmp_path / "r1.log"))
    assert rc == 0, out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("1", "2")}
    # GPUs batch steps 1st tok/s eff step opt opt% NorMuon NM% AdamW peak active loss@6 skipped
    assert rows["1"][1:] == ["4x4096", "6", "90s", "1,000", "100.0%", "0.500", "20.0", "4.0",
                             "6.0", "1.2", "12.0", "36.00", "20.00", "11.4000", "0"]
    assert rows["2"][2] == "8" and rows["2"][4:9] == ["900", "90.0%", "0.500", "10.0", "2.0"]
    assert "means over steps 3-6" in out
    assert "step   7: reference 11.3000  resumed 11.4000  dloss +0.1000" in out
    assert "max |dloss| 0.1000, mean dloss +0.1000" in out
    assert "reads OTHER sequences" in out and "48 sequences consumed so far" in out
    assert "verdict: within tolerance" in out  # 0.1 / 11.3 < 3 %
    assert "local batch 4, global 8, 2 microbatch(es)" in out
    dump = json.loads((tmp_path / "scalars.json").read_text())
    assert set(dump) == {"scale_1gpu", "scale_2gpu", "resume_2to1gpu"}
    assert dump["resume_2to1gpu"]["comparison"]["steps"] == [7, 8]

    # a larger jump is outside the tolerance, and the exit code says so
    rc, out = table(tmp_path, "--rel-tol-data", "0.005",
                    "--scale", "2", str(tmp_path / "s2"), str(tmp_path / "s2.log"),
                    "--resume", "1", str(tmp_path / "r1"), str(tmp_path / "r1.log"))
    assert rc == 1 and "verdict: OUTSIDE tolerance" in out

    # a resume that trains differently: every step within the per-step tolerance, but the
    # loss falls 0.5 more than the reference's over the continued steps (the trend catches it)
    fast = lambda s: ref_loss(s) - 0.5 * (s - 7)  # noqa: E731
    write_resumed(tmp_path, "r2", fast,
                  extra="Resuming with 1 data-parallel ranks from a checkpoint of 2: the epoch in "
                        "progress continues with the documents no rank has read yet (254 on rank "
                        "0, in 2 range(s)); the old ranks' buffered partial sequences are dropped")
    rc, out = table(tmp_path, "--scale", "2", str(tmp_path / "s2"), str(tmp_path / "s2.log"),
                    "--resume", "1", str(tmp_path / "r2"), str(tmp_path / "r2.log"))
    assert rc == 1 and "verdict: OUTSIDE tolerance" in out, out
    assert "the resumed loss moved -0.5000 more than the reference's" in out
    assert "no rank has read yet (254 on rank 0, in 2 range(s))" in out


def test_log_fills_in_a_run_without_tensorboard_and_missing_runs_are_named(tmp_path):
    """A run cut before its events were written still gets loss, tokens/s and memory from its
    log; step time from the log's timestamps; a run that never started is reported, not fatal."""
    loss = lambda s: 10.0  # noqa: E731
    write_log(tmp_path / "s2.log", list(range(1, 5)), loss, 1234.0)
    rc, out = table(tmp_path, "--scale", "2", str(tmp_path / "nothing"), str(tmp_path / "s2.log"),
                    "--scale", "1", str(tmp_path / "nothing"), str(tmp_path / "missing.log"),
                    "--resume", "1", str(tmp_path / "nothing"), str(tmp_path / "missing.log"))
    assert rc == 1
    row = next(line.split() for line in out.splitlines() if line.startswith("   2"))
    assert row[4] == "1,234" and row[6] == "1.000" and row[9] == "-" and row[12] == "40.00"
    assert "NOTE: only 2 timed steps (4 logged, tensorboard 0)" in out
    assert "1  no step logged" in out
    assert "on 1 GPU(s): not run" in out


def test_script_parses():
    subprocess.run(["bash", "-n", "benchmarks/scaling.sh"], cwd=REPO, check=True)


def test_config_batch_row_reports_the_optimizer_share_of_an_accumulated_step(tmp_path):
    loss = lambda s: 11.0  # noqa: E731
    write_tb(tmp_path / "c2", range(1, 5), loss, tps=950.0, opt_pct=0.5)
    write_log(tmp_path / "c2.log", list(range(1, 5)), loss, 950.0, local=4, global_=128, accum=16)
    rc, out = table(tmp_path, "--config-batch", "2", str(tmp_path / "c2"), str(tmp_path / "c2.log"))
    assert rc == 0, out
    assert ("The config's own batch on 2 GPU(s): local 4, global 128, 16 microbatch(es) per "
            "step; means over steps 2-4:") in out
    # opt 0.005 s per % -> 2.5 ms; NorMuon 30 % of it (0.15 % of the step); CautiousAdamW 60 %
    assert ("optimizer step 2.5 ms (0.50 %), NorMuon 0.8 ms (0.15 % of the step), "
            "CautiousAdamW 1.5 ms") in out
    # a run that logged fewer than 2 steps is named and fails the table
    write_log(tmp_path / "c1.log", [1], loss, 950.0)
    rc, out = table(tmp_path, "--config-batch", "1", str(tmp_path / "none"), str(tmp_path / "c1.log"))
    assert rc == 1 and "on 1 GPU(s): fewer than 2 steps logged" in out
