"""HyMo's text sources, and ``prepare`` (python -m hymo_recipes.data.prepare), which writes the
default corpus and tokenizer.

- ``load_local(path, split)``: your own files: a ``.jsonl``, ``.json`` or ``.parquet`` file
  with a ``text`` column, a ``.txt`` file (one document per file), or a directory holding
  ``train.<ext>`` / ``validation.<ext>`` (the prepared layout: the split asked for must be
  there) or else files of one of those kinds (all of them are read, for either split). ``data/brown``, as ``prepare`` writes it, is such a directory.
- ``load_hub(path, split)``: a Hugging Face Hub dataset, streamed, with a ``text`` column.

TorchTitan's dataset table names them (``brown``, ``local``, ``hf`` and their ``_validation``
splits): hymo_recipes/titan/datasets.py registers them and builds the tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from .prepare import DEFAULT_DATA_DIR, DEFAULT_TOKENIZER_DIR, PREPARE_COMMAND

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
SPLITS = ("train", "validation")  # the prepared layout's file stems
PREPARE_HINT = f"prepare it with `{PREPARE_COMMAND}` (or ./scripts/setup.sh)"


def local_files(path: str, split: str) -> tuple[str, list[str]]:
    """(HF builder name, files) for a local dataset path; raises with a hint when missing."""
    if not path:
        raise ValueError("dataset 'local' needs dataset_path (a file or a directory)")
    p = Path(path)
    if not p.exists():
        hint = PREPARE_HINT if p == Path(DEFAULT_DATA_DIR) else "check dataset_path"
        raise FileNotFoundError(f"dataset path {path!r} does not exist: {hint}")
    if p.is_dir():
        files = [f for f in sorted(p.iterdir()) if f.stem == split and f.suffix in FORMATS]
        splits = sorted(f.name for f in p.iterdir() if f.stem in SPLITS and f.suffix in FORMATS)
        if not files and splits:
            # the prepared layout without this split: reading the other split's file instead
            # would train (or validate) on the wrong documents
            raise FileNotFoundError(f"dataset path {path!r} has {', '.join(splits)} but no {split}.<ext>: add "
                                    f"{split}.<ext>, or point dataset_path at the {split} file itself")
        if not files:
            files = [f for f in sorted(p.iterdir()) if f.suffix in FORMATS]
    else:
        files = [p]
    kinds = {FORMATS.get(f.suffix) for f in files}
    if not files or None in kinds or len(kinds) != 1:
        raise ValueError(f"dataset path {path!r}: expected {split}.<ext> or files of one kind "
                         f"among {sorted(FORMATS)}, found {[f.name for f in files] or 'none'}")
    return kinds.pop(), [str(f) for f in files]


def load_local(path: str, split: str):
    """A map-style HF dataset with a ``text`` column from local files (see the module doc)."""
    from datasets import load_dataset

    builder, files = local_files(path, split)
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


def text(sample: dict) -> str:
    return sample["text"]


__all__ = ["DEFAULT_DATA_DIR", "DEFAULT_TOKENIZER_DIR", "PREPARE_COMMAND", "PREPARE_HINT", "load_hub", "load_local", "local_files", "text"]
