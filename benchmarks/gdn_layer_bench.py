"""One Gated DeltaNet token mixer, timed and weighed beside flash-linear-attention's and its GEMMs alone.

    python -m benchmarks.gdn_layer_bench                       # GPU: 16 x 4096 tokens, HyMo 750m's mixer
    python -m benchmarks.gdn_layer_bench --batch 4 --no-compile
    python -m benchmarks.gdn_layer_bench --dry                  # CPU: a tiny shape, the reference backend

The modules, on the same input x [B, T, dim] (bf16 on the GPU):
- ``hymo``: HyMo's ``GatedDeltaNet`` (hymo_recipes.model.gdn) at the 750m flavor's shape (dim 896,
  40 heads, K = V = 32), the Triton backend with its fused ops (hymo_kernels.gdn.mixer), compiled
  as training compiles it (per module, ``torch.compile``) unless ``--no-compile``;
  ``hymo_keep`` the same keeping the conv outputs and the gated norm's output for the backward
  (``gdn_mixer_saves = "outputs"``) instead of recomputing them; ``hymo_local`` the same with
  the kernel's "local" backward (``gdn_bwd_path = "local"``: only chunk-boundary states saved,
  the sub-chunk states recomputed in the backward);
  ``hymo_unfused`` the same with ``gdn_fused_mixer = False`` (conv, norms and gates in PyTorch);
- ``fla``: flash-linear-attention's ``fla.layers.GatedDeltaNet`` at the same shape (short conv,
  output gate, chunk mode; its own fused kernels; never compiled, as fla's layer is not
  compile-clean), when the package imports (GPU only);
- ``gemms``: the mixer's GEMMs alone as the fused layer runs them (q, k, v in one projection;
  a, b, g; o out) as plain matmuls: the floor the fused layer should approach,
  with the GDN kernel's time on top.

Per module: forward and forward+backward time (median over ``--iters`` after warm-up, CUDA events;
host clock on the CPU), and the activations kept per token: the bytes of every distinct tensor
autograd saves for the backward (saved-tensor hooks, parameters excluded) over B × T, in KiB.
On the GPU also the allocator's growth across the forward (output included) per token.
fla-core refuses its gated backward on Hopper with Triton < 3.7.1 (fla issue #640); as in
benchmarks/gdn/bench.py that guard is lifted here for timing only, and the output says so.
"""

from __future__ import annotations

import argparse
import math
import dataclasses
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


MODULES = ("hymo", "hymo_keep", "hymo_local", "hymo_unfused", "fla", "gemms")


def log(msg: str) -> None:
    print(f"gdn_layer_bench: {msg}", flush=True)


class SavedBytes:
    """Counts the bytes of the distinct non-parameter tensors autograd saves while active."""

    def __init__(self, params: set[int]):
        self.params = params
        self.seen: dict[tuple, int] = {}

    def pack(self, t: torch.Tensor):
        if t.data_ptr() not in self.params and t.numel() > 0:
            st = t.untyped_storage()
            self.seen[(st.data_ptr(), t.device.type)] = st.nbytes()
        return t

    def __enter__(self):
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


class Gemms(nn.Module):
    """The GDN mixer's GEMMs only, as the fused layer runs them: x -> q, k, v in one projection,
    a, b, g each in their own; o_proj on a [.., value_dim] input."""

    def __init__(self, dim: int, n_heads: int, K: int, V: int):
        super().__init__()
        self.ins = nn.ModuleList(nn.Linear(dim, n, bias=False) for n in (n_heads * (2 * K + V), n_heads, n_heads,
                                                                            n_heads * V))
        self.o_proj = nn.Linear(n_heads * V, dim, bias=False)

    def forward(self, x):
        qkv, a, b, gate = (lin(x) for lin in self.ins)
        return self.o_proj(gate) + (qkv.sum() + a.sum() + b.sum()) * 0


@dataclasses.dataclass
class Result:
    name: str
    fwd_ms: float = float("nan")
    fwdbwd_ms: float = float("nan")
    saved_kib: float = float("nan")
    alloc_kib: float = float("nan")
    note: str = ""


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
    else:
        def run(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    return run


def measure(name: str, module: nn.Module, x: torch.Tensor, args) -> Result:
    res = Result(name)
    dy = torch.randn_like(x)
    timer = _timer(x.device)

    def fwd():
        return module(x)

    def fwdbwd():
        y = module(x)
        y.backward(dy)

    try:
        for _ in range(args.warmup):
            fwdbwd()
        res.fwd_ms = statistics.median(timer(fwd) for _ in range(args.iters))
        res.fwdbwd_ms = statistics.median(timer(fwdbwd) for _ in range(args.iters))
        params = {p.data_ptr() for p in module.parameters()}
        if x.device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        with SavedBytes(params) as saved:
            y = module(x)
        tokens = x.shape[0] * x.shape[1]
        res.saved_kib = saved.total / tokens / 1024
        if x.device.type == "cuda":
            torch.cuda.synchronize()
            res.alloc_kib = (torch.cuda.memory_allocated() - before) / tokens / 1024
        del y
    except Exception as e:  # noqa: BLE001  (a peer that fails is reported, not fatal)
        res.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    for p in module.parameters():
        p.grad = None
    x.grad = None
    return res


def build_hymo(args, device, dtype, fused: bool = True, saves: str = "inputs", bwd_path: str = "table"):
    from hymo_recipes.model import HymoModelArgs
    from hymo_recipes.model.gdn import GatedDeltaNet

    margs = HymoModelArgs(dim=args.dim, gdn_n_heads=args.heads, gdn_head_dim=args.head_dim,
                          gdn_v_head_dim=args.head_dim, gdn_backend="torch_chunk" if args.dry else "triton",
                          gdn_fused_mixer=fused, gdn_mixer_saves=saves, gdn_bwd_path=bwd_path)
    m = GatedDeltaNet(margs).to(device=device)
    m.init_weights(0.02, 0.02)
    m = m.to(dtype)
    m.A_log.data, m.dt_bias.data = m.A_log.data.float(), m.dt_bias.data.float()
    return torch.compile(m) if args.compile else m


def build_fla(args, device, dtype):
    import fla.ops.common.chunk_o as fla_chunk_o
    from fla.layers import GatedDeltaNet as FlaGDN

    lifted = bool(getattr(fla_chunk_o, "IS_NVIDIA_HOPPER", False) and getattr(fla_chunk_o, "TRITON_ABOVE_3_4_0", False)
                  and not getattr(fla_chunk_o, "TRITON_ABOVE_3_7_1", True))
    if lifted:
        fla_chunk_o.TRITON_ABOVE_3_4_0 = False
    log(f"fla: Hopper/Triton<3.7.1 guard on the gated backward (fla #640) {'LIFTED for timing' if lifted else 'not active'}")
    m = FlaGDN(hidden_size=args.dim, expand_v=1, head_dim=args.head_dim, num_heads=args.heads, mode="chunk",
               use_gate=True, use_short_conv=True, conv_size=4).to(device=device, dtype=dtype)

    class Wrap(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)[0]

    return Wrap(m)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shape, the torch_chunk reference, no fla")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default 16; 1 with --dry)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096; 64 with --dry)")
    ap.add_argument("--dim", type=int, default=None, help="model dim (default 896; 64 with --dry)")
    ap.add_argument("--heads", type=int, default=None, help="GDN heads (default 40; 2 with --dry)")
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (default 20; 2 with --dry)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed fwd+bwd first (default 5; 1 with --dry)")
    ap.add_argument("--only", nargs="+", choices=MODULES, default=None, help="time only these modules")
    args = ap.parse_args(argv)
    dry = args.dry
    args.batch = args.batch or (1 if dry else 16)
    args.seq_len = args.seq_len or (64 if dry else 4096)
    args.dim = args.dim or (64 if dry else 896)
    args.heads = args.heads or (2 if dry else 40)
    args.iters = args.iters or (2 if dry else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if dry else 5)
    if dry:
        args.compile = False
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            sys.exit("gdn_layer_bench: no CUDA GPU; run with --dry on a CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16
        log(f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq_len, args.dim, device=device, dtype=dtype, requires_grad=True)
    log(f"x [{args.batch}, {args.seq_len}, {args.dim}] {str(dtype).removeprefix('torch.')}, {args.heads} heads of "
        f"K = V = {args.head_dim}, compile {'on' if args.compile else 'off'}")
    only = set(args.only or MODULES)
    results = []
    if "hymo" in only:
        results.append(measure("hymo", build_hymo(args, device, dtype), x, args))
    if "hymo_keep" in only and not dry:
        results.append(measure("hymo_keep", build_hymo(args, device, dtype, saves="outputs"), x, args))
    if "hymo_local" in only and not dry:
        results.append(measure("hymo_local", build_hymo(args, device, dtype, bwd_path="local"), x, args))
    if "hymo_unfused" in only and not dry:
        results.append(measure("hymo_unfused", build_hymo(args, device, dtype, fused=False), x, args))
    if "fla" in only and dry:
        results.append(Result("fla", note="skipped: GPU only"))
    elif "fla" in only:
        try:
            fla_mod = build_fla(args, device, dtype)
        except Exception as e:  # noqa: BLE001
            results.append(Result("fla", note=f"not available: {type(e).__name__}: {e}"[:200]))
        else:
            results.append(measure("fla", fla_mod, x, args))
    if "gemms" in only:
        results.append(measure("gemms", Gemms(args.dim, args.heads, args.head_dim, args.head_dim).to(device, dtype),
                               x, args))
    by = {r.name: r for r in results}
    print("| module | fwd ms | fwd+bwd ms | saved KiB/token | alloc KiB/token | note |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.name} | {r.fwd_ms:.3f} | {r.fwdbwd_ms:.3f} | {r.saved_kib:.1f} | {r.alloc_kib:.1f} | {r.note} |")
    for name in ("hymo", "hymo_keep", "hymo_local"):
        h = by.get(name)
        if h is None:
            continue
        for peer in ("fla", "gemms"):
            if peer in by and not math.isnan(by[peer].fwdbwd_ms):  # measured
                print(f"{name} / {peer}: fwd+bwd {h.fwdbwd_ms / by[peer].fwdbwd_ms:.2f}x, "
                      f"saved per token {h.saved_kib / by[peer].saved_kib:.2f}x")
    return 1 if any(r.note and r.name.startswith("hymo") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
