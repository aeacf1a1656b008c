"""HyMo's datasets in TorchTitan's dataset table, and the tokenizer builder.

Importing this module registers these names (used by ``[training] dataset`` and ``[validation]
dataset``; ``dataset_path`` overrides the path), each a loader of ``hymo_recipes.data``:

- ``brown`` / ``brown_validation``: the embedded default, ``data/brown`` as written by
  ``python -m hymo_recipes.data.prepare`` (train / held-out split);
- ``local`` / ``local_validation``: your own files, given by ``dataset_path`` (``load_local``);
- ``hf`` / ``hf_validation``: a Hugging Face Hub dataset named by ``dataset_path``, streamed,
  split ``train`` / ``validation`` (``load_hub``).

The tokenizer is an HF ``tokenizer.json`` (plus optional ``tokenizer_config.json`` naming the
BOS/EOS tokens) in ``[model] hf_assets_path``; the default ``assets/tokenizer`` is the byte-level
BPE that ``prepare`` trains on the Brown train split.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from hymo_recipes.data import DEFAULT_DATA_DIR, DEFAULT_TOKENIZER_DIR, PREPARE_COMMAND, PREPARE_HINT, load_hub, load_local, local_files, text
from hymo_recipes.titan.api import DATASETS, DatasetConfig, HuggingFaceTokenizer

for _name, _path, _loader in (("brown", DEFAULT_DATA_DIR, load_local),
                              ("local", "", load_local),
                              ("hf", "", load_hub)):
    DATASETS[_name] = DatasetConfig(_path, partial(_loader, split="train"), text)
    DATASETS[f"{_name}_validation"] = DatasetConfig(_path, partial(_loader, split="validation"), text)


def check_dataset(name: str, path: str | None, setting: str) -> None:
    """Raises ValueError naming `setting` if a local dataset's files are missing or unusable
    (run before anything is built, preflight.py); Hub datasets and other names are left to
    their loaders."""
    cfg = DATASETS.get(name)
    loader = getattr(cfg, "loader", None)
    if getattr(loader, "func", None) is not load_local:
        return
    try:
        local_files(path or cfg.path, loader.keywords["split"])
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{setting}: {e}") from None


def load_tokenizer(hf_assets_path: str) -> HuggingFaceTokenizer:
    """TorchTitan's HuggingFaceTokenizer, after checking the files exist and that documents
    will be separated (an EOS id); raises FileNotFoundError / ValueError naming the setting."""
    path = Path(hf_assets_path)
    if not (path / "tokenizer.json").is_file():
        hint = (PREPARE_HINT if path == Path(DEFAULT_TOKENIZER_DIR)
                else "point [model] hf_assets_path at a directory holding an HF tokenizer.json")
        raise FileNotFoundError(f"no tokenizer.json in {str(path)!r} (model.hf_assets_path): {hint}")
    hint = (f"restore it with `{PREPARE_COMMAND} --force`" if path == Path(DEFAULT_TOKENIZER_DIR)
            else "restore it, or point [model] hf_assets_path at a directory with a valid tokenizer.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            json.loads(file.read_bytes())
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{file} (model.hf_assets_path) is not valid JSON ({e}): {hint}") from None
    try:
        tokenizer = HuggingFaceTokenizer(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library's errors do not name the files
        raise ValueError(f"the tokenizer in {str(path)!r} (model.hf_assets_path) cannot be loaded "
                         f"({type(e).__name__}: {' '.join(str(e).split())}): {hint}") from None
    if tokenizer.eos_id is None:
        raise ValueError(f"the tokenizer in {str(path)!r} has no EOS token (tokenizer_config.json "
                         "eos_token): packed documents would run together without a separator")
    return tokenizer


def set_vocab_size(job_config, tokenizer) -> None:
    """Writes the tokenizer's vocabulary size into ``[hymo] vocab_size`` when it is 0 (the
    model args take it from there); raises ValueError if a set value is too small for it."""
    hymo = getattr(job_config, "hymo", None)
    if hymo is None:
        return
    n = tokenizer.get_vocab_size()
    if hymo.vocab_size == 0:
        hymo.vocab_size = n
    elif hymo.vocab_size < n:
        raise ValueError(f"[hymo] vocab_size = {hymo.vocab_size} is smaller than the tokenizer's "
                         f"vocabulary ({n}, model.hf_assets_path)")


def build_tokenizer(job_config) -> HuggingFaceTokenizer:
    """The TrainSpec's tokenizer builder: ``load_tokenizer`` of ``[model] hf_assets_path``, and its
    vocabulary size into ``[hymo] vocab_size`` (``set_vocab_size``; the preflight has done that
    already when the run comes through HyMo's entry point). TorchTitan builds the tokenizer before
    it applies the config to the model args."""
    tokenizer = load_tokenizer(job_config.model.hf_assets_path)
    set_vocab_size(job_config, tokenizer)
    return tokenizer
