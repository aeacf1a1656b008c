"""Batches read ahead on a thread (hymo_recipes/titan/prefetch.py): the same batches in order, an
error where it happened, a checkpoint at the position of the batches taken (not of those read
ahead), nothing left running after close; the trainer's batch generator the same with and
without it."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shims first)
from _brown import brown_loader, brown_tokenizer
from hymo_recipes.titan.api import DataloaderExhaustedError
from hymo_recipes.titan.prefetch import Prefetcher

SEQ, BATCH = 64, 2


@pytest.fixture(scope="module")
def tokenizer():
    return brown_tokenizer()


def loader(tokenizer):
    return brown_loader(tokenizer, 0, 1, SEQ, BATCH)


def counting(n: int, read: list):
    """0 .. n-1, each appended to ``read`` as it is read."""
    for i in range(n):
        read.append(i)
        yield i


def _within(fn, timeout=10.0):
    """fn() on a daemon thread; fails instead of hanging if it does not return in time."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung"
    return out[0]


def _wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_items_in_order_prepared_with_the_position_after_each():
    read = []
    with Prefetcher(counting(20, read), prepare=lambda i: i * 10, snapshot=lambda: len(read), depth=3) as p:
        got = list(p)
    assert got == [(10 * i, i + 1) for i in range(20)]


def test_it_reads_ahead_up_to_its_depth_and_no_further():
    read = []
    with Prefetcher(counting(100, read), prepare=lambda i: i, snapshot=lambda: len(read), depth=4) as p:
        _wait_until(lambda: len(read) >= 5)  # 4 queued + 1 in hand waiting for room
        time.sleep(0.05)
        assert len(read) == 5
        assert next(p) == (0, 1)  # the position of the batch taken, not of those read ahead
        _wait_until(lambda: len(read) >= 6)


def test_paced_it_reads_only_what_was_granted_or_is_waited_for():
    read = []
    with Prefetcher(counting(30, read), prepare=lambda i: i, snapshot=lambda: len(read), depth=4, paced=True) as p:
        _wait_until(lambda: len(read) >= 5)  # depth + 1 credits at the start
        time.sleep(0.05)
        assert len(read) == 5
        assert [next(p)[0] for _ in range(3)] == [0, 1, 2]
        time.sleep(0.05)
        assert len(read) == 5  # room in the queue, but no credit
        p.grant()
        p.grant()
        _wait_until(lambda: len(read) >= 7)
        time.sleep(0.05)
        assert len(read) == 7
        # a consumer that stops granting still gets every batch, in order, read as it waits
        assert _within(lambda: [item for item, _ in p]) == list(range(3, 30))
        assert len(read) == 30


def test_unpaced_grant_changes_nothing():
    read = []
    with Prefetcher(counting(10, read), prepare=lambda i: i, snapshot=lambda: len(read), depth=2) as p:
        p.grant()
        _wait_until(lambda: len(read) >= 3)
        time.sleep(0.05)
        assert len(read) == 3
        assert [item for item, _ in p] == list(range(10))


def test_close_stops_a_paced_thread_waiting_for_a_credit():
    closed = threading.Event()

    def source():
        try:
            yield from range(100)
        finally:
            closed.set()

    p = Prefetcher(source(), prepare=lambda i: i, snapshot=lambda: None, depth=2, paced=True)
    assert next(p)[0] == 0
    _wait_until(lambda: p._read_count == 3 and p._queue.full())  # 1 and 2 queued, no credit for 3
    _within(p.close)
    assert closed.is_set() and not p._thread.is_alive()


def test_an_error_is_raised_where_it_happened_and_ends_the_iteration():
    closed = threading.Event()

    def source():
        try:
            yield 0
            yield 1
            raise ValueError("bad document")
        finally:
            closed.set()

    p = Prefetcher(source(), prepare=lambda i: i, snapshot=lambda: None, depth=8)
    assert [next(p)[0], next(p)[0]] == [0, 1]
    with pytest.raises(ValueError, match="bad document"):
        next(p)
    with pytest.raises(StopIteration):
        next(p)
    p.close()
    assert closed.is_set()


def test_close_stops_a_thread_waiting_for_room_and_closes_the_source():
    closed = threading.Event()

    def source():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    p = Prefetcher(source(), prepare=lambda i: i, snapshot=lambda: None, depth=2)
    next(p)
    _wait_until(lambda: p._queue.full())
    p.close()
    assert closed.is_set() and not p._thread.is_alive()
    with pytest.raises(StopIteration):
        next(p)


def test_a_checkpoint_keeps_the_position_of_the_batches_taken(tokenizer):
    """Three batches taken while the thread has read further: the saved position resumes at the
    fourth batch of a plain read, exactly."""
    plain = [b for _, b in zip(range(8), loader(tokenizer))]
    dl = loader(tokenizer)
    with Prefetcher(dl, prepare=lambda b: b, snapshot=dl.live_state, depth=4) as p:
        for i in range(3):
            (x, y), position = next(p)
            assert torch.equal(x["input"], plain[i][0]["input"]) and torch.equal(y, plain[i][1])
            dl.consumed = position
        _wait_until(lambda: p._queue.full())
        assert dl.live_state()[1] > dl.local_state()[1] == 3 * BATCH  # read ahead, three batches taken
        saved = dl.state_dict()
    for resumed in (loader(tokenizer), dl):  # a fresh loader, and the used one (its consumed position dropped)
        resumed.load_state_dict(saved)
        assert resumed.consumed is None
        for i, (x, y) in zip(range(3, 8), resumed):
            assert torch.equal(x["input"], plain[i][0]["input"]) and torch.equal(y, plain[i][1]), i


def _trainer(tokenizer, prefetch: bool, accumulation: int = 2):
    from hymo_recipes.titan.trainer import HymoTrainer

    t = object.__new__(HymoTrainer)  # only what batch_generator reads
    t.job_config = SimpleNamespace(hymo=SimpleNamespace(document_masking=True, data_prefetch=prefetch))
    t.tokenizer, t.device, t.gradient_accumulation_steps, t.ntokens_seen = tokenizer, torch.device("cpu"), accumulation, 0
    t.metrics_processor = SimpleNamespace(ntokens_since_last_log=0, data_loading_times=[])
    return t


def test_the_train_step_grants_one_batch_after_each_microbatch_it_launched():
    """The next step's batches are read one per microbatch, after it is launched (prefetch.py)."""
    from hymo_recipes.titan.trainer import HymoTrainer

    events = []

    def forward_backward_step(input_dict, labels, global_valid_tokens):
        events.append("microbatch")
        return torch.tensor(1.0)

    t = object.__new__(HymoTrainer)  # only what train_step reads
    t._start_step, t._data_can_run_out, t.step, t.device = 1, False, 1, torch.device("cpu")
    t.gradient_accumulation_steps = 3
    t.parallel_dims = SimpleNamespace(dp_enabled=False, ep_enabled=False, get_optional_mesh=lambda name: None)
    t.job_config = SimpleNamespace(model=SimpleNamespace(name="peer"), training=SimpleNamespace(max_norm=1.0),
                                   hymo=SimpleNamespace(fsdp_sync_once_per_step=False))
    t.model_args = SimpleNamespace(fused_loss_chunk=0)
    t.model_parts = [torch.nn.Linear(2, 2)]
    t.optimizers = SimpleNamespace(zero_grad=lambda: None, step=lambda: events.append("optimizer"))
    t.lr_schedulers = SimpleNamespace(schedulers=[SimpleNamespace(get_last_lr=lambda: [1e-3])], step=lambda: None)
    t.checkpointer = SimpleNamespace(maybe_wait_for_staging=lambda: None)
    t.metrics_processor = SimpleNamespace(should_log=lambda step: False)
    t.forward_backward_step = forward_backward_step
    t._prefetcher = SimpleNamespace(grant=lambda: events.append("grant"))
    batch = ({"input": torch.ones(1, 4, dtype=torch.long)}, torch.ones(1, 4, dtype=torch.long))
    t.train_step(iter([batch] * 3))
    assert events == ["microbatch", "grant"] * 3 + ["optimizer"]


def test_the_trainers_batches_are_the_same_with_and_without_prefetching(tokenizer):
    """Each batch with its document boundaries, the token count and one loading time per batch,
    alike either way; the data's end is DataloaderExhaustedError as in TorchTitan."""
    def run(prefetch):
        t, dl = _trainer(tokenizer, prefetch), loader(tokenizer)
        gen = t.batch_generator(dl)
        out = []
        for _ in range(5):
            out.append(next(gen))
            if prefetch:  # as train_step does after each microbatch it launched
                t._prefetcher.grant()
        if prefetch:  # the thread reads on (3 at the start, 5 granted) before the last batch is taken
            _wait_until(lambda: dl.sequences_consumed == 8 * BATCH)
        out.append(next(gen))
        gen.close()
        assert t._prefetcher is None
        return t, dl, out

    t_plain, dl_plain, plain = run(False)
    t_pre, dl_pre, pre = run(True)
    assert dl_plain.consumed is None and dl_pre.consumed is not None
    assert dl_pre.local_state() == dl_plain.local_state()  # the position after the six batches taken
    for (a, la), (b, lb) in zip(plain, pre):
        assert a.keys() == b.keys() == {"input", "cu_seqlens", "positions"}
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert torch.equal(la, lb)
    for t in (t_plain, t_pre):
        assert t.ntokens_seen == t.metrics_processor.ntokens_since_last_log == 6 * BATCH * SEQ
        assert len(t.metrics_processor.data_loading_times) == 6

    t = _trainer(tokenizer, True)
    gen = t.batch_generator(iter([({"input": torch.ones(1, 4, dtype=torch.long)}, torch.ones(1, 4))]))
    next(gen)  # not HyMo's dataloader: read on this thread
    with pytest.raises(DataloaderExhaustedError):
        next(gen)
    assert not any(th.name == "hymo-batches" for th in threading.enumerate())
