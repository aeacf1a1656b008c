"""Checkpoints that resume safely (hymo_recipes/titan/checkpoints.py) and one run per dump folder
(run_lock.py): each fault injected here must be named in one line, or skipped with a warning.

The fast tests drive ``SaveGuard`` around a stand-in checkpointer that saves with DCP in this
process; the slow ones run ./run_train.sh with two processes."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shim 1 first)
from hymo_recipes.titan import checkpoints, preflight, run_lock
from hymo_recipes.titan.train import parse_config

REPO = Path(__file__).resolve().parents[2]
DEBUG = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")]


class FakeCheckpointer:
    """What SaveGuard uses of TorchTitan's CheckpointManager; saves a small state with DCP."""

    def __init__(self, folder: Path, interval: int = 2, numel: int = 4096):
        self.enable, self.load_only, self.folder, self.interval, self.numel = True, False, str(folder), interval, numel

    def _create_checkpoint_id(self, step, folder=""):
        return os.path.join(folder or self.folder, f"step-{step}")

    def _should_save(self, step, last_step=False):
        return last_step or step % self.interval == 0

    def _find_load_step(self, folder=""):
        return -2

    def save(self, step, last_step=False):
        if self._should_save(step, last_step):
            dcp.save({"w": torch.arange(float(self.numel)) + step, "b": torch.ones(64)},
                     checkpoint_id=self._create_checkpoint_id(step))


class FakeTrainer:
    def __init__(self, ck):
        self.checkpointer, self.device = ck, torch.device("cpu")
        self.should_continue_training = lambda: True


@pytest.fixture(autouse=True)
def restore_signal_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def _config(dump: Path, *extra: str):
    return parse_config(DEBUG + ["--job.dump_folder", str(dump), *extra])


def _train(dump: Path, steps: int, *extra: str, on_signal: bool = False, numel: int = 4096):
    """`steps` steps of a stand-in run (a checkpoint every 2nd step and at the last) through SaveGuard."""
    config = _config(dump, *extra)
    config.hymo.checkpoint_on_signal = on_signal
    ck = FakeCheckpointer(dump / "checkpoint", numel=numel)
    trainer = FakeTrainer(ck)
    guard = checkpoints.SaveGuard(trainer, config).install()
    for step in range(1, steps + 1):
        ck.save(step, last_step=step == steps)
        if not trainer.should_continue_training():
            break
    return guard, trainer, ck


@pytest.fixture
def run_dir(tmp_path):
    dump = tmp_path / "out"
    _train(dump, 4)
    return dump, dump / "checkpoint"


def test_manifest_is_written_last_with_identity_and_checksums(run_dir, caplog):
    dump, folder = run_dir
    for step in (2, 4):
        names = sorted(p.name for p in (folder / f"step-{step}").iterdir())
        assert names == [".metadata", "__0_0.distcp", checkpoints.MANIFEST]  # the marker is gone
        manifest = json.loads((folder / f"step-{step}" / checkpoints.MANIFEST).read_text())
        assert manifest["step"] == step and set(manifest["files"]) == {".metadata", "__0_0.distcp"}
        assert manifest["identity"]["flavor"] == "debugmodel"
        assert manifest["identity"]["tokenizer"]["vocab_size"] == 8192
        assert manifest["identity"]["shape"]["dim"] == 256
    with caplog.at_level("WARNING"):
        _config(dump)  # the preflight checks step-4: nothing to say
    assert "step-" not in caplog.text


def _tokenizer_copy(tmp_path: Path) -> Path:
    """assets/tokenizer with the ids of two tokens swapped: same vocabulary size, other meaning."""
    copy = tmp_path / "tokenizer"
    shutil.copytree(REPO / "assets" / "tokenizer", copy)
    spec = json.loads((copy / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "the", "of"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    return copy


def test_another_tokenizer_of_the_same_size_stops_the_resume(run_dir, tmp_path):
    dump, _ = run_dir
    other = _tokenizer_copy(tmp_path)
    with pytest.raises(SystemExit, match=r"step-4 was trained with tokenizer [0-9a-f]{16} \(vocab 8192, from "
                                         r".*\), this run has [0-9a-f]{16} \(vocab 8192, from .*tokenizer\): point "
                                         r"--model.hf_assets_path at the original or start a new dump folder"):
        _config(dump, "--model.hf_assets_path", str(other))


def test_a_tokenizer_of_another_size_stops_the_resume_in_one_line(run_dir, tmp_path):
    """One more token (vocab 8193): named as a tokenizer change before any embedding shape
    mismatch could surface."""
    dump, _ = run_dir
    bigger = tmp_path / "bigger"
    shutil.copytree(REPO / "assets" / "tokenizer", bigger)
    spec = json.loads((bigger / "tokenizer.json").read_text())
    spec["model"]["vocab"]["zqzqzq"] = len(spec["model"]["vocab"])
    (bigger / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(SystemExit, match=r"step-4 was trained with tokenizer [0-9a-f]{16} \(vocab 8192, from "
                                         r".*\), this run has [0-9a-f]{16} \(vocab 8193, from .*bigger\): point "
                                         r"--model.hf_assets_path at the original"):
        _config(dump, "--model.hf_assets_path", str(bigger))


def test_another_flavor_or_shape_stops_the_resume(run_dir):
    dump, _ = run_dir
    with pytest.raises(SystemExit, match="step-4 was trained with flavor 'debugmodel', this run builds 'small': "
                                         "resume with --model.flavor debugmodel"):
        _config(dump, "--model.flavor", "small", "--hymo.gdn_backend", "torch_chunk")
    with pytest.raises(SystemExit, match=r"step-4 holds a debugmodel model of another shape than this run's "
                                         r"\(vocab_size 8192 vs 9000; checkpoint vs run\)"):
        _config(dump, "--hymo.vocab_size", "9000")


def test_another_mup_base_width_stops_the_resume(run_dir, tmp_path):
    """muP changes no shape, only init, lrs, MLA's softmax scale and the logits: the manifest
    records the base width, and a manifest without it was written with muP off."""
    dump, folder = run_dir
    assert json.loads((folder / "step-4" / checkpoints.MANIFEST).read_text())["identity"]["mup_base_width"] == 0
    with pytest.raises(SystemExit, match=r"step-4 was trained with mup_base_width 0 \(muP off\), this run has "
                                         r"mup_base_width 128: resume with --hymo.mup_base_width 0 \(\[hymo\] "
                                         r"mup_base_width in the TOML\) or start a new dump folder"):
        _config(dump, "--hymo.mup_base_width", "128")
    mup = tmp_path / "mup"
    _train(mup, 2, "--hymo.mup_base_width", "128")
    manifest = mup / "checkpoint" / "step-2" / checkpoints.MANIFEST
    assert json.loads(manifest.read_text())["identity"]["mup_base_width"] == 128
    with pytest.raises(SystemExit, match=r"step-2 was trained with mup_base_width 128, this run has "
                                         r"mup_base_width 0 \(muP off\): resume with --hymo.mup_base_width 128 "):
        _config(mup)
    _config(mup, "--hymo.mup_base_width", "128")  # the same base width resumes
    # a manifest written before the base width was recorded: muP off
    record = json.loads(manifest.read_text())
    del record["identity"]["mup_base_width"]
    manifest.write_text(json.dumps(record))
    _config(mup)
    with pytest.raises(SystemExit, match=r"step-2 was trained with mup_base_width 0 \(muP off\), this run has "
                                         r"mup_base_width 128"):
        _config(mup, "--hymo.mup_base_width", "128")


def test_a_shard_overwritten_at_the_same_length_names_itself_and_the_step_before(run_dir):
    dump, folder = run_dir
    shard = folder / "step-4" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * 16)
    assert shard.stat().st_size == size
    with pytest.raises(SystemExit, match=r"checkpoint .*step-4 is damaged: __0_0.distcp does not match its checksum "
                                         r"in hymo_manifest.json .*--checkpoint.load_step 2 \(whole: 2\)"):
        _config(dump)
    _config(dump, "--checkpoint.load_step", "2")  # the step named is whole


def test_the_ranks_of_a_resume_read_the_files_between_them(run_dir, monkeypatch):
    """Each rank reads the bytes of its share of the files (every world-th of the sorted list):
    an altered file stops the rank whose share holds it, and only that one."""
    dump, folder = run_dir
    step = folder / "step-4"
    files = sorted(json.loads((step / checkpoints.MANIFEST).read_text())["files"])
    assert len(files) >= 2
    victim = step / files[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    config = _config(folder.parent / "elsewhere")  # a config of this run's identity
    for rank, world, caught in [(0, 2, False), (1, 2, True), (0, 1, True)]:
        call = lambda: checkpoints.check_manifest(str(step), config, [2], share=(rank, world))
        if caught:
            with pytest.raises(ValueError, match=f"step-4 is damaged: {files[1]} does not match its checksum"):
                call()
        else:
            call()
    checkpoints.check_manifest(str(step), config, [2], share=None)  # sizes and identity only
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match=f"damaged: {files[1]} does not match"):
        _config(dump)
    monkeypatch.setenv("RANK", "0")
    _config(dump)  # rank 0's share is whole


def test_a_step_without_its_manifest_is_skipped_and_old_checkpoints_still_resume(run_dir, caplog):
    dump, folder = run_dir
    (folder / "step-4" / checkpoints.MANIFEST).unlink()
    with caplog.at_level("WARNING"):
        _config(dump)
    assert "step-4 in" in caplog.text and "no hymo_manifest.json" in caplog.text and "resuming from step-2" in caplog.text
    guard, trainer, ck = _train(dump, 0)
    assert ck._find_load_step() == 2  # what TorchTitan loads
    # a folder where no step has a manifest: written before manifests; the newest resumes, unchecked
    (folder / "step-2" / checkpoints.MANIFEST).unlink()
    caplog.clear()
    with caplog.at_level("WARNING"):
        _config(dump)
    assert "resuming from step-4" in caplog.text and "unchecked" in caplog.text
    assert _train(dump, 0)[2]._find_load_step() == 4


def test_a_checkpoint_without_a_manifest_is_still_compared_by_its_model_shapes(tmp_path, caplog):
    """A checkpoint written before manifests resumes unchecked, but one of another model shape
    (here another vocabulary) stops in one line before the model is built, not in a load error."""
    import copy

    from hymo_recipes.model import HymoModel, hymo_flavors

    dump = tmp_path / "out"
    args = copy.deepcopy(hymo_flavors["debugmodel"])
    args.update_from_config(_config(dump))
    state = {k: v.detach() for k, v in HymoModel(args).state_dict().items()}
    dcp.save(state, checkpoint_id=str(dump / "checkpoint" / "step-5"))
    with caplog.at_level("WARNING"):
        _config(dump)  # the same model: resumes, unchecked
    assert "resuming from step-5" in caplog.text and "only the model's shapes" in caplog.text
    with pytest.raises(SystemExit, match=r"step-5 holds a model of another shape than this run's \(flavor "
                                         r"'debugmodel'\): tok_embeddings.weight is \[8192, 256\] there, "
                                         r"\[8256, 256\] here; resume with the flavor"):
        _config(dump, "--hymo.vocab_size", "8256")


def test_a_save_killed_before_its_manifest_is_skipped(run_dir, caplog):
    dump, folder = run_dir
    shutil.copytree(folder / "step-4", folder / "step-6")  # DCP finished: shards and .metadata
    (folder / "step-6" / checkpoints.MANIFEST).unlink()
    (folder / "step-6" / checkpoints.SAVING).write_text("{}")
    with caplog.at_level("WARNING"):
        _config(dump)
    assert "step-6 in" in caplog.text and "a save that did not finish" in caplog.text and "resuming from step-4" in caplog.text
    assert _train(dump, 0)[2]._find_load_step() == 4


def _real_write_item():
    import torch.distributed.checkpoint.filesystem as fs

    return fs, fs._write_item


@pytest.mark.parametrize("how", ["oserror", "short_write", "manifest"])
def test_a_full_disk_during_a_save_is_named_and_the_previous_checkpoint_kept(run_dir, monkeypatch, how):
    dump, folder = run_dir
    fs, write_item = _real_write_item()

    def full(*args, **kwargs):
        if how in ("oserror", "manifest"):
            raise OSError(errno.ENOSPC, "No space left on device")
        # what a rank sees of another rank's full disk: PyTorchStreamWriter's message, the OSError lost
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    if how == "manifest":
        monkeypatch.setattr(checkpoints.json, "dump", lambda *a, **k: full())  # the manifest's write
    else:
        monkeypatch.setattr(fs, "_write_item", full)
    config = _config(dump)
    ck = FakeCheckpointer(folder)
    checkpoints.SaveGuard(FakeTrainer(ck), config).install()
    reason = "disk full or over quota \\(a short write; .* MiB free there\\)" if how == "short_write" else "disk full"
    with pytest.raises(checkpoints.CheckpointSaveError,
                       match=f"^{reason} while saving step 6 to {folder}: the previous checkpoint \\(step 4\\) is kept"):
        ck.save(6)
    monkeypatch.undo()
    assert (folder / "step-6" / checkpoints.SAVING).is_file()
    assert checkpoints.plan_resume(str(folder)).target == 4
    _config(dump)  # step-4 passes its checks; step-6 is skipped


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_really_full_disk(tmp_path):
    """The same on a real filesystem that fills up: a 400 KiB tmpfs, checkpoints of ~260 KiB
    (needs the right to mount, as root in a container)."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "400k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(checkpoints.CheckpointSaveError,
                           match=f"^disk full while saving step 4 to {disk}/checkpoint: the previous checkpoint "
                                 r"\(step 2\) is kept"):
            _train(disk, 4, numel=64_000)
        assert checkpoints.plan_resume(str(disk / "checkpoint")).target == 2
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_at_the_next_step_boundary_and_stops(tmp_path, sig, caplog):
    config = _config(tmp_path / "out")
    ck = FakeCheckpointer(tmp_path / "out" / "checkpoint")
    trainer = FakeTrainer(ck)
    guard = checkpoints.SaveGuard(trainer, config).install()  # checkpoint_on_signal: on by default
    ck.save(1)
    os.kill(os.getpid(), sig)  # during step 2
    assert trainer.should_continue_training()
    ck.save(2 + 1)  # step 3 is not a checkpoint step: saved because of the signal
    assert guard.stopped_at == 3 and not trainer.should_continue_training()
    assert (tmp_path / "out" / "checkpoint" / "step-3" / checkpoints.MANIFEST).is_file()
    assert not (tmp_path / "out" / "checkpoint" / "step-1").exists()
    assert any(f"hymo: stopped by {sig.name} after step 3" in r.getMessage() for r in caplog.records)


def test_signal_handlers_are_left_alone_when_checkpoint_on_signal_is_off(tmp_path):
    config = _config(tmp_path / "out")
    config.hymo.checkpoint_on_signal = False  # off: the signal handlers stay as they are
    signal.signal(signal.SIGINT, signal.default_int_handler)
    checkpoints.SaveGuard(FakeTrainer(FakeCheckpointer(tmp_path / "b")), config).install()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_stop_before_a_step_saves_the_step_before_once(tmp_path, caplog):
    """What the train step does when the data runs out: the step before is saved (force); a
    step this run saved or resumed from is left alone; one an earlier run left is replaced;
    before step 1 there is nothing to save."""
    guard, trainer, ck = _train(tmp_path / "out", 3)  # steps 2 and 3 saved (every 2nd and the last)
    folder = tmp_path / "out" / "checkpoint"
    manifest = (folder / "step-3" / checkpoints.MANIFEST).read_bytes()
    assert guard.stop_before(4) == f"checkpoint {folder}/step-3 (step 3) is on disk"
    assert (folder / "step-3" / checkpoints.MANIFEST).read_bytes() == manifest
    assert guard.stop_before(6) == f"checkpoint {folder}/step-5 (step 5) saved"  # step 5: not a regular save
    assert (folder / "step-5" / checkpoints.MANIFEST).is_file()
    assert checkpoints.plan_resume(str(folder)).target == 5
    assert guard.stop_before(1) is None
    # another run resumed from step 3: its own step is on disk; step 5 is an earlier run's, replaced
    again = checkpoints.SaveGuard(FakeTrainer(FakeCheckpointer(folder)), _config(tmp_path / "out")).install()
    assert again.stop_before(4, resumed_from=3) == f"checkpoint {folder}/step-3 (step 3) is on disk"
    with caplog.at_level("WARNING"):
        assert again.stop_before(6, resumed_from=3) == f"checkpoint {folder}/step-5 (step 5) saved"
    assert any(f"replacing {folder}/step-5, left by an earlier run" in r.getMessage() for r in caplog.records)


def test_async_checkpointing_is_refused():
    with pytest.raises(SystemExit, match="checkpoint.async_mode = 'async' is not supported"):
        parse_config(DEBUG + ["--checkpoint.async_mode", "async"])


# -- the run lock ------------------------------------------------------------------------------

_HOLD = ("import sys, time; from hymo_recipes.titan.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); "
         "print('held', flush=True); time.sleep(60)")
_TAKE = "import sys; from hymo_recipes.titan.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); print('took')"


def test_a_second_process_stops_while_the_first_holds_the_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run([sys.executable, "-c", _TAKE, str(tmp_path)], capture_output=True, text=True)
        assert second.returncode != 0
        assert (f"RunLockError: dump folder {tmp_path} is in use by another run (pid {holder.pid} on "
                f"{socket.gethostname()}") in second.stderr
    finally:
        holder.kill()
        holder.wait()
    # the holder was killed: its lock file stays, its lock does not; the next run takes over
    assert json.loads((tmp_path / run_lock.LOCK_NAME).read_text())["pid"] == holder.pid
    again = subprocess.run([sys.executable, "-c", _TAKE, str(tmp_path)], capture_output=True, text=True)
    assert again.returncode == 0 and "took" in again.stdout
    assert f"stale lock {tmp_path}/run.lock taken over: pid {holder.pid}" in again.stderr
    assert "is not running" in again.stderr


def test_a_stale_lock_file_of_a_dead_pid_is_taken_over_and_released(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "hostname": socket.gethostname()}))
    lock = run_lock.RunLock(str(tmp_path))
    with caplog.at_level("WARNING"):
        lock.acquire()
    assert f"pid {dead.pid} on {socket.gethostname()}" in caplog.text and "is not running" in caplog.text
    assert json.loads((tmp_path / run_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / run_lock.LOCK_NAME).exists()


def test_a_lock_file_of_a_live_pid_without_its_lock_is_not_taken(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps({"pid": alive.pid, "hostname": socket.gethostname()}))
        with pytest.raises(run_lock.RunLockError, match=f"lock file .* of pid {alive.pid} on this host, which is running"):
            run_lock.RunLock(str(tmp_path)).acquire()
    finally:
        alive.kill()
        alive.wait()


# -- through run_train.sh, two processes ------------------------------------------------------

def _env():
    env = dict(os.environ, NGPU="2", CONFIG_FILE="train_configs/debug_model.toml")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(dump: Path, *extra: str) -> subprocess.CompletedProcess:
    # the timeout: a hang (a collective one rank never joins) fails the test instead of the suite
    return subprocess.run(["./run_train.sh", "--job.dump_folder", str(dump), "--validation.no-enable", *extra],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_second_run_stops_in_one_line_and_sigterm_saves_a_checkpoint_that_resumes(tmp_path):
    dump, log = tmp_path / "run", tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(["./run_train.sh", "--job.dump_folder", str(dump), "--validation.no-enable",
                                  "--training.steps", "40"], cwd=REPO, env=_env(), stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "step:  2" not in log.read_text():
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        holder = json.loads((dump / run_lock.LOCK_NAME).read_text())["pid"]
        second = _run(dump, "--training.steps", "2")
        assert second.returncode != 0
        # it wrote no tensorboard events (the first run's rank 0 writes the one events file)
        assert len(list((dump / "tb").rglob("events.out.tfevents.*"))) == 1
        output = second.stdout + second.stderr
        assert f"hymo: dump folder {dump.resolve()} is in use by another run (pid {holder} on" in output, output[-3000:]
        assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]
        os.killpg(first.pid, signal.SIGTERM)  # what a scheduler's preemption does
        assert first.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    text = log.read_text()
    stopped = [line for line in text.splitlines() if "hymo: stopped by SIGTERM after step" in line]
    assert stopped, text[-3000:]
    step = int(stopped[-1].split("after step ")[1].split(":")[0])
    assert 2 <= step < 40
    saved = dump / "checkpoint" / f"step-{step}"
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", checkpoints.MANIFEST]
    assert not (dump / run_lock.LOCK_NAME).exists()
    resumed = _run(dump, "--training.steps", str(step + 1))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert f"Training starts at step {step + 1}" in resumed.stdout + resumed.stderr
    # the preflight's schedule check: step + 1 is the last step of a (step + 1)-step schedule, at
    # its minimum, where the 40-step run would have been near its peak
    from hymo_recipes.scheduler import WSDSchedule

    def factor(total):  # the debug config's schedule: warmup 0.1, stable 0.75, decay 0.15
        return WSDSchedule.from_fractions(total, 0.1, 0.75, 0.15).factor(step + 1)

    was, now = factor(40), factor(step + 1)
    assert (f"resuming at step {step + 1} with a schedule of {step + 1} steps changes the learning rate there "
            f"from {was:.4g} to {now:.4g} × the peak") in resumed.stdout + resumed.stderr


@pytest.mark.slow
def test_a_stream_that_runs_out_on_one_rank_checkpoints_the_last_whole_step(tmp_path):
    """A streamed dataset (cannot be sized before the run) of three Brown documents: each rank
    reads every other one, so rank 1 runs out first, while rank 0 still has data. Both stop
    before the step computes anything, the step before it is checkpointed, one line says so,
    and the checkpoint resumes (here with the data looped)."""
    import pyarrow.parquet as pq

    stream = tmp_path / "stream"
    stream.mkdir()
    docs = pq.read_table(REPO / "data" / "brown" / "train.parquet").column("text").to_pylist()[:3]
    (stream / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    dump = tmp_path / "run"
    data = ["--training.dataset", "hf", "--training.dataset_path", str(stream), "--metrics.no-enable_tensorboard"]
    run = _run(dump, *data, "--training.steps", "20", "--checkpoint.interval", "100")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    notes = [line for line in output.splitlines() if "hymo: the training data ran out during step" in line]
    assert notes and notes[-1].startswith("hymo: the training data ran out"), output[-4000:]  # printed last, bare
    step = int(notes[-1].split("during step ")[1].split(" ")[0])
    assert 2 <= step < 20
    saved = dump / "checkpoint" / f"step-{step - 1}"
    assert f"step {step} was not trained; checkpoint {saved} (step {step - 1}) saved" in notes[-1]
    assert f"during step {step} (dataset hf ran out on rank 1); step" in notes[-1]  # every other document: 1 of 3
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", checkpoints.MANIFEST]
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == [saved.name]
    assert f"step: {step - 1:2d}" in output and f"step: {step:2d}" not in output
    resumed = _run(dump, *data, "--training.steps", str(step), "--hymo.allow_data_repeat")
    out2 = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out2[-4000:]
    assert f"Training starts at step {step}" in out2 and f"step: {step:2d}" in out2, out2[-4000:]


@pytest.mark.slow
def test_a_full_disk_in_a_real_run_keeps_the_previous_checkpoint(tmp_path):
    """Two processes on a 100 MiB tmpfs: step 1's checkpoint (~60 MB) fits, step 2's does not."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "100m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        run = _run(disk, "--training.steps", "3", "--checkpoint.interval", "1", "--metrics.no-enable_tensorboard")
        output = run.stdout + run.stderr
        assert run.returncode != 0
        assert (f"disk full while saving step 2 to {disk}/checkpoint: the previous checkpoint (step 1) is kept"
                in output), output[-4000:]
        assert checkpoints.plan_resume(str(disk / "checkpoint")).target == 1
        assert not (disk / run_lock.LOCK_NAME).exists()
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_unfinished_saves_are_moved_aside_or_removed_by_the_next_save(run_dir, caplog):
    """A folder with the marker and no manifest is skipped by a resume; left in place it would
    count among checkpoint.keep_latest_k, and TorchTitan would delete a whole checkpoint instead
    of it. One whose DCP data is complete (only the manifest is missing) is moved, untouched, out
    of what resume and keep_latest_k see; one with incomplete data is removed."""
    dump, folder = run_dir
    for step in (3, 6, 9):
        shutil.copytree(folder / "step-4", folder / f"step-{step}")
        (folder / f"step-{step}" / checkpoints.MANIFEST).unlink()
        (folder / f"step-{step}" / checkpoints.SAVING).write_text("{}")
    (folder / "step-3" / ".metadata").unlink()  # killed inside DCP's save: shards, no .metadata
    with open(folder / "step-6" / "__0_0.distcp", "r+b") as f:  # a shard shorter than .metadata says
        f.truncate(100)
    (folder / "step-7").mkdir()  # no marker: not HyMo's to judge, left alone
    shard = (folder / "step-9" / "__0_0.distcp").read_bytes()
    assert checkpoints.unfinished_saves(str(folder)) == [str(folder / f"step-{s}") for s in (3, 6, 9)]
    with caplog.at_level("WARNING"):
        _train(dump, 2)  # saves step 2 again
    assert not (folder / "step-3").exists() and not (folder / "step-6").exists()
    assert not (folder / "step-9").exists() and (folder / "step-7").is_dir()
    [kept] = list((folder / checkpoints.UNFINISHED).iterdir())
    assert kept.name.startswith("step-9.unfinished-")
    assert sorted(p.name for p in kept.iterdir()) == [checkpoints.SAVING, ".metadata", "__0_0.distcp"]
    assert (kept / "__0_0.distcp").read_bytes() == shard  # untouched
    assert (folder / "step-4" / checkpoints.MANIFEST).is_file() and (folder / "step-2" / checkpoints.MANIFEST).is_file()
    moved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("moved ")]
    assert moved == [f"moved {folder / 'step-9'} to {kept}: a save that did not finish (no hymo_manifest.json) but "
                     "whose DCP data is complete; resume and keep_latest_k do not see it there (to load it, move it "
                     "back to step-9 and pass --checkpoint.load_step 9: unchecked)"]
    for step in (3, 6):
        assert f"removing {folder / f'step-{step}'}: a save that did not finish (no hymo_manifest.json; its DCP " \
               "data is incomplete)" in caplog.text
    # neither the resume nor TorchTitan's step discovery (the pattern keep_latest_k uses too) sees it
    assert checkpoints.plan_resume(str(folder)).target == 4
    from torchtitan.components.checkpoint import CheckpointManager

    assert CheckpointManager._find_load_step(FakeCheckpointer(folder)) == 4
    assert not re.search(r"step-(\d+)", checkpoints.UNFINISHED)  # what keep_latest_k matches in the folder's entries
    # the next unfinished save of the same step goes beside it, the first one kept
    shutil.copytree(kept, folder / "step-9")
    _train(dump, 2)
    assert len(list((folder / checkpoints.UNFINISHED).iterdir())) == 2
    # a third: only the newest UNFINISHED_KEEP (2) stay, the first moved is removed
    shutil.copytree(kept, folder / "step-9")
    caplog.clear()
    with caplog.at_level("WARNING"):
        _train(dump, 2)
    left = sorted(p.name for p in (folder / checkpoints.UNFINISHED).iterdir())
    assert len(left) == 2 and kept.name not in left
    assert f"removing {kept}: only the newest 2 unfinished saves are kept" in caplog.text
