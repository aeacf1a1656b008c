"""benchmarks.gdn.regs: the fused mixer's launches recorded in the interpreter, then compiled for
sm_90 by the installed Triton (no GPU needed); a register cap shows in the registers it reports."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench

# every Triton kernel of the fused GDN mixer's forward and backward (kernels/gdn/DESIGN.md)
MIXER_KERNELS = {"_conv3_fwd_rows_kernel", "_wy_inverse_kernel", "_fwd_prep_kernel", "_state_pass_kernel",
                 "_fwd_out_kernel", "_gnorm_fwd_kernel", "_gnorm_bwd_kernel", "_bwd_prep_kernel",
                 "_bwd_local_kernel", "_conv3_bwd_rows_kernel"}


def run_regs(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.gdn.regs", *args], capture_output=True, text=True, env=env,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| _")]
    return [dict(name=r[0].strip(), tiles=r[1], warps=int(r[2]), regs=int(r[4]), stack=int(r[5]), sass=int(r[10]),
                 loop=int(r[11]), mma=int(r[12]), bar=int(r[13]), smem=int(r[14]), shfl=int(r[15])) for r in rows]


def test_every_mixer_kernel_is_compiled_and_read():
    rows = run_regs()
    assert {r["name"] for r in rows} == MIXER_KERNELS
    # the 750m's heads reach the chunk kernels' tile constants
    assert all("H=40" in r["tiles"] for r in rows if r["name"] in ("_fwd_out_kernel", "_bwd_local_kernel"))
    # the instruction mix: the chunk kernels' dots are tensor-core MMAs fed through shared memory,
    # the convs are elementwise row walks
    by_name = {r["name"]: r for r in rows}
    bwd, conv = by_name["_bwd_local_kernel"], by_name["_conv3_bwd_rows_kernel"]
    assert bwd["mma"] > 0 and bwd["bar"] > 0 and bwd["smem"] > 0 and bwd["sass"] > bwd["mma"] + bwd["bar"]
    # the chunk kernels loop over sub-chunks, the inverse is one sub-chunk per program
    assert 0 < bwd["loop"] < bwd["sass"] and by_name["_wy_inverse_kernel"]["loop"] == 0
    assert conv["mma"] == 0 and conv["sass"] > 0


def test_sass_mix_counts_opcodes_predicated_or_not():
    from benchmarks.gdn.regs import sass_mix

    sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;  /* 0x0000000c0804723c */
        /*0020*/               @P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x0000000000000b1d */
        /*0030*/                   LDSM.16.M88.4 R16, [R2] ;              /* 0x000000000210783b */
        /*0040*/              @!P1 STS [R3], R5 ;                         /* 0x0000000503009388 */
        /*0050*/                   SHFL.BFLY PT, R6, R7, 0x1, 0x1f ;      /* 0x0c201f0007067f89 */
        /*0060*/                   LDS.64 R8, [R3+0x10] ;                 /* 0x0000100003087984 */
        /*0070*/                   HMMA.16816.F32.BF16 R4, R8, R14, R4 ;  /* 0x0000000e0804723c */
        /*0080*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24 ;  /* 0x0000000004187de0 */
    """
    assert sass_mix(sass) == dict(sass=9, loop=0, mma=3, bar=1, smem=3, shfl=1)


def test_sass_mix_counts_the_longest_loop():
    from benchmarks.gdn.regs import sass_mix

    sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;  /* 0x0000000c0804723c */
        /*0020*/                   FADD R6, R6, R7 ;                      /* 0x0000000706067221 */
        /*0030*/               @P0 BRA 0x10 ;                             /* 0x0000000000000947 */
        /*0040*/                   FMUL R6, R6, R7 ;                      /* 0x0000000706067220 */
        /*0050*/                   FADD R6, R6, R7 ;                      /* 0x0000000706067221 */
        /*0060*/              @!P1 BRA 0x40 ;                             /* 0x0000000000000947 */
        /*0070*/                   BRA 0x90 ;                             /* 0x0000000000000947 */
        /*0080*/                   NOP ;                                  /* 0x0000000000000918 */
        /*0090*/                   EXIT ;                                 /* 0x000000000000794d */
        /*00a0*/                   BRA 0xa0 ;                             /* 0x0000000000000947 */
    """
    # two loops (0x10-0x30: 3 instructions, 0x40-0x60: 3); neither the forward branch nor the
    # kernel's closing branch to itself is a loop
    assert sass_mix(sass)["loop"] == 3
    nested = sass.replace("@!P1 BRA 0x40", "@!P1 BRA 0x10")
    assert sass_mix(nested)["loop"] == 6
    straight = "\n".join(line for line in sass.splitlines() if "BRA 0x10" not in line and "BRA 0x40" not in line)
    assert sass_mix(straight)["loop"] == 0


def test_a_register_cap_shows_and_spills():
    rows = run_regs("--maxnreg", "64")
    assert all(r["regs"] <= 64 for r in rows)
    assert next(r for r in rows if r["name"] == "_bwd_local_kernel")["stack"] > 0  # its chain does not fit in 64


def test_the_interpreter_is_refused():
    out = subprocess.run([sys.executable, "-m", "benchmarks.gdn.regs"], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1"), timeout=120)
    assert out.returncode == 2 and re.search(r"unset TRITON_INTERPRET", out.stderr)


@pytest.mark.parametrize("regs, warps, programs", [(255, 2, 4), (118, 1, 16), (88, 4, 5), (104, 4, 4), (32, 1, 32),
                                                   (32, 8, 8)])
def test_programs_per_sm_follow_the_occupancy_rules(regs, warps, programs):
    """Registers in units of 256 per warp from one of four 16,384-register sub-partitions; at most
    64 warps and 32 programs per SM (NVIDIA's occupancy calculator for sm_90)."""
    from benchmarks.gdn.regs import programs_per_sm

    assert programs_per_sm(regs, warps) == programs
