"""The CPU shims: TorchTitan sees device type "cpu" and a memory monitor that works."""

import pytest
import torch

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shim 1 first)
from hymo_recipes.titan import api, cpu_shims

pytestmark = pytest.mark.skipif(not cpu_shims.no_accelerator(),
                                reason="the shims apply only without an accelerator")


def test_torchtitan_chose_cpu():
    assert api.titan_device_type == "cpu"


def test_memory_monitor_functions_report_this_process():
    cpu_shims.install()
    stats = torch.cpu.memory_stats()
    assert stats["reserved_bytes.all.peak"] > 10 * 2**20  # a Python with torch is > 10 MiB
    torch.cpu.reset_peak_memory_stats()
    assert torch.cpu.get_device_properties().total_memory > stats["reserved_bytes.all.peak"]
    assert torch.cpu.get_device_name() == "cpu"
    assert api.dist_utils.set_pg_timeouts is cpu_shims._set_pg_timeouts_cpu


def test_profiler_shim_drops_the_missing_device_activity(tmp_path, monkeypatch):
    """TorchTitan's maybe_enable_profiling asks torch.profiler for [CPU, None] without a GPU
    (a TypeError); the shim drops the None. (The trace itself: tests/test_step_profile_script.py.)"""
    import sys
    from types import SimpleNamespace

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)  # no process group here
    cpu_shims.install()
    trainer_module = sys.modules[api.Trainer.__module__]
    shimmed = trainer_module.maybe_enable_profiling
    cpu_shims.install()  # idempotent: one wrapper, not two
    assert trainer_module.maybe_enable_profiling is shimmed and shimmed._hymo_cpu_shim
    real = torch.profiler.profile
    cfg = SimpleNamespace(enable_profiling=True, save_traces_folder="traces", profile_freq=10, profiler_warmup=3,
                          profiler_active=1)
    with shimmed(cfg, global_step=0, base_folder=str(tmp_path), leaf_folder="") as prof:
        assert torch.profiler.profile is real  # the patch lasts only while the profiler is built
        assert prof.activities == {torch.profiler.ProfilerActivity.CPU}
        prof.step()
    assert torch.profiler.profile is real
