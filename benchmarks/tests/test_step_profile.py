"""benchmarks/step_profile.sh on CPU (DRY=1: the debug config, 5 steps, the last one traced)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench
REPO = Path(__file__).resolve().parents[2]


def run_script(tmp_path, *args, **env):
    full = dict(os.environ, DRY="1", OUT=str(tmp_path / "out"), RUN_DIR=str(tmp_path / "runs"), **env)
    return subprocess.run(["bash", "benchmarks/step_profile.sh", *args], cwd=REPO, env=full, capture_output=True,
                          text=True)


def test_profiled_run_writes_the_last_steps_trace(tmp_path):
    res = run_script(tmp_path, "--training.local_batch_size", "2")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    trace = tmp_path / "runs" / "debug_model" / "profile_traces" / "iteration_5" / "rank0_trace.json"
    assert f"trace: {trace})" in res.stdout
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    # one optimizer step traced, through the CPU shim's profiler (TorchTitan alone raises on CPU)
    assert "Optimizer.step#NorMuon.step" in names and "Optimizer.step#CautiousAdamW.step" in names
    assert sum(n.startswith("ProfilerStep#") for n in names) == 1
    log = (tmp_path / "out" / "debug_model.log").read_text()
    assert "step:  5" in log and "Dumping profiler traces at step 5" in log
    # one microbatch per step: the global batch follows the local batch given on the command line
    assert "local batch size 2, global batch size 2, gradient accumulation steps 1" in log


def test_bad_input_is_refused_before_any_run(tmp_path):
    res = run_script(tmp_path, STEPS="4")
    assert res.returncode == 2 and "STEPS must be an integer >= 5" in res.stderr
    res = run_script(tmp_path, CONFIG="train_configs/nope.toml")
    assert res.returncode == 2 and "no config train_configs/nope.toml" in res.stderr
    assert not (tmp_path / "runs").exists()


def test_cuda_only_is_refused_on_the_cpu_path(tmp_path):
    res = run_script(tmp_path, CUDA_ONLY="1")
    assert res.returncode == 2 and "CUDA_ONLY=1 traces the GPU alone" in res.stderr
    assert not (tmp_path / "runs").exists()


def test_the_cuda_only_profiler_keeps_the_gpu_activity_alone(monkeypatch):
    import torch

    from benchmarks import cuda_only_train

    seen = {}
    monkeypatch.setattr(cuda_only_train, "_profile", lambda *a, **kw: seen.update(kw))
    acts = torch.profiler.ProfilerActivity
    cuda_only_train._cuda_only(activities=[acts.CPU, acts.CUDA], record_shapes=True, schedule=None)
    assert seen == dict(activities=[acts.CUDA], record_shapes=False, schedule=None)
    with pytest.raises(RuntimeError, match="no CUDA activity"):
        cuda_only_train._cuda_only(activities=[acts.CPU, None])
