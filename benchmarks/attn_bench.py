"""The MLA blocks' attention at the 750m training shape: flex attention with Inductor's default
tiles beside other tiles (``kernel_options``) and FlashAttention's variable-length kernel.

    python -m benchmarks.attn_bench                                     # GPU: 8 x 4,096 packed tokens
    python -m benchmarks.attn_bench --options "bwd_num_stages=2" "fwd_BLOCK_M=64,fwd_BLOCK_N=128"
    python -m benchmarks.attn_bench --dry                               # CPU: a tiny shape, forward only

The input is what one 750m microbatch hands an MLA block's attention in training: one packed
row of 8 sequences of 4,096 tokens, each sequence cut into documents of 500-6,000 tokens (a
fixed draw; a sequence always starts a document, as the loader's rows do), 16 query heads on
4 KV groups, q/k head dim 128 (96 + 32 rope), v head dim 128, bf16, the MLA's softmax scale,
causal attention inside each document. q, k and v are transposed [1, T, heads, d] tensors as
the model hands flex attention (the model's k and v are slices of wider projections).

Rows (fwd and fwd+bwd ms: median of ``triton.testing.do_bench``, the forward with autograd
recording as in training, the backward through ``torch.autograd.grad`` so that no gradient
accumulates between calls; the host clock in the dry mode). Each variant compiles afresh
(Dynamo's caches reset before it): no variant reuses another's compiled tiles or falls back to
eager flex attention at the recompile limit:

- ``flex, defaults``: the model's path (``hymo_recipes.model.mla``: ``document_attention_mask``'s
  BlockMask, ``flex_attention`` compiled), with Inductor's default tiles for this GPU;
- ``flex, OPTIONS``: the same with each ``--options`` entry as ``kernel_options`` (comma-separated
  KEY=VALUE; ``fwd_`` / ``bwd_`` prefixes address one direction's kernel, e.g. ``fwd_BLOCK_M``,
  ``bwd_BLOCK_N1``, ``bwd_num_stages``, ``USE_TMA``): what ``[hymo] mla_flex_options`` takes
  (an option flex cannot honour, e.g. ``USE_TMA`` on inputs TMA cannot load, falls back to the
  defaults inside flex: such a row then times the defaults); ``--options BACKEND=FLASH`` times
  flash-attn-4's kernels in flex's place (the ``flash`` extra installed);
- ``varlen_attn (FlashAttention 2)``: ``torch.nn.attention.varlen.varlen_attn`` on the packed
  [T, heads, d] layout with the documents' cumulative lengths (GPU, when torch has it; the KV
  groups expanded to the query heads where it has no GQA, that copy timed with it).

Per row also the attention's TFLOP/s, forward and backward, by the FLOPs the masks leave:
2 · pairs · heads · (d_qk + d_v) forward and 2.5 times that backward, where pairs is each
document's L (L + 1) / 2; and the largest relative error of its output and q, k, v gradients
against the defaults' (a row above 5e-2 fails the run: a wrong tile, not a slow one).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time

import torch

from benchmarks.common import bench_device, document_lengths, rel_err, timer, timing_args
from hymo_recipes.model.args import parse_flex_options
from hymo_recipes.model.mla import _flex_attention, document_attention_mask
from hymo_recipes.model.model import positions_in_documents

_MAX_ERR = 5e-2


def log(msg: str) -> None:
    print(f"attn_bench: {msg}", flush=True)


def kernel_options(spec: str) -> dict:
    """``KEY=VALUE[,KEY=VALUE...]`` -> flex attention's kernel_options, as the model's
    ``mla_flex_options`` reads them (an argparse type)."""
    try:
        out = parse_flex_options(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not out:
        raise argparse.ArgumentTypeError("empty kernel options")
    return out


def packed_documents(rows: int, seq: int, lo: int, hi: int) -> list[int]:
    """Document lengths of ``rows`` sequences of ``seq`` tokens, each sequence filled by its own draw."""
    return [n for r in range(rows) for n in document_lengths(seq, lo, hi, seed=r)]


def attention_flops(lengths: list[int], heads: int, d_qk: int, d_v: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of causal attention inside each document."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    fwd = 2.0 * pairs * heads * (d_qk + d_v)
    return fwd, 2.5 * fwd


def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        log(f"varlen_attn: not in this torch ({e!r})")
        return None
    return varlen_attn


def varlen_call(varlen_attn, cu: torch.Tensor, max_len: int, scale: float):
    """q [1, Hq, T, d], k, v [1, Hkv, T, d] -> o [1, Hq, T, dv] through varlen_attn, whichever of
    its signatures (causal as is_causal or as a (-1, 0) window; GQA native or expanded) torch has."""
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = "enable_gqa" in params

    def run(q, k, v):
        q3, k3, v3 = (t[0].transpose(0, 1) for t in (q, k, v))  # [T, heads, d] views
        if not gqa and k3.shape[1] != q3.shape[1]:
            rep = q3.shape[1] // k3.shape[1]
            k3, v3 = k3.repeat_interleave(rep, 1), v3.repeat_interleave(rep, 1)
        kw = dict(causal, scale=scale, **({"enable_gqa": True} if gqa else {}))
        o = varlen_attn(q3.contiguous(), k3.contiguous(), v3.contiguous(), cu, cu, max_len, max_len, **kw)
        return o.transpose(0, 1)[None]

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8, help="sequences in the packed row (default 8)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--qk-dim", type=int, default=128)
    ap.add_argument("--v-dim", type=int, default=128)
    ap.add_argument("--options", type=kernel_options, nargs="*", default=[
        {"bwd_num_stages": 2},
        {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_warps": 4},
        {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8},
        {"USE_TMA": True},
        {"ROWS_GUARANTEED_SAFE": True},
    ], help="kernel_options to time beside the defaults, each KEY=VALUE[,KEY=VALUE...]")
    ap.add_argument("--no-varlen", action="store_true", help="leave out varlen_attn")
    timing_args(ap)
    ap.add_argument("--dry", action="store_true", help="CPU: 2 sequences of 64 tokens, 4 heads on 2 groups, "
                                                       "d 16, fp32, forward only (flex has no CPU backward)")
    args = ap.parse_args(argv)
    device = bench_device(ap, args.dry)
    if args.dry:
        args.rows, args.seq, args.heads, args.kv_heads, args.qk_dim, args.v_dim = 2, 64, 4, 2, 16, 16
    for name in ("rows", "seq", "heads", "kv_heads", "qk_dim", "v_dim"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    grad = device == "cuda"
    lengths = packed_documents(args.rows, args.seq, *((10, 40) if args.dry else (500, 6000)))
    T = sum(lengths)
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    positions = positions_in_documents(cu, T)
    scale = args.qk_dim ** -0.5
    log(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"T {T} in {len(lengths)} documents (longest {max(lengths)}), {args.heads} heads on {args.kv_heads} "
        f"groups, d {args.qk_dim}/{args.v_dim}, {str(dtype).removeprefix('torch.')}"
        f"{'' if grad else ', forward only'}")

    g = torch.Generator(device="cpu").manual_seed(0)

    def make(heads, d):  # the model's layout: [1, T, heads, d] transposed to [1, heads, T, d]
        return torch.randn(1, T, heads, d, generator=g).to(device, dtype).transpose(1, 2).requires_grad_(grad)

    q, k, v = make(args.heads, args.qk_dim), make(args.kv_heads, args.qk_dim), make(args.kv_heads, args.v_dim)
    do = torch.randn(1, args.heads, T, args.v_dim, generator=g).to(device, dtype)
    if device == "cuda":
        mask = document_attention_mask(positions)
    else:  # document_attention_mask gives CPU callers SDPA's dense mask; flex wants a BlockMask
        from torch.nn.attention.flex_attention import create_block_mask

        mask = create_block_mask(lambda b, h, i, j: (j <= i) & (j >= i - positions[i]), None, None, T, T,
                                 device="cpu", BLOCK_SIZE=32)

    def outputs(fn):
        for t in (q, k, v):
            t.grad = None
        o = fn(q, k, v)
        if not grad:
            return [o.detach()]
        o.backward(do)
        return [o.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]

    def timed(fn):
        def fwd():  # autograd records, as in training; the output and its graph are dropped
            fn(q, k, v)

        def both():
            torch.autograd.grad(fn(q, k, v), (q, k, v), do)

        return bench(fwd), (bench(both) if grad else float("nan"))

    bench = timer(device, args.warmup_ms, args.rep_ms)
    variants = [("flex, defaults", lambda q_, k_, v_: _flex_attention(q_, k_, v_, mask, scale))]
    for opts in args.options:
        name = ",".join(f"{key}={val}" for key, val in opts.items())
        variants.append((f"flex, {name}", lambda q_, k_, v_, o=opts: _flex_attention(q_, k_, v_, mask, scale,
                                                                                     kernel_options=o)))
    varlen_attn = None if (args.no_varlen or device != "cuda") else _varlen()
    if varlen_attn is not None:
        variants.append(("varlen_attn (FlashAttention 2)", varlen_call(varlen_attn, cu, max(lengths), scale)))

    flops_fwd, flops_bwd = attention_flops(lengths, args.heads, args.qk_dim, args.v_dim)
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True  # never time eager flex unawares
    rows, reference = [], None
    for name, fn in variants:
        start = time.monotonic()
        # each variant compiles afresh: Dynamo may guard kernel_options by their keys alone (a
        # variant would reuse another's tiles), and past its recompile limit flex runs eagerly
        torch._dynamo.reset()
        try:
            got = outputs(fn)
        except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is a row that says so
            log(f"{name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
            if reference is None:
                log("FAILED: the defaults did not run, so there is nothing to compare with")
                return 1
            rows.append((name, float("nan"), float("nan"), float("nan"), "failed"))
            continue
        if reference is None:
            reference = got
        err = max(rel_err(a, b) for a, b in zip(got, reference))
        if err > _MAX_ERR:
            log(f"FAILED: {name} computes another attention (relative error {err:.1e} against the defaults)")
            return 1
        f, both = timed(fn)
        log(f"{name}: fwd {f:.3f} ms, fwd+bwd {both:.3f} ms, error {err:.1e} "
            f"(compiled and timed in {time.monotonic() - start:.0f} s)")
        rows.append((name, f, both, err, ""))

    base = rows[0]
    print("\n| variant | fwd ms | fwd+bwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd / defaults | rel. error |")
    print("|---|---|---|---|---|---|---|---|")
    for name, f, both, err, note in rows:
        bwd = both - f
        print(f"| {name} | {f:.3f} | {both:.3f} | {bwd:.3f} | {flops_fwd / f / 1e9:.0f} | {flops_bwd / bwd / 1e9:.0f} | "
              f"{both / base[2]:.2f} | {note or f'{err:.1e}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
