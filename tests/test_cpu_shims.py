"""The CPU shims: TorchTitan sees device type "cpu" and a memory monitor that works."""

import pytest
import torch

import hymo_recipes  # noqa: F401  (applies shim 1 before torchtitan is imported)
from hymo_recipes import _titan, cpu_shims

pytestmark = pytest.mark.skipif(not cpu_shims.no_accelerator(),
                                reason="the shims apply only without an accelerator")


def test_torchtitan_chose_cpu():
    assert _titan.titan_device_type == "cpu"


def test_memory_monitor_functions_report_this_process():
    cpu_shims.install()
    stats = torch.cpu.memory_stats()
    assert stats["reserved_bytes.all.peak"] > 10 * 2**20  # a Python with torch is > 10 MiB
    torch.cpu.reset_peak_memory_stats()
    assert torch.cpu.get_device_properties().total_memory > stats["reserved_bytes.all.peak"]
    assert torch.cpu.get_device_name() == "cpu"
    assert _titan.dist_utils.set_pg_timeouts is cpu_shims._set_pg_timeouts_cpu
