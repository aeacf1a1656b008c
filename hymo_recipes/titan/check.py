"""The config check: every check a run makes before it trains, in one process, without the
machine the run is for (``CHECK=1 ./run_train.sh``, or ``python -m hymo_recipes.titan.check
--job.config_file <toml> [overrides]``; ``NGPU``: the run's process count, default 1).

It parses the config and runs the preflight (preflight.py: value types, flavor, sequence
lengths, tokenizer, schedule, optimizer values, batch sizes against the process count, the data
and the checkpoint a resume would load), builds the model on the meta device (no memory),
builds the optimizers on it (the partition: tensors and parameters per optimizer) and prints a
memory estimate per GPU under FSDP2 at the run's process count: parameters, gradients and
optimizer states, sharded over the data-parallel ranks, plus the gathered parameters: two blocks
when FSDP reshards after the forward, every block when it does not (one rank, by default), and
with ``optimizer.cuda_graph`` its static copy of the gradients not read by address (not its pool
of temporaries); and the activations (``activation_bytes``): what eager autograd saves for the
backward, measured by running one block of each kind, and the final norm, MTP heads, tied head
and loss, on meta tensors of the run's [local_batch_size, seq_len] in
training.mixed_precision_param, under ``saved_tensors_hooks``, times the blocks of that kind, as
activation checkpointing leaves it. torch.compile's partitioner may save less or more than eager
autograd, and the peak also holds transient buffers (kernel workspaces, the logits' gradients,
the block being recomputed's temporaries, the allocator's fragmentation): BENCHMARKS.md measures
the peaks. Not checked, being properties of the machine that runs: whether it can run the GDN
backend and compile it. No step runs and nothing is written; meta tensors hold no memory, so
hymo_750m checks on a small CPU machine.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys

from hymo_recipes.titan import console, cpu_shims  # noqa: F401 - cpu_shims first (hymo_recipes/titan/__init__.py)
from hymo_recipes.titan.api import TORCH_DTYPE_MAP, init_logger, logger

GIB = 1 << 30


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _saved_bytes(fn, exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``fn()`` runs, less
    those in ``exclude`` (storage keys of parameters and buffers: the gathered parameters are
    counted apart, and a buffer is not an activation).

    Dedupe by storage: meta tensors have no data (every data_ptr is 0), so a storage is known by
    its C++ StorageImpl's address (``untyped_storage()._cdata``), which every view of a tensor
    shares and no two live storages share (the hook holds each saved tensor until the count is
    done, so no address is reused). A storage counts its whole size: a saved slice keeps its
    whole base alive."""
    import torch

    saved: dict[int, tuple[int, object]] = {}

    def pack(t):
        s = t.untyped_storage()
        saved.setdefault(s._cdata, (s.nbytes(), t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(n for key, (n, _) in saved.items() if key not in exclude)


def _storage_keys(*modules) -> set[int]:
    return {t.untyped_storage()._cdata for m in modules for t in (*m.parameters(), *m.buffers())}


def _gpu_kernels():
    """A TorchFunctionMode under which the probe saves what the GPU's eager kernels save, where
    the meta device's (CPU-style composite) paths differ: causal SDPA without a mask runs as flash
    attention (saves q, k, v, the output and fp32 logsumexp [B, H, T]; CUDA's flash op also keeps
    two RNG scalars: the CPU flash op, which has a meta kernel, stands in), not as the math path
    (which saves the [B, H, T, T] attention weights); RMSNorm as the fused kernel (saves its
    input, weight and fp32 1/rms per row), not as fp32 composite ops."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class FusedRMSNorm(torch.autograd.Function):
        # forward only: the probe never runs a backward
        @staticmethod
        def forward(ctx, x, shape, weight, eps):
            dims = tuple(range(-len(shape), 0))
            rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + (torch.finfo(x.dtype).eps if eps is None
                                                                             else eps))
            ctx.save_for_backward(x, weight, rstd)
            y = (x.float() * rstd).to(x.dtype)
            return y if weight is None else y * weight

        @staticmethod
        def backward(ctx, dy):
            raise NotImplementedError("the config check's memory probe has no backward")

    def rms_norm(input, normalized_shape, weight=None, eps=None):  # F.rms_norm's signature
        return FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps)

    class GPUKernels(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is None and len(args) == 3:
                q, k, v = args
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                    scale=kwargs.get("scale"))[0]
            if func is F.rms_norm:
                return rms_norm(*args, **kwargs)
            return func(*args, **kwargs)

    return GPUKernels()


@contextlib.contextmanager
def _probe_recompute():
    """The recomputed regions (hymo_recipes/model/recompute.py) as the probe sees them: the
    checkpoint's own storage is invisible to ``saved_tensors_hooks``, so within this context a
    region runs without autograd and one forward-only node saves what the checkpoint keeps (its
    tensor inputs and the outputs of the matmuls inside)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hymo_recipes.model import recompute

    class Kept(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, *kept):
            ctx.save_for_backward(*kept)
            return out.view_as(out)  # the kept storage, as the checkpoint's cache shares it

        @staticmethod
        def backward(ctx, dout):
            raise NotImplementedError("the config check's memory probe has no backward")

    def probe_checkpoint(fn, *args, **kwargs):
        kept = [a for a in args if isinstance(a, torch.Tensor)]

        class Matmuls(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, a=(), kw=None):
                out = func(*a, **(kw or {}))
                if func in recompute.KEPT_OPS:
                    kept.append(out)
                return out

        with torch.no_grad(), Matmuls():
            out = fn(*args)
        return Kept.apply(out, *kept)

    real = recompute.checkpoint
    recompute.checkpoint = probe_checkpoint
    try:
        yield
    finally:
        recompute.checkpoint = real


def _probe_copy(module, dtype, memo=None):
    """A copy of a meta module with its parameters (not buffers) in ``dtype``, as FSDP's mixed
    precision gathers them; routed experts as they run on the GPU (``_probe_experts``)."""
    import copy

    import torch

    from hymo_recipes.model.moe import GroupedExperts

    # to_empty: a meta model's copy on the meta device whatever the copy did (after some
    # torch.compile traces in the same process, a deepcopy of meta parameters comes back on the CPU)
    m = copy.deepcopy(module, memo).to_empty(device="meta")
    for p in m.parameters():
        p.data = p.data.to(dtype)
    for sub in m.modules():
        if isinstance(sub, GroupedExperts):
            sub.forward = _probe_experts.__get__(sub)
    return m


def _probe_experts(self, x, rows, num_tokens_per_expert, capacity=None, assignments=None):
    """GroupedExperts.forward on meta tensors as it runs on a GPU: torch._grouped_mm for bf16
    (its shapes are fixed by the token and expert counts), else the per-expert loop, here over an
    even split of the rows: the loop's saved tensors hold each expert's rows, so their bytes are
    the same for every split (the real one needs the routing's data). Nothing dropped: the
    capacity is ignored, which counts the most the experts can keep. ``assignments`` goes to the
    grouped path as the MoE passes it (its inverse map is kept for the backward)."""
    import torch

    from hymo_recipes.model.grouped_mm import grouped_swiglu

    w1, w2, w3 = self.w1, self.w2, self.w3
    dtype = w1.dtype if self.mixed_precision else torch.promote_types(x.dtype, w1.dtype)
    if self.use_grouped_mm and dtype == torch.bfloat16:
        return grouped_swiglu(w1, w2, w3, x, rows, num_tokens_per_expert,
                              recompute_products=self.recompute_products, assignments=assignments)
    E, M = self.num_experts, rows.shape[0]
    even = torch.tensor([M // E + (e < M % E) for e in range(E)])
    out, at = self._loop(x[rows].to(dtype), w1.to(dtype), w2.to(dtype), w3.to(dtype), even)
    return out.to(x.dtype), at


def _block_kind(block) -> str:
    name = "MLA+MoE block" if getattr(block, "moe_enabled", False) else "GDN block"
    return name if getattr(block.attn, "use_rope", True) else f"{name} (NoPE)"


def activation_bytes(model, config) -> dict:
    """Activations per GPU for one microbatch (module docstring): eager autograd's saved set on the
    GPU's kernels (``_gpu_kernels``), at the run's [local_batch_size, seq_len], in
    training.mixed_precision_param, for unpacked rows (document masking's masked attention is not
    probed).

    Returns ``{"blocks": {kind: (count, saved bytes of one block)}, "input": one block's input,
    "heads": final norm + MTP heads + tied head + loss (with ``fused_loss_chunk``, the fused
    readout's kept gradients per head; else the logits in fp32 for the cross entropy), "kept":
    what stays for the backward as activation_checkpoint.mode leaves it, "assumed": how the mode
    was counted}``. Activation checkpointing: "full" keeps each block's input, plus one block's saved set while it is recomputed in the backward; "selective" with
    a layer period n (selective_ac_option "n", TorchTitan's count from 1) does that for every
    n-th block and keeps the others whole; per-op selective ("op") is counted as no
    checkpointing, an upper bound (it keeps the saved ops' outputs and recomputes the rest)."""
    import torch

    from hymo_recipes.model.recompute import defer_to_outer_checkpoint
    from hymo_recipes.titan.loss import head_ce_sums

    t = config.training
    dtype = TORCH_DTYPE_MAP[t.mixed_precision_param]
    B, T, D = t.local_batch_size, t.seq_len, model.model_args.dim
    base = _storage_keys(model)
    rope = model.rope_cache.to("meta")
    ac = config.activation_checkpoint
    mode, option = ac.mode, str(getattr(ac, "selective_ac_option", ""))
    per_layer = mode == "full" or (mode == "selective" and option.isdigit())
    n = 1 if mode == "full" else int(option) if per_layer else 0
    # the blocks TorchTitan's apply_ac wraps (per layer: every n-th counted from 1; per op: all),
    # where keep_matmuls defers to the outer checkpoint (parallelize.py)
    checkpointed = [mode != "none" and (not per_layer or not n or i % n == 0)
                    for i in range(1, len(model.layers) + 1)]
    kinds, order = {}, []
    with _gpu_kernels(), _probe_recompute():
        for block, wrapped in zip(model.layers.values(), checkpointed):
            kind = _block_kind(block) + (", checkpointed" if wrapped else "")
            order.append(kind)
            if kind in kinds:
                kinds[kind][0] += 1
                continue
            probe = _probe_copy(block, dtype)
            if wrapped:
                defer_to_outer_checkpoint(probe)
            x = torch.empty(B, T, D, device="meta", dtype=dtype, requires_grad=True)
            saved = _saved_bytes(lambda: probe(x, rope), base | _storage_keys(probe))
            kinds[kind] = [1, saved]
        # the root without its blocks: embedding (saves the token ids), final norm, MTP heads, tied head
        head = _probe_copy(model, dtype, memo={id(model.layers): torch.nn.ModuleDict()})
        tokens = torch.empty(B, T, device="meta", dtype=torch.long)
        if model.model_args.fused_loss_chunk:  # training's path: the model computes the losses
            run_heads = lambda: head(tokens, labels=tokens)  # noqa: E731
        else:
            run_heads = lambda: head_ce_sums(*head(tokens), tokens)  # noqa: E731
        heads = _saved_bytes(run_heads, base | _storage_keys(head))
    x_bytes = B * T * D * dtype.itemsize
    if per_layer:
        kept = sum(x_bytes if c else kinds[k][1] for k, c in zip(order, checkpointed))
        kept += max((kinds[k][1] for k, c in zip(order, checkpointed) if c), default=0)
        assumed = ("each block keeps its input, one block recomputed at a time" if mode == "full" else
                   f"every {n}th block keeps its input (one recomputed at a time), the others all")
    else:
        kept = sum(count * saved for count, saved in kinds.values())
        assumed = ("no checkpointing" if mode == "none" else
                   "per-op selective counted as no checkpointing, an upper bound")
    return {"blocks": {k: tuple(v) for k, v in kinds.items()}, "input": x_bytes, "heads": heads,
            "kept": kept + heads, "assumed": assumed}


def memory_lines(model, optimizers: dict, config, dp: int) -> list[str]:
    """The estimate per GPU (module docstring), one line each."""
    import torch

    params = list(model.parameters())
    p_bytes = _tensor_bytes(params)
    state = [v for opt in optimizers.values() for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    o_bytes = _tensor_bytes(state)
    from hymo_recipes.titan.data_checks import gradient_accumulation
    from hymo_recipes.titan.parallelize import fsdp_plan, reshard_after_forward

    gathered = TORCH_DTYPE_MAP[config.training.mixed_precision_param].itemsize
    numel = sum(p.numel() for p in params)
    block = max((sum(p.numel() for p in layer.parameters()) for layer in model.layers.values()), default=0)
    units, sync_once = fsdp_plan(getattr(config, "hymo", None), dp)
    # reduced once per step, every unit stays gathered from a microbatch's backward to the next forward
    sync_once = sync_once and gradient_accumulation(config, dp) > 1
    if reshard_after_forward(config.parallelism.fsdp_reshard_after_forward, dp) and units == "block" \
            and not sync_once:
        # FSDP2 gathers one block ahead (forward and backward prefetch): two blocks at a time
        gather_bytes, gathers = 2 * block * gathered, "all-gathered blocks"
    else:  # every block's gathered copy stays from its forward to its backward
        gather_bytes, gathers = numel * gathered, "gathered copies kept for the backward"
    # gradients summed unsharded over a step's microbatches (fsdp_sync_once_per_step), in the reduction dtype
    sums = numel * TORCH_DTYPE_MAP[config.training.mixed_precision_reduce].itemsize if sync_once else 0
    # optimizer.cuda_graph (one rank) replays the step from a static copy of the gradients, but
    # for those an optimizer reads by address (NorMuon's fused kernels)
    by_address = {id(p) for opt in optimizers.values() for p in getattr(opt, "grads_by_address", list)()}
    graph = (_tensor_bytes([p for p in params if id(p) not in by_address]) / dp
             if getattr(getattr(config, "optimizer", None), "cuda_graph", False) else 0)
    total = (2 * p_bytes + o_bytes) / dp + gather_bytes + sums + graph
    t = config.training
    act = activation_bytes(model, config)
    tokens = t.local_batch_size * t.seq_len
    blocks = ", ".join(f"{kind} {saved / tokens / 1024:.1f} KiB/token x {count}"
                       for kind, (count, saved) in act["blocks"].items())
    return [f"HyMo memory per GPU at {dp} data-parallel rank(s) (FSDP2, sharded): parameters {_size(p_bytes / dp)}, "
            f"gradients {_size(p_bytes / dp)}, optimizer states {_size(o_bytes / dp)}, {gathers} "
            f"{_size(gather_bytes)} ({t.mixed_precision_param})"
            + (f", unsharded gradient sums {_size(sums)} ({t.mixed_precision_reduce})" if sums else "")
            + (f", the CUDA-graphed optimizer step's gradient copy {_size(graph)} (its pool of the step's "
               "temporaries apart)" if graph else "")
            + f"; {_size(total)} in all, activations apart (next line)",
            f"HyMo activations per GPU, eager autograd's saved tensors for {t.local_batch_size} x {t.seq_len:,} tokens "
            f"in {t.mixed_precision_param} (activation_checkpoint {config.activation_checkpoint.mode}: "
            f"{act['assumed']}): {blocks}, norm + MTP heads + head + loss "
            f"{act['heads'] / tokens / 1024:.1f} KiB/token; {_size(act['kept'])}, {_size(total + act['kept'])} with "
            "the line above (torch.compile's partitioner may save less or more; the peak adds transient buffers)"]


def main(args: list[str] | None = None) -> None:
    import torch

    from hymo_recipes.model import HymoModel, hymo_flavors
    from hymo_recipes.scheduler import wsd_schedule
    from hymo_recipes.titan.data_checks import dp_degree, gradient_accumulation
    from hymo_recipes.titan.optimizers import optimizers_for_part
    from hymo_recipes.titan.spec import describe_model
    from hymo_recipes.titan.train import parse_config

    init_logger()
    console.quiet(cpu=cpu_shims.no_accelerator())
    os.environ["WORLD_SIZE"] = os.environ.get("NGPU", "1")  # the run's process count, for the preflight
    argv = sys.argv[1:] if args is None else args
    config = parse_config(argv, this_machine=False)
    if config.model.name != "hymo":
        raise SystemExit(f"hymo check: [model] name is {config.model.name!r}; the check knows HyMo's models only")
    dp = dp_degree(config)
    model_args = copy.deepcopy(hymo_flavors[config.model.flavor])
    model_args.update_from_config(config)
    with torch.device("meta"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype])
        try:
            model = HymoModel(model_args)
        finally:
            torch.set_default_dtype(previous)
        optimizers = optimizers_for_part(model, config.optimizer)
    logger.info(describe_model(config.model.flavor, model_args))
    from hymo_recipes.titan.spec import describe_run

    for line in describe_run(config, [model], _Named(optimizers), None):
        logger.info(line)
    t = config.training
    accumulation = gradient_accumulation(config, dp)
    schedule = wsd_schedule(config.lr_scheduler, t.steps)
    logger.info(f"HyMo batch: {t.local_batch_size} sequences of {t.seq_len} per rank and microbatch, {dp} data-parallel "
                f"rank(s), {accumulation} microbatch(es) per step: {t.local_batch_size * dp * accumulation * t.seq_len:,} "
                f"tokens per step, {t.steps:,} steps; schedule: warmup {schedule.warmup_steps:,}, stable "
                f"{schedule.stable_steps:,}, decay {schedule.decay_steps:,} steps")
    for line in memory_lines(model, optimizers, config, dp):
        logger.info(line)
    logger.info(f"hymo check: {config.job.config_file} passed at {os.environ['WORLD_SIZE']} process(es) "
                f"(not checked here: whether the machine that runs it can run GDN backend {model_args.gdn_backend!r}"
                f"{' and compile' if config.compile.enable else ''})")


class _Named:
    """The optimizers of one part, in the shape ``describe_run`` reads from a container."""

    def __init__(self, optimizers: dict):
        self.optimizer_names = list(optimizers)
        self.optimizers = list(optimizers.values())


if __name__ == "__main__":
    main()
