"""One HyMo block at a training microbatch, forward and backward: its time, what it keeps, and
where its GPU time goes, kernel by kernel.

    python -m benchmarks.block_profile                         # GPU: a GDN block of the 750m, 8 x 4096 tokens
    python -m benchmarks.block_profile --block mla
    python -m benchmarks.block_profile --dry                   # CPU: the debug model's block, tiny, eager

The block (hymo_recipes.model.model's GDNBlock or MLABlock, the flavor's first layer of that kind)
runs as training runs it: bf16 weights (A_log and dt_bias kept fp32, as benchmarks.gdn_layer_bench
keeps them; FSDP casts them too, a difference in [heads]-sized elementwise work), compiled per
block, the input one packed row of batch × seq tokens in documents of 500-6,000 tokens
(benchmarks.common's fixed draw) with document masking, the GDN mixer with the configs' ``gdn_mixer_saves`` (``--saves``).
A step's whole picture is benchmarks/step_profile.sh's; this is one block of it, cheap to rerun
beside a change (one call, a few minutes).

Prints the block's forward+backward time (on the GPU the mean of ``--iters`` run back to back
after ``--warmup``, between two CUDA events; in the dry mode the median by the host clock, which
says nothing), the bytes the forward leaves
allocated per token (its output included) and the backward's peak above that (GPU), then each
GPU kernel's time per forward+backward (the gradients cleared after each, so no sums across
iterations) with its launches and category
(benchmarks.trace_breakdown's), the ``--top`` longest, and the totals by category. In the dry
mode the rows are the CPU profiler's operators (self time, calls) instead, without categories.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict

import torch

from benchmarks.common import bench_device, document_lengths
from benchmarks.trace_breakdown import categorize

BLOCKS = ("gdn", "mla")


def block_args(flavor: str, saves: str, dry: bool):
    """The flavor's model args as training runs them here: the Triton backend (the CPU one in
    the dry mode) and the given ``gdn_mixer_saves``."""
    from hymo_recipes.model.args import hymo_flavors

    return dataclasses.replace(hymo_flavors[flavor], gdn_backend="torch_chunk" if dry else "triton",
                               gdn_mixer_saves=saves)


def first_layer(args, block: str) -> int | None:
    """The first layer of that kind, or None if the flavor has none."""
    mla = set(args.mla_layers)
    return next((i for i in range(args.n_layers) if (i in mla) == (block == "mla")), None)


def build(args, block: str, layer: int, device: str, dry: bool):
    """The block, weights initialised as training does; bf16 but for A_log, dt_bias and the
    buffers on the GPU."""
    from hymo_recipes.model.model import GDNBlock, MLABlock

    torch.manual_seed(0)
    m = (MLABlock if block == "mla" else GDNBlock)(layer, args).to(device)
    m.init_weights(buffer_device=torch.device(device))
    if not dry:
        m = m.to(torch.bfloat16)
        for name, p in m.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.data = p.data.float()
        for b in m.buffers():  # the MoE's load-balancing bias stays as training keeps it
            if b.is_floating_point():
                b.data = b.data.float()
    return m


def inputs(args, tokens: int, device: str, dtype: torch.dtype):
    """(x [1, tokens, dim], rope cache, cu_seqlens, positions, attention mask, documents)."""
    from hymo_recipes.model.mla import document_attention_mask, precompute_rope_cache
    from hymo_recipes.model.model import positions_in_documents

    lengths = document_lengths(tokens)
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    pos = positions_in_documents(cu, tokens)
    rope = precompute_rope_cache(args.qk_rope_head_dim, max(args.max_seq_len, tokens), args.rope_theta).to(device)
    x = torch.randn(1, tokens, args.dim, device=device, dtype=dtype)
    return x, rope, cu, pos, document_attention_mask(pos) if args.mla_layers else None, len(lengths)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block", choices=BLOCKS, default="gdn")
    ap.add_argument("--flavor", default=None, help="a hymo flavor (default 750m; debugmodel with --dry)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per microbatch (default 8; 1 with --dry)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096; 64 with --dry)")
    ap.add_argument("--saves", choices=("inputs", "outputs"), default="outputs",
                    help="the GDN mixer's gdn_mixer_saves (default outputs: the configs')")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=25, help="kernels listed (default 25)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--dry", action="store_true", help="CPU: the debug model, tiny, eager, the CPU backend")
    args = ap.parse_args(argv)
    device = bench_device(ap, args.dry)
    flavor = args.flavor or ("debugmodel" if args.dry else "750m")
    batch = args.batch if args.batch is not None else (1 if args.dry else 8)
    seq = args.seq_len if args.seq_len is not None else (64 if args.dry else 4096)
    if min(batch, seq, args.iters, args.top) < 1 or args.warmup < 0:
        ap.error("--batch, --seq-len, --iters and --top must be >= 1, --warmup >= 0")
    compile_ = args.compile and not args.dry
    from hymo_recipes.model.args import hymo_flavors

    if flavor not in hymo_flavors:
        ap.error(f"unknown flavor {flavor!r}; choose from {', '.join(sorted(hymo_flavors))}")
    margs = block_args(flavor, args.saves, args.dry)
    layer = first_layer(margs, args.block)
    if layer is None:
        ap.error(f"flavor {flavor!r} has no {args.block} block")
    block = build(margs, args.block, layer, device, args.dry)
    dtype = torch.float32 if args.dry else torch.bfloat16
    x, rope, cu, pos, mask, docs = inputs(margs, batch * seq, device, dtype)
    x.requires_grad_()
    dy = torch.randn_like(x)
    run = torch.compile(block) if compile_ else block
    print(f"block_profile: {args.block} block (layer {layer} of {flavor}), {batch} x {seq} tokens packed in "
          f"{docs} documents, {str(dtype).removeprefix('torch.')}, compile {'on' if compile_ else 'off'}, "
          f"gdn_mixer_saves = {args.saves!r}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}",
          flush=True)

    params = list(block.parameters())

    def clear_grads():  # no accumulation across iterations (in training FSDP sums the gradients)
        x.grad = None
        for p in params:
            p.grad = None

    def step():
        run(x, rope, cu, pos, mask).backward(dy)
        clear_grads()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    if device == "cuda":  # back to back, as a step queues its blocks: the host's launch gaps of one
        # iteration overlap the GPU's work on the one before (a sync per iteration would count them)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.iters):
            step()
        b.record()
        b.synchronize()
        ms = a.elapsed_time(b) / args.iters
    else:
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
        ms = statistics.median(times)
    tokens = batch * seq
    line = f"| fwd+bwd ms | {ms:.3f} |"
    if device == "cuda":
        m0 = torch.cuda.memory_allocated()
        y = run(x, rope, cu, pos, mask)
        kept = torch.cuda.memory_allocated() - m0
        torch.cuda.reset_peak_memory_stats()  # from here on the backward's peak alone
        y.backward(dy)
        del y
        clear_grads()
        sync()
        line += (f" kept KiB/token {kept / tokens / 1024:.2f} | backward's peak above what the forward left "
                 f"{(torch.cuda.max_memory_allocated() - m0 - kept) / 2**20:.0f} MiB |")
    print(line)

    from torch.profiler import ProfilerActivity, profile

    reps = 3
    acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(reps):
            step()
        sync()
    per = defaultdict(lambda: [0.0, 0])  # name -> [ms per fwd+bwd, launches per fwd+bwd]
    if device == "cuda":
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name][0] += e.device_time / 1e3 / reps
                per[e.name][1] += 1
    else:
        for e in prof.key_averages():
            per[e.key] = [e.self_cpu_time_total / 1e3 / reps, e.count]
    for v in per.values():
        v[1] = round(v[1] / reps)
    total = sum(v[0] for v in per.values())
    ranked = sorted(per.items(), key=lambda kv: -kv[1][0])[:args.top]
    if device != "cuda":  # the dry mode: the CPU profiler's operators, no kernel categories
        print(f"CPU operators (self time): {total:.3f} ms per fwd+bwd")
        print("| ms | share | calls | operator |\n|---|---|---|---|")
        for name, (ms, n) in ranked:
            print(f"| {ms:.4f} | {100 * ms / total:.1f} % | {n} | {name[:100]} |")
        return 0
    print(f"kernels: {total:.3f} ms per fwd+bwd, {sum(v[1] for v in per.values())} launches")
    print("| ms | share | launches | category | name |\n|---|---|---|---|---|")
    for name, (ms, n) in ranked:
        print(f"| {ms:.4f} | {100 * ms / total:.1f} % | {n} | {categorize(name)} | {name[:100]} |")
    cats = defaultdict(float)
    for name, (ms, _) in per.items():
        cats[categorize(name)] += ms
    print("| by category | ms | share |\n|---|---|---|")
    for cat, ms in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {ms:.3f} | {100 * ms / total:.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
