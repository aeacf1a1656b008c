"""benchmarks/trace_breakdown.py on a small hand-made chrome trace (totals worked out by hand)."""

import json

import pytest

from benchmarks import trace_breakdown as tb

pytestmark = pytest.mark.bench


def _k(name, ts, dur, corr, cat="kernel"):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=0, tid=7, args=dict(correlation=corr))


def _launch(ts, corr):
    return dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=3, pid=1, tid=1,
                args=dict(correlation=corr))


TRACE = {"traceEvents": [
    dict(ph="X", cat="user_annotation", name="ProfilerStep#12", ts=0, dur=5000, pid=1, tid=1),
    dict(ph="X", cat="user_annotation", name="Optimizer.step#NorMuon.step", ts=3000, dur=1000, pid=1, tid=1),
    # the profiler's GPU-track copies of the annotations: not host time, not optimizer launches
    dict(ph="X", cat="gpu_user_annotation", name="ProfilerStep#12", ts=100, dur=3600, pid=0, tid=7),
    dict(ph="X", cat="gpu_user_annotation", name="Optimizer.step#NorMuon.step", ts=0, dur=3000, pid=0, tid=7),
    dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize", ts=4100, dur=200, pid=1, tid=1),
    _launch(10, 1), _k("_bwd_local_kernel", 100, 600, 1),
    _launch(20, 2), _k("_fwd_out_kernel", 700, 100, 2),            # back to back with the first
    _launch(30, 3), _k("triton_poi_fused_add_0", 1000, 50, 3),
    _launch(40, 4), _k("sm90_xmma_gemm_bf16bf16_bf16f32", 2000, 200, 4),
    _launch(3100, 5), _k("sm90_xmma_gemm_bf16bf16_bf16f32", 3200, 300, 5),   # launched in the optimizer step
    dict(_launch(3200, 6), cat="cuda_driver", name="cuLaunchKernel"),
    _k("ncclDevKernel_AllGather_RING_LL", 3600, 100, 6),
    _launch(50, 7), _k("Memcpy DtoD (Device -> Device)", 1500, 20, 7, cat="gpu_memcpy"),
    _launch(60, 8), _k("void cutlass::Kernel2<cutlass_80_GroupProblemShape>", 2300, 80, 8),
    _launch(70, 9), _k("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", 2400, 40, 9),
    _launch(80, 10), _k("my_unknown_kernel", 2500, 10, 10),
    dict(ph="i", cat="instant", name="marker", ts=5, pid=1, tid=1),
]}


def test_breakdown_by_category_and_optimizer_share():
    b = tb.breakdown(TRACE)
    cats = b["categories"]
    assert cats["GDN (hymo_kernels.gdn)"]["ms"] == pytest.approx(0.7) and cats["GDN (hymo_kernels.gdn)"]["n"] == 2
    assert cats["GEMM"]["ms"] == pytest.approx(0.5) and cats["GEMM"]["opt_ms"] == pytest.approx(0.3)
    assert cats["NCCL"]["opt_ms"] == pytest.approx(0.1)
    assert cats["Inductor (fused Triton)"]["ms"] == pytest.approx(0.05)
    assert cats["grouped GEMM (MoE experts)"]["ms"] == pytest.approx(0.08)
    assert cats["attention (SDPA)"]["ms"] == pytest.approx(0.04)
    assert cats[tb.COPY]["ms"] == pytest.approx(0.02)
    assert cats[tb.OTHER]["ms"] == pytest.approx(0.01) and cats[tb.OTHER]["opt_ms"] == 0
    assert b["kernel_ms"] == pytest.approx(1.5)
    # kernels cover [100, 800) ∪ [1000, 1050) ∪ [1500, 1520) ∪ [2000, 2200) ∪ [2300, 2380) ∪ [2400, 2440)
    # ∪ [2500, 2510) ∪ [3200, 3500) ∪ [3600, 3700) µs
    assert b["busy_ms"] == pytest.approx(1.5)
    assert b["span_ms"] == pytest.approx(3.6)
    assert b["step_ms"] == pytest.approx(5.0) and b["n_steps"] == 1 and b["optimizer_spans"] == 1
    # the optimizer's kernels: [3200, 3500) and [3600, 3700); the rest of the step's span: 3.6 - 0.5 ms
    assert b["phases"]["inside Optimizer.step"] == pytest.approx(dict(busy_ms=0.4, span_ms=0.5, n=2))
    assert b["phases"]["outside Optimizer.step"] == pytest.approx(dict(busy_ms=1.1, span_ms=3.1, n=8))
    assert b["api"]["launches"] == pytest.approx(dict(n=10, ms=0.03))
    assert b["api"]["synchronisations"] == pytest.approx(dict(n=1, ms=0.2)) and b["host_waits_in_optimizer"] == 0


@pytest.mark.parametrize("name, ts, in_opt", [("cudaStreamSynchronize", 3500, 1), ("cudaMemcpy", 3990, 1),
                                              ("cudaEventSynchronize", 2990, 0), ("cudaLaunchKernel", 3500, 0)])
def test_host_waits_inside_the_optimizer_step_are_counted(name, ts, in_opt):
    extra = dict(ph="X", cat="cuda_runtime", name=name, ts=ts, dur=5, pid=1, tid=1)
    b = tb.breakdown({"traceEvents": TRACE["traceEvents"] + [extra]})
    assert b["host_waits_in_optimizer"] == in_opt
    assert f"host waits for the GPU inside Optimizer.step: {in_opt}" in tb.render(b)


def test_overlapping_kernels_count_once_in_busy_time():
    trace = {"traceEvents": [_k("a", 0, 100, 1), _k("b", 50, 100, 2), _k("c", 120, 10, 3)]}
    b = tb.breakdown(trace)
    assert b["busy_ms"] == pytest.approx(0.15) and b["kernel_ms"] == pytest.approx(0.21)
    assert b["step_ms"] is None and set(b["phases"]) == {"step", "outside Optimizer.step"}


def test_render_and_cli(tmp_path, capsys):
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps(TRACE))
    assert tb.main([str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "| GDN (hymo_kernels.gdn) | 0.70 | 46.7 % | 2 | 0.00 |" in out
    assert "| GEMM | 0.50 | 33.3 % | 2 | 0.30 |" in out
    assert "5.0 ms host time in 1 ProfilerStep annotation(s); 1 Optimizer.step annotation(s)" in out
    assert "| step | 3.6 | 1.5 | 42 % | 10 |" in out and "| inside Optimizer.step | 0.5 | 0.4 | 80 % | 2 |" in out
    assert ("host CUDA API: 10 launches (0.0 ms), 1 synchronisations (0.2 ms); host waits for the GPU inside "
            "Optimizer.step: 0") in out
    top = [line for line in out.splitlines() if line.startswith("| `")]
    # longest first; equal times (0.1 ms: _fwd_out and the NCCL kernel) by name
    assert [line.split("`")[1] for line in top] == ["_bwd_local_kernel", "sm90_xmma_gemm_bf16bf16_bf16f32",
                                                   "_fwd_out_kernel"]


@pytest.mark.parametrize("content, message", [
    ("{not json", "Expecting property name"),
    (json.dumps({"events": []}), "no 'traceEvents' list"),
    (json.dumps({"traceEvents": [dict(ph="X", cat="cpu_op", name="aten::add", ts=0, dur=5)]}), "no GPU kernels"),
])
def test_bad_traces_fail_clearly(tmp_path, capsys, content, message):
    path = tmp_path / "t.json"
    path.write_text(content)
    assert tb.main([str(path)]) == 2
    assert message in capsys.readouterr().err
    assert tb.main([str(tmp_path / "missing.json")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_idle_gaps_charged_to_the_late_launch_and_syncs_listed():
    r = tb.idle_and_syncs(TRACE)
    # gaps between the merged kernels: 200, 450, 480, 100, 20, 60 µs before kernels launched in the
    # step only; 690 and 100 µs before the two launched inside the optimizer step
    assert r["gap_ms"] == pytest.approx(2.1)
    opt = r["gaps"]["Optimizer.step#NorMuon.step"]
    assert opt["ms"] == pytest.approx(0.79) and opt["n"] == 2
    rest = r["gaps"]["(outside any host event)"]
    assert rest["ms"] == pytest.approx(1.31) and rest["n"] == 6
    assert r["syncs"] == {"cudaStreamSynchronize: (outside any host event)": dict(ms=pytest.approx(0.2), n=1)}
    # a larger threshold drops the 20 and 60 µs gaps
    assert tb.idle_and_syncs(TRACE, min_gap_us=61)["gap_ms"] == pytest.approx(2.02)
    text = tb.render_idle(r)
    assert "2.1 ms" in text and "| Optimizer.step#NorMuon.step | 0.79 | 2 |" in text


def test_busy_timeline_window_by_window():
    # kernels cover [100, 800) ∪ [1000, 1050) | [1500, 1520) ∪ [2000, 2100) | [2100, 2200) ∪ [2300, 2380)
    # ∪ [2400, 2440) ∪ [2500, 2510) | [3200, 3500) ∪ [3600, 3700), the last window 600 µs long
    assert tb.busy_timeline(TRACE, window_ms=1.0) == pytest.approx([75.0, 12.0, 23.0, 400 / 6])
    assert tb.busy_timeline({"traceEvents": []}) == []


def test_cli_prints_the_timeline_and_refuses_a_bad_window(tmp_path, capsys):
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps(TRACE))
    assert tb.main([str(path), "--idle", "--window", "1"]) == 0
    assert "GPU busy per 1 ms from the first kernel (%): 75 12 23 67" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tb.main([str(path), "--idle", "--window", "0"])


def test_busy_timeline_splits_a_kernel_across_windows_and_counts_overlaps_once():
    trace = {"traceEvents": [_k("a", 0, 250, 1), _k("b", 100, 50, 2), _k("c", 250, 50, 3), _k("d", 390, 10, 4)]}
    # busy [0, 300) ∪ [390, 400): windows of 100 µs
    assert tb.busy_timeline(trace, window_ms=0.1) == pytest.approx([100.0, 100.0, 100.0, 10.0])
