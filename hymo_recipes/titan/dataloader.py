"""The training dataloader: TorchTitan's, with a checkpoint that any number of ranks can load.

TorchTitan 0.2.2 splits the documents into one contiguous shard per data-parallel (DP) rank,
saves each rank's position under its own key (``dp_rank_<r>``) and asserts on load that the DP
degree is unchanged; a run with more ranks cannot even load (DCP finds no key for the new
ranks). HyMo's loader saves one entry instead, written identically by every rank: the DP degree
W, the sequences each rank has consumed, every rank's TorchTitan state and, for map-style
datasets, which documents each rank has read in the epoch in progress (gathered over the ranks
when the checkpoint is written). On load:

- same DP degree: each rank restores its own TorchTitan state, an exact resume (bitwise on
  CPU, tests/integration/test_train.py);
- DP degree W -> W' (logged as a warning), map-style dataset: the epoch continues with exactly
  the documents no rank has read yet. Rank r' of W' takes its new contiguous shard (the same
  split TorchTitan makes) minus every document the W ranks read in this epoch, in order; the
  next epoch reads its whole shard again. Lost: each old rank's buffered tail (the part of its
  last document not yet cut into a sequence, under seq_len + 1 tokens per rank). No document is
  read twice, which matters: a model re-reading sequences it has just trained on shows a
  falsely low loss after a resume on another number of GPUs;
- DP degree change, streaming dataset or a checkpoint without document positions: rank r' of
  W' replays its new shard from the start and skips its share of the G sequences consumed by
  all ranks together (G // W', one more for the first G % W' ranks): the position in tokens is
  kept, the documents are not (some are read twice, as many are skipped).

Document positions are saved for map-style datasets read without worker processes
(``num_workers = 0``, the configs' setting); with workers, the sequence-count fallback applies.
"""

from __future__ import annotations

import collections
import itertools
import pickle
import threading
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from datasets import Dataset

from hymo_recipes.titan.api import HuggingFaceTextDataset, ParallelAwareDataloader, logger

__all__ = ["DataRanOut", "HymoDataloader", "HymoTextDataset", "build_hymo_dataloader", "pack_states",
           "shard_bounds", "take_ranges", "subtract_ranges"]

Ranges = list[tuple[int, int]]  # [start, end) document index ranges, sorted, disjoint


def shard_bounds(n_docs: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous shard: datasets' ``Dataset.shard(contiguous=True)``,
    which ``split_dataset_by_node`` uses for map-style datasets."""
    div, mod = divmod(n_docs, world)
    start = div * rank + min(rank, mod)
    return start, start + div + (1 if rank < mod else 0)


def take_ranges(ranges: Ranges, count: int) -> Ranges:
    """The first ``count`` documents of ``ranges``, as ranges."""
    out = []
    for a, b in ranges:
        if count <= 0:
            break
        out.append((a, min(b, a + count)))
        count -= b - a
    return out


def subtract_ranges(block: tuple[int, int], taken: Ranges) -> Ranges:
    """The documents of ``block`` outside every range of ``taken``."""
    out, cursor = [], block[0]
    for a, b in sorted(taken):
        a, b = max(a, block[0]), min(b, block[1])
        if a >= b:
            continue
        if a > cursor:
            out.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < block[1]:
        out.append((cursor, block[1]))
    return out


CHUNK_DOCS = 64  # documents per batch encode of the read-ahead thread
PASS_END = object()  # in a read-ahead's samples and output: one pass over the data ends here


def batch_encoder(tokenizer):
    """texts -> token id lists as ``tokenizer.encode(text, add_bos=True, add_eos=True)`` gives
    them: for TorchTitan's HuggingFaceTokenizer one ``encode_batch`` of the underlying
    tokenizers.Tokenizer (which releases the GIL), with its BOS/EOS rule; otherwise one
    encode per text."""
    hf = getattr(tokenizer, "tokenizer", None)
    if not (hasattr(hf, "encode_batch") and hasattr(tokenizer, "hf_adds_bos")):
        return lambda texts: [tokenizer.encode(t, add_bos=True, add_eos=True) for t in texts]
    bos = tokenizer.bos_id if not tokenizer.hf_adds_bos else None
    eos = tokenizer.eos_id if not tokenizer.hf_adds_eos else None

    def encode(texts):
        out = []
        for enc in hf.encode_batch(texts) if texts else ():
            ids = enc.ids
            if bos is not None:
                ids.insert(0, bos)
            if eos is not None:
                ids.append(eos)
            out.append(ids)
        return out

    return encode


class ReadAhead:
    """Documents read and tokenized by a background thread, up to ``budget`` tokens ahead of
    the consumer; iterating yields each document's token ids in order, and ``PASS_END`` where
    the samples hold it.

    Tokenizing on the training loop's thread leaves the GPU waiting while it runs, and
    TorchTitan reads every microbatch of a step before the first forward. The thread batch-encodes CHUNK_DOCS documents at a time (the
    tokenizers library's batch encode runs on several cores without the GIL) while the GPU
    computes, and keeps about two steps' tokens ready. An error in the thread is raised by
    the iterator, in order.
    """

    def __init__(self, samples, text_fn, encode, budget: int):
        self._cond = threading.Condition()
        self._chunks: collections.deque = collections.deque()
        self._queued = 0
        self._stop = False
        self._thread = threading.Thread(target=self._produce, args=(samples, text_fn, encode, budget),
                                        name="hymo-tokenize", daemon=True)
        self._thread.start()

    def _produce(self, samples, text_fn, encode, budget: int) -> None:
        samples = iter(samples)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or self._queued < budget)
                    if self._stop:
                        return
                texts, marker = [], None
                for s in itertools.islice(samples, CHUNK_DOCS):
                    if s is PASS_END:  # a chunk ends with its pass (the next pass reads on)
                        marker = s
                        break
                    texts.append(text_fn(s))
                docs = encode(texts) if texts else []
                with self._cond:
                    if docs or marker is None:  # an empty chunk without a marker: the end of the samples
                        self._chunks.append(docs)
                        self._queued += sum(map(len, docs))
                    if marker is not None:
                        self._chunks.append(marker)
                    self._cond.notify_all()
                if not docs and marker is None:
                    return
        except BaseException as e:  # handed to the consumer, raised there
            with self._cond:
                self._chunks.append(e)
                self._cond.notify_all()

    def __iter__(self):
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._chunks)
                    docs = self._chunks.popleft()
                    if isinstance(docs, BaseException):
                        raise docs
                    if docs is not PASS_END:
                        self._queued -= sum(map(len, docs))
                    self._cond.notify_all()
                if docs is PASS_END:
                    yield PASS_END
                    continue
                if not docs:
                    return
                yield from docs
        finally:
            self.close()

    def close(self) -> None:
        """Stops the thread and waits for it (at most the chunk it is encoding), so that no
        reader outlives its iterator."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()


class DataRanOut(RuntimeError):
    """An infinite training dataset reached its end without ``[hymo] allow_data_repeat``: the
    train step stops the run with a checkpoint of the last whole step (trainer.py)."""


class HymoTextDataset(HuggingFaceTextDataset):
    """TorchTitan's text dataset that can finish an epoch on a list of document ranges (the
    documents a resume with another DP degree still has to read); the next epoch reads the
    whole shard. The ranges are part of the saved state."""

    def __init__(self, *args, allow_repeat: bool = False, lookahead_tokens: int = 1 << 20, **kwargs):
        super().__init__(*args, **kwargs)
        self.lookahead_tokens = lookahead_tokens
        self._epoch_ranges: Ranges | None = None  # shard-relative, for the epoch in progress
        self.allow_repeat = allow_repeat
        self._repeat_warned = False

    def __iter__(self):
        """TorchTitan's loop (HuggingFaceTextDataset.__iter__), but an infinite dataset starts
        another pass only when ``allow_repeat`` ([hymo] allow_data_repeat) says so, with one
        warning for the run instead of one per pass; otherwise running out is an error. A
        map-style dataset's read-ahead runs on from one pass into the next (``PASS_END`` marks
        the boundary), so a new pass does not start with the reader's queue empty."""
        max_buffer_token_len = 1 + self.seq_len
        while True:
            stream = self._encoded(self._get_data_iter())
            try:  # the stream (and a read-ahead thread behind it) ends with this loop, however it ends
                for sample_tokens in stream:
                    if sample_tokens is PASS_END:
                        if not self._next_pass():
                            return
                        continue
                    self._token_buffer.extend(sample_tokens)
                    self._sample_idx += 1
                    whole = len(self._token_buffer) // max_buffer_token_len
                    if not whole:
                        continue
                    # the whole sequences in one conversion (numpy's, ~4x torch's from a list:
                    # this runs on the prefetch thread, holding the GIL the training loop needs);
                    # the buffer, which a checkpoint saves, loses each one as it is yielded
                    rows = torch.from_numpy(np.array(self._token_buffer[:whole * max_buffer_token_len],
                                                     dtype=np.int64)).view(whole, max_buffer_token_len)
                    for x in rows:
                        self._token_buffer = self._token_buffer[max_buffer_token_len:]
                        yield {"input": x[:-1]}, x[1:]
            finally:
                stream.close()
            if not self._next_pass():  # a streamed dataset's pass, which ends its iterator
                return

    def _next_pass(self) -> bool:
        """A pass over the data has been consumed: whether another one follows (raises if the
        data may not end nor loop)."""
        self._epoch_ranges = None  # a pass over ranges is done: the next reads the full shard
        if not self.infinite:
            logger.warning(f"Dataset {self.dataset_name} has run out of data")
            return False
        if not self.allow_repeat:
            raise DataRanOut(f"dataset {self.dataset_name} ran out of data after one pass: use more data or "
                             "fewer steps, or pass --hymo.allow_data_repeat to loop over it")
        if self.map_style and len(self._data) == 0:
            raise ValueError(f"dataset {self.dataset_name}: this rank's shard holds no document, so looping over "
                             "it yields nothing (fewer documents than data-parallel ranks): use more data or fewer ranks")
        if not self._repeat_warned:
            logger.warning(f"Dataset {self.dataset_name} is being re-looped (hymo.allow_data_repeat; said once)")
            self._repeat_warned = True
        self._sample_idx = 0
        if not isinstance(self._data, Dataset) and hasattr(self._data, "set_epoch") and hasattr(self._data, "epoch"):
            self._data.set_epoch(self._data.epoch + 1)
        return True

    @staticmethod
    def _passes(first, data, repeat: bool):
        """The samples of ``first`` (this pass), then, if ``repeat``, of every later pass (the
        whole shard ``data`` from its start), each pass followed by PASS_END. Runs on the reader
        thread: what it reads of the dataset was decided on the consumer's (``_encoded``)."""
        yield from first
        while repeat and len(data):  # an empty shard: the consumer's _next_pass says so
            yield PASS_END
            yield from iter(data)
        yield PASS_END

    def _encoded(self, samples):
        """The token ids of each document of ``samples``, in order, with BOS and EOS as
        TorchTitan's loop adds them. A map-style dataset is read and tokenized ahead by a
        background thread (ReadAhead): its saved position is the count of consumed documents
        (``_sample_idx``), so read-ahead ones are read again after a resume. A streaming
        dataset saves its iterator's own state, which reading ahead would move past documents
        not yet trained on: it is tokenized here, one document at a time."""
        if not self.map_style:
            return (self._tokenizer.encode(self._text_processor(s), add_bos=True, add_eos=True) for s in samples)
        passes = self._passes(samples, self._data, self.infinite and self.allow_repeat)
        return iter(ReadAhead(passes, self._text_processor, batch_encoder(self._tokenizer), self.lookahead_tokens))

    @property
    def map_style(self) -> bool:
        return isinstance(self._data, Dataset)

    def _get_data_iter(self):
        if self._epoch_ranges is None or not self.map_style:
            return super()._get_data_iter()
        return self._iter_ranges()

    def _iter_ranges(self):
        skip = self._sample_idx  # documents of this epoch already read
        for a, b in self._epoch_ranges:
            if skip >= b - a:
                skip -= b - a
                continue
            yield from self._data.select(range(a + skip, b))
            skip = 0

    def documents_read(self) -> Ranges:
        """Shard-relative ranges of the documents read in the epoch in progress."""
        epoch = self._epoch_ranges if self._epoch_ranges is not None else [(0, len(self._data))]
        return take_ranges(epoch, self._sample_idx)

    def continue_epoch(self, ranges: Ranges) -> None:
        """Read exactly ``ranges`` (shard-relative) for the rest of this epoch, from a clean
        buffer."""
        self._epoch_ranges = [tuple(r) for r in ranges]
        self._sample_idx = 0
        self._token_buffer = []

    def state_dict(self):
        state = super().state_dict()
        state["epoch_ranges"] = self._epoch_ranges
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._epoch_ranges = state_dict.get("epoch_ranges")

_KEY = "hymo_data"


class HymoDataloader(ParallelAwareDataloader):
    """TorchTitan's ParallelAwareDataloader with a DP-degree-independent checkpoint (module
    docstring). ``state_dict`` is collective: every rank must call it (DCP does)."""

    def __init__(self, dataset, dp_rank: int, dp_world_size: int, **kwargs):
        super().__init__(dataset, dp_rank, dp_world_size, **kwargs)
        self.sequences_consumed = 0  # by this rank since the start of the run
        # live_state() after the last batch training took, when batches are read ahead
        # (hymo_recipes/titan/prefetch.py); None: the live position is the consumed one
        self.consumed: tuple | None = None

    def __iter__(self):
        for batch in super().__iter__():
            self.sequences_consumed += len(batch[1])  # labels [B, T]
            yield batch

    def local_state(self) -> tuple:
        """This rank's entry of the checkpoint: the position after the last batch training took
        (``consumed``, when batches are read ahead), else ``live_state()``."""
        return self.consumed if self.consumed is not None else self.live_state()

    def live_state(self) -> tuple:
        """(DP rank, sequences read, TorchTitan's state of this rank, documents) after the last
        batch read: the last is (documents in this rank's shard, shard-relative ranges read in
        the epoch in progress) for a map-style dataset, else None."""
        docs = None
        # With worker processes the dataset here is not the copy that reads (each worker has
        # its own), so its position says nothing: such a checkpoint keeps the sequence-count
        # fallback on a DP-degree change.
        if (self.num_workers == 0 and isinstance(self.dataset, HymoTextDataset)
                and self.dataset.map_style):
            docs = (len(self.dataset._data), self.dataset.documents_read())
        return self.dp_rank, self.sequences_consumed, super().state_dict()[self._rank_id], docs

    def state_dict(self) -> dict[str, Any]:
        mine = self.local_state()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        return pack_states(gathered, self.dp_world_size)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.consumed = None
        if _KEY not in state_dict:
            raise ValueError(
                f"dataloader checkpoint has keys {sorted(state_dict)}, not HyMo's {_KEY!r} "
                "(written by an older HyMo or by TorchTitan's loader); resume without the data "
                "position with --checkpoint.exclude_from_loading dataloader"
            )
        entry = pickle.loads(state_dict[_KEY])
        saved_world = entry["dp_world_size"]
        if saved_world == self.dp_world_size:
            self.sequences_consumed = entry["sequences"][self.dp_rank]
            super().load_state_dict({self._rank_id: entry["ranks"][self.dp_rank],
                                     "world_size": saved_world})
            return
        total = sum(entry["sequences"])
        skip = total // self.dp_world_size + (self.dp_rank < total % self.dp_world_size)
        docs = entry.get("docs")
        if (docs is not None and isinstance(self.dataset, HymoTextDataset)
                and self.dataset.map_style):
            left = self._unread_documents(docs, saved_world)
            if self.dp_rank == 0:
                logger.warning(
                    f"Resuming with {self.dp_world_size} data-parallel ranks from a checkpoint "
                    f"of {saved_world}: the epoch in progress continues with the documents no "
                    f"rank has read yet ({sum(b - a for a, b in left)} on rank 0, in "
                    f"{len(left)} range(s)); the old ranks' buffered partial sequences are "
                    "dropped (hymo_recipes/titan/dataloader.py)."
                )
            self.dataset.continue_epoch(left)
            super(ParallelAwareDataloader, self).load_state_dict({})  # fresh iterator
            self.sequences_consumed = skip
            return
        if self.dp_rank == 0:
            logger.warning(
                f"Resuming with {self.dp_world_size} data-parallel ranks from a checkpoint of "
                f"{saved_world}: the exact data position cannot carry over. Each rank restarts "
                f"its shard and skips its share of the {total} sequences consumed so far "
                f"({skip} on rank 0), i.e. continues where a {self.dp_world_size}-rank run "
                f"would be; some documents of this epoch repeat and as many are skipped "
                f"(hymo_recipes/titan/dataloader.py)."
            )
        self._replay(skip)
        self.sequences_consumed = skip

    def _unread_documents(self, docs: list, saved_world: int) -> Ranges:
        """This rank's new shard minus every document the saved ranks read in the epoch in
        progress, shard-relative."""
        n_docs = sum(length for length, _ in docs)
        read: Ranges = []
        for rank, (length, ranges) in enumerate(docs):
            start, end = shard_bounds(n_docs, rank, saved_world)
            if end - start != length:
                raise RuntimeError(
                    f"dataloader checkpoint: DP rank {rank} of {saved_world} had {length} "
                    f"documents, a contiguous split of {n_docs} gives {end - start}; resume "
                    "without the data position with --checkpoint.exclude_from_loading dataloader")
            read += [(start + a, start + b) for a, b in ranges]
        block = shard_bounds(n_docs, self.dp_rank, self.dp_world_size)
        if block[1] - block[0] != len(self.dataset._data):
            raise RuntimeError(
                f"dataloader checkpoint was written for a dataset of {n_docs} documents, but DP "
                f"rank {self.dp_rank} of {self.dp_world_size} has {len(self.dataset._data)} "
                f"(expected {block[1] - block[0]}): did the dataset change? Resume without the "
                "data position with --checkpoint.exclude_from_loading dataloader")
        return [(a - block[0], b - block[0]) for a, b in subtract_ranges(block, read)]

    def _replay(self, sequences: int) -> None:
        """Moves the dataset past its first ``sequences`` windows (HuggingFaceTextDataset keeps
        its position in ``state_dict``: documents read and the leftover token buffer)."""
        it = iter(self.dataset)
        for i in range(sequences):
            try:
                next(it)
            except StopIteration:
                raise RuntimeError(f"dataset ran out after {i} of the {sequences} sequences to "
                                   "skip on resume") from None
        position = self.dataset.state_dict()
        del it
        self.dataset.load_state_dict(position)
        super(ParallelAwareDataloader, self).load_state_dict({})  # fresh iterator, no saved state


def pack_states(gathered: list[tuple], dp_world_size: int) -> dict[str, Any]:
    """The checkpoint entry from every rank's ``local_state()``. Ranks that share a DP rank
    (tensor/pipeline parallel) hold the same data position; the first one's entry is kept."""
    ranks: dict[int, tuple] = {}
    for dp_rank, sequences, state, *docs in gathered:
        ranks.setdefault(dp_rank, (sequences, state, docs[0] if docs else None))
    if sorted(ranks) != list(range(dp_world_size)):
        raise RuntimeError(f"dataloader states of DP ranks {sorted(ranks)}, expected 0.."
                           f"{dp_world_size - 1}")
    docs = [ranks[r][2] for r in range(dp_world_size)]
    entry = {"dp_world_size": dp_world_size,
             "sequences": [ranks[r][0] for r in range(dp_world_size)],
             "ranks": [ranks[r][1] for r in range(dp_world_size)],
             "docs": docs if all(d is not None for d in docs) else None}
    # One bytes value: DCP stores it once and hands it to any number of ranks on load.
    return {_KEY: pickle.dumps(entry)}


def build_hymo_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config,
                          infinite: bool = True, allow_repeat: bool | None = None) -> HymoDataloader:
    """TorchTitan's ``build_text_dataloader`` (hf_datasets/text_datasets.py), HyMo's class.
    ``allow_repeat`` (default: ``[hymo] allow_data_repeat``) lets an infinite dataset loop."""
    training = job_config.training
    # read ahead two optimizer steps' worth of this rank's sequences
    per_step = training.local_batch_size
    if training.global_batch_size > 0:
        per_step = max(per_step, training.global_batch_size // dp_world_size)
    dataset = HymoTextDataset(
        dataset_name=training.dataset,
        dataset_path=training.dataset_path,
        tokenizer=tokenizer,
        seq_len=training.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        allow_repeat=(bool(getattr(getattr(job_config, "hymo", None), "allow_data_repeat", False))
                      if allow_repeat is None else allow_repeat),
        lookahead_tokens=2 * per_step * (training.seq_len + 1),
    )
    kwargs = {**asdict(training.dataloader), "batch_size": training.local_batch_size}
    return HymoDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)
