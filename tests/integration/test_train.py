"""End-to-end CPU runs through run_train.sh: TorchTitan's Trainer, HyMo's TrainSpec, FSDP2 over
gloo, DCP checkpoints, tensorboard. A few steps each; the debug config is the base.

Each entry of OVERRIDES (TorchTitan's integration-test style) is one run: a name, the number
of processes and the CLI overrides on top of train_configs/debug_model.toml.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CONFIG = "train_configs/debug_model.toml"

# Every logged step must carry these (the debug model has MoE and two MTP heads).
REQUIRED_TAGS = {
    "loss_metrics/global_avg_loss", "loss_metrics/main_ce", "loss_metrics/mtp_1_ce",
    "loss_metrics/mtp_2_ce", "lr", "grad_norm", "throughput(tps)", "moe/max_load",
    "moe/min_load", "moe/dropped_frac",
}

pytestmark = pytest.mark.slow


@dataclass
class OverrideDefinitions:
    name: str
    ngpu: int
    overrides: tuple[str, ...] = ()


OVERRIDES = [
    # one process: FSDP2 on the 1-rank mesh; full AC (MoE blocks re-run in backward, so the
    # routed/dropped counters double: the logged ratios must not); validation on the held-out split
    OverrideDefinitions("1proc_full_ac_validation", 1, (
        "--activation_checkpoint.mode", "full", "--training.steps", "3",
        "--checkpoint.interval", "2", "--validation.freq", "2", "--validation.steps", "1")),
]


@pytest.fixture(scope="module", autouse=True)
def prepared_data():
    missing = [p for p in ("data/brown/train.parquet", "assets/tokenizer/tokenizer.json")
               if not (REPO / p).exists()]
    if missing:
        pytest.fail(f"{missing} missing: run `python -m hymo_recipes.data.prepare` "
                    "(or ./scripts/setup.sh) in the repository root first")


def run_train(dump_folder: Path, ngpu: int, *overrides: str) -> str:
    env = dict(os.environ, NGPU=str(ngpu), CONFIG_FILE=CONFIG)
    # torchrun and python3 of this interpreter's environment, activated or not
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(["./run_train.sh", "--job.dump_folder", str(dump_folder), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"run_train.sh failed ({proc.returncode}):\n{output[-6000:]}"
    return output


def read_scalars(dump_folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} over every tensorboard event file of the run (a resumed run
    writes a second file)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for events in sorted((dump_folder / "tb").rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return scalars


def load_checkpoint(step_dir: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@pytest.mark.parametrize("case", OVERRIDES, ids=lambda c: c.name)
def test_train(case, tmp_path):
    run_train(tmp_path, case.ngpu, *case.overrides)
    scalars = read_scalars(tmp_path)
    assert REQUIRED_TAGS <= scalars.keys()
    steps = int(case.overrides[case.overrides.index("--training.steps") + 1])
    assert sorted(scalars["loss_metrics/global_avg_loss"]) == list(range(1, steps + 1))
    assert all(v == v and v < 20 for v in scalars["loss_metrics/global_avg_loss"].values())
    # with AC the counters double; shares stay shares: some expert is at or above the mean
    assert all(1.0 <= v <= 8.0 for v in scalars["moe/max_load"].values())
    assert all(0.0 <= v < 1.0 for v in scalars["moe/dropped_frac"].values())
    assert set(scalars["validation_metrics/loss"]) == {1, 2}  # step 1 and every freq-th
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2", f"step-{steps}"]


# Two processes, 4 steps; total_steps pins the lr schedule, which otherwise follows
# --training.steps (the stopped run trains only 2 of the 4).
TWO_PROCESS = ("--lr_scheduler.total_steps", "4", "--validation.freq", "2",
               "--validation.steps", "1")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted 2-process run the other runs must reproduce."""
    folder = tmp_path_factory.mktemp("reference")
    run_train(folder, 2, *TWO_PROCESS, "--training.steps", "4")
    return folder, read_scalars(folder)


def assert_same_training_metrics(a, b):
    assert REQUIRED_TAGS <= a.keys()
    for tag in REQUIRED_TAGS - {"throughput(tps)"}:
        assert a[tag] == b[tag], tag  # exact float equality, every step


def test_two_process_stop_and_resume_is_bitwise(reference_run, tmp_path):
    """Steps 1-4 in one go == steps 1-2, stop, resume from the step-2 checkpoint, steps 3-4:
    every logged number and every tensor of the final checkpoint (model, optimizer state,
    MoE balancing buffers) are bitwise equal. Validation at step 2 must not disturb it."""
    full, full_scalars = reference_run
    stopped = tmp_path / "stopped"
    run_train(stopped, 2, *TWO_PROCESS, "--training.steps", "2")
    resumed_log = run_train(stopped, 2, *TWO_PROCESS, "--training.steps", "4")
    assert "Training starts at step 3" in resumed_log
    assert_same_training_metrics(full_scalars, read_scalars(stopped))

    ckpt_a = flatten(load_checkpoint(full / "checkpoint" / "step-4", tmp_path))
    ckpt_b = flatten(load_checkpoint(stopped / "checkpoint" / "step-4", tmp_path))
    assert ckpt_a.keys() == ckpt_b.keys()
    assert any(k.endswith("moe.expert_bias") for k in ckpt_a)
    assert any(k.startswith("optimizer.state.") for k in ckpt_a)
    for key, value in ckpt_a.items():
        if torch.is_tensor(value):
            assert torch.equal(value, ckpt_b[key]), key
        else:
            assert value == ckpt_b[key], key


def test_selective_activation_checkpointing_changes_no_number(reference_run, tmp_path):
    """Per-op selective AC recomputes part of the forward in backward; on CPU the recomputed
    values are bitwise the originals, so every logged number matches the reference run."""
    run_train(tmp_path, 2, *TWO_PROCESS, "--training.steps", "4",
              "--activation_checkpoint.mode", "selective",
              "--activation_checkpoint.selective_ac_option", "op", "--checkpoint.no-enable")
    assert_same_training_metrics(reference_run[1], read_scalars(tmp_path))
