"""Applies activation checkpointing, per-block torch.compile and FSDP2 to a HyMo model.

The canonical TorchTitan order (models/README.md): TP/EP -> AC -> compile -> FSDP. HyMo has no
TP/EP/CP/PP plans yet; asking for them raises. The same function runs on 1..N GPUs and on CPU
(gloo): FSDP2 is applied even on a single rank, on the 1-rank world mesh, so bf16 parameters
with fp32 reduction and fp32 sharded masters mean the same thing at every scale.

Note for one rank with bf16: TorchTitan's Trainer also enters ``torch.autocast`` whenever its
FSDP check (data-parallel shard degree > 1) is false. With FSDP's bf16 parameters autocast
changes only the ops it keeps in fp32 (norms, softmax, ...); it is inactive for fp32 runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from hymo_kernels.accum.add import accumulate_ as accumulate_triton, pair_refused
from hymo_kernels.ce import ce_chunk
from hymo_kernels.ce.chunk import ce_chunk as ce_chunk_triton
from hymo_recipes.model.recompute import defer_to_outer_checkpoint
from hymo_recipes.nonfinite_probe import NonfiniteProbe
from hymo_recipes.titan.api import TORCH_DTYPE_MAP, apply_ac, logger

# Selective (per-op) activation checkpointing keeps these ops' outputs instead of recomputing
# them: the matmuls and attention kernels that dominate recompute time, FSDP's
# reduce-scatter, and max (cheap to keep, needed by low-precision scaling).
_op_sac_save_list = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_attention_math.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
    torch._higher_order_ops.inductor_compiled_code,
}


def check_compile_backend(job_config, gdn_backend: str) -> bool:
    """Whether the model's blocks are compiled; raises if the GDN backend cannot be."""
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if compile_model and gdn_backend == "torch_chunk":
        raise ValueError("[hymo] gdn_backend = 'torch_chunk' is kept out of torch.compile (its "
                         "compiled backward fails), and the blocks compile with fullgraph: use "
                         "gdn_backend = 'triton' on a GPU, or --compile.no-enable")
    return compile_model


# [hymo] fsdp_units: which modules are FSDP units besides the root
FSDP_UNITS = {
    "auto": "model, with gradients reduced once per step, on one data-parallel rank; block on more",
    "block": "one unit per block and per MTP head, the root keeping the rest",
    "model": "the root only: one gather before the forward and one reduce after the backward",
}


def fsdp_plan(hymo, ranks: int) -> tuple[str, bool]:
    """(FSDP units, whether gradients are reduced once per step) for ``ranks`` data-parallel
    ranks from ``[hymo] fsdp_units`` and ``fsdp_sync_once_per_step`` (``hymo`` None: the
    defaults). On one rank "auto" takes the root alone and syncs once per step: FSDP there only
    casts and copies, and its per-block, per-microbatch hooks cost the host more than the GPU
    waits for."""
    units = getattr(hymo, "fsdp_units", "auto")
    sync_once = bool(getattr(hymo, "fsdp_sync_once_per_step", False))
    if units not in FSDP_UNITS:
        raise ValueError(f"[hymo] fsdp_units = {units!r}: one of {', '.join(FSDP_UNITS)}")
    if units == "auto":
        return ("model", True) if ranks == 1 else ("block", sync_once)
    return units, sync_once


def data_parallel_ranks(parallel_dims) -> int:
    """The ranks FSDP shards over (replicas times shards)."""
    return parallel_dims.dp_replicate * parallel_dims.dp_shard


def parallelize_hymo(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    _check_supported(parallel_dims, job_config)
    # [hymo] gdn_backend is applied by HymoModelArgs.update_from_config; make sure it was.
    hymo = getattr(job_config, "hymo", None)  # absent without [job] custom_config_module
    wanted = hymo.gdn_backend if hymo is not None else "flavor"
    if wanted != "flavor" and model.model_args.gdn_backend != wanted:
        raise ValueError(f"[hymo] gdn_backend = {wanted!r} was not applied: the model was built "
                         f"with {model.model_args.gdn_backend!r}")
    compile_model = check_compile_backend(job_config, model.model_args.gdn_backend)
    if job_config.activation_checkpoint.mode != "none":
        apply_checkpointing(model, job_config, compile_model)
    if compile_model:
        apply_compile(model, job_config.compile.backend)
    apply_loss_compile(model, job_config)
    if hymo is not None and hymo.nonfinite_probe:
        # After compile (it watches compiled blocks as wholes), before FSDP: its hooks must run
        # before FSDP's post-forward reshard, so that an eager replay sees whole parameters.
        model.nonfinite_probe = NonfiniteProbe(model)
        logger.warning("[hymo] nonfinite_probe is on: module outputs are checked every step (slow)")

    if parallel_dims.dp_replicate_enabled:
        mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp"])  # HSDP
    elif parallel_dims.dp_shard_enabled:
        mesh = parallel_dims.get_mesh("fsdp")
    else:
        mesh = parallel_dims.world_mesh  # one rank
    training = job_config.training
    units, sync_once = fsdp_plan(hymo, data_parallel_ranks(parallel_dims))
    apply_fsdp(
        model,
        mesh,
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        reshard_after_forward=reshard_after_forward(job_config.parallelism.fsdp_reshard_after_forward,
                                                    mesh.size()),
        units=units,
    )
    if mesh.size() == 1 and getattr(hymo, "fsdp_one_rank_copy", True):
        apply_one_rank_copy(model)
        logger.info("FSDP's one-rank gather: one multi-tensor cast-and-copy per FSDP unit ([hymo] fsdp_one_rank_copy)")
    if sync_once and getattr(hymo, "fsdp_accumulate_kernel", True):
        apply_grad_accumulation(model)
        logger.info("FSDP's gradient sums over a step's microbatches: one hymo_kernels.accum launch per unit "
                    "where the gradients are CUDA tensors and the sums fp32 ([hymo] fsdp_accumulate_kernel)")
    logger.info(f"Applied FSDP2 to the model on a mesh of {mesh.size()} rank(s) ({units} units"
                f"{', gradients reduced once per step' if sync_once else ''}), parameters in "
                f"{training.mixed_precision_param}, reduction in {training.mixed_precision_reduce}")
    return model


def apply_checkpointing(model: nn.Module, job_config, compile_model: bool) -> list[str]:
    """TorchTitan's activation checkpointing of the blocks; inside each block it wraps, the
    SwiGLUs' own product recompute (model/recompute.py) is turned off, since the outer checkpoint
    recomputes them whole. Returns the names of the wrapped blocks."""
    blocks = dict(model.layers.named_children())
    apply_ac(model, job_config.activation_checkpoint, model_compile_enabled=compile_model,
             op_sac_save_list=_op_sac_save_list, base_folder=job_config.job.dump_folder)
    wrapped = [name for name, layer in model.layers.named_children() if layer is not blocks[name]]
    for name in wrapped:
        defer_to_outer_checkpoint(model.layers[name])
    return wrapped


def apply_loss_compile(model: nn.Module, job_config) -> bool:
    """Makes the fused readout + cross-entropy's per-chunk work (hymo_recipes/model/linear_ce.py)
    fast when compile is on with "loss" among its components and the model computes its loss
    (``fused_loss_chunk`` > 0); whether it did. On a GPU the chunks go to HyMo's Triton kernel
    (hymo_kernels.ce.chunk: the logits read once, which Inductor's code for them does not do),
    elsewhere to ``ce_chunk`` compiled; the choice is made per call by the logits' device."""
    c = job_config.compile
    if not (c.enable and "loss" in c.components and model.model_args.fused_loss_chunk):
        return False
    model.loss_chunk_fn = LossChunks(torch.compile(ce_chunk, backend=c.backend, dynamic=False))
    logger.info("The fused loss's per-chunk cross-entropy: HyMo's Triton kernel on GPU logits, "
                "ce_chunk compiled on others (compile components include \"loss\")")
    return True


class LossChunks:
    """The fused loss's per-chunk function: CUDA logits to the Triton kernel, others to ``cpu``."""

    def __init__(self, cpu):
        self.cpu = cpu

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, want_grad: bool):
        if logits.is_cuda:
            return ce_chunk_triton(logits, targets, want_grad)
        return self.cpu(logits, targets, want_grad)


def reshard_after_forward(policy: str, ranks: int) -> bool:
    """TorchTitan's ``parallelism.fsdp_reshard_after_forward``: "always" / "never", and for
    "default" resharding on more than one rank only. On one rank a block's parameters gathered
    for the forward are all of them, in bf16 (2 bytes per parameter kept until the backward):
    resharding would only repeat the copies and casts in the backward."""
    if policy not in ("default", "always", "never"):
        raise ValueError(f"parallelism.fsdp_reshard_after_forward = {policy!r}: default, always or never")
    return policy == "always" or (policy == "default" and ranks > 1)


def apply_grad_accumulation(model: nn.Module) -> None:
    """Gradient accumulation with gradients reduced once per step (fsdp_sync_once_per_step, or
    "auto" on one rank) in one launch per FSDP unit.

    There, each microbatch of a step after the first adds every parameter's unsharded bf16
    gradient into its sum in the reduction dtype, and FSDP2 does that with one PyTorch add per
    parameter (its post-backward), whose mixed-dtype kernel loads and stores one element at a
    time. Here each unit's post-backward first adds its pairs with hymo_kernels.accum (one
    Triton launch per gradient dtype, 16-byte loads; bitwise the same sums) and clears the
    added gradients, which leaves FSDP's own loop nothing to add. The kernel takes CUDA pairs
    whose sum is fp32 (the configs' reduction dtype), contiguous and 16-byte aligned; FSDP's
    loop adds any other pair, as before, and the log says so once."""
    for group in fsdp_param_groups(model):
        if not hasattr(group, "post_backward"):
            raise RuntimeError("apply_grad_accumulation: this torch's FSDP2 has no FSDPParamGroup.post_backward "
                               f"(torch {torch.__version__}); set [hymo] fsdp_accumulate_kernel = false")
        group.post_backward = _accumulating_first(group, group.post_backward)


def fsdp_param_groups(model: nn.Module) -> list:
    """FSDP2's parameter groups (FSDPParamGroup: one per unit) of ``model``, each once."""
    groups, seen = [], set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        found = getattr(state, "_fsdp_param_groups", None)
        if found is None:  # torch versions with one parameter group per state
            found = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
        for group in found:
            if id(group) not in seen:
                if not hasattr(group, "fsdp_params"):
                    raise RuntimeError("this torch's FSDP2 has no FSDPParamGroup.fsdp_params "
                                       f"(torch {torch.__version__}); HyMo's FSDP patches need it")
                seen.add(id(group))
                groups.append(group)
    return groups


# What FSDP2's one-rank gather touches (torch 2.11-2.13): the group's and each FSDPParam's.
_ONE_RANK_GROUP_API = ("_all_gather_result", "_to_unsharded", "_wait_all_gather_streams_on_event",
                       "device_handle", "device")
_ONE_RANK_PARAM_API = ("_sharded_param_data", "_sharded_local_tensor", "init_all_gather_outputs", "all_gather_outputs",
                       "init_unsharded_param", "sharded_state", "offload_to_cpu")


def apply_one_rank_copy(model: nn.Module) -> None:
    """On one rank, each FSDP unit's gather as one multi-tensor cast-and-copy.

    There FSDP2 has nothing to gather: its unshard casts each sharded fp32 parameter to the
    parameter dtype in a tensor of its own and copies that into the unsharded parameter's
    storage, two kernels and their Python per parameter, while the GPU, done with the step
    before, waits for the host. Here the unit's parameters are cast straight into that storage
    by one ``torch._foreach_copy_`` call per dtype pair (a few multi-tensor launches); the rest
    (the unsharded parameters set on the modules, the stream events) is FSDP's own code. The
    same rounding (to nearest even), so the same values bitwise. Plain sharded tensors only:
    CPU offload and tensor subclasses with a gather of their own are refused here.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState, alloc_storage

    for group in fsdp_param_groups(model):
        missing = [a for a in _ONE_RANK_GROUP_API if not hasattr(group, a)]
        missing += [f"FSDPParam.{a}" for fp in group.fsdp_params[:1] for a in _ONE_RANK_PARAM_API
                    if not hasattr(fp, a)]
        if missing:
            raise RuntimeError(f"[hymo] fsdp_one_rank_copy: this torch's FSDP2 lacks {', '.join(missing)} "
                               f"(torch {torch.__version__}); set [hymo] fsdp_one_rank_copy = false")
        for fp in group.fsdp_params:
            if fp.offload_to_cpu or hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
                raise RuntimeError(f"[hymo] fsdp_one_rank_copy: a parameter with CPU offload ({fp.offload_to_cpu}) "
                                   f"or of type {type(fp._sharded_local_tensor).__name__}: only plain sharded "
                                   "tensors are copied; set [hymo] fsdp_one_rank_copy = false")
        group.wait_for_unshard = _one_rank_wait_for_unshard(group, ShardedState.SHARDED, alloc_storage)


def _one_rank_wait_for_unshard(group, sharded, alloc_storage):
    @torch._dynamo.disable  # like FSDP's own hooks: host code, never traced
    def wait_for_unshard():
        if not group._all_gather_result:
            return  # no unshard before it (FSDP's own check)
        pairs: dict[tuple, tuple[list, list]] = {}
        for fp in group.fsdp_params:
            if fp.sharded_state != sharded:  # resharded to a smaller mesh after the forward: not on one rank
                raise RuntimeError(f"[hymo] fsdp_one_rank_copy: a parameter in state {fp.sharded_state}; "
                                   "set [hymo] fsdp_one_rank_copy = false")
            src = fp._sharded_param_data
            fp.init_all_gather_outputs([src.numel()], [fp.param_dtype or src.dtype], 1, group.device)
            out = fp.all_gather_outputs[0]
            alloc_storage(out)
            outs, srcs = pairs.setdefault((out.dtype, src.dtype), ([], []))
            outs.append(out)
            srcs.append(src)
        for outs, srcs in pairs.values():
            with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):  # as FSDP's copy
                torch._foreach_copy_(outs, srcs)
        for fp in group.fsdp_params:
            fp.init_unsharded_param()
        group._to_unsharded()
        event = group.device_handle.Event()
        event.record()
        group._wait_all_gather_streams_on_event(event)
        group._all_gather_result = None

    return wait_for_unshard


ACCUMULATE_DEVICES = ("cuda",)  # where apply_grad_accumulation's kernel adds (the tests add "cpu": the interpreter)
_left_to_fsdp_logged = False


def _accumulating_first(group, post_backward):
    @torch._dynamo.disable  # like FSDP's own post-backward: host code, never traced
    def post_backward_accumulating(*args, **kwargs):
        # a call of its own: the added gradients die with its frame, before FSDP's reduce-scatter
        # (the step's last microbatch) allocates its buffers
        _add_and_clear(group.fsdp_params)
        return post_backward(*args, **kwargs)

    return post_backward_accumulating


def _add_and_clear(fsdp_params) -> None:
    """Adds the unsharded gradients of ``fsdp_params`` into their fp32 sums with the kernel (one
    launch per gradient dtype) and clears them; leaves the pairs it cannot take to FSDP's loop."""
    global _left_to_fsdp_logged
    params, sums, grads, left = [], [], [], []
    for fp in fsdp_params:
        total = fp.unsharded_accumulated_grad
        if total is None:  # the step's first microbatch: FSDP casts its gradient to the sum
            continue
        grad = fp.unsharded_param.grad
        if grad is None or total.device.type not in ACCUMULATE_DEVICES:  # (the setup's log says where it adds)
            continue
        why = pair_refused(total, grad)
        if why is None:
            params.append(fp.unsharded_param)
            sums.append(total)
            grads.append(grad)
        else:
            left.append(why)
    for dtype in {g.dtype for g in grads}:
        pick = [i for i, g in enumerate(grads) if g.dtype == dtype]
        accumulate_triton([sums[i] for i in pick], [grads[i] for i in pick], checked=True)  # pair_refused above
    for param in params:
        param.grad = None
    if left and not _left_to_fsdp_logged:
        _left_to_fsdp_logged = True
        logger.info(f"[hymo] fsdp_accumulate_kernel: {len(left)} gradient sum(s) per microbatch left to FSDP2's own "
                    f"adds, e.g. a pair that is {left[0]}")


def _check_supported(parallel_dims, job_config) -> None:
    unsupported = {"tensor": parallel_dims.tp, "context": parallel_dims.cp,
                   "pipeline": parallel_dims.pp, "expert": parallel_dims.ep}
    for name, degree in unsupported.items():
        if degree > 1:
            raise NotImplementedError(f"HyMo has no {name}-parallel plan yet (degree {degree}); "
                                      "use data parallelism (FSDP/HSDP)")
    if parallel_dims.dp_replicate_enabled and not parallel_dims.dp_shard_enabled:
        raise NotImplementedError("pure DDP is not supported; set "
                                  "parallelism.data_parallel_shard_degree > 1 (FSDP or HSDP)")
    if job_config.activation_checkpoint.mode not in ("none", "selective", "full"):
        raise NotImplementedError(f"activation_checkpoint.mode "
                                  f"{job_config.activation_checkpoint.mode!r}: HyMo supports "
                                  "none, selective and full")
    if job_config.training.enable_cpu_offload:
        raise NotImplementedError("training.enable_cpu_offload is not supported by HyMo yet")


def apply_compile(model: nn.Module, backend: str) -> None:
    """Compiles each block separately: the blocks repeat, so compilation is cheap, and FSDP's
    hooks stay outside the compiled graphs. ``fullgraph=True`` turns a graph break, a silent
    slowdown otherwise, into an error."""
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, torch.compile(block, backend=backend,
                                                             fullgraph=True))
    logger.info("Compiled each HyMo block with torch.compile")


def apply_fsdp(model: nn.Module, mesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool, units: str = "block") -> None:
    """FSDP2 units by ``units`` (FSDP_UNITS). "block": one unit per block and per MTP head; the
    root unit keeps the embedding (also the tied output head, used at the end of forward) and
    the final norm; each unit's gather and reduce overlap the neighbouring blocks' compute.
    "model": the root alone, whose hooks run once per forward and backward instead of once per
    block; all parameters are gathered at once and kept to the backward, and all gradients
    reduced at its end (on one rank, where FSDP only casts and copies and keeps the gathered
    parameters anyway, the same memory but for the unsharded gradients living to the end of
    the backward).

    TorchTitan divides the loss by the global token count itself, so FSDP must sum gradients
    without dividing; forcing plain SUM reductions keeps that on gloo too, which has no
    PREMUL_SUM (the numbers are the same on NCCL).
    """
    config = {"mesh": mesh,
              "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if units not in ("block", "model"):
        raise ValueError(f"apply_fsdp: units = {units!r}: block or model (fsdp_plan resolves auto)")
    if units == "block":
        for block in model.layers.values():
            fully_shard(block, **config, reshard_after_forward=reshard_after_forward)
        for head in model.mtp_heads.values():
            fully_shard(head, **config, reshard_after_forward=reshard_after_forward)
    fully_shard(model, **config)  # FSDP2 never reshards the root after its forward
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
