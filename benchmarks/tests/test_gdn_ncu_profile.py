"""benchmarks.gdn.ncu_profile's summaries, on small exports written here in ncu's CSV layout
(the layout of Nsight Compute 2025.3's `--page raw --csv` and `--page source --print-source
cuda,sass --csv`, as read from an H200 run)."""

import pytest

from benchmarks.gdn import ncu_profile as N

pytestmark = pytest.mark.bench

RAW = """\
"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum","launch__registers_per_thread","sm__warps_active.avg.per_cycle_active","smsp__inst_executed.sum","smsp__issue_active.avg.pct_of_peak_sustained_active"
"","","Gbyte","Mbyte","ms","register/thread","warp","inst","%"
"0","_bwd_local_kernel","2.5","300","3.5","255","7.8","163,573,760","33.6"
"""

# two Python lines of one kernel (one in Triton's standard.py, one a dot), each followed by
# its SASS rows; a line's row carries the sums of its rows
SRC = """\
"File Path","/site/triton/language/standard.py"
"Function Name","_bwd_local_kernel"
"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_short_sb","stall_wait","stall_short_sb (Not Issued)"
"263","return a + b","-","-","30","20","10","20","0","15"
"","","0x10","      FADD R1, R2, R3","30","20","10","20","0","15"
"File Path","/site/hymo_kernels/gdn/backward.py"
"Function Name","_bwd_local_kernel"
"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_short_sb","stall_wait","stall_short_sb (Not Issued)"
"76","c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))","-","-","70","50","0","10","60","5"
"","","0x20","      HMMA.16816.F32.BF16 R4, R8, R12, R4","70","50","0","10","60","5"
"""


def test_raw_units_are_converted(tmp_path):
    (tmp_path / "raw_x.csv").write_text(RAW)
    (row,) = N.read_raw(str(tmp_path / "raw_x.csv"))
    assert row["kernel"] == "_bwd_local_kernel"
    assert row["us"] == pytest.approx(3500.0)          # 3.5 ms
    assert row["DRAM rd MB"] == pytest.approx(2500.0)  # 2.5 Gbyte
    assert row["DRAM wr MB"] == pytest.approx(300.0)
    assert row["warp insts M"] == pytest.approx(163.57376)
    assert row["regs"] == 255 and row["warps/SM"] == pytest.approx(7.8)


def test_source_lines_stalls_and_categories(tmp_path):
    (tmp_path / "src.csv").write_text(SRC)
    lines = N.read_source(str(tmp_path / "src.csv"))
    assert [(x["line"], x["samples"]) for x in lines] == [(263, 30.0), (76, 70.0)]
    s = N.summarize_kernel(lines)
    assert s["samples"] == 100.0
    # stall reasons over both lines: barrier 10, short_sb 30, wait 60 (Not Issued columns left out)
    assert s["stalls"] == pytest.approx({"wait": 0.6, "short_sb": 0.3, "barrier": 0.1})
    assert s["categories"] == pytest.approx({"dots": 0.7, "reductions": 0.3})
    assert s["top"][0]["line"] == 76


def test_summarize_tables(tmp_path):
    (tmp_path / "raw_4_64_2_32_32.csv").write_text(RAW)
    (tmp_path / "src_bwd_local_kernel_4_64_2_32_32.csv").write_text(SRC)
    text = N.summarize(str(tmp_path))
    assert "== 4_64_2_32_32" in text
    assert "-- bwd_local_kernel: 100 stall samples" in text
    assert "wait 60%, short_sb 30%, barrier 10%" in text
    assert "dots 70%, reductions 30%" in text


def test_bad_exports_are_named(tmp_path):
    (tmp_path / "raw_x.csv").write_text('"a","b"\n"1","2"\n')
    with pytest.raises(ValueError, match="not an ncu --page raw"):
        N.read_raw(str(tmp_path / "raw_x.csv"))
    (tmp_path / "src.csv").write_text('"Kernel Name","_k",\n')
    with pytest.raises(ValueError, match="not an ncu --page source"):
        N.read_source(str(tmp_path / "src.csv"))
    with pytest.raises(FileNotFoundError, match="no raw_<tag>.csv"):
        N.summarize(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot convert"):
        N.unit_factor("register/thread", "us")
