"""The training dataloader's checkpoint: exact with the same DP degree; with another degree the
epoch continues on exactly the documents no rank has read (map-style datasets), or, without
document positions, the documented fallback (continue where a run with the new degree would
be)."""

import pytest
import torch

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shim 1 first)
from _brown import REPO, brown_loader, brown_tokenizer
from hymo_recipes.titan.dataloader import pack_states, shard_bounds, subtract_ranges, take_ranges

SEQ, BATCH = 64, 2


@pytest.fixture(scope="module")
def tokenizer():
    return brown_tokenizer()


def loader(tokenizer, rank, world, batch=BATCH, workers=0):
    return brown_loader(tokenizer, rank, world, SEQ, batch, workers)


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


def without_documents(state):
    """A checkpoint as HyMo wrote it before document positions were saved."""
    import pickle

    entry = pickle.loads(state["hymo_data"])
    entry.pop("docs")
    return {"hymo_data": pickle.dumps(entry)}


def test_without_document_positions_two_ranks_into_one_continue_where_a_one_rank_run_would_be(
        tokenizer):
    ranks = [loader(tokenizer, r, 2) for r in range(2)]
    for dl in ranks:
        take(dl, 3)
    state = without_documents(checkpoint(ranks))  # 2 ranks x 3 batches x 2 sequences = 12
    resumed = loader(tokenizer, 0, 1)
    resumed.load_state_dict(state)
    assert resumed.sequences_consumed == 12
    # an uninterrupted 1-rank run after 12 sequences (6 batches)
    _, it = take(loader(tokenizer, 0, 1), 6)
    following, _ = take(resumed, 2)
    assert torch.equal(following[0], next(it)[1]) and torch.equal(following[1], next(it)[1])
    # not what the 2-rank run would have read next
    assert not torch.equal(following[0], next(iter(ranks[0]))[1])


def test_without_document_positions_one_rank_into_two_splits_the_consumed_sequences(tokenizer):
    single = loader(tokenizer, 0, 1)
    take(single, 3)  # 6 sequences: each of 2 ranks skips 3
    state = without_documents(checkpoint([single]))
    for r in range(2):
        resumed = loader(tokenizer, r, 2, batch=1)
        resumed.load_state_dict(state)
        _, it = take(loader(tokenizer, r, 2, batch=1), 3)
        assert torch.equal(next(iter(resumed))[1], next(it)[1])


def test_shard_bounds_are_the_split_torchtitan_makes():
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node

    for n, world in [(10, 1), (10, 2), (11, 2), (11, 3), (7, 4), (5, 4)]:
        ds = Dataset.from_dict({"i": list(range(n))})
        for rank in range(world):
            start, end = shard_bounds(n, rank, world)
            assert split_dataset_by_node(ds, rank, world)["i"] == list(range(start, end))


def test_range_helpers():
    assert take_ranges([(0, 4), (10, 12)], 5) == [(0, 4), (10, 11)]
    assert take_ranges([(3, 5)], 0) == []
    assert subtract_ranges((0, 10), [(2, 4), (3, 6), (9, 12)]) == [(0, 2), (6, 9)]
    assert subtract_ranges((5, 8), [(0, 5), (8, 9)]) == [(5, 8)]
    assert subtract_ranges((5, 8), [(0, 9)]) == []


def documents(dl):
    """How many documents of its shard the rank has pulled into its buffer."""
    return dl.dataset._sample_idx


def first_tokens(tokenizer, dl, doc, n=16):
    """The first n tokens of shard-relative document `doc` as the dataset tokenizes it."""
    text = dl.dataset._text_processor(dl.dataset._data[doc])
    return tokenizer.encode(text, add_bos=True, add_eos=True)[:n]


def test_two_ranks_into_one_read_exactly_the_unread_documents(tokenizer):
    ranks = [loader(tokenizer, r, 2) for r in range(2)]
    for dl in ranks:
        take(dl, 3)
    read = [documents(dl) for dl in ranks]  # documents pulled into each rank's buffer
    n = sum(len(dl.dataset._data) for dl in ranks)
    (s0, e0), (s1, e1) = shard_bounds(n, 0, 2), shard_bounds(n, 1, 2)
    resumed = loader(tokenizer, 0, 1)
    resumed.load_state_dict(checkpoint(ranks))
    # rank 0's unread tail, then rank 1's: no document twice, none skipped
    assert resumed.dataset._epoch_ranges == [(s0 + read[0], e0), (s1 + read[1], e1)]
    first = next(iter(resumed))[0]["input"][0][:16].tolist()
    assert first == first_tokens(tokenizer, resumed, s0 + read[0])


def test_one_rank_into_two_splits_the_unread_documents(tokenizer):
    single = loader(tokenizer, 0, 1)
    take(single, 3)
    k = documents(single)
    n = len(single.dataset._data)
    state = checkpoint([single])
    for r in range(2):
        resumed = loader(tokenizer, r, 2, batch=1)
        resumed.load_state_dict(state)
        start, end = shard_bounds(n, r, 2)
        expected = [(max(start, k) - start, end - start)] if k < end else []
        assert resumed.dataset._epoch_ranges == expected
        # and the tokens: each rank's first sequence opens its first unread document
        first = next(iter(resumed))[0]["input"][0][:16].tolist()
        assert first == first_tokens(tokenizer, resumed, max(start, k) - start), r
    assert k < shard_bounds(n, 0, 2)[1]  # rank 0 starts mid-shard, rank 1 at its start


def test_a_resumed_epoch_resumes_again_exactly_and_then_reads_the_whole_shard(tokenizer):
    ranks = [loader(tokenizer, r, 2) for r in range(2)]
    for dl in ranks:
        take(dl, 2)
    once = loader(tokenizer, 0, 1)
    once.load_state_dict(checkpoint(ranks))
    _, it = take(once, 2)
    state = checkpoint([once])  # same degree from here on
    expected = next(it)[1]
    again = loader(tokenizer, 0, 1)
    again.load_state_dict(state)
    assert torch.equal(next(iter(again))[1], expected)
    # the epoch's last range ends; the next epoch reads the whole shard from its start: the
    # token stream is document 3, then documents 0, 1, ...
    ds = again.dataset
    ds.allow_repeat = True  # a next epoch is a second pass over the data ([hymo] allow_data_repeat)
    ds.continue_epoch([(3, 4)])
    text = ds._text_processor
    expected = sum((tokenizer.encode(text(ds._data[d]), add_bos=True, add_eos=True)
                    for d in (3, 0, 1)), [])
    stream, samples = [], iter(ds)
    while len(stream) + SEQ + 1 <= len(expected):
        x, label = next(samples)
        stream += x["input"].tolist() + label[-1:].tolist()
    assert len(stream) > len(expected) // 2 and stream == expected[:len(stream)]
    assert ds._epoch_ranges is None


def test_an_old_layout_is_refused_with_a_way_out(tokenizer):
    dl = loader(tokenizer, 0, 1)
    with pytest.raises(ValueError, match="exclude_from_loading dataloader"):
        dl.load_state_dict({"dp_rank_0": b"", "world_size": 1})


def test_a_changed_dataset_is_a_clear_error(tokenizer):
    import pickle

    ranks = [loader(tokenizer, r, 2) for r in range(2)]
    entry = pickle.loads(checkpoint(ranks)["hymo_data"])
    # a corpus 10 documents larger when the checkpoint was written (5 more per shard)
    entry["docs"] = [(n + 5, read) for n, read in entry["docs"]]
    with pytest.raises(RuntimeError, match="did the dataset change.*exclude_from_loading dataloader"):
        loader(tokenizer, 0, 1).load_state_dict({"hymo_data": pickle.dumps(entry)})
    entry["docs"][1] = (entry["docs"][1][0] + 3, entry["docs"][1][1])  # not a contiguous split
    with pytest.raises(RuntimeError, match="contiguous split.*exclude_from_loading dataloader"):
        loader(tokenizer, 0, 1).load_state_dict({"hymo_data": pickle.dumps(entry)})


def test_with_worker_processes_no_document_positions_are_saved(tokenizer):
    """The main process's dataset copy does not read when workers do: its position would be
    wrong, so the checkpoint leaves it out and a DP-degree change uses the sequence fallback."""
    import pickle

    dl = loader(tokenizer, 0, 1, workers=1)
    take(dl, 2)
    assert dl.local_state()[3] is None
    assert pickle.loads(checkpoint([dl])["hymo_data"])["docs"] is None


def test_read_ahead_yields_what_torchtitans_loop_yields_and_saves_the_same_position(tokenizer):
    """The background tokenizer changes nothing: the same sequences as TorchTitan's own
    HuggingFaceTextDataset, through a whole pass, and after any number of sequences the same
    saved state (documents consumed, token buffer), whatever was read ahead."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    from hymo_recipes.titan.dataloader import HymoTextDataset

    kw = dict(dataset_name="brown", dataset_path=str(REPO / "data/brown"), tokenizer=tokenizer, seq_len=SEQ * 8,
              dp_rank=0, dp_world_size=1, infinite=False)
    ours, theirs = HymoTextDataset(**kw, lookahead_tokens=4096), HuggingFaceTextDataset(**kw)
    n = 0
    for (x, y), (x_ref, y_ref) in zip(ours, theirs, strict=True):
        assert torch.equal(x["input"], x_ref["input"]) and torch.equal(y, y_ref)
        n += 1
        if n in (1, 7, 300):
            a, b = ours.state_dict(), theirs.state_dict()
            assert a["sample_idx"] == b["sample_idx"] and a["token_buffer"] == b["token_buffer"]
    assert n > 1000 and ours.state_dict()["sample_idx"] == theirs.state_dict()["sample_idx"]


def test_read_ahead_keeps_to_its_budget_and_raises_the_threads_error():
    from hymo_recipes.titan.dataloader import CHUNK_DOCS, ReadAhead

    read = []

    def samples():
        for i in range(10 * CHUNK_DOCS):
            read.append(i)
            if i == 5 * CHUNK_DOCS + 3:
                raise ValueError("bad document 323")
            yield i

    encode = lambda texts: [[t] * 10 for t in texts]  # noqa: E731  (10 tokens per document)
    it = iter(ReadAhead(samples(), lambda s: s, encode, budget=10 * CHUNK_DOCS))
    assert next(it) == [0] * 10
    import time
    time.sleep(0.2)
    # a budget of one chunk's tokens: one chunk queued ahead of the one being consumed, at most
    assert len(read) <= 2 * CHUNK_DOCS + 1
    got = [next(it)[0] for _ in range(5 * CHUNK_DOCS - 1)]
    assert got == list(range(1, 5 * CHUNK_DOCS))
    with pytest.raises(ValueError, match="bad document 323"):
        next(it)


def test_read_ahead_close_waits_for_its_thread():
    """Closing the iterator stops the reader and waits for it, even mid-encode: no reader thread
    outlives its iterator (a new pass would otherwise race a stale one)."""
    import time

    from hymo_recipes.titan.dataloader import ReadAhead

    def slow_encode(texts):
        time.sleep(0.3)
        return [[1] * 4 for _ in texts]

    ra = ReadAhead(iter(range(10_000)), lambda s: s, slow_encode, budget=1 << 20)
    it = iter(ra)
    next(it)
    time.sleep(0.05)  # the thread is now inside its second encode
    it.close()
    assert not ra._thread.is_alive()


def test_a_streaming_dataset_resumes_exactly(tokenizer, monkeypatch):
    """A streaming dataset's saved position is its iterator's own state: it must be the position
    of the documents consumed (not of documents a reader thread took ahead), so that a resume
    continues with the very next sequence."""
    import copy

    from datasets import load_dataset

    from hymo_recipes.titan.dataloader import HymoTextDataset

    def streaming():
        ds = HymoTextDataset(dataset_name="brown", dataset_path=str(REPO / "data/brown"), tokenizer=tokenizer,
                             seq_len=SEQ, dp_rank=0, dp_world_size=1, infinite=False)
        ds._data = load_dataset("parquet", data_files=str(REPO / "data/brown/train.parquet"), split="train",
                                streaming=True)
        assert not ds.map_style
        return ds

    from hymo_recipes.titan import dataloader as dl

    def no_read_ahead(*args, **kwargs):
        raise AssertionError("a streaming dataset must not be read ahead: its saved state would run ahead")

    monkeypatch.setattr(dl, "ReadAhead", no_read_ahead)
    ds = streaming()
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = copy.deepcopy(ds.state_dict())
    expected = [next(it) for _ in range(3)]
    resumed = streaming()
    resumed.load_state_dict(state)
    got = [x for x, _ in zip(resumed, range(3))]
    for (x, y), (x_ref, y_ref) in zip(got, expected, strict=True):
        assert torch.equal(x["input"], x_ref["input"]) and torch.equal(y, y_ref)


def test_the_read_ahead_runs_on_into_the_next_pass(tokenizer):
    """A dataset that loops reads and tokenizes the next pass's first documents before the
    consumer reaches the end of this one: one reader thread for both passes, the stream the
    same (the last document of this pass, then documents 0, 1, ... of the next), the position
    counted per pass."""
    import threading
    import time

    from hymo_recipes.titan.dataloader import HymoTextDataset

    def readers():
        return [t for t in threading.enumerate() if t.name == "hymo-tokenize" and t not in before]

    before = set(threading.enumerate())
    ds = HymoTextDataset(dataset_name="brown", dataset_path=str(REPO / "data/brown"), tokenizer=tokenizer,
                         seq_len=SEQ, dp_rank=0, dp_world_size=1, infinite=True, allow_repeat=True,
                         lookahead_tokens=8192)
    last = len(ds._data) - 1
    ds.continue_epoch([(last, last + 1)])  # this pass: its last document only
    encode, text = ds._tokenizer.encode, ds._text_processor
    expected = sum((encode(text(ds._data[d]), add_bos=True, add_eos=True) for d in (last, 0, 1)), [])
    samples = iter(ds)
    x, label = next(samples)  # the reader is now running
    time.sleep(0.5)
    reader = readers()
    assert len(reader) == 1 and reader[0].is_alive()  # on past the end of this pass (one document) into the next
    stream = x["input"].tolist() + label[-1:].tolist()
    while len(stream) + SEQ + 1 <= len(expected):
        x, label = next(samples)
        stream += x["input"].tolist() + label[-1:].tolist()
    assert stream == expected[:len(stream)]
    assert readers() == reader
    assert ds._sample_idx == 2 and ds._epoch_ranges is None  # documents 0 and 1 of the new pass consumed
    samples.close()
    assert not reader[0].is_alive() and not readers()


@pytest.mark.parametrize("docs", [7, 64])
def test_looping_read_ahead_yields_what_torchtitans_loop_yields_pass_after_pass(tokenizer, docs):
    """Over several passes of a small shard (fewer documents than a read-ahead chunk, or exactly
    one chunk), the same sequences and after each the same saved position as TorchTitan's own
    infinite HuggingFaceTextDataset; no reader thread is left once the iterator closes."""
    import threading

    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    from hymo_recipes.titan.dataloader import HymoTextDataset

    before = set(threading.enumerate())
    kw = dict(dataset_name="brown", dataset_path=str(REPO / "data/brown"), tokenizer=tokenizer, seq_len=SEQ * 8,
              dp_rank=0, dp_world_size=1, infinite=True)
    ours, theirs = HymoTextDataset(**kw, allow_repeat=True, lookahead_tokens=4096), HuggingFaceTextDataset(**kw)
    ours._data = theirs._data = theirs._data.select(range(docs))
    total = sum(len(tokenizer.encode(ours._text_processor(d), add_bos=True, add_eos=True)) for d in ours._data)
    n, passes = 0, 3.5  # sequences for three and a half passes
    it_ours, it_theirs = iter(ours), iter(theirs)
    while n * (SEQ * 8 + 1) < passes * total:
        (x, y), (x_ref, y_ref) = next(it_ours), next(it_theirs)
        assert torch.equal(x["input"], x_ref["input"]) and torch.equal(y, y_ref), n
        a, b = ours.state_dict(), theirs.state_dict()
        assert a["sample_idx"] == b["sample_idx"] and a["token_buffer"] == b["token_buffer"], n
        n += 1
    it_ours.close()
    assert not [t for t in threading.enumerate() if t.name == "hymo-tokenize" and t not in before]


def test_an_empty_shard_that_loops_is_a_clear_error(tokenizer):
    from hymo_recipes.titan.dataloader import HymoTextDataset

    ds = HymoTextDataset(dataset_name="brown", dataset_path=str(REPO / "data/brown"), tokenizer=tokenizer,
                         seq_len=SEQ, dp_rank=0, dp_world_size=1, infinite=True, allow_repeat=True)
    ds._data = ds._data.select(range(0))
    with pytest.raises(ValueError, match="this rank's shard holds no document"):
        next(iter(ds))
