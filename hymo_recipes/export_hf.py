"""Export a HyMo checkpoint as a Hugging Face model folder: ``python -m hymo_recipes.export_hf``.

    python -m hymo_recipes.export_hf outputs/debug_model exports/debug_model

The input is what ``python -m hymo_recipes.generate --checkpoint`` takes (a DCP step folder
saved by any number of ranks, or a dump folder / its ``checkpoint`` folder: the newest whole
step), or a step folder TorchTitan saved in HF safetensors (``--checkpoint.last_save_in_hf``:
weights only, under the same HF names). The model is rebuilt from the checkpoint's
``hymo_manifest.json`` (flavor, shape, muP's base width, tokenizer) or ``--flavor`` / ``--config``
and read in one process (generate.py's loader and its rules); the tokenizer is the one it was trained with (checked against
the manifest).

The output folder holds:

- ``model.safetensors``: every parameter and persistent buffer under its HF name
  (hymo_recipes/hf/names.py: the TrainSpec's state-dict adapter), in the checkpoint's dtype
  (fp32 masters): the MoE selection bias and load EMA and the MTP heads included, so that
  ``python -m hymo_recipes.import_hf`` gives the checkpoint back bit for bit;
- ``config.json``: ``HymoConfig`` with an ``auto_map`` to the two modeling files, muP's
  ``logit_multiplier`` and MLA's softmax scale written out, and under ``hymo`` the flavor,
  every model arg and the tokenizer's identity (what an import needs);
- ``configuration_hymo.py``, ``modeling_hymo.py``: the model in plain torch + transformers
  (no HyMo import), for ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``;
- the tokenizer's files, byte for byte (``AutoTokenizer`` loads them: ``tokenizer_class`` is
  in config.json), and ``generation_config.json`` (BOS, EOS).

The exported model computes HyMo's inference forward (dropless MoE, MTP heads not run). It
does not add BOS itself: encode prompts with it first, as HyMo's training and generate do.

Bad input (no checkpoint at the path, a checkpoint of another flavor or shape, another
tokenizer, an output folder that is not empty) ends with one line ``export_hf: error: ...`` and
exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

import torch

from hymo_recipes import generate
from hymo_recipes.generate import GenerateError
from hymo_recipes.hf import names
from hymo_recipes.model import HymoModel, HymoModelArgs

HF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf")
MODELING_FILES = ("configuration_hymo.py", "modeling_hymo.py")
WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
EXPORT_FORMAT = 1


class ExportError(GenerateError):
    """A bad input, reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ExportError(f"{message} (python -m {self.prog.split()[-1]} --help)")


# -- the config ------------------------------------------------------------------------------------

def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def model_args_dict(args: HymoModelArgs) -> dict:
    return {f.name: _plain(getattr(args, f.name)) for f in dataclasses.fields(HymoModelArgs)}


def meta_model(args: HymoModelArgs) -> HymoModel:
    """A HymoModel of `args` on the meta device (shapes and derived constants, no memory), with the
    chunked PyTorch GDN backend, which any machine can build (the backend sets no shape)."""
    cpu = {"gdn_backend": "torch_chunk", "gdn_dot_precision": "table", "gdn_bwd_path": "table", "gdn_mixer_saves": "inputs"}
    known = {f.name for f in dataclasses.fields(HymoModelArgs)}
    args = dataclasses.replace(args, **{k: v for k, v in cpu.items() if k in known})
    with torch.device("meta"):
        return HymoModel(args)


def hf_config(args: HymoModelArgs, flavor: str, tokenizer: dict, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json of an export. muP's logit multiplier and MLA's softmax scale are read off a
    HymoModel, so they are what the training forward uses."""
    model = meta_model(args)
    scale = (model.layers[str(args.mla_layers[0])].attn.softmax_scale if args.mla_layers
             else (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5)
    return {
        "architectures": ["HymoForCausalLM"],
        "model_type": "hymo",
        "auto_map": {"AutoConfig": "configuration_hymo.HymoConfig",
                     "AutoModelForCausalLM": "modeling_hymo.HymoForCausalLM"},
        "tokenizer_class": "PreTrainedTokenizerFast",
        "dtype": "float32",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "mla_layers": list(args.mla_layers),
        "nope_layers": list(args.nope_layers),
        "gdn_num_heads": args.gdn_n_heads,
        "gdn_head_dim": args.gdn_head_dim,
        "gdn_v_head_dim": args.gdn_v_head_dim,
        "gdn_conv_size": args.gdn_conv_size,
        "gdn_intermediate_size": args.gdn_ffn_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "q_lora_rank": args.q_lora_rank,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_base": args.rope_theta,
        "attention_softmax_scale": scale,
        "n_routed_experts": args.moe_num_experts,
        "n_shared_experts": args.moe_num_shared_experts,
        "num_experts_per_tok": args.moe_top_k,
        "moe_intermediate_size": args.moe_inter_dim,
        "mtp_depth": args.mtp_depth,
        "mtp_intermediate_size": args.mtp_inter_dim,
        "logit_multiplier": model.logit_multiplier,
        "tie_word_embeddings": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "hymo": {"format": EXPORT_FORMAT, "flavor": flavor, "model_args": model_args_dict(args),
                 "tokenizer": {"sha256": tokenizer["sha256"], "vocab_size": tokenizer["vocab_size"]}},
    }


# -- checking a state dict against the model args -------------------------------------------------

def expected_shapes(args: HymoModelArgs) -> dict[str, tuple[int, ...]]:
    """HyMo name -> shape of every tensor a HymoModel of `args` saves (built on the meta device)."""
    return {k: tuple(v.shape) for k, v in meta_model(args).state_dict().items()}


def check_state(state: dict, args: HymoModelArgs, where: str, what: str) -> None:
    """ExportError naming the first missing, unexpected or misshapen tensor of `state` (HyMo names)."""
    want = expected_shapes(args)
    for key in want:
        if key not in state:
            raise ExportError(f"{where} does not hold a HyMo {what} model: no {names.to_hf_name(key)}")
    for key in state:
        if key not in want:
            raise ExportError(f"{where} holds {names.to_hf_name(key)}, which a HyMo {what} model does not have")
    for key, shape in want.items():
        if tuple(state[key].shape) != shape:
            raise ExportError(f"shape mismatch: {names.to_hf_name(key)} is {list(state[key].shape)} in {where}, "
                              f"a HyMo {what} model has {list(shape)}")


# -- reading ---------------------------------------------------------------------------------------

def read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's model.safetensors, or of the files its index names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = os.path.join(folder, HF_INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ExportError(f"{index} cannot be read ({type(e).__name__}: {e})") from None
    elif os.path.isfile(os.path.join(folder, WEIGHTS)):
        files = [WEIGHTS]
    else:
        raise ExportError(f"no weights in {folder}: neither {WEIGHTS} nor {HF_INDEX}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ExportError(f"{index} names {name}, which is not in {folder}")
        try:
            part = load_file(path)
        except (SafetensorError, OSError) as e:
            raise ExportError(f"{path} is not a readable safetensors file ({e})") from None
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise ExportError(f"{twice[0]} is in {path} and in another file of {folder}: which one holds the weights "
                              "is ambiguous")
        tensors.update(part)
    return tensors


def hymo_state_from_hf(tensors: dict, where: str) -> dict:
    try:
        return names.from_hf(tensors)
    except KeyError as e:
        raise ExportError(f"{where}: {e.args[0]}") from None


def source_step(path: str, step: int | None) -> tuple[str, bool]:
    """(step folder, whether it is TorchTitan's HF-format save) for a step, checkpoint or dump folder."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")) \
            and not os.path.isfile(os.path.join(path, ".metadata")):
        raise ExportError(f"{path} is already a Hugging Face export (it has config.json); "
                          "python -m hymo_recipes.import_hf turns it back into a checkpoint")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, HF_INDEX)) \
            and not os.path.isfile(os.path.join(path, ".metadata")):
        return path, True
    try:
        step_dir = generate.resolve_checkpoint(path, step)
    except GenerateError as e:
        raise ExportError(str(e)) from None
    hf = not os.path.isfile(os.path.join(step_dir, ".metadata")) and os.path.isfile(os.path.join(step_dir, HF_INDEX))
    return step_dir, hf


# -- writing ---------------------------------------------------------------------------------------

def prepare_out(out: str, overwrite: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"output {out} exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            raise ExportError(f"output folder {out} is not empty (pass --overwrite to replace an earlier export)")
        if not _is_export(out):
            raise ExportError(f"output folder {out} is not empty and not a HyMo export: --overwrite replaces only "
                              "an earlier export; give a new folder")
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)


def _is_export(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f).get("model_type") == "hymo"
    except (OSError, ValueError, AttributeError):
        return False


def tokenizer_files(path: str) -> list[str]:
    from hymo_recipes.titan.checkpoints import TOKENIZER_FILES

    return [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]


def write_export(out: str, state: dict, args: HymoModelArgs, flavor: str, tokenizer_dir: str, tokenizer) -> dict:
    """Writes the export of HyMo-named `state` into the (empty) folder `out`; returns its config."""
    from safetensors.torch import save_file

    from hymo_recipes.titan.checkpoints import tokenizer_identity

    hf = {k: v.detach().to("cpu").contiguous() for k, v in sorted(names.to_hf(state).items())}
    save_file(hf, os.path.join(out, WEIGHTS), metadata={"format": "pt"})
    config = hf_config(args, flavor, tokenizer_identity(tokenizer_dir), tokenizer.bos_id, tokenizer.eos_id)
    # the parameters' dtype as stored (fp32 from a training checkpoint; a last_save_in_hf save
    # may have been written in another export_dtype)
    dtypes = {v.dtype for k, v in hf.items() if v.is_floating_point()}
    if len(dtypes) == 1:
        config["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.eos_id}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2, sort_keys=True)
        f.write("\n")
    for name in MODELING_FILES:
        shutil.copyfile(os.path.join(HF_DIR, name), os.path.join(out, name))
    for name in tokenizer_files(tokenizer_dir):
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(out, name))
    return config


# -- the command -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m hymo_recipes.export_hf", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a DCP step folder, a dump folder / its checkpoint folder (the newest whole "
                                      "step), or a step folder saved with --checkpoint.last_save_in_hf")
    p.add_argument("out", help="the export folder to write (new or empty)")
    p.add_argument("--step", type=int, default=None, help="with a dump or checkpoint folder: export this step")
    p.add_argument("--config", default=None, help="the training TOML: the flavor, tokenizer and [hymo] mup_base_width "
                                                  "for a checkpoint without hymo_manifest.json; else it must agree")
    p.add_argument("--flavor", default=None, help="model flavor, for a checkpoint without hymo_manifest.json")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: the config's, the "
                                                     "manifest's, or ./assets/tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    return p


def run(opts) -> None:
    step_dir, from_hf = source_step(opts.checkpoint, opts.step)
    manifest = generate.read_manifest(step_dir)
    config = generate.read_config(opts.config) if opts.config else None
    if config and config.get("model", {}).get("name", "hymo") != "hymo":
        raise ExportError(f"--config {opts.config} trains model {config['model']['name']!r}, not hymo")
    flavor = opts.flavor or (config or {}).get("model", {}).get("flavor")
    tok_dir = generate.tokenizer_path(opts, config, manifest)
    tokenizer = generate.load_tokenizer(tok_dir, manifest, step_dir)
    vocab = (config or {}).get("hymo", {}).get("vocab_size") or tokenizer.get_vocab_size()
    name, args = generate.model_args(manifest, flavor, vocab, step_dir,
                                     (config or {}).get("hymo", {}).get("mup_base_width"))
    if os.path.abspath(opts.out) == os.path.abspath(step_dir):
        raise ExportError("the output folder is the checkpoint itself: give another folder")
    if from_hf:
        state = hymo_state_from_hf(read_safetensors(step_dir), step_dir)
        check_state(state, args, step_dir, generate.describe(name, args))
    else:
        model = generate.load_model(step_dir, name, generate.with_backend(args, torch.device("cpu")),
                                    torch.device("cpu"), torch.float32)
        state = model.state_dict()
    prepare_out(opts.out, opts.overwrite)
    written = write_export(opts.out, state, args, name, tok_dir, tokenizer)
    n = sum(v.numel() for v in state.values())
    print(f"export_hf: wrote {opts.out} from {step_dir} ({generate.describe(name, args)}, {len(state)} tensors, "
          f"{n:,} values; logit multiplier {written['logit_multiplier']:g})")


def main(argv: list[str] | None = None) -> int:
    return generate.run_command(argv, "export_hf", build_parser, run)


if __name__ == "__main__":
    sys.exit(main())
