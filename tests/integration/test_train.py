"""End-to-end CPU runs through run_train.sh: TorchTitan's Trainer, HyMo's TrainSpec, FSDP2 over
gloo, DCP checkpoints, tensorboard. A few steps each; the debug config is the base.

Each entry of OVERRIDES (TorchTitan's integration-test style) is one run: a name, the number
of processes and the CLI overrides on top of train_configs/debug_model.toml.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CONFIG = "train_configs/debug_model.toml"

# Every logged step must carry these (the debug model has MoE and two MTP heads; NorMuon +
# CautiousAdamW by default).
TIMING_TAGS = {"throughput(tps)", "time_metrics/optimizer_step(s)",
               "time_metrics/optimizer_step(%)"}
REQUIRED_TAGS = {
    "loss_metrics/global_avg_loss", "loss_metrics/main_ce", "loss_metrics/mtp_1_ce",
    "loss_metrics/mtp_2_ce", "lr", "grad_norm", "moe/max_load", "moe/min_load",
    "moe/dropped_frac", "lr/NorMuon", "lr/CautiousAdamW", "optimizer/skipped_steps",
} | TIMING_TAGS

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


def run_train(dump_folder: Path, ngpu: int, *overrides: str, fails: bool = False) -> str:
    env = dict(os.environ, NGPU=str(ngpu), CONFIG_FILE=CONFIG)
    # torchrun and python3 of this interpreter's environment, activated or not
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(["./run_train.sh", "--job.dump_folder", str(dump_folder), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if fails:
        assert proc.returncode != 0, f"run_train.sh should have failed:\n{output[-6000:]}"
    else:
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
    # recomputing the blocks in backward changes no logged number (bitwise on the CPU), the
    # MoE load shares included, though their counters see every block twice
    plain = tmp_path / "no_ac"
    run_train(plain, case.ngpu, *case.overrides, "--activation_checkpoint.mode", "none", "--checkpoint.no-enable")
    assert_same_training_metrics(scalars, read_scalars(plain))
    assert scalars["validation_metrics/loss"] == read_scalars(plain)["validation_metrics/loss"]


# A schedule whose lr moves every step (factors 0.5, 1, 0.525, 0.05 over 4 steps; 1/3, 2/3, 1, 0.68,
# 0.37, 0.05 over 6), so that a schedule that restarted or did not wait shows in the logged lr.
# TorchTitan logs at step k the lr after that step's scheduler step, i.e. step k + 1's.
MOVING_LR = ("--lr_scheduler.warmup_fraction", "0.5", "--lr_scheduler.stable_fraction", "0",
             "--lr_scheduler.decay_fraction", "0.5")
# Two processes, 4 steps; total_steps pins the lr schedule, which otherwise follows
# --training.steps (the stopped run trains only 2 of the 4).
TWO_PROCESS = ("--lr_scheduler.total_steps", "4", "--validation.freq", "2",
               "--validation.steps", "1", *MOVING_LR)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted 2-process run the other runs must reproduce."""
    folder = tmp_path_factory.mktemp("reference")
    run_train(folder, 2, *TWO_PROCESS, "--training.steps", "4")
    return folder, read_scalars(folder)


# One process, two microbatches per step, 3 steps: the one-rank runs' common arguments.
ONE_RANK_TWO_MICROBATCHES = ("--training.steps", "3", "--training.global_batch_size", "8", "--validation.no-enable",
                             "--checkpoint.no-enable", *MOVING_LR)


@pytest.fixture(scope="module")
def one_rank_default_run(tmp_path_factory):
    """(log, scalars) of the debug config on one process with ONE_RANK_TWO_MICROBATCHES and every
    other setting as shipped: the plain run of the one-rank comparisons below (run once)."""
    folder = tmp_path_factory.mktemp("one_rank_default")
    log = run_train(folder, 1, *ONE_RANK_TWO_MICROBATCHES)
    return log, read_scalars(folder)


def assert_same_training_metrics(a, b):
    assert REQUIRED_TAGS <= a.keys()
    for tag in REQUIRED_TAGS - TIMING_TAGS:
        assert a[tag] == b[tag], tag  # exact float equality, every step


def assert_same_tensors(a: dict, b: dict, skip=()) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if key.startswith(tuple(skip)):
            continue
        if torch.is_tensor(value):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def test_two_process_stop_and_resume_is_bitwise(reference_run, tmp_path):
    """Steps 1-4 in one go == steps 1-2, stop, resume from the step-2 checkpoint, steps 3-4:
    every logged number and every tensor of the final checkpoint (model, NorMuon and
    CautiousAdamW state, both schedulers, MoE balancing buffers) are bitwise equal. Validation
    at step 2 must not disturb it.

    Then the same step-2 checkpoint resumed by ONE process (same global batch: 2 microbatches
    of 4), next to a half-written step-3 folder that must be ignored: model and optimizer state
    reshard, the lr schedule continues, and the data position takes the documented fallback
    (hymo_recipes/titan/dataloader.py) with a warning."""
    full, full_scalars = reference_run
    stopped, shrunk = tmp_path / "stopped", tmp_path / "shrunk"
    run_train(stopped, 2, *TWO_PROCESS, "--training.steps", "2")
    shutil.copytree(stopped / "checkpoint" / "step-2", shrunk / "checkpoint" / "step-2")
    resumed_log = run_train(stopped, 2, *TWO_PROCESS, "--training.steps", "4")
    assert "Training starts at step 3" in resumed_log
    assert_same_training_metrics(full_scalars, read_scalars(stopped))

    ckpt_a = flatten(load_checkpoint(full / "checkpoint" / "step-4", tmp_path))
    ckpt_b = flatten(load_checkpoint(stopped / "checkpoint" / "step-4", tmp_path))
    assert any(k.endswith("moe.expert_bias") for k in ckpt_a)
    assert any(k.endswith("momentum_buffer") for k in ckpt_a)  # NorMuon's state
    assert any(k.endswith("exp_avg_sq") for k in ckpt_a)  # CautiousAdamW's state
    assert {"lr_scheduler.normuon.last_epoch",
            "lr_scheduler.cautious_adamw.last_epoch"} <= ckpt_a.keys()
    assert_same_tensors(ckpt_a, ckpt_b)

    # A save killed midway leaves a step folder without .metadata (DCP writes that file last,
    # via a temporary file and a rename); TorchTitan resumes only from folders that have one.
    half = shrunk / "checkpoint" / "step-3"
    half.mkdir()
    shutil.copy(stopped / "checkpoint" / "step-4" / "__0_0.distcp", half / "__0_0.distcp")
    shrunk_log = run_train(shrunk, 1, *TWO_PROCESS, "--training.steps", "4",
                           "--training.global_batch_size", "8", "--validation.no-enable")
    assert "Training starts at step 3" in shrunk_log
    # the epoch continues on the documents neither of the 2 ranks read (tests/test_dataloader.py)
    assert ("Resuming with 1 data-parallel ranks from a checkpoint of 2" in shrunk_log
            and "continues with the documents no rank has read yet" in shrunk_log), \
        shrunk_log[-3000:]
    assert "gradient accumulation steps 2" in shrunk_log
    shrunk_scalars = read_scalars(shrunk)
    for tag in ("lr/NorMuon", "lr/CautiousAdamW"):  # the schedule continues at step 3
        # a restarted schedule would log at step 3 what the full run logged at step 1
        assert full_scalars[tag][3] != full_scalars[tag][1], full_scalars[tag]
        assert shrunk_scalars[tag] == {s: full_scalars[tag][s] for s in (3, 4)}, tag
    losses = shrunk_scalars["loss_metrics/global_avg_loss"]
    assert sorted(losses) == [3, 4] and all(v < 20 for v in losses.values())
    ckpt_c = flatten(load_checkpoint(shrunk / "checkpoint" / "step-4", tmp_path))
    assert ckpt_c.keys() == ckpt_a.keys()
    for key in ("lr_scheduler.normuon.last_epoch", "lr_scheduler.cautious_adamw.last_epoch",
                "optimizer.nan_guard.steps_done"):
        assert ckpt_c[key] == ckpt_a[key] == 4, key


def test_selective_activation_checkpointing_changes_no_number(reference_run, tmp_path):
    """Per-op selective AC recomputes part of the forward in backward; on CPU the recomputed
    values are bitwise the originals, so every logged number matches the reference run."""
    run_train(tmp_path, 2, *TWO_PROCESS, "--training.steps", "4",
              "--activation_checkpoint.mode", "selective",
              "--activation_checkpoint.selective_ac_option", "op", "--checkpoint.no-enable")
    assert_same_training_metrics(reference_run[1], read_scalars(tmp_path))


def test_injected_nans_skip_their_steps_and_the_limit_stops_training(tmp_path):
    """One process, a checkpoint after every step, NaN losses injected at steps 2, 4 and 5,
    consecutive_nan_limit 2. Step 2 is skipped and changes nothing (parameters, optimizer
    state, MoE balancing buffers, lr schedule: checkpoint 2 == checkpoint 1 but for the step
    counters and the data position), step 3 trains, step 4 is skipped, step 5 is the second
    skip in a row: training stops with a clear error before step 5 is saved; every checkpoint
    on disk is complete (loadable, with .metadata). That the skip counters survive a resume is
    tests/optim/test_container.py::test_guard_counters_resume_through_dcp."""
    run = tmp_path / "run"
    log = run_train(run, 1, "--training.steps", "6", "--checkpoint.interval", "1",
                    "--validation.no-enable", "--optimizer.inject_nan_steps", "2", "4", "5",
                    "--optimizer.consecutive_nan_limit", "2", *MOVING_LR, fails=True)
    assert "NonFiniteTrainingError: 2 consecutive training steps (through step 5)" in log
    assert "Root Cause (first observed failure)" in log  # a failure during training keeps torchrun's report
    assert "optimizer.consecutive_nan_limit = 2" in log
    assert "step 2: non-finite loss or gradient; optimizer step skipped" in log
    folder = run / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == [f"step-{s}" for s in (1, 2, 3, 4)]
    assert all((folder / f"step-{s}" / ".metadata").is_file() for s in (1, 2, 3, 4))

    scalars = read_scalars(run)
    assert scalars["optimizer/skipped_steps"] == {1: 0, 2: 1, 3: 1, 4: 2}
    losses = scalars["loss_metrics/global_avg_loss"]
    assert [math.isnan(losses[s]) for s in (1, 2, 3, 4)] == [False, True, False, True]
    lr = scalars["lr/NorMuon"]  # the schedule moves every step, but not on a skipped one
    assert lr[1] == lr[2] != lr[3] == lr[4], lr

    ckpt = {s: flatten(load_checkpoint(folder / f"step-{s}", tmp_path)) for s in (1, 2, 3, 4)}
    counters = ("train_state.", "dataloader.", "optimizer.nan_guard.")
    assert any(k.endswith("moe.expert_bias") for k in ckpt[1])
    assert any(k.startswith("lr_scheduler.") for k in ckpt[1])
    assert_same_tensors(ckpt[1], ckpt[2], skip=counters)  # the skipped step 2
    assert_same_tensors(ckpt[3], ckpt[4], skip=counters)  # the skipped step 4
    assert not torch.equal(ckpt[2]["norm.weight"], ckpt[3]["norm.weight"])  # step 3 trained
    assert ckpt[4]["optimizer.nan_guard.skipped_total"] == 2
    assert ckpt[4]["lr_scheduler.normuon.last_epoch"] == 2  # steps 1 and 3 only


def test_document_masking_trains_through_the_loop_and_changes_the_losses(reference_run, tmp_path):
    """The reference run has [hymo] document_masking on (the default): the train step and the
    validator hand each batch's document boundaries to the model (that each document is then
    computed alone: tests/titan/test_documents.py). Turned off, the training losses of the
    steps whose batches hold a document start and every held-out loss differ, and all is
    logged as usual."""
    run_train(tmp_path, 2, *TWO_PROCESS, "--training.steps", "4", "--hymo.no-document_masking",
              "--checkpoint.no-enable")
    plain, masked = read_scalars(tmp_path), reference_run[1]
    assert REQUIRED_TAGS <= plain.keys()
    losses = plain["loss_metrics/global_avg_loss"]
    assert sorted(losses) == [1, 2, 3, 4] and all(v < 20 for v in losses.values())
    # step 1's rows hold no document start (its loss is the reference's); later steps' do
    assert any(v != masked["loss_metrics/global_avg_loss"][s] for s, v in losses.items())
    held_out = plain["validation_metrics/loss"]
    assert held_out and set(held_out) <= set(masked["validation_metrics/loss"])
    assert all(masked["validation_metrics/loss"][s] != v for s, v in held_out.items())


def test_fsdp_knobs_on_one_rank(tmp_path, one_rank_default_run):
    """Two microbatches per step. With [hymo] fsdp_sync_once_per_step the first microbatch's
    gradients stay in FSDP's unsharded accumulator and only the last one reduce-scatters; on one
    rank the sums are the same additions in the same order, so every logged number is bitwise
    the plain run's (a lost or doubled microbatch would change the loss from step 2 on).
    With fsdp_units = "model" as well (the root alone, for FSDP's per-block host work; what
    "auto", the default, picks on one rank): the same
    casts, sums and copies; only the order in which autograd adds the tied embedding's gradient
    from its uses may change (FSDP's hooks sit elsewhere in the graph), so the runs agree to
    float32 rounding (assert_agree_to_rounding)."""
    args = ONE_RANK_TWO_MICROBATCHES
    log = run_train(tmp_path / "plain", 1, *args, "--hymo.fsdp_units", "block")
    assert "gradient accumulation steps 2" in log and "(block units)" in log
    plain = read_scalars(tmp_path / "plain")
    run_train(tmp_path / "once", 1, *args, "--hymo.fsdp_units", "block", "--hymo.fsdp_sync_once_per_step")
    assert_same_training_metrics(plain, read_scalars(tmp_path / "once"))
    # the default on one rank ("auto"): the root alone, gradients reduced once per step
    log, model = one_rank_default_run
    assert "(model units, gradients reduced once per step)" in log
    assert_agree_to_rounding(plain, model)


def assert_agree_to_rounding(a: dict, b: dict) -> None:
    """Two runs that compute the same sums in another order: every logged loss, norm and lr
    agrees to float32 rounding (relative 1e-4) up to the first step whose MoE loads differ
    (rounding flipped a routing choice, whose effect then grows), and to 2e-3 from it on. Step 1
    must be before it (its forward is the same: only its backward's sums are ordered otherwise)."""
    assert REQUIRED_TAGS <= b.keys()
    moe = [t for t in REQUIRED_TAGS if t.startswith("moe/")]
    steps = sorted(a["loss_metrics/global_avg_loss"])
    flip = next((s for s in steps if any(a[t][s] != b[t][s] for t in moe)), math.inf)
    assert flip > 1, "the MoE loads of step 1 differ: its forward was not the same"
    for tag in {t for t in REQUIRED_TAGS - TIMING_TAGS if t not in moe}:
        assert a[tag].keys() == b[tag].keys() == set(steps), tag
        for step, value in a[tag].items():
            tol = 1e-4 if step < flip else 2e-3
            assert math.isclose(value, b[tag][step], rel_tol=tol, abs_tol=1e-6), (tag, step, value, b[tag][step])


def test_fused_loss_through_the_train_loop(tmp_path, one_rank_default_run):
    """The debug model trains with full logits (fused_loss_chunk 0); with the chunked readout +
    cross-entropy (the GPU flavors' path: the labels go to the model, which returns the heads'
    sums) every logged loss, per-head cross-entropy, norm and lr agrees to float32 rounding over
    steps of two microbatches (assert_agree_to_rounding), so its gradients are the same (one off
    by a scale or a head would show in step 1's grad norm). Chunks of 100 tokens do not divide a
    microbatch."""
    plain = one_rank_default_run[1]
    run_train(tmp_path / "fused", 1, *ONE_RANK_TWO_MICROBATCHES, "--hymo.fused_loss_chunk", "100")
    fused = read_scalars(tmp_path / "fused")
    assert_agree_to_rounding(plain, fused)
    # ... and it did run the other path: the chunked sums round differently somewhere
    assert any(plain[t][s] != fused[t][s] for t in ("loss_metrics/main_ce", "loss_metrics/mtp_1_ce",
                                                    "grad_norm") for s in plain[t])


def test_the_paced_prefetch_changes_no_number(tmp_path):
    """Four microbatches per step, their batches read on the prefetch thread one per microbatch
    the train step launched (hymo_recipes/titan/prefetch.py) or on the training thread: the same
    batches in the same order, so every logged number is bitwise the same."""
    args = ("--training.steps", "3", "--training.global_batch_size", "16", "--validation.no-enable",
            "--checkpoint.no-enable", *MOVING_LR)
    log = run_train(tmp_path / "paced", 1, *args)
    assert "gradient accumulation steps 4" in log
    run_train(tmp_path / "plain", 1, *args, "--hymo.no-data_prefetch")
    assert_same_training_metrics(read_scalars(tmp_path / "plain"), read_scalars(tmp_path / "paced"))
