"""Fixtures shared by the FSDP tests of tests/titan."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@pytest.fixture
def one_rank(tmp_path):
    """A 1-rank gloo process group and its CPU device mesh, torn down after the test."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
