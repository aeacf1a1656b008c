"""Registers and spills of every Triton kernel in one GDN mixer's forward and backward, compiled
for a Hopper GPU on a machine without one.

    python -m benchmarks.gdn.regs                 # the 750m mixer's launches (K = V = 32, bf16, packed)
    python -m benchmarks.gdn.regs --head-dim 128  # another head size's launch-table entry
    python -m benchmarks.gdn.regs --arch 100      # another target (compute capability x 10)
    python -m benchmarks.gdn.regs --maxnreg 128   # every launch capped: what the spills would be

A kernel's occupancy, and so how much memory latency it can hide, follows from its registers per
thread; a spill (local-memory traffic) is a cost a CPU can see. This records the launches
(arguments, tile constants, warps, stages, register caps, the arguments a GPU launch would mark
16-divisible) of the fused mixer's forward and backward at the configs' tiles, 750m's heads, by
running a short packed batch once in Triton's interpreter (bf16 values are wrong there, so the
kernels are not run: only their launches are kept), then, in a second process without the
interpreter, compiles each for ``sm_<arch>`` with the installed Triton and reads the cubin with
the cuobjdump it ships. Printed per kernel: warps, stages, registers per thread, the local
memory ("stack") and the local loads and stores in the SASS (spills), load and store
instructions, the programs of the kernel an SM holds by its registers (and its 64 warps and 32
programs), the SASS's instruction mix (all instructions, those of the longest loop's body, tensor-core
MMAs, barriers, shared-memory loads and stores, shuffles: what a latency-bound chain of small dots
spends its steps on) and the compile time (0 when Triton's cache has the kernel). The loop body's
count (per warp) times the iterations a launch runs and its warps per program, over the SMs'
issue rate (four warp-instructions per cycle per SM), bounds the kernel's time from below where
it is bound by instruction issue rather than by latency (a loop the compiler unrolled holds
several iterations per back edge).

The compiler that matters is the GPU image's: run it in an environment with that Triton (a
virtual environment with the same ``triton==`` pin and a CPU torch is enough). Times are not
measured here; ``benchmarks.gdn.bench`` and ``benchmarks.gdn.conv_bench`` time on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

def _triton_type(v) -> tuple[str, object, bool]:
    """(signature type, constexpr value or None, 16-divisible) of one launch argument, as a GPU
    launch specialises it: a tensor whose address and an integer that are multiples of 16 are
    marked divisible (wider loads), an integer equal to 1 becomes the constant 1."""
    import torch

    if isinstance(v, torch.Tensor):
        return "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                      torch.int64: "i64", torch.uint8: "u8", torch.bool: "i1"}[v.dtype], None, v.data_ptr() % 16 == 0
    if isinstance(v, bool) or v is None:
        return "constexpr", v, False
    if isinstance(v, int):
        if v == 1:
            return "constexpr", 1, False
        return ("i32" if -2 ** 31 <= v < 2 ** 31 else "i64"), None, v % 16 == 0
    if isinstance(v, float):
        return "fp32", None, False
    return "constexpr", v, False


def record(head_dim: int, heads: int) -> list[dict]:
    """The launches of one fused mixer forward + backward (interpreter; run in its own process)."""
    import torch

    from hymo_kernels.gdn import backward, gated_norm, output, prep, short_conv, state_pass, wy
    from hymo_kernels.gdn.mixer import conv_gated_delta_rule, gated_norm_linear

    launches: list[dict] = []
    for mod in (backward, gated_norm, output, prep, short_conv, state_pass, wy):
        for name, k in list(vars(mod).items()):
            if name.endswith("_kernel") and hasattr(k, "run") and hasattr(k, "arg_names"):
                def run(*args, grid, warmup, _k=k, _name=name, **kwargs):
                    sig, const, divisible = {}, {}, []
                    values = dict(zip(_k.arg_names, args)) | {a: kwargs[a] for a in _k.arg_names if a in kwargs}
                    annotated = {a for a, t in _k.fn.__annotations__.items() if "constexpr" in str(t)}
                    for i, a in enumerate(_k.arg_names):
                        if a not in values:
                            continue  # a default
                        ty, cv, div = _triton_type(values[a])
                        if a in annotated or ty == "constexpr":
                            sig[a], const[a] = "constexpr", values[a] if a in annotated else cv
                        else:
                            sig[a] = ty
                            if div:
                                divisible.append(i)
                    opts = {o: kwargs[o] for o in ("num_warps", "num_stages", "maxnreg") if o in kwargs}
                    launches.append(dict(module=_k.fn.__module__, name=_name, signature=sig, constexprs=const,
                                         divisible=divisible, options=opts))
                    # not run: the interpreter cannot run every bf16 kernel, and only the launch is
                    # wanted (the outputs stay unwritten; no launch reads a value on the host)
                k.run = run
    # the 750m's 40 heads (H is a tile constant of the chunk kernels); T and the channel counts
    # multiples of 16, as in training, so that the same arguments are marked divisible; four
    # documents, so that sequences x heads >= 128 picks the launch table's training tiles
    H, D, T = heads, head_dim, 64
    lengths = [19, 17, 15, 13]
    g = torch.Generator().manual_seed(0)

    def mk(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).requires_grad_()

    qkv = mk(1, T, 3 * H * D)  # the mixer's q, k, v projection in one tensor
    wq, wk, wv = mk(H * D, 4, scale=0.5), mk(H * D, 4, scale=0.5), mk(H * D, 4, scale=0.5)
    gdecay = (-torch.rand(1, T, H, generator=g) * 0.5).requires_grad_()
    beta = torch.rand(1, T, H, generator=g).to(torch.bfloat16).requires_grad_()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    o = conv_gated_delta_rule(qkv, wq, wk, wv, gdecay, beta, head_k=D, head_v=D, cu_seqlens=cu, positions=pos)
    gate, norm_w, out_w = mk(1, T, H * D), mk(D), mk(64, H * D, scale=0.05)
    out = gated_norm_linear(o, gate, norm_w, out_w, 1e-6)
    out.float().sum().backward()
    return launches


def compile_one(launch: dict, arch: int, maxnreg: int = 0) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    src = ASTSource(fn=fn, signature=launch["signature"], constexprs=launch["constexprs"],
                    attrs={(i,): [["tt.divisibility", 16]] for i in launch["divisible"]})
    start = time.perf_counter()
    options = dict(launch["options"], **({"maxnreg": maxnreg} if maxnreg else {}))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    seconds = time.perf_counter() - start
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    fields = dict(item.split(":") for line in usage.splitlines() if "REG:" in line for item in line.split()
                  if ":" in item and item.split(":")[1].isdigit())
    ops = re.findall(r"\b(STL|LDL|LDG|STG)[.\s]", sass)  # LDGSTS (async copies) and LDGDEPBAR not counted
    return dict(regs=int(fields["REG"]), stack=int(fields.get("STACK", 0)), spills=ops.count("STL") + ops.count("LDL"),
                loads=ops.count("LDG"), stores=ops.count("STG"), seconds=seconds, **sass_mix(sass))


def sass_mix(sass: str) -> dict:
    """Static instruction counts of a kernel's SASS: all, those of its longest loop's body (loop;
    0 without a loop), tensor-core MMAs (HMMA, and Hopper's warpgroup HGMMA), CTA barriers (BAR),
    shared-memory loads and stores (LDS, STS, LDSM, STSM) and warp shuffles (SHFL). For a
    latency-bound kernel (a chain of small dots) the barriers and shared-memory round trips of its
    layout conversions are what a restructure has to cut; the counts are of the code, not of its
    execution (a loop body counts once)."""
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9]*)([^;\n]*);", sass)
    opcodes = [op for _, op, _ in ins]
    # the longest loop: the address range of a branch back to an earlier address (a loop's back
    # edge; an outer loop's range holds its inner loops'). A pipelined loop's prologue repeats its
    # loads outside it, so the whole kernel's count overstates what one iteration issues.
    addrs = [int(a, 16) for a, _, _ in ins]
    loop = 0
    for addr, (_, op, args) in zip(addrs, ins):
        m = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        target = int(m.group(1), 16) if m else addr
        if target < addr:
            loop = max(loop, sum(target <= a <= addr for a in addrs))
    return dict(sass=len(opcodes), loop=loop, mma=opcodes.count("HMMA") + opcodes.count("HGMMA"),
                bar=opcodes.count("BAR"), smem=sum(opcodes.count(o) for o in ("LDS", "STS", "LDSM", "STSM")),
                shfl=opcodes.count("SHFL"))


def programs_per_sm(regs: int, warps: int) -> int:
    """Programs of ``warps`` warps that one SM holds, bounded by its registers (each of the four
    sub-partitions has 16,384; a warp's registers, allocated in units of 256, come from one),
    its 64 warps and its 32 programs (the CUDA occupancy calculator's rules for sm_90)."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(4 * (16384 // per_warp) // warps, 64 // warps, 32)


def _key(launch: dict) -> str:
    return json.dumps([launch["name"], launch["signature"], launch["constexprs"], launch["options"]], sort_keys=True,
                      default=str)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=32, help="K = V of the GDN heads (default 32: the 750m's)")
    ap.add_argument("--heads", type=int, default=40, help="GDN heads (default 40: the 750m's)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    ap.add_argument("--maxnreg", type=int, default=0, help="cap every launch's registers per thread (0: as launched)")
    ap.add_argument("--record", action="store_true", help=argparse.SUPPRESS)  # the interpreter half
    args = ap.parse_args(argv)
    if args.record:
        json.dump(record(args.head_dim, args.heads), sys.stdout)
        return 0
    import triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("compiling needs Triton without its interpreter: unset TRITON_INTERPRET")
    env = dict(os.environ, TRITON_INTERPRET="1")
    rec = subprocess.run([sys.executable, "-m", "benchmarks.gdn.regs", "--record", "--head-dim", str(args.head_dim),
                          "--heads", str(args.heads)],
                         capture_output=True, text=True, env=env)
    if rec.returncode:
        print(rec.stderr[-3000:], file=sys.stderr)
        print("regs: recording the launches failed (above)", file=sys.stderr)
        return 1
    launches = {_key(x): x for x in json.loads(rec.stdout)}
    print(f"regs: Triton {triton.__version__}, sm_{args.arch}, H = {args.heads}, K = V = {args.head_dim}, bf16, "
          f"packed documents: "
          f"{len(launches)} distinct launches{f', capped at {args.maxnreg} registers' if args.maxnreg else ''}",
          flush=True)
    rows = []
    for launch in launches.values():
        res = compile_one(launch, args.arch, args.maxnreg)
        warps = launch["options"].get("num_warps", 4)
        tiles = {k: v for k, v in launch["constexprs"].items() if k.isupper() and isinstance(v, int)
                 and not isinstance(v, bool)}
        rows.append((launch["name"], " ".join(f"{k}={v}" for k, v in tiles.items()), warps,
                     launch["options"].get("num_stages", 3), res, programs_per_sm(res["regs"], warps)))
        print(f"regs: {launch['name']}: {res['regs']} registers, {res['seconds']:.1f} s", flush=True)
    print("\n| kernel | tiles | warps | stages | registers | stack B | spill ld/st | LDG | STG | programs/SM "
          "(registers) | SASS | loop SASS | MMA | BAR | smem ld/st | SHFL | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, tiles, warps, stages, r, progs in rows:
        print(f"| {name} | {tiles} | {warps} | {stages} | {r['regs']} | {r['stack']} | {r['spills']} | {r['loads']} | "
              f"{r['stores']} | {progs} | {r['sass']} | {r['loop']} | {r['mma']} | {r['bar']} | {r['smem']} | "
              f"{r['shfl']} | {r['seconds']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
