"""benchmarks/launch_overhead.py --dry: every row measured on the CPU (Triton's interpreter)."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before Triton or the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks import launch_overhead  # noqa: E402

pytestmark = pytest.mark.bench


def test_dry_run_times_every_entry_point(capsys):
    launch_overhead.main(["--dry", "--calls", "1", "--warmup", "1"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| entry")}
    assert set(rows) == {"aten_add", "triton_bare", "conv_fwd", "conv_bwd", "conv_qkv_fwd", "conv_qkv_bwd",
                         "chunk_fwd", "mixer_fwd", "mixer_fwd_packed", "gated_norm_fwd"}
    assert all(float(us) > 0 for us in rows.values())
