"""Datasets and tokenizer for HyMo runs.

Importing this module registers these names in TorchTitan's dataset table (used by
``[training] dataset`` and ``[validation] dataset``; ``dataset_path`` overrides the path):

- ``brown`` / ``brown_validation``: the embedded default, ``data/brown`` as written by
  ``python -m hymo_recipes.data.prepare`` (train / held-out split).
- ``local`` / ``local_validation``: your own files, given by ``dataset_path``: a ``.jsonl``,
  ``.json`` or ``.parquet`` file with a ``text`` column, a ``.txt`` file (one document per file),
  or a directory holding ``train.<ext>`` / ``validation.<ext>`` (the prepared layout) or else
  files of one of those kinds (all of them are read).
- ``hf`` / ``hf_validation``: a Hugging Face Hub dataset named by ``dataset_path``, streamed,
  split ``train`` / ``validation``, with a ``text`` column.

The tokenizer is an HF ``tokenizer.json`` (plus optional ``tokenizer_config.json`` naming the
BOS/EOS tokens) in ``[model] hf_assets_path``; the default ``assets/tokenizer`` is the byte-level
BPE that ``prepare`` trains on the Brown train split.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from hymo_recipes._titan import DATASETS, DatasetConfig, HuggingFaceTokenizer

from .prepare import DEFAULT_DATA_DIR, DEFAULT_TOKENIZER_DIR, PREPARE_COMMAND

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_PREPARE_HINT = f"prepare it with `{PREPARE_COMMAND}` (or ./scripts/setup.sh)"


def _local_files(path: str, split: str) -> tuple[str, list[str]]:
    """(HF builder name, files) for a local dataset path; raises with a hint when missing."""
    if not path:
        raise ValueError("dataset 'local' needs dataset_path (a file or a directory)")
    p = Path(path)
    if not p.exists():
        hint = _PREPARE_HINT if p == Path(DEFAULT_DATA_DIR) else "check dataset_path"
        raise FileNotFoundError(f"dataset path {path!r} does not exist: {hint}")
    if p.is_dir():
        files = [f for f in sorted(p.iterdir()) if f.stem == split and f.suffix in _FORMATS]
        if not files:
            files = [f for f in sorted(p.iterdir()) if f.suffix in _FORMATS]
    else:
        files = [p]
    kinds = {_FORMATS.get(f.suffix) for f in files}
    if not files or None in kinds or len(kinds) != 1:
        raise ValueError(f"dataset path {path!r}: expected {split}.<ext> or files of one kind "
                         f"among {sorted(_FORMATS)}, found {[f.name for f in files] or 'none'}")
    return kinds.pop(), [str(f) for f in files]


def load_local(path: str, split: str):
    """A map-style HF dataset with a ``text`` column from local files (see the module doc)."""
    from datasets import load_dataset

    builder, files = _local_files(path, split)
    extra = {"sample_by": "document"} if builder == "text" else {}
    ds = load_dataset(builder, data_files=files, split="train", **extra)
    if "text" not in ds.column_names:
        raise ValueError(f"dataset {path!r} has no 'text' column (columns: {ds.column_names})")
    return ds


def load_hub(path: str, split: str):
    from datasets import load_dataset

    if not path:
        raise ValueError("dataset 'hf' needs dataset_path = the Hub name of the dataset")
    return load_dataset(path, split=split, streaming=True)


def _text(sample: dict) -> str:
    return sample["text"]


for _name, _path, _loader in (("brown", DEFAULT_DATA_DIR, load_local),
                              ("local", "", load_local),
                              ("hf", "", load_hub)):
    DATASETS[_name] = DatasetConfig(_path, partial(_loader, split="train"), _text)
    DATASETS[f"{_name}_validation"] = DatasetConfig(_path, partial(_loader, split="validation"),
                                                    _text)


def check_dataset(name: str, path: str | None, setting: str) -> None:
    """Raises ValueError naming `setting` if a local dataset's files are missing or unusable
    (run before anything is built, preflight.py); Hub datasets and other names are left to
    their loaders."""
    cfg = DATASETS.get(name)
    loader = getattr(cfg, "loader", None)
    if getattr(loader, "func", None) is not load_local:
        return
    try:
        _local_files(path or cfg.path, loader.keywords["split"])
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{setting}: {e}") from None


def build_tokenizer(job_config) -> HuggingFaceTokenizer:
    """TorchTitan's HuggingFaceTokenizer, after checking the files exist and that documents
    will be separated (an EOS id), so a bad path fails here, before the model is built."""
    path = Path(job_config.model.hf_assets_path)
    if not (path / "tokenizer.json").is_file():
        hint = (_PREPARE_HINT if path == Path(DEFAULT_TOKENIZER_DIR)
                else "point [model] hf_assets_path at a directory holding an HF tokenizer.json")
        raise FileNotFoundError(f"no tokenizer.json in {str(path)!r} (model.hf_assets_path): {hint}")
    tokenizer = HuggingFaceTokenizer(str(path))
    if tokenizer.eos_id is None:
        raise ValueError(f"the tokenizer in {str(path)!r} has no EOS token (tokenizer_config.json "
                         "eos_token): packed documents would run together without a separator")
    return tokenizer
