"""benchmarks/trace_graphs.py on a synthetic trace: kernels charged to the compiled graph around
their launch (forward and backward apart), idle gaps to the kernel that ended them."""

import gzip
import json

import pytest

from benchmarks import trace_graphs

pytestmark = pytest.mark.bench


def _trace(tmp_path):
    X = lambda cat, name, ts, dur, tid=1, **args: dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid, args=args)
    events = [
        X("cpu_op", "CompiledFunction", 0, 100),
        X("cpu_op", "## Call CompiledFxGraph abcdef0123456789 ##", 1, 98),
        X("cuda_runtime", "cudaLaunchKernel", 10, 2, correlation=1),
        X("cuda_runtime", "cudaLaunchKernel", 20, 2, correlation=2),
        X("cpu_op", "autograd::engine::evaluate_function: CompiledFunctionBackward", 200, 100, tid=2),
        X("cpu_op", "## Call CompiledFxGraph 9876543210fedcba ##", 201, 98, tid=2),
        X("cuda_runtime", "cudaLaunchKernel", 210, 2, tid=2, correlation=3),
        X("cpu_op", "aten::copy_", 400, 5),
        X("cuda_runtime", "cudaMemcpyAsync", 401, 2, correlation=4),
        X("kernel", "fwd_kernel_1", 1000, 300, correlation=1),
        X("kernel", "fwd_kernel_2", 1300, 200, correlation=2),  # no gap before it
        X("kernel", "bwd_kernel", 1600, 400, correlation=3),  # 100 us idle before it
        X("gpu_memcpy", "Memcpy DtoD", 2010, 40, correlation=4),  # 10 us
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_kernels_and_gaps_by_graph(tmp_path, capsys):
    trace_graphs.main([_trace(tmp_path)])
    out = capsys.readouterr().out
    assert "| graph abcdef01 | fwd | 0.50 | 53.2 % | 2 |" in out
    assert "| graph 98765432 | bwd | 0.40 | 42.6 % | 1 |" in out
    assert "| aten::copy_ | fwd | 0.04 |" in out
    assert "GPU idle in gaps of >= 5 us: 0.1 ms" in out
    assert "| graph 98765432 | bwd | 0.10 | 1 |" in out and "| aten::copy_ | fwd | 0.01 | 1 |" in out


def test_a_trace_without_kernels_is_one_line(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(SystemExit, match="has no GPU kernels"):
        trace_graphs.main([str(path)])
