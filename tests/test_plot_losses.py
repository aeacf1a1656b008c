"""``python -m hymo_recipes.plot_losses``: loss curves from tensorboard event files written the
way TorchTitan writes them (torch's SummaryWriter, one folder per launch under
``<dump_folder>/tb``), a PNG out, and bad input in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from hymo_recipes import plot_losses

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _launch(folder: Path, steps: range, start_time: float, offset: float = 0.0, validate_every: int = 5,
            tags: tuple[str, ...] = ("loss_metrics/main_ce", "loss_metrics/mtp_1_ce", "loss_metrics/mtp_2_ce")) -> None:
    """One launch's event file: the tags HyMo logs per step, and the held-out loss every few steps."""
    writer = SummaryWriter(str(folder))
    for i, step in enumerate(steps):
        wall = start_time + i
        for k, tag in enumerate(tags):
            writer.add_scalar(tag, 9.0 - 0.05 * step + 0.1 * k + offset, step, walltime=wall)
        writer.add_scalar("loss_metrics/global_avg_loss", 12.0 - 0.05 * step + offset, step, walltime=wall)
        if step % validate_every == 0:
            writer.add_scalar("validation_metrics/loss", 9.2 - 0.05 * step + offset, step, walltime=wall)
    writer.close()


def test_a_resumed_run_is_merged_and_plotted(tmp_path, capsys):
    dump = tmp_path / "run"
    # the first launch logged steps 1-12, the second resumed from step 10's checkpoint
    _launch(dump / "tb" / "20260101-0100", range(10, 21), start_time=2000.0, offset=0.5)
    _launch(dump / "tb" / "20260101-0000", range(1, 13), start_time=1000.0)
    files = plot_losses.event_files(str(dump))
    assert len(files) == 2
    scalars = plot_losses.read_scalars(files)
    main = scalars["loss_metrics/main_ce"]
    assert sorted(main) == list(range(1, 21))
    assert main[9] == pytest.approx(9.0 - 0.45)  # only the first launch logged it
    assert main[11] == pytest.approx(9.0 - 0.55 + 0.5)  # both did: the later launch's value
    lines = plot_losses.curves(scalars, objective=False)
    assert [tag for tag, _, _ in lines] == ["loss_metrics/main_ce", "loss_metrics/mtp_1_ce", "loss_metrics/mtp_2_ce",
                                            "validation_metrics/loss"]
    out = tmp_path / "plots" / "loss.png"
    assert plot_losses.main([str(dump), "-o", str(out), "--objective"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    err = capsys.readouterr().err
    assert err.startswith(f"plot_losses: wrote {out} from 2 event file(s); last values: training loss ")
    assert "MTP head 2 " in err and "held-out loss " in err and "training objective " in err


def test_the_command_writes_a_png_from_a_tensorboard_folder(tmp_path):
    _launch(tmp_path / "tb" / "20260101-0000" / "rank_0", range(1, 6), start_time=1000.0)
    _launch(tmp_path / "tb" / "20260101-0000" / "rank_1", range(1, 6), start_time=1000.0, offset=3.0)
    files = plot_losses.event_files(str(tmp_path / "tb"))
    assert len(files) == 1 and "rank_0" in files[0]  # the losses are global: the lowest rank's files only
    out = tmp_path / "loss.png"
    run = subprocess.run([sys.executable, "-m", "hymo_recipes.plot_losses", str(tmp_path / "tb"), "-o", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC


def _one_line_error(argv, capsys) -> str:
    assert plot_losses.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("plot_losses: error: "), err
    return err.strip()


def test_bad_input_fails_in_one_line(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    (empty / "checkpoint" / "step-2").mkdir(parents=True)
    assert _one_line_error([str(empty), "-o", str(tmp_path / "x.png")], capsys) == (
        f"plot_losses: error: no tensorboard event files (events.out.tfevents.*) under {empty}: was the run started "
        "with [metrics] enable_tensorboard = true?")
    assert not (tmp_path / "x.png").exists()
    assert _one_line_error([str(tmp_path / "missing")], capsys) == f"plot_losses: error: {tmp_path / 'missing'} does not exist"
    other = tmp_path / "other"
    _launch(other, range(1, 4), start_time=1000.0, tags=("accuracy",))  # no head's loss, no validation step
    assert "hold none of the loss tags" in _one_line_error([str(other)], capsys)
    assert "the following arguments are required: path" in _one_line_error([], capsys)
    # no matplotlib: the install command, in one line
    good = tmp_path / "good"
    _launch(good, range(1, 4), start_time=1000.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert _one_line_error([str(good), "-o", str(tmp_path / "y.png")], capsys) == (
        "plot_losses: error: matplotlib is not installed: pip install 'hymo-recipes[plot]' (or pip install matplotlib)")
