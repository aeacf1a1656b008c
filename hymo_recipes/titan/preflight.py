"""Checks of a parsed job config that run before the Trainer builds anything.

Each one would otherwise fail late (after the model is built and sharded, or at the first
forward, or at the first validation) or with an error that does not name the setting to change:

- every TOML/CLI value has its field's type (``steps = "4"`` in a TOML is a string), and the
  counts in ``POSITIVE`` are at least 1;
- the tokenizer in ``model.hf_assets_path`` loads and has an EOS token; its vocabulary size
  goes into ``[hymo] vocab_size`` when that is 0 (the model args take it from there);
- the model flavor exists, and its args accept this config (``HymoModelArgs.update_from_config``
  on a copy: sequence lengths, MTP depth, every ``[hymo]`` knob's value);
- this machine can run the GDN backend (the Triton kernel needs a GPU);
- torch.compile is not asked of a backend that cannot be compiled (``parallelize``'s check);
- the learning-rate schedule can be built for ``training.steps``;
- a local dataset's files exist (training, and validation when it is on: its missing files
  were found only after the model was built);
- the checkpoint a resume would load is whole: its ``.metadata`` reads, and every shard file it
  names is there and long enough. Step folders without ``.metadata`` (a save that was killed)
  are skipped by TorchTitan; that is logged here, with the step that is loaded instead.

All raise ValueError with the setting to change; ``train.parse_config`` turns that into one line.
The model args' own hook stays a pure function of the config: the file reads and machine probes
are here.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import types
import typing

from hymo_recipes.titan.api import logger


# Settings that TorchTitan needs positive but checks late, or with a message that does not name them.
POSITIVE = ("training.local_batch_size", "training.seq_len", "checkpoint.interval", "metrics.log_freq",
            "validation.seq_len", "validation.freq")


def check_job_config(config) -> None:
    check_value_types(config)
    for name in POSITIVE:
        section, _, field = name.partition(".")
        value = getattr(getattr(config, section), field)
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if config.model.name == "hymo":
        from hymo_recipes.model import hymo_flavors
        from hymo_recipes.scheduler import wsd_schedule
        from hymo_recipes.titan.datasets import check_dataset, load_tokenizer, set_vocab_size
        from hymo_recipes.titan.parallelize import check_compile_backend

        if config.model.flavor not in hymo_flavors:
            raise ValueError(f"unknown [model] flavor {config.model.flavor!r}: HyMo has {', '.join(hymo_flavors)}")
        set_vocab_size(config, load_tokenizer(config.model.hf_assets_path))
        args = copy.deepcopy(hymo_flavors[config.model.flavor])  # the Trainer updates its own copy
        args.update_from_config(config)
        check_gdn_backend_runs(args.gdn_backend)
        check_compile_backend(config, args.gdn_backend)
        wsd_schedule(config.lr_scheduler, config.training.steps)
        check_dataset(config.training.dataset, config.training.dataset_path, "[training] dataset")
        if config.validation.enable:
            check_dataset(config.validation.dataset, config.validation.dataset_path, "[validation] dataset")
    check_checkpoint_to_load(config)


def check_gdn_backend_runs(backend: str) -> None:
    """Raises ValueError if this machine cannot run the GDN backend (the Triton kernel needs a
    GPU and a working Triton)."""
    if backend != "triton":
        return
    import torch

    from hymo_kernels.gdn.chunk import unavailable

    if why := unavailable("cuda" if torch.cuda.is_available() else "cpu"):
        raise ValueError(f'gdn_backend "triton" {why}. Without a GPU use --hymo.gdn_backend torch_chunk '
                         "(and --compile.no-enable: that backend is not compiled)")


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
    ck = config.checkpoint
    folder = os.path.join(config.job.dump_folder, ck.folder)
    if not ck.enable or not os.path.isdir(folder):
        return
    steps = {int(m.group(1)): os.path.join(folder, name)
             for name in os.listdir(folder) if (m := re.fullmatch(r"step-(\d+)", name))}
    # what TorchTitan's _find_load_step counts as a checkpoint: DCP's .metadata, or an HF index
    whole = sorted(s for s, path in steps.items()
                   if any(os.path.isfile(os.path.join(path, f)) for f in (".metadata", "model.safetensors.index.json")))
    if ck.load_step != -1:
        target = ck.load_step
        if target not in whole:
            return  # TorchTitan names the missing folder itself
    elif not whole:
        target = None
    else:
        target = whole[-1]
    skipped = sorted(s for s in steps if s not in whole and (target is None or s > target))
    if skipped:
        logger.warning(f"checkpoint folder(s) {', '.join(f'step-{s}' for s in skipped)} in {folder} have no .metadata "
                       f"(a save that did not finish) and are skipped: "
                       f"{f'resuming from step-{target}' if target is not None else 'no whole checkpoint, starting afresh'}")
    if target is not None and os.path.isfile(os.path.join(steps[target], ".metadata")):
        check_dcp_checkpoint(steps[target], earlier=[s for s in whole if s < target])


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
