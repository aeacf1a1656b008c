"""Checks of a parsed job config that run before the Trainer builds anything.

Each one would otherwise fail late (after the model is built and sharded, or at the first
forward, or at the first validation) or with an error that does not name the setting to change:

- every TOML/CLI value has its field's type (``steps = "4"`` in a TOML is a string), and the
  counts in ``POSITIVE`` are at least 1;
- the tokenizer in ``model.hf_assets_path`` loads and has an EOS token; its vocabulary size
  goes into ``[hymo] vocab_size`` when that is 0 (the model args take it from there);
- the model flavor exists, and its args accept this config (``HymoModelArgs.update_from_config``
  on a copy: sequence lengths, MTP depth, every ``[hymo]`` knob's value);
- this machine can run the GDN backend (the Triton kernel needs a GPU), and flex attention's
  FLASH backend where ``mla_flex_options`` asks for it (flash-attn-4 installed; no deterministic
  mode, which that backend lacks with HyMo's block mask);
- document masking is asked of HyMo models only (another model's forward takes no document
  boundaries);
- torch.compile is not asked of a backend that cannot be compiled (``parallelize``'s check);
- the learning-rate schedule can be built for ``training.steps``;
- ``[optimizer]`` values are in the range torch's optimizers accept (a negative lr fails only
  when the optimizers are built, after the model), and ``optimizer.cuda_graph`` is asked on one
  rank of a CUDA machine, of HyMo's optimizers;
- the batch sizes divide over the data-parallel ranks, and a local dataset's files exist, are
  readable UTF-8 and hold what the run reads (data_checks.py; training, and validation when it is
  on);
- the checkpoint a resume would load is whole: its ``.metadata`` reads, and every shard file it
  names is there and long enough; its manifest (checkpoints.py) names this run's tokenizer,
  flavor and model shape, and every file has its recorded size and checksum. Step folders of
  unfinished saves (no ``.metadata``, or no manifest) are skipped; that is logged here, with the
  step that is loaded instead; async checkpointing is refused. A resume whose learning rate
  would jump at its step (the total steps changed) gets one warning (resume_schedule.py).

All raise ValueError with the setting to change; ``train.parse_config`` turns that into one line.
The model args' own hook stays a pure function of the config: the file reads and machine probes
are here.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing

import torch

from hymo_recipes.titan.api import logger


# Settings that TorchTitan needs positive but checks late, or with a message that does not name them.
POSITIVE = ("training.local_batch_size", "training.seq_len", "checkpoint.interval", "metrics.log_freq",
            "validation.seq_len", "validation.freq")


def check_job_config(config, *, this_machine: bool = True) -> None:
    """Every check of the module docstring. ``this_machine=False`` (the config check,
    check.py) leaves out the ones about the machine the check runs on: whether it can run the
    GDN backend and compile it, and whether flash-attn-4 imports."""
    check_value_types(config)
    for name in POSITIVE:
        section, _, field = name.partition(".")
        value = getattr(getattr(config, section), field)
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if config.model.name == "hymo":
        from hymo_recipes.titan.parallelize import fsdp_plan

        fsdp_plan(getattr(config, "hymo", None), 1)  # a bad fsdp_units, in one line
        from hymo_recipes.titan import documents

        documents.masked(config, validation=True)  # a bad validation_document_masking, in one line
        from hymo_recipes.model import hymo_flavors
        from hymo_recipes.scheduler import wsd_schedule
        from hymo_recipes.titan.data_checks import check_data, dp_degree, process_count
        from hymo_recipes.titan.datasets import load_tokenizer, set_vocab_size
        from hymo_recipes.titan.parallelize import check_compile_backend

        if config.model.flavor not in hymo_flavors:
            raise ValueError(f"unknown [model] flavor {config.model.flavor!r}: HyMo has {', '.join(hymo_flavors)}")
        tokenizer = load_tokenizer(config.model.hf_assets_path)
        set_vocab_size(config, tokenizer)
        # document masking needs a BOS or EOS token: say so here, not after the model is built
        documents.splitter(config, tokenizer)
        documents.splitter(config, tokenizer, validation=True)
        args = copy.deepcopy(hymo_flavors[config.model.flavor])  # the Trainer updates its own copy
        args.update_from_config(config)
        check_flash_attention(args.mla_flex_options, config.debug.deterministic, installed=this_machine)
        if this_machine:
            check_gdn_backend_runs(args.gdn_backend, cuda_graph=getattr(config.optimizer, "cuda_graph", False),
                                   normuon_fused=getattr(config.optimizer, "normuon_fused", False))
            check_compile_backend(config, args.gdn_backend)
        check_optimizer_values(config.optimizer)
        check_optimizer_graph(config.optimizer, installed=this_machine, processes=process_count(config),
                              cpu_offload=config.training.enable_cpu_offload)
        check_normuon_fused(config.optimizer, installed=this_machine, cpu_offload=config.training.enable_cpu_offload)
        wsd_schedule(config.lr_scheduler, config.training.steps)
        check_data(config, tokenizer, dp_degree(config))
    else:
        from hymo_recipes.titan import documents

        if documents.masked(config) or documents.masked(config, validation=True):
            raise ValueError(f"[hymo] document_masking is for HyMo models: model.name = {config.model.name!r} takes no "
                             "document boundaries; pass --hymo.no-document_masking (and "
                             "--hymo.validation_document_masking off if it is \"on\")")
    check_checkpoint_to_load(config)


# [optimizer] values torch's optimizers reject only when they are built (after the model is)
NONNEGATIVE = ("lr", "normuon_lr", "eps", "normuon_eps", "weight_decay", "normuon_weight_decay", "embed_weight_decay")
BELOW_ONE = ("beta1", "beta2", "normuon_momentum", "normuon_beta2")


def check_optimizer_graph(cfg, *, installed: bool = True, processes: int | None = None, cpu_offload: bool = False) -> None:
    """[optimizer] cuda_graph's limits (hymo_recipes/optim/graph.py), in one line each; ``installed``:
    also whether this machine has a CUDA GPU; ``processes``: the run's process count (default
    WORLD_SIZE); ``cpu_offload``: training.enable_cpu_offload (parameters on the CPU)."""
    streams = getattr(cfg, "cuda_graph_streams", 1)
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"optimizer.cuda_graph_streams must be an integer >= 1 (1: the captured step on one stream), "
                         f"got {streams!r}")
    if not getattr(cfg, "cuda_graph", False):
        # cuda_graph_streams shapes the captured step only; a config that sets it stays usable with
        # --optimizer.no-cuda_graph (CPU, several GPUs, the AdamW baseline), as documented.
        return
    if cfg.name == "AdamW":
        raise ValueError('optimizer.cuda_graph replays HyMo\'s NorMuon and CautiousAdamW steps; optimizer.name = "AdamW" '
                         "(torch's) is not graphed: turn it off (--optimizer.no-cuda_graph) or pick NorMuon / CautiousAdamW")
    world = int(os.environ.get("WORLD_SIZE", "1")) if processes is None else processes
    if world > 1:
        raise ValueError(f"optimizer.cuda_graph runs on one rank only (the optimizers' collectives are not captured); "
                         f"this run has {world}: turn it off (--optimizer.no-cuda_graph)")
    if cpu_offload:
        raise ValueError("optimizer.cuda_graph replays the step on the GPU and training.enable_cpu_offload keeps the "
                         "parameters on the CPU: turn one off (--optimizer.no-cuda_graph)")
    if installed and not torch.cuda.is_available():
        raise ValueError("optimizer.cuda_graph needs a CUDA GPU and this machine has none: turn it off "
                         "(--optimizer.no-cuda_graph)")


def check_normuon_fused(cfg, *, installed: bool = True, cpu_offload: bool = False) -> None:
    """[optimizer] normuon_fused's limits (hymo_kernels.normuon), in one line each; ``installed``:
    also whether this machine has a CUDA GPU."""
    if not getattr(cfg, "normuon_fused", False):
        return
    off = "turn it off (--optimizer.no-normuon_fused)"
    if getattr(cfg, "normuon_compiled", False):
        raise ValueError("optimizer.normuon_fused and normuon_compiled are two ways to run NorMuon's passes: "
                         "pick one (--optimizer.no-normuon_compiled or --optimizer.no-normuon_fused)")
    if getattr(cfg, "normuon_ortho_dtype", "bfloat16") == "float64":
        raise ValueError(f"optimizer.normuon_fused runs a bf16 or fp32 orthogonalisation, not float64: {off}")
    if cpu_offload:
        raise ValueError(f"optimizer.normuon_fused runs on the GPU and training.enable_cpu_offload keeps the "
                         f"parameters on the CPU: {off}")
    if installed and not torch.cuda.is_available():
        raise ValueError(f"optimizer.normuon_fused runs Triton kernels on a CUDA GPU and this machine has none: {off}")


def check_optimizer_values(cfg) -> None:
    for name in NONNEGATIVE + BELOW_ONE:
        value = getattr(cfg, name, None)
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (name in BELOW_ONE and value >= 1):
            bounds = "in [0, 1)" if name in BELOW_ONE else "a finite number, at least 0"
            raise ValueError(f"optimizer.{name} = {value!r} must be {bounds}")
    if getattr(cfg, "normuon_ns_steps", 1) < 1:
        raise ValueError(f"optimizer.normuon_ns_steps = {cfg.normuon_ns_steps} must be at least 1")


def check_gdn_backend_runs(backend: str, *, cuda_graph: bool = False, normuon_fused: bool = False) -> None:
    """Raises ValueError if this machine cannot run the GDN backend (the Triton kernel needs a
    GPU and a working Triton); ``cuda_graph`` / ``normuon_fused``: the config also graphs the
    optimizer step / runs NorMuon's fused kernels, which the advice for a machine without a GPU
    then turns off too."""
    if backend != "triton":
        return
    import torch

    from hymo_kernels.gdn.chunk import unavailable

    if why := unavailable("cuda" if torch.cuda.is_available() else "cpu"):
        gpu_only = "".join(f" and --optimizer.no-{name}" for name, on in
                           (("cuda_graph", cuda_graph), ("normuon_fused", normuon_fused)) if on)
        raise ValueError(f'gdn_backend "triton" {why}. Without a GPU use --hymo.gdn_backend torch_chunk '
                         f"(and --compile.no-enable: that backend is not compiled{gpu_only})")


def check_flash_attention(flex_options: str, deterministic: bool, *, installed: bool = True) -> None:
    """Raises ValueError if ``mla_flex_options`` asks for flex attention's FLASH backend and the
    run is deterministic (that backend's deterministic backward needs write-order metadata HyMo's
    block mask does not carry, and does not exist on Hopper), or, with ``installed``, flash-attn-4's
    kernels do not import here (asked on a CPU too, where no flex attention runs: the config names
    a package this machine lacks). Without the check, both fail only when the first MLA block
    compiles."""
    from hymo_recipes.model.args import parse_flex_options

    if parse_flex_options(flex_options).get("BACKEND") != "FLASH":
        return
    if deterministic:
        raise ValueError("mla_flex_options BACKEND=FLASH has no deterministic backward with HyMo's block mask: "
                         "drop BACKEND=FLASH, or debug.deterministic")
    if not installed:
        return
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import is the answer
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
        raise ValueError(f"mla_flex_options BACKEND=FLASH runs flash-attn-4's kernels, which do not import here "
                         f'({why}): pip install -e ".[flash]", or drop BACKEND=FLASH') from None


def _type_ok(value, hint) -> bool | None:
    """Whether value fits the annotation; None for annotations not checked here (lists, dicts)."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        verdicts = [_type_ok(value, h) for h in typing.get_args(hint)]
        return None if None in verdicts else any(verdicts)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return None


def check_value_types(config) -> None:
    """Every scalar field of every section holds a value of its annotated type."""
    for section in dataclasses.fields(config):
        obj = getattr(config, section.name)
        if not dataclasses.is_dataclass(obj):
            continue
        try:
            hints = typing.get_type_hints(type(obj))
        except Exception:  # noqa: BLE001 - an annotation this Python cannot resolve: not checked
            continue
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if _type_ok(value, hints.get(f.name)) is False:
                raise ValueError(f"{section.name}.{f.name} = {value!r} ({type(value).__name__}) does not fit its "
                                 f"type {_hint_name(hints[f.name])}: in a TOML, numbers and booleans are written "
                                 "without quotes")


def _hint_name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def check_checkpoint_to_load(config) -> None:
    """The step a resume loads (checkpoints.plan_resume: the newest with a manifest; unfinished
    saves skipped with a warning) is whole and was written for this run (checkpoints.py)."""
    from hymo_recipes.titan import checkpoints

    ck = config.checkpoint
    if ck.enable and ck.async_mode.lower() != "disabled":
        raise ValueError(f"checkpoint.async_mode = {ck.async_mode!r} is not supported: HyMo writes a checkpoint's "
                         "checksummed manifest once every rank has finished saving it, which an async save does not "
                         'report; use "disabled"')
    folder = os.path.join(config.job.dump_folder, ck.folder)
    plan = checkpoints.plan_resume(folder, ck.load_step) if ck.enable else None
    if plan is None or not plan.exists:
        return  # nothing to resume, or TorchTitan names the missing step itself
    target = plan.target
    if plan.skipped:
        reasons = "; ".join(f"step-{s}: {why}" for s, why in plan.skipped)
        logger.warning(f"checkpoint folder(s) {', '.join(f'step-{s}' for s, _ in plan.skipped)} in {folder} are "
                       f"skipped ({reasons}): "
                       f"{f'resuming from step-{target}' if target is not None else 'no whole checkpoint, starting afresh'}"
                       " (--checkpoint.load_step N loads a skipped one that has .metadata, unchecked)")
    if target is None:
        return
    if plan.unchecked:
        logger.warning(f"resuming from step-{target} in {folder} unchecked: {plan.unchecked}; the tokenizer and "
                       "file checksums cannot be compared with this run's, only the model's shapes")
    earlier = checkpoints.whole_earlier(plan)
    if os.path.isfile(os.path.join(plan.path, ".metadata")):
        check_dcp_checkpoint(plan.path, earlier=earlier)
        if plan.unchecked:
            check_model_shapes(plan.path, config)
    if not plan.unchecked:
        # every rank compares identity and sizes, and reads its share of the files' bytes
        share = (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
        checkpoints.check_manifest(plan.path, config, earlier, share=share)
    if os.path.isfile(os.path.join(plan.path, ".metadata")):
        from hymo_recipes.titan.resume_schedule import check_schedule_continues

        check_schedule_continues(config, plan.path)  # a warning if the lr would jump at this step


def check_model_shapes(path: str, config) -> None:
    """For a checkpoint without a manifest: raises ValueError naming the first tensor of this
    run's model (its flavor and model args, built on the meta device) that the DCP checkpoint at
    `path` holds in another shape or, holding the model, lacks. A checkpoint with none of the
    model's entries is left to TorchTitan's load."""
    if config.model.name != "hymo":
        return
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from hymo_recipes.model import HymoModel, hymo_flavors

    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    args = copy.deepcopy(hymo_flavors[config.model.flavor])
    args.update_from_config(config)
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in HymoModel(args).state_dict().items()}
    # TorchTitan 0.2.2 saves the model's entries at the top level; "model." covers other layouts
    found = {k: stored.get(k, stored.get(f"model.{k}")) for k in want}
    if not any(hasattr(m, "size") for m in found.values()):
        return
    fix = "resume with the flavor and [hymo] settings it was trained with, or give this run a new job.dump_folder"
    for key, shape in want.items():
        meta = found[key]
        if meta is None or not hasattr(meta, "size"):
            raise ValueError(f"checkpoint {path} holds another model than this run's (flavor {config.model.flavor!r}): "
                             f"no {key}; {fix}")
        if tuple(meta.size) != shape:
            raise ValueError(f"checkpoint {path} holds a model of another shape than this run's (flavor "
                             f"{config.model.flavor!r}): {key} is {list(meta.size)} there, {list(shape)} here; {fix}")


def check_dcp_checkpoint(path: str, earlier: list[int] = ()) -> None:
    """Raises ValueError unless the .metadata of a DCP checkpoint reads and every byte range it
    names lies inside its shard file."""
    from torch.distributed.checkpoint import FileSystemReader

    hint = (f"resume from an earlier step with --checkpoint.load_step {earlier[-1]} (whole: "
            f"{', '.join(map(str, earlier))}), or move the folder away" if earlier
            else "move the folder away to start afresh")
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - any failure to read it means the same to the user
        raise ValueError(f"checkpoint {path} is damaged: its .metadata cannot be read ({e!r}); {hint}") from None
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            what = "is missing" if have is None else f"has {have:,} bytes where its metadata needs {size:,}"
            raise ValueError(f"checkpoint {path} is damaged: shard {name} {what}; {hint}")
