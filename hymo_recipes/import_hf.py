"""Turn a HyMo Hugging Face export back into a training checkpoint: ``python -m hymo_recipes.import_hf``.

    python -m hymo_recipes.import_hf exports/debug_model outputs/from_hf
    ./run_train.sh --job.dump_folder outputs/from_hf      # trains on from the imported weights

The input is a folder ``python -m hymo_recipes.export_hf`` wrote (config.json with its ``hymo``
block, model.safetensors or an index with shards, the tokenizer). The output is a dump folder:
the weights become ``<out>/checkpoint/step-0``, a model-only DCP checkpoint (one file, top-level
names, as TorchTitan saves a model), with the ``hymo_manifest.json`` a HyMo save writes (the
tokenizer's identity, the flavor and shape, every file's size and CRC-32). A run with that dump
folder loads it as TorchTitan loads a step-0 checkpoint: the model only, then training from step
1 with fresh optimizer state, schedule and data position; its preflight checks the manifest
against the run (tokenizer, flavor, shape) as on any resume.

The tokenizer is the export's (or ``--tokenizer``): the manifest records its identity, and the
run must use the same one (``model.hf_assets_path``). An export records the identity of the
tokenizer it was trained with; another one is refused.

Bad input (a missing folder, a folder that is not a HyMo export, a config.json that contradicts
itself or names no HyMo model, tensors of another shape, no tokenizer, an output that already
holds checkpoints) ends with one line ``import_hf: error: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import warnings

from hymo_recipes.export_hf import (ExportError, _Parser, check_state, hf_config, hymo_state_from_hf,
                                    read_safetensors)
from hymo_recipes import generate
from hymo_recipes.model import HymoModelArgs, hymo_flavors

STEP = "step-0"
# config.json keys that the model args determine: an export's must equal hf_config's
_ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "mla_layers",
              "nope_layers", "gdn_num_heads", "gdn_head_dim", "gdn_v_head_dim", "gdn_conv_size",
              "gdn_intermediate_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_base", "attention_softmax_scale",
              "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "mtp_depth",
              "mtp_intermediate_size", "logit_multiplier")


def read_export_config(folder: str) -> tuple[str, HymoModelArgs, dict]:
    """(flavor, model args, the recorded tokenizer identity) from an export's config.json."""
    if not os.path.exists(folder):
        raise ExportError(f"no Hugging Face export at {folder}: the path does not exist")
    if not os.path.isdir(folder):
        raise ExportError(f"no Hugging Face export at {folder}: not a folder")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        what = ("a DCP checkpoint (python -m hymo_recipes.export_hf exports it)"
                if os.path.isfile(os.path.join(folder, ".metadata")) or os.path.isdir(os.path.join(folder, "checkpoint"))
                else "weights without config.json (python -m hymo_recipes.export_hf on this folder completes it)"
                if os.path.isfile(os.path.join(folder, "model.safetensors.index.json")) else "no Hugging Face export")
        raise ExportError(f"{folder} is not a HyMo export: it has no config.json; it is {what}")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ExportError(f"wrong config.json in {folder}: it cannot be read as JSON ({e})") from None
    if not isinstance(config, dict) or config.get("model_type") != "hymo":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise ExportError(f"wrong config.json in {folder}: model_type is {kind!r}, not 'hymo' (not a HyMo export)")
    hymo = config.get("hymo")
    if not isinstance(hymo, dict) or not isinstance(hymo.get("model_args"), dict):
        raise ExportError(f"wrong config.json in {folder}: no hymo.model_args (export it with "
                          "python -m hymo_recipes.export_hf)")
    flavor = hymo.get("flavor")
    if flavor not in hymo_flavors:
        raise ExportError(f"wrong config.json in {folder}: hymo.flavor {flavor!r} is not one of "
                          f"{', '.join(hymo_flavors)}")
    known = {f.name for f in dataclasses.fields(HymoModelArgs)}
    unknown = sorted(set(hymo["model_args"]) - known)
    if unknown:
        raise ExportError(f"wrong config.json in {folder}: hymo.model_args has fields this version does not "
                          f"know: {', '.join(unknown)}")
    try:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in hymo["model_args"].items()}
        args = dataclasses.replace(hymo_flavors[flavor], **fields)
    except (TypeError, ValueError) as e:
        raise ExportError(f"wrong config.json in {folder}: hymo.model_args is invalid ({e})") from None
    tokenizer = hymo.get("tokenizer") or {}
    expected = hf_config(args, flavor, {"sha256": "", "vocab_size": 0}, None, None)
    for key in _ARCH_KEYS:
        if config.get(key) != expected[key]:
            raise ExportError(f"wrong config.json in {folder}: {key} is {config.get(key)!r}, its hymo.model_args "
                              f"give {expected[key]!r}")
    return flavor, args, tokenizer


def pick_tokenizer(folder: str, option: str | None, recorded: dict) -> tuple[str, dict]:
    from hymo_recipes.titan.checkpoints import tokenizer_identity
    from hymo_recipes.titan.datasets import load_tokenizer

    path = option or folder
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        where = f"--tokenizer {option}" if option else f"{folder}"
        raise ExportError(f"no tokenizer.json in {where}: pass --tokenizer DIR, the tokenizer the model was trained "
                          "with (the checkpoint's manifest records it and a resume checks it)")
    try:
        load_tokenizer(path)
        identity = tokenizer_identity(path)
    except (FileNotFoundError, ValueError) as e:
        raise ExportError(str(e).replace("(model.hf_assets_path)", "(--tokenizer)")) from None
    if recorded.get("sha256") and (recorded["sha256"] != identity["sha256"]
                                   or recorded.get("vocab_size") != identity["vocab_size"]):
        raise ExportError(f"the tokenizer in {path} ({identity['sha256']}, vocab {identity['vocab_size']}) is not the "
                          f"one the export was trained with ({recorded['sha256']}, vocab {recorded.get('vocab_size')}): "
                          "pass the original with --tokenizer")
    return path, identity


def step_folder(out: str) -> str:
    """<out>/checkpoint/step-0 for a dump folder `out` (or `out` itself if it already ends so)."""
    norm = os.path.normpath(out)
    if os.path.basename(norm) == STEP and os.path.basename(os.path.dirname(norm)) == "checkpoint":
        step_dir = norm
    elif re.fullmatch(r"step-\d+", os.path.basename(norm)):
        raise ExportError(f"{out}: an imported checkpoint is {STEP} (TorchTitan loads step 0 as the model only); "
                          "give the dump folder")
    else:
        step_dir = os.path.join(norm, "checkpoint", STEP)
    folder = os.path.dirname(step_dir)
    if os.path.isdir(folder):
        steps = sorted(n for n in os.listdir(folder) if re.fullmatch(r"step-\d+", n))
        if steps:
            raise ExportError(f"{folder} already holds checkpoints ({', '.join(steps)}): give a new dump folder")
    return step_dir


def write_checkpoint(step_dir: str, state: dict, flavor: str, args: HymoModelArgs, tokenizer: dict) -> None:
    """A model-only DCP checkpoint of HyMo-named `state` in `step_dir`, then its manifest (last:
    a folder with a manifest is a whole checkpoint)."""
    import torch.distributed.checkpoint as dcp

    from hymo_recipes.titan import checkpoints

    os.makedirs(step_dir)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save({k: v.contiguous() for k, v in state.items()}, checkpoint_id=step_dir)
    shape = {k: (list(v) if isinstance(v := getattr(args, k), tuple) else v) for k in checkpoints.SHAPE_FIELDS}
    files = {n: {"size": os.path.getsize(os.path.join(step_dir, n)), "crc32": checkpoints.file_crc32(os.path.join(step_dir, n))}
             for n in sorted(os.listdir(step_dir)) if os.path.isfile(os.path.join(step_dir, n))}
    manifest = {"format": checkpoints.FORMAT, "step": 0, "world_size": 1, "written": time.strftime("%Y-%m-%d %H:%M:%S"),
                "identity": {"tokenizer": tokenizer, "flavor": flavor, "shape": shape,
                             "mup_base_width": args.mup_base_width},
                "files": files}
    tmp = os.path.join(step_dir, checkpoints.MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(step_dir, checkpoints.MANIFEST))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m hymo_recipes.import_hf", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", help="a folder written by python -m hymo_recipes.export_hf")
    p.add_argument("out", help="the dump folder to train in (the weights go to <out>/checkpoint/step-0)")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: the export's own)")
    return p


def run(opts) -> None:
    flavor, args, recorded = read_export_config(opts.hf_dir)
    tok_dir, identity = pick_tokenizer(opts.hf_dir, opts.tokenizer, recorded)
    state = hymo_state_from_hf(read_safetensors(opts.hf_dir), opts.hf_dir)
    check_state(state, args, opts.hf_dir, f"flavor {flavor!r} (vocab {args.vocab_size}, as its config.json says)")
    step_dir = step_folder(opts.out)
    write_checkpoint(step_dir, state, flavor, args, identity)
    dump = os.path.dirname(os.path.dirname(step_dir))
    print(f"import_hf: wrote {step_dir} ({flavor}, {len(state)} tensors, tokenizer {identity['sha256']} from "
          f"{tok_dir}); train from it with ./run_train.sh --job.dump_folder {dump} --model.flavor {flavor} "
          f"--model.hf_assets_path {tok_dir}")


def main(argv: list[str] | None = None) -> int:
    return generate.run_command(argv, "import_hf", build_parser, run)


if __name__ == "__main__":
    sys.exit(main())
