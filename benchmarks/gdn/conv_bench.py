"""The GDN mixer's short causal conv + SiLU on q, k and v: HyMo's kernels beside
flash-linear-attention's ``causal_conv1d`` and the memory floor, at the 750m training shape.

    python -m benchmarks.gdn.conv_bench                               # GPU: 32,768 packed tokens, 3 x 1280 channels
    python -m benchmarks.gdn.conv_bench --bwd-rows 16,256,4,1 32,256,4  # backward row tiles to try
    python -m benchmarks.gdn.conv_bench --fwd-rows 16,256,2,2 32,256,1  # forward row tiles to try
    python -m benchmarks.gdn.conv_bench --dry                          # CPU: Triton's interpreter, a tiny shape

The input is what one 750m microbatch of 8 x 4,096 tokens hands the convs in training: three
[1, T, C] bf16 projections as one packed row (documents of 500-6,000 tokens, a fixed draw,
``--no-documents`` for one causal row), conv width 4. Rows, forward and backward (ms, the
median of ``triton.testing.do_bench``; the host clock in the dry mode):

- ``ours, one launch``: hymo_kernels.gdn.short_conv's ``conv_silu_qkv_fwd`` / ``_bwd`` (the fused
  mixer's path, the three convs in one launch each way), and ``ours, three launches``;
- ``ours, forward rows L,BC,warps,ahead`` and ``ours, backward rows ...``: the one-launch forward
  with each ``--fwd-rows`` tile and backward with each ``--bwd-rows`` tile (outputs checked
  bitwise against the shipped tile's, dw to rounding);
- ``fla``: fla-core's ``causal_conv1d(x, w, activation="silu", cu_seqlens=...)`` three times
  (GPU only, when the package imports); its backward time is that of a forward with autograd
  recording plus the backward, less the plain forward's;
- the floor: the bytes each direction must move (forward: x read, y written; backward: x and
  dy read, dx written; three tensors, bf16) at ``--bandwidth`` TB/s (4.3: a device-to-device copy
  measured on an H200).

The same outputs are checked first: ours (forward, and the backward's input and weight
gradients) against the float64 reference of hymo_kernels.gdn.mixer_torch, and fla's forward
against both.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # the kernels read it at import: the interpreter on a CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.common import bench_device, document_lengths, rel_err, timer, timing_args  # noqa: E402
from hymo_kernels.gdn import short_conv  # noqa: E402
from hymo_kernels.gdn.mixer_torch import short_causal_conv  # noqa: E402
from hymo_recipes.model.model import positions_in_documents  # noqa: E402


def log(msg: str) -> None:
    print(f"conv_bench: {msg}", flush=True)


def tile(spec: str) -> tuple[int, int, int, int]:
    """ROWS,CHANNELS,WARPS[,AHEAD] (AHEAD: rows loaded ahead, 0-4, default 0)."""
    parts = spec.split(",")
    if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts) or not all(int(p) > 0 for p in parts[:3]):
        raise argparse.ArgumentTypeError(f"a tile is ROWS,CHANNELS,WARPS[,AHEAD] (positive integers), got {spec!r}")
    t = (*(int(p) for p in parts[:3]), int(parts[3]) if len(parts) == 4 else 0)
    try:
        short_conv._row_tile(t)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return t


class Rows(list):
    """(name, fwd ms, bwd ms) rows, each logged as it is measured (a call cut short still says
    how far it got)."""

    def append(self, row: tuple[str, float, float]) -> None:
        log(f"{row[0]}: fwd {row[1]:.3f} ms, bwd {row[2]:.3f} ms ({time.strftime('%H:%M:%S')})")
        super().append(row)


def load_fla():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception as e:  # noqa: BLE001 - any import failure: the row is left out, said once
        log(f"fla: not available ({e!r})")
        return None
    return causal_conv1d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768, help="T of the packed row (default: 8 x 4096)")
    ap.add_argument("--channels", type=int, default=1280, help="C of each of q, k, v (750m: 40 heads x 32)")
    ap.add_argument("--no-documents", action="store_true", help="one causal row instead of packed documents")
    ap.add_argument("--bwd-rows", type=tile, nargs="*",
                    default=[(64, 256, 4, 4), (16, 256, 4, 3), (128, 256, 4, 4), (256, 256, 4, 4)],
                    help="ROWS,CHANNELS,WARPS[,AHEAD] tiles of the one-launch backward to time")
    ap.add_argument("--fwd-rows", type=tile, nargs="*", default=[(16, 256, 2, 4), (32, 256, 2, 2)],
                    help="ROWS,CHANNELS,WARPS[,AHEAD] tiles of the one-launch forward to time")
    ap.add_argument("--bandwidth", type=float, default=4.3, help="TB/s of the floor (default 4.3)")
    timing_args(ap)
    ap.add_argument("--dry", action="store_true", help="CPU: Triton's interpreter, T = 96, C = 32, documents of "
                                                       "10-40 tokens, two tiles: the code paths, not times")
    args = ap.parse_args(argv)
    device = bench_device(ap, args.dry)
    if args.dry:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--dry needs Triton's interpreter (TRITON_INTERPRET=1 before the kernels are imported)")
        args.tokens, args.channels = 96, 32
        args.bwd_rows = args.fwd_rows = [(16, 32, 1, 2), (32, 32, 1, 4)]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 is wrong
    T, C, W = args.tokens, args.channels, 4
    torch.manual_seed(0)
    xs = [torch.randn(1, T, C, device=device, dtype=dtype) for _ in range(3)]
    ws = [(torch.rand(C, W, device=device) - 0.5).to(dtype) for _ in range(3)]
    dys = [torch.randn(1, T, C, device=device, dtype=dtype) for _ in range(3)]
    lengths = None if args.no_documents else document_lengths(T, *((10, 40) if args.dry else (500, 6000)))
    cu = None if lengths is None else torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    pos = None if cu is None else positions_in_documents(cu, T)
    log(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}, torch {torch.__version__}, "
        f"[1, {T}, {C}] x 3 {str(dtype).removeprefix('torch.')}, W = {W}, "
        f"{'one causal row' if lengths is None else f'documents: {len(lengths)}'}")

    # the same function: ours against the float64 reference (and fla's, below)
    ref = [torch.nn.functional.silu(short_causal_conv(x.double(), w.double()[:, None, :], pos)) for x, w in zip(xs, ws)]
    ours = short_conv.conv_silu_qkv_fwd(*xs, *ws, pos)
    err = max(rel_err(o, r) for o, r in zip(ours, ref))
    log(f"ours vs float64 reference: forward rel. error {err:.1e}")
    if err > (2e-2 if dtype == torch.bfloat16 else 1e-5):
        log("FAILED: ours does not compute the reference's conv")
        return 1

    xr = [x.double().requires_grad_() for x in xs]
    wr = [w.double().requires_grad_() for w in ws]
    torch.autograd.backward([torch.nn.functional.silu(short_causal_conv(x, w[:, None, :], pos)) for x, w in zip(xr, wr)],
                            [dy.double() for dy in dys])
    err = max(rel_err(g, r.grad) for g, r in zip(short_conv.conv_silu_qkv_bwd(*xs, *ws, *dys, pos), xr + wr))
    log(f"ours vs float64 reference: backward rel. error {err:.1e}")
    if err > (2e-2 if dtype == torch.bfloat16 else 1e-5):
        log("FAILED: ours does not compute the reference's gradients")
        return 1
    del xr, wr

    bench = timer(device, args.warmup_ms, args.rep_ms)
    shipped, shipped_fwd = short_conv.BWD_ROWS, short_conv.FWD_ROWS
    rows = Rows()
    rows.append(("ours, one launch", bench(lambda: short_conv.conv_silu_qkv_fwd(*xs, *ws, pos)),
                 bench(lambda: short_conv.conv_silu_qkv_bwd(*xs, *ws, *dys, pos))))
    rows.append(("ours, three launches", bench(lambda: [short_conv.conv_silu_fwd(x, w, pos) for x, w in zip(xs, ws)]),
                 bench(lambda: [short_conv.conv_silu_bwd(x, w, dy, pos) for x, w, dy in zip(xs, ws, dys)])))
    base = short_conv.conv_silu_qkv_bwd(*xs, *ws, *dys, pos)
    try:
        for t in args.fwd_rows:
            short_conv.FWD_ROWS = t
            if not all(torch.equal(a, b) for a, b in zip(short_conv.conv_silu_qkv_fwd(*xs, *ws, pos), ours)):
                log(f"FAILED: the forward with rows {t} differs from the shipped {shipped_fwd}")
                return 1
            rows.append((f"ours, forward rows {','.join(map(str, t))}", bench(lambda: short_conv.conv_silu_qkv_fwd(
                *xs, *ws, pos)), float("nan")))
        for t in args.bwd_rows:
            short_conv.BWD_ROWS = t
            got = short_conv.conv_silu_qkv_bwd(*xs, *ws, *dys, pos)
            if not (all(torch.equal(a, b) for a, b in zip(got[:3], base[:3]))
                    and all(rel_err(a, b) < 1e-3 for a, b in zip(got[3:], base[3:]))):
                log(f"FAILED: the backward with rows {t} differs from the shipped {shipped}")
                return 1
            rows.append((f"ours, backward rows {','.join(map(str, t))}", float("nan"),
                         bench(lambda: short_conv.conv_silu_qkv_bwd(*xs, *ws, *dys, pos))))
    finally:
        short_conv.BWD_ROWS, short_conv.FWD_ROWS = shipped, shipped_fwd

    fla_conv = load_fla() if device == "cuda" else None
    if fla_conv is not None:
        def fla_fwd(x, w, grad=False):
            x = x.detach().requires_grad_(grad)
            return x, fla_conv(x, w, activation="silu", cu_seqlens=cu)[0]

        theirs = [fla_fwd(x, w)[1] for x, w in zip(xs, ws)]
        log(f"fla vs float64 reference: forward rel. error {max(rel_err(o, r) for o, r in zip(theirs, ref)):.1e}; "
            f"ours vs fla {max(rel_err(o, f) for o, f in zip(ours, theirs)):.1e}")

        def fla_bwd():
            for x, w, dy in zip(xs, ws, dys):
                xg, y = fla_fwd(x, w, grad=True)
                y.backward(dy)

        def fla_fwd3():
            with torch.no_grad():
                for x, w in zip(xs, ws):
                    fla_fwd(x, w)

        f_fwd, f_both = bench(fla_fwd3), bench(fla_bwd)
        rows.append(("fla causal_conv1d", f_fwd, f_both - f_fwd))
    else:
        log("fla: no row (GPU only, and the package must import)")

    nbytes = 3 * T * C * torch.finfo(dtype).bits // 8
    floor_fwd, floor_bwd = 2 * nbytes / (args.bandwidth * 1e9), 3 * nbytes / (args.bandwidth * 1e9)
    fla_row = next((r for r in rows if r[0].startswith("fla")), None)
    print(f"\n| variant | fwd ms | bwd ms | fwd / floor | bwd / floor |{' bwd / fla |' if fla_row else ''}")
    print(f"|---|---|---|---|---|{'---|' if fla_row else ''}")
    for name, f, b in rows + [(f"floor at {args.bandwidth} TB/s", floor_fwd, floor_bwd)]:
        extra = f" {b / fla_row[2]:.2f} |" if fla_row else ""
        print(f"| {name} | {f:.3f} | {b:.3f} | {f / floor_fwd:.2f} | {b / floor_bwd:.2f} |{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
