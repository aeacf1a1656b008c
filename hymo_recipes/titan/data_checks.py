"""Checks of a run's local data before anything is built (preflight.py), each failing in one line
that names the file and what to do:

- the files of the split exist; a directory in the prepared layout (``train.<ext>`` /
  ``validation.<ext>``) must hold the split asked for (a folder with only ``validation.*``
  would otherwise be read as training data and validate on itself);
- no file is empty, text files decode as UTF-8, the split has documents;
- every data-parallel rank's shard (the contiguous split TorchTitan makes) holds the tokens the
  run reads: ``training.steps`` × gradient accumulation × ``local_batch_size`` windows of
  ``seq_len + 1`` tokens for training, ``validation.steps`` batches (at least one) for
  validation. Less is an error unless ``[hymo] allow_data_repeat`` asks to loop over the data;
  then one warning says how many passes the run makes (dataloader.py loops without further
  warnings; when the data runs out and looping was not asked for, the train step checkpoints
  the last whole step and stops the run, trainer.py).

Hub datasets (streamed) are not read here: their size is unknown before the run.
"""

from __future__ import annotations

import codecs
import os

from hymo_recipes.data import load_local, local_files
from hymo_recipes.titan.api import DATASETS, logger

REPEAT_KNOB = "--hymo.allow_data_repeat"


def process_count(config) -> int:
    """How many processes the run has: torchrun's WORLD_SIZE, or NGPU under a fake comm mode."""
    if config.comm.mode in ("fake_backend", "local_tensor"):
        return int(os.environ.get("NGPU", "1"))
    return int(os.environ.get("WORLD_SIZE", "1"))


def dp_degree(config) -> int:
    """The data-parallel degree the Trainer will use: the process count (torchrun's WORLD_SIZE,
    NGPU under a fake comm mode) over the tensor, pipeline and context parallel degrees."""
    world = process_count(config)
    p = config.parallelism
    other = p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree
    if other < 1 or world % other:
        raise ValueError(f"{world} processes do not divide into tensor × pipeline × context parallel degrees "
                         f"{p.tensor_parallel_degree} × {p.pipeline_parallel_degree} × {p.context_parallel_degree}")
    return world // other


def gradient_accumulation(config, dp: int) -> int:
    """Microbatches per step; raises ValueError when the batch sizes do not divide."""
    t = config.training
    if t.global_batch_size < 0:
        return 1
    per_microbatch = t.local_batch_size * dp
    if t.global_batch_size < per_microbatch or t.global_batch_size % per_microbatch:
        raise ValueError(f"training.global_batch_size {t.global_batch_size} is not a multiple of training.local_batch_size "
                         f"{t.local_batch_size} × {dp} data-parallel ranks = {per_microbatch}: set --training.global_batch_size "
                         f"to a multiple of {per_microbatch} (or -1: one microbatch per step), or change the local batch "
                         "or the process count (NGPU)")
    return t.global_batch_size // per_microbatch


def check_utf8(file: str) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise ValueError(f"{file} is not valid UTF-8 (byte {offset + e.start:,}: {e.reason}): re-encode it as "
                                 "UTF-8, e.g. iconv -f latin1 -t utf-8") from None
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise ValueError(f"{file} is not valid UTF-8 (it ends inside a character: {e.reason}): re-encode it "
                             "as UTF-8") from None


def shard_tokens(docs, tokenizer, n_ranks: int, need: int | None) -> list[int]:
    """Tokens (with BOS/EOS, as the dataset packs them) in each rank's contiguous shard of
    ``docs``; counting a shard stops once it holds ``need`` (None: count everything)."""
    from hymo_recipes.titan.dataloader import shard_bounds

    counts = []
    for rank in range(n_ranks):
        start, end = shard_bounds(len(docs), rank, n_ranks)
        total = 0
        for i in range(start, end):
            total += len(tokenizer.encode(docs[i]["text"], add_bos=True, add_eos=True))
            if need is not None and total >= need:
                break
        counts.append(total)
    return counts


def check_split(name: str, path: str | None, setting: str, tokenizer, *, dp: int, sequences: int,
                seq_len: int, allow_repeat: bool, what: str) -> None:
    """One split of a local dataset: files, content and size against ``sequences`` windows of
    ``seq_len + 1`` tokens per rank. Other datasets (Hub, TorchTitan's) are left to their loaders."""
    cfg = DATASETS.get(name)
    loader = getattr(cfg, "loader", None)
    if getattr(loader, "func", None) is not load_local:
        return
    split = loader.keywords["split"]
    where = path or cfg.path
    try:
        builder, files = local_files(where, split)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{setting}: {e}") from None
    for file in files:
        if os.path.getsize(file) == 0:
            raise ValueError(f"{setting}: {file} is empty: put documents in it, or point the dataset_path at other data")
        if builder in ("json", "text"):
            try:
                check_utf8(file)
            except ValueError as e:
                raise ValueError(f"{setting}: {e}") from None
    try:
        docs = load_local(where, split)
    except ValueError as e:
        raise ValueError(f"{setting}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the reader's own error, named with the files it read
        raise ValueError(f"{setting}: {', '.join(files)} cannot be read as {builder} "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): fix or replace the file") from None
    if len(docs) == 0:
        raise ValueError(f"{setting}: {', '.join(files)} holds no documents: put documents in it, or point the "
                         "dataset_path at other data")
    window = seq_len + 1
    need = sequences * window
    counts = shard_tokens(docs, tokenizer, dp, None if allow_repeat else need)
    smallest = min(counts)
    if smallest >= need:
        return
    shard = f"the smallest of {dp} ranks' shards holds" if dp > 1 else "it holds"
    if smallest == 0:  # looping over nothing yields nothing
        raise ValueError(f"{setting}: {', '.join(files)} is too small: {shard} no tokens ({len(docs):,} documents "
                         f"for {dp} data-parallel ranks): use more data or fewer ranks")
    if not allow_repeat:
        raise ValueError(f"{setting}: {', '.join(files)} is too small: {shard} {smallest:,} tokens "
                         f"({smallest // window:,} windows of {window}), {what} reads {sequences:,} windows "
                         f"({need:,} tokens): use more data, fewer steps or smaller batches, or pass {REPEAT_KNOB} "
                         "to loop over it")
    passes = "less than one window" if smallest < window else f"{need / (smallest // window * window):.1f} passes"
    logger.warning(f"{setting}: {', '.join(files)} is smaller than {what} reads ({shard} {smallest:,} tokens, "
                   f"{need:,} read): looping over it ({passes}; hymo.allow_data_repeat)")


def check_data(config, tokenizer, dp: int) -> None:
    """The training split and, with validation on, the validation split (module docstring)."""
    t, v = config.training, config.validation
    allow = bool(getattr(getattr(config, "hymo", None), "allow_data_repeat", False))
    accumulation = gradient_accumulation(config, dp)
    check_split(t.dataset, t.dataset_path, "[training] dataset", tokenizer, dp=dp,
                sequences=t.steps * accumulation * t.local_batch_size, seq_len=t.seq_len,
                allow_repeat=allow, what=f"the run ({t.steps:,} steps)")
    if v.enable:
        check_split(v.dataset, v.dataset_path, "[validation] dataset", tokenizer, dp=dp,
                    sequences=max(v.steps, 1) * v.local_batch_size, seq_len=v.seq_len, allow_repeat=allow,
                    what="a validation" if v.steps == -1 else f"a validation ({v.steps} steps)")


__all__ = ["REPEAT_KNOB", "check_data", "check_split", "check_utf8", "dp_degree", "gradient_accumulation"]
