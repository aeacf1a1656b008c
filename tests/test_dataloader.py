"""The training dataloader's checkpoint: exact with the same DP degree, and the documented
fallback (continue where a run with the new degree would be) when the degree changes."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hymo_recipes  # noqa: F401  (registers the datasets)
from hymo_recipes._titan import JobConfig
from hymo_recipes.data import build_tokenizer
from hymo_recipes.data.dataloader import build_hymo_dataloader, pack_states

REPO = Path(__file__).resolve().parents[1]
SEQ, BATCH = 64, 2


@pytest.fixture(scope="module")
def tokenizer():
    if not (REPO / "assets/tokenizer/tokenizer.json").exists():
        pytest.fail("run `python -m hymo_recipes.data.prepare` first")
    return build_tokenizer(SimpleNamespace(model=SimpleNamespace(
        hf_assets_path=str(REPO / "assets/tokenizer"))))


def loader(tokenizer, rank, world, batch=BATCH):
    config = JobConfig()  # TorchTitan's defaults: [training.dataloader] num_workers = 0, ...
    config.training.dataset = "brown"
    config.training.dataset_path = str(REPO / "data/brown")
    config.training.seq_len, config.training.local_batch_size = SEQ, batch
    return build_hymo_dataloader(world, rank, tokenizer, config)


def take(dl, n):
    it = iter(dl)
    return [next(it)[1] for _ in range(n)], it


def checkpoint(loaders):
    """What DCP stores: every rank's state, gathered (done here without processes)."""
    return pack_states([dl.local_state() for dl in loaders], len(loaders))


def test_same_degree_resumes_exactly(tokenizer):
    ranks = [loader(tokenizer, r, 2) for r in range(2)]
    iters = [take(dl, 3)[1] for dl in ranks]
    state = checkpoint(ranks)
    expected = [next(it)[1] for it in iters]
    for r in range(2):
        resumed = loader(tokenizer, r, 2)
        resumed.load_state_dict(state)
        assert resumed.sequences_consumed == 3 * BATCH
        assert torch.equal(next(iter(resumed))[1], expected[r])


def test_two_ranks_into_one_continues_where_a_one_rank_run_would_be(tokenizer):
    ranks = [loader(tokenizer, r, 2) for r in range(2)]
    for dl in ranks:
        take(dl, 3)
    state = checkpoint(ranks)  # 2 ranks x 3 batches x 2 sequences = 12 sequences
    resumed = loader(tokenizer, 0, 1)
    resumed.load_state_dict(state)
    assert resumed.sequences_consumed == 12
    # an uninterrupted 1-rank run after 12 sequences (6 batches)
    _, it = take(loader(tokenizer, 0, 1), 6)
    following, _ = take(resumed, 2)
    assert torch.equal(following[0], next(it)[1]) and torch.equal(following[1], next(it)[1])
    # not what the 2-rank run would have read next
    assert not torch.equal(following[0], next(iter(ranks[0]))[1])


def test_one_rank_into_two_splits_the_consumed_sequences(tokenizer):
    single = loader(tokenizer, 0, 1)
    take(single, 3)  # 6 sequences: each of 2 ranks skips 3
    state = checkpoint([single])
    for r in range(2):
        resumed = loader(tokenizer, r, 2, batch=1)
        resumed.load_state_dict(state)
        _, it = take(loader(tokenizer, r, 2, batch=1), 3)
        assert torch.equal(next(iter(resumed))[1], next(it)[1])


def test_an_old_layout_is_refused_with_a_way_out(tokenizer):
    dl = loader(tokenizer, 0, 1)
    with pytest.raises(ValueError, match="exclude_from_loading dataloader"):
        dl.load_state_dict({"dp_rank_0": b"", "world_size": 1})
