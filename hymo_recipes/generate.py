"""Sample text from a HyMo checkpoint: ``python -m hymo_recipes.generate``.

    python -m hymo_recipes.generate --checkpoint outputs/debug_model --prompt "The jury said" --greedy

``--checkpoint`` is a DCP step folder (``<dump_folder>/checkpoint/step-N``) as TorchTitan's
trainer writes it, saved by any number of ranks, or a dump folder / its ``checkpoint`` folder
(the newest whole step is taken, as a resume would: hymo_recipes/titan/checkpoints.py). It is
read into one process without a process group (``torch.distributed.checkpoint.load`` reshards
the FSDP2 shards into whole tensors); only the model's entries are read, not the optimizer's.
It may also be a folder written by ``python -m hymo_recipes.export_hf``: its config.json names
the flavor and shape and its safetensors hold the weights (its tokenizer is the default one).

The model is rebuilt from the checkpoint's ``hymo_manifest.json`` (flavor, shape, muP's base
width, tokenizer) or, for a checkpoint without one, from ``--flavor`` / ``--config`` (its ``[hymo]
mup_base_width``, else the flavor's); a manifest that does not record the base width was written
with muP off. The base width changes no shape but sets the logit multiplier and MLA's softmax
scale: a model rebuilt with another one would load and sample from other logits. The tokenizer
comes from ``--tokenizer``, the config's ``model.hf_assets_path``, the manifest's path or
``assets/tokenizer``, and it must be the one the checkpoint was trained with. On a machine
without CUDA the GDN layers run the chunked PyTorch reference (a flavor's "triton" backend is
replaced).

Decoding: hymo_recipes/model/decode.py (prefill of all prompts as one packed row, then one
token per sequence with the GDN state and the MLA latent cache; MoE dropless). A prompt is
encoded as in training, with BOS and without EOS; a sequence stops at EOS (``--ignore-eos``
keeps going) or after ``--max-new-tokens``.

Output: the generated text on stdout, nothing else: the first prompt's completion is streamed
as it is sampled (after the prompt's text); with several prompts the others follow when the
batch is done, each sample under a ``--- i/N`` line. The speed (tokens/s, time to the first
token) and what was loaded go to stderr. Bad input (no checkpoint at the path, a checkpoint of
another flavor or shape, another tokenizer, an empty prompt) ends with one line
``generate: error: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import sys
import time
import warnings

import torch

from hymo_recipes.model import HymoModel, HymoModelArgs, hymo_flavors
from hymo_recipes.model.decode import HymoDecoder

MANIFEST = "hymo_manifest.json"  # hymo_recipes.titan.checkpoints.MANIFEST (not imported: that imports TorchTitan)
DEFAULT_TOKENIZER = "./assets/tokenizer"


class GenerateError(Exception):
    """A bad input, reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + error
        raise GenerateError(f"{message} (python -m hymo_recipes.generate --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m hymo_recipes.generate", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="a DCP step folder (<dump_folder>/checkpoint/step-N), a dump folder / its checkpoint folder "
                        "(the newest whole step), or a Hugging Face export (python -m hymo_recipes.export_hf)")
    p.add_argument("--step", type=int, default=None, help="with a dump or checkpoint folder: load this step")
    p.add_argument("--config", default=None, help="the training TOML (flavor, tokenizer path); needed only for a "
                                                  "checkpoint without hymo_manifest.json, else it must agree")
    p.add_argument("--flavor", default=None, help=f"model flavor ({', '.join(hymo_flavors)}); as --config")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: the config's "
                                                     "model.hf_assets_path, the manifest's, or ./assets/tokenizer)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    p.add_argument("--prompts-file", default=None, help="a file of prompts, one per line (blank lines skipped)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (1: all)")
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop a sequence at EOS")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    return p


# -- the checkpoint --------------------------------------------------------------------------------

def resolve_checkpoint(path: str, step: int | None) -> str:
    """The step folder to load: `path` itself if it holds DCP's .metadata, else the newest whole
    step (or `step`) of `path` or `path`/checkpoint."""
    if not os.path.exists(path):
        raise GenerateError(f"no checkpoint at {path}: the path does not exist")
    if not os.path.isdir(path):
        raise GenerateError(f"no checkpoint at {path}: not a folder (give a step folder such as "
                            "outputs/debug_model/checkpoint/step-60, or the dump folder)")
    if os.path.isfile(os.path.join(path, ".metadata")):
        if step is not None and os.path.basename(os.path.normpath(path)) != f"step-{step}":
            raise GenerateError(f"--step {step} goes with a dump or checkpoint folder; {path} is a step folder")
        return path
    if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        raise GenerateError(f"{path} is a Hugging Face safetensors checkpoint; this tool reads DCP checkpoints")
    folder = path
    has_steps = any(re.fullmatch(r"step-\d+", n) for n in os.listdir(path))
    if not has_steps and os.path.isdir(os.path.join(path, "checkpoint")):
        folder = os.path.join(path, "checkpoint")
    if not any(re.fullmatch(r"step-\d+", n) for n in os.listdir(folder)):
        raise GenerateError(f"no checkpoint at {path}: no DCP .metadata there and no step-N folders "
                            f"(a dump folder holds them in checkpoint/)")
    from hymo_recipes.titan.checkpoints import plan_resume  # the resume's choice (TorchTitan import)

    plan = plan_resume(folder, -1 if step is None else step)
    if plan is None or plan.target is None or not plan.exists:
        what = f"step {step}" if step is not None else "a whole step"
        skipped = "; ".join(f"step-{s}: {why}" for s, why in plan.skipped) if plan else ""
        raise GenerateError(f"no checkpoint at {folder}: {what} not found" + (f" ({skipped})" if skipped else ""))
    for s, why in plan.skipped:
        print(f"generate: skipping step-{s} ({why})", file=sys.stderr)
    return plan.path


def read_manifest(step_dir: str) -> dict | None:
    file = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise GenerateError(f"checkpoint {step_dir} is damaged: its {MANIFEST} cannot be read ({e})") from None


def read_config(path: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise GenerateError(f"cannot read --config {path}: {e}") from None


def model_args(manifest: dict | None, flavor: str | None, vocab_size: int, step_dir: str,
               mup_base_width: int | None = None) -> tuple[str, HymoModelArgs]:
    """(flavor, model args): the manifest's flavor, shape and muP base width, or the named flavor
    with `vocab_size` (the config's [hymo] vocab_size or the tokenizer's, as in training) and
    `mup_base_width` (the config's [hymo] mup_base_width; None or -1: the flavor's). With a
    manifest, a given `mup_base_width` must agree with it."""
    identity = (manifest or {}).get("identity") or {}
    trained = identity.get("flavor")
    if flavor is not None and flavor not in hymo_flavors:
        raise GenerateError(f"unknown flavor {flavor!r}; choose one of {', '.join(hymo_flavors)}")
    if trained is not None and flavor is not None and trained != flavor:
        raise GenerateError(f"checkpoint {step_dir} was trained with flavor {trained!r}, not {flavor!r} "
                            f"(--flavor / --config): drop the option or pass --flavor {trained}")
    name = trained or flavor
    if name is None:
        raise GenerateError(f"checkpoint {step_dir} has no {MANIFEST} to name its model: pass --flavor or --config")
    if name not in hymo_flavors:
        raise GenerateError(f"checkpoint {step_dir} holds flavor {name!r}, which this version does not define")
    args = copy.deepcopy(hymo_flavors[name])
    shape = identity.get("shape")
    given = mup_base_width if mup_base_width is not None and mup_base_width >= 0 else None
    if shape:
        trained_mup = int(identity.get("mup_base_width", 0))  # not recorded: written with muP off
        if given is not None and given != trained_mup:
            raise GenerateError(f"checkpoint {step_dir} was trained with mup_base_width {trained_mup}, not {given} "
                                f"([hymo] mup_base_width of --config): drop the setting or set it to {trained_mup}")
    try:
        if shape:
            known = {f.name for f in dataclasses.fields(HymoModelArgs)}
            fields = {k: tuple(v) if isinstance(v, list) else v for k, v in shape.items() if k in known}
            args = dataclasses.replace(args, **fields, mup_base_width=trained_mup)
        else:
            args = dataclasses.replace(args, vocab_size=vocab_size,
                                       **({} if given is None else {"mup_base_width": given}))
    except ValueError as e:
        raise GenerateError(f"checkpoint {step_dir}: its model args are invalid ({e})") from None
    return name, args


def with_backend(args: HymoModelArgs, device: torch.device) -> HymoModelArgs:
    """The GDN backend this device runs: the flavor's on CUDA, the chunked PyTorch reference on CPU."""
    if device.type == "cuda" or args.gdn_backend != "triton":
        return args
    return dataclasses.replace(args, gdn_backend="torch_chunk", gdn_dot_precision="table", gdn_bwd_path="table",
                               gdn_mixer_saves="inputs")


def load_model(step_dir: str, name: str, args: HymoModelArgs, device: torch.device, dtype: torch.dtype) -> HymoModel:
    """Builds the model and reads its entries of the DCP checkpoint (top-level keys, as TorchTitan
    0.2.2 flattens them, or under "model."); a missing entry or another shape is a GenerateError."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    try:
        stored = FileSystemReader(step_dir).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a torn or foreign .metadata
        raise GenerateError(f"checkpoint {step_dir} is damaged: its .metadata cannot be read "
                            f"({type(e).__name__}: {e})") from None
    prefix = "model." if any(k.startswith("model.") for k in stored) and "tok_embeddings.weight" not in stored else ""

    with torch.device("meta"):  # shapes first: a wrong flavor fails before anything is allocated
        model = HymoModel(args)
    for key, value in model.state_dict().items():
        meta = stored.get(prefix + key)
        if meta is None or not hasattr(meta, "size"):
            raise GenerateError(f"checkpoint {step_dir} does not hold a HyMo {describe(name, args)} model: no "
                                f"{prefix + key}")
        if tuple(meta.size) != tuple(value.shape):
            raise GenerateError(f"checkpoint {step_dir} holds a model of another shape than {describe(name, args)}: "
                                f"{key} is {list(meta.size)} there, {list(value.shape)} here")
    model = model.to_empty(device=device)
    model.init_weights(buffer_device=device)  # every entry is overwritten below; this sets the RoPE table
    state = model.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp_load({prefix + k: v for k, v in state.items()}, checkpoint_id=step_dir)
    # parameters in `dtype` (as FSDP's mixed precision computes with them); buffers (the MoE
    # selection bias, the RoPE table) stay fp32, as in training
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model.eval()


def is_hf_export(path: str) -> bool:
    """Whether `path` is a folder written by ``python -m hymo_recipes.export_hf`` (its config.json
    says model_type "hymo")."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type") == "hymo"
    except (OSError, ValueError, AttributeError):
        return False


def read_hf_export_config(folder: str) -> tuple[str, HymoModelArgs, dict]:
    """(flavor, model args, the tokenizer identity it records) of an export's config.json."""
    from hymo_recipes.import_hf import read_export_config  # imports this module: loaded on use

    return read_export_config(folder)


def load_hf_export(folder: str, name: str, args: HymoModelArgs, device: torch.device,
                   dtype: torch.dtype) -> HymoModel:
    """Builds the model and reads an export's safetensors (HF names mapped back to HyMo's); a
    missing, unexpected or misshapen tensor is a GenerateError."""
    from hymo_recipes.export_hf import check_state, hymo_state_from_hf, read_safetensors

    state = hymo_state_from_hf(read_safetensors(folder), folder)
    check_state(state, args, folder, describe(name, args))
    with torch.device("meta"):
        model = HymoModel(args)
    model = model.to_empty(device=device)
    model.init_weights(buffer_device=device)  # every saved entry is overwritten below; this sets the RoPE table
    model.load_state_dict(state, strict=True)
    for param in model.parameters():  # as load_model: parameters in `dtype`, buffers fp32
        param.data = param.data.to(dtype)
    return model.eval()


def describe(name: str, args: HymoModelArgs) -> str:
    return f"flavor {name!r} (vocab {args.vocab_size}" + (f", muP base width {args.mup_base_width})"
                                                          if args.mup_base_width else ")")


# -- the tokenizer ---------------------------------------------------------------------------------

def load_tokenizer(path: str, manifest: dict | None, step_dir: str):
    from hymo_recipes.titan.checkpoints import tokenizer_identity
    from hymo_recipes.titan.datasets import load_tokenizer as titan_load_tokenizer

    try:
        tokenizer = titan_load_tokenizer(path)
    except (FileNotFoundError, ValueError) as e:
        raise GenerateError(str(e).replace("(model.hf_assets_path)", "(--tokenizer)")) from None
    trained = ((manifest or {}).get("identity") or {}).get("tokenizer")
    if trained:
        ours = tokenizer_identity(path)
        if ours["sha256"] != trained["sha256"] or ours["vocab_size"] != trained["vocab_size"]:
            raise GenerateError(f"checkpoint {step_dir} was trained with tokenizer {trained['sha256']} (vocab "
                                f"{trained['vocab_size']}, from {trained.get('path')}), {path} holds {ours['sha256']} "
                                f"(vocab {ours['vocab_size']}): pass the original with --tokenizer")
    return tokenizer


def tokenizer_path(opts, config: dict | None, manifest: dict | None) -> str:
    if opts.tokenizer:
        return opts.tokenizer
    if config and config.get("model", {}).get("hf_assets_path"):
        return config["model"]["hf_assets_path"]
    trained = ((manifest or {}).get("identity") or {}).get("tokenizer") or {}
    if trained.get("path") and os.path.isfile(os.path.join(trained["path"], "tokenizer.json")):
        return trained["path"]
    return DEFAULT_TOKENIZER


def read_prompts(opts) -> list[str]:
    prompts = list(opts.prompt)
    if opts.prompts_file:
        try:
            with open(opts.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise GenerateError(f"cannot read --prompts-file {opts.prompts_file}: {e}") from None
    if not prompts:
        raise GenerateError("no prompt: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    for i, p in enumerate(prompts):
        if not p.strip():
            raise GenerateError(f"prompt {i + 1} is empty: give it some text")
    return prompts


def check_sampling(opts) -> None:
    if opts.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be at least 1, got {opts.max_new_tokens}")
    if not opts.greedy:
        if opts.temperature < 0:
            raise GenerateError(f"--temperature must be >= 0 (0 = greedy), got {opts.temperature}")
        if not 0 < opts.top_p <= 1:
            raise GenerateError(f"--top-p must lie in (0, 1], got {opts.top_p}")
        if opts.top_k < 0:
            raise GenerateError(f"--top-k must be >= 0 (0 = all tokens), got {opts.top_k}")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise GenerateError(f"--device {name}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GenerateError(f"--device {name}: CUDA is not available here (use --device cpu)")
    return device


# -- streaming -------------------------------------------------------------------------------------

class Streamer:
    """Writes a completion's text as its tokens arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out, self.ids, self.written = tokenizer, out, [], 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self.out.write(text[self.written:])
            self.out.flush()
            self.written = len(text)

    def close(self) -> None:
        text = self.tokenizer.decode(self.ids)
        self.out.write(text[self.written:] + "\n")
        self.out.flush()


def run(opts) -> None:
    check_sampling(opts)
    prompts = read_prompts(opts)
    device = pick_device(opts.device)
    dtype = getattr(torch, opts.dtype)
    if is_hf_export(opts.checkpoint):
        step_dir = opts.checkpoint
        for option in ("step", "flavor", "config"):
            if getattr(opts, option) is not None:
                raise GenerateError(f"--{option} goes with a DCP checkpoint; {step_dir} is a Hugging Face export "
                                    "(its config.json names the flavor and shape)")
        name, args, recorded = read_hf_export_config(step_dir)
        # the export records the tokenizer it was trained with, as a manifest does
        tokenizer = load_tokenizer(opts.tokenizer or step_dir, {"identity": {"tokenizer": recorded}}, step_dir)
        args = with_backend(args, device)
        torch.manual_seed(opts.seed)
        t0 = time.perf_counter()
        model = load_hf_export(step_dir, name, args, device, dtype)
    else:
        step_dir = resolve_checkpoint(opts.checkpoint, opts.step)
        manifest = read_manifest(step_dir)
        config = read_config(opts.config) if opts.config else None
        flavor = opts.flavor or (config or {}).get("model", {}).get("flavor")
        if config and config.get("model", {}).get("name", "hymo") != "hymo":
            raise GenerateError(f"--config {opts.config} trains model {config['model']['name']!r}, not hymo")

        tokenizer = load_tokenizer(tokenizer_path(opts, config, manifest), manifest, step_dir)
        vocab = (config or {}).get("hymo", {}).get("vocab_size") or tokenizer.get_vocab_size()
        name, args = model_args(manifest, flavor, vocab, step_dir,
                                (config or {}).get("hymo", {}).get("mup_base_width"))
        args = with_backend(args, device)
        torch.manual_seed(opts.seed)
        t0 = time.perf_counter()
        model = load_model(step_dir, name, args, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"generate: loaded {step_dir} ({describe(name, args)}, {n_params:,} parameters, "
          f"GDN backend {args.gdn_backend}) on {device} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    ids = [tokenizer.encode(p, add_bos=True, add_eos=False) for p in prompts]
    if any(len(i) == 0 for i in ids):
        raise GenerateError("a prompt encodes to no tokens")
    decoder = HymoDecoder(model)
    generator = torch.Generator().manual_seed(opts.seed)
    out = sys.stdout
    if len(prompts) > 1:
        out.write(f"--- 1/{len(prompts)}\n")
    out.write(prompts[0])
    out.flush()
    stream = Streamer(tokenizer, out)
    first: list[float] = []
    eos = None if opts.ignore_eos else tokenizer.eos_id
    finished = [False]  # the first sequence sampled EOS at an earlier step

    def on_step(step, new, done):
        if step == 0:
            first.append(time.perf_counter())
        if not finished[0] and new[0] != eos:
            stream.add(new[0])
        finished[0] = done[0]
    start = time.perf_counter()
    completions = decoder.generate(ids, opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
                                   top_p=opts.top_p, greedy=opts.greedy, generator=generator, eos_id=eos,
                                   on_step=on_step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    total = time.perf_counter() - start
    stream.close()
    for i in range(1, len(prompts)):
        text = tokenizer.decode([t for t in completions[i] if t != eos])
        out.write(f"--- {i + 1}/{len(prompts)}\n{prompts[i]}{text}\n")
    out.flush()

    n_new = sum(len(c) for c in completions)
    ttft = (first[0] - start) if first else total
    steps = max(len(c) for c in completions) - 1
    rate = f", decode {steps * len(prompts) / (total - ttft):.1f} tokens/s" if steps > 0 and total > ttft else ""
    print(f"generate: {n_new} tokens for {len(prompts)} prompt(s) in {total:.2f} s: {n_new / total:.1f} tokens/s "
          f"(first token after {ttft:.2f} s for a {sum(map(len, ids))}-token prefill{rate})", file=sys.stderr)


def run_command(argv: list[str] | None, prog: str, parser, runner) -> int:
    """A command's main: parse, run; a GenerateError (or subclass) is one line and exit code 2,
    Ctrl-C exit code 130. Shared by generate, export_hf and import_hf."""
    try:
        opts = parser().parse_args(argv)
        runner(opts)
    except GenerateError as e:
        sys.stdout.flush()
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(argv, "generate", build_parser, run)


if __name__ == "__main__":
    sys.exit(main())
