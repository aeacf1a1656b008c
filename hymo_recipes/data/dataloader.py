"""The training dataloader: TorchTitan's, with a checkpoint that any number of ranks can load.

TorchTitan 0.2.2 splits the documents into one contiguous shard per data-parallel (DP) rank,
saves each rank's position under its own key (``dp_rank_<r>``) and asserts on load that the DP
degree is unchanged; a run with more ranks cannot even load (DCP finds no key for the new
ranks). HyMo's loader saves one entry instead, written identically by every rank: the DP degree
W, the sequences each rank has consumed, and every rank's TorchTitan state (gathered over the
ranks when the checkpoint is written). On load:

- same DP degree: each rank restores its own TorchTitan state, an exact resume (bitwise on
  CPU, tests/integration/test_train.py);
- DP degree W -> W' (fallback, logged as a warning): an exact continuation does not exist,
  because W' ranks read differently cut shards. With G sequences consumed by all W ranks
  together, rank r' of W' replays its new shard from the start and skips its share of G
  (G // W', one more for the first G % W' ranks): it continues exactly where a W'-rank run
  would be after the same number of sequences. The position in tokens is kept; the documents
  are not: in the epoch in progress some documents are read a second time and as many are
  not read (later epochs are unaffected). The replay tokenizes the skipped prefix once
  (a fraction of a second for the Brown corpus, long for a large dataset).

Tested with map-style datasets and ``num_workers = 0`` (the configs' setting).
"""

from __future__ import annotations

import pickle
from dataclasses import asdict
from typing import Any

import torch.distributed as dist

from hymo_recipes._titan import HuggingFaceTextDataset, ParallelAwareDataloader, logger

__all__ = ["HymoDataloader", "build_hymo_dataloader", "pack_states"]

_KEY = "hymo_data"


class HymoDataloader(ParallelAwareDataloader):
    """TorchTitan's ParallelAwareDataloader with a DP-degree-independent checkpoint (module
    docstring). ``state_dict`` is collective: every rank must call it (DCP does)."""

    def __init__(self, dataset, dp_rank: int, dp_world_size: int, **kwargs):
        super().__init__(dataset, dp_rank, dp_world_size, **kwargs)
        self.sequences_consumed = 0  # by this rank since the start of the run

    def __iter__(self):
        for batch in super().__iter__():
            self.sequences_consumed += len(batch[1])  # labels [B, T]
            yield batch

    def local_state(self) -> tuple[int, int, bytes]:
        """(DP rank, sequences consumed, TorchTitan's state of this rank)."""
        return self.dp_rank, self.sequences_consumed, super().state_dict()[self._rank_id]

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
        if self.dp_rank == 0:
            logger.warning(
                f"Resuming with {self.dp_world_size} data-parallel ranks from a checkpoint of "
                f"{saved_world}: the exact data position cannot carry over. Each rank restarts "
                f"its shard and skips its share of the {total} sequences consumed so far "
                f"({skip} on rank 0), i.e. continues where a {self.dp_world_size}-rank run "
                f"would be; some documents of this epoch repeat and as many are skipped "
                f"(hymo_recipes/data/dataloader.py)."
            )
        self._replay(skip)
        self.sequences_consumed = skip

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


def pack_states(gathered: list[tuple[int, int, bytes]], dp_world_size: int) -> dict[str, Any]:
    """The checkpoint entry from every rank's ``local_state()``. Ranks that share a DP rank
    (tensor/pipeline parallel) hold the same data position; the first one's entry is kept."""
    ranks: dict[int, tuple[int, bytes]] = {}
    for dp_rank, sequences, state in gathered:
        ranks.setdefault(dp_rank, (sequences, state))
    if sorted(ranks) != list(range(dp_world_size)):
        raise RuntimeError(f"dataloader states of DP ranks {sorted(ranks)}, expected 0.."
                           f"{dp_world_size - 1}")
    entry = {"dp_world_size": dp_world_size,
             "sequences": [ranks[r][0] for r in range(dp_world_size)],
             "ranks": [ranks[r][1] for r in range(dp_world_size)]}
    # One bytes value: DCP stores it once and hands it to any number of ranks on load.
    return {_KEY: pickle.dumps(entry)}


def build_hymo_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config,
                          infinite: bool = True) -> HymoDataloader:
    """TorchTitan's ``build_text_dataloader`` (hf_datasets/text_datasets.py), HyMo's class."""
    training = job_config.training
    dataset = HuggingFaceTextDataset(
        dataset_name=training.dataset,
        dataset_path=training.dataset_path,
        tokenizer=tokenizer,
        seq_len=training.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
    )
    kwargs = {**asdict(training.dataloader), "batch_size": training.local_batch_size}
    return HymoDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)
