"""The training batches read ahead on a background thread, one optimizer step in advance.

TorchTitan's train step reads every microbatch of a step from the dataloader before its first
forward, and each logged step ends with a host read of the loss, so the GPU sits idle while the
host cuts a step's rows out of the token stream, collates them and finds their documents (at
750m's 8 x 4,096-token microbatches about 14 ms each on the host, traced, 16 of them per step).
``Prefetcher`` does that work on a thread while the GPU computes the step before, and hands the
batches over in the dataloader's order, each already prepared (document boundaries added, pinned
for a non-blocking copy): the same batches, the same numbers. Side effects of the dataset's
reading happen up to a step early (its "looping over the data" warning, say), and the trainer's
data-loading time becomes the wait for a prepared batch.

Reading ahead moves the dataloader's position past what training has consumed, and a checkpoint
must record the consumed position. The thread takes the position after each batch it reads
(``snapshot``, on the thread that owns the iterator, so it is consistent), and hands it over with
the batch; the consumer publishes it when it takes the batch (``HymoDataloader.consumed``), and
the checkpoint saves that.

The thread's reading is Python work that competes with the main thread for the GIL, and a step
takes all of its microbatches before its first forward. Read all at once, the next step's
batches would be read while the host does the work the GPU waits for most: FSDP's gather of the
parameters and the first forward, right after the previous step's closing host read, when the
GPU has nothing queued, so that every stall of the main thread is GPU idle. So the trainer paces
the reading (``paced=True``): the thread reads a batch only against a credit, ``depth + 1`` at
the start (a step's batches and the next in hand) and one per ``grant()``. The train step grants
one after each microbatch it has launched, when the GPU has that microbatch's backward queued,
so the next step's batches are read one per microbatch. A consumer waiting for a batch not yet
granted lets the thread read it, so one that never grants still gets every batch.

An exception in the thread (the data ran out, a bad document) is raised by the consumer at the
batch where it happened, in order; the end of the data is ``StopIteration`` there. Closing the
prefetcher (or leaving its ``with`` block) stops the thread and closes the iterator it read
(a dataloader's own tokenizer thread, a daemon, stays with the dataloader).
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Any, Callable, Iterable, Iterator

_END = object()  # the dataloader's iterator is exhausted


class Prefetcher:
    """Iterates ``(prepare(batch), snapshot())`` for each batch of ``iterable``, read ahead by a
    daemon thread: ``depth`` batches held ready at most, and one more in hand waiting for room.

    Args:
        iterable: the batches (a dataloader); its iterator is made here and used only by the
            thread from then on.
        prepare: batch -> what the consumer gets (runs on the thread).
        snapshot: () -> the iterable's position after the batch just read (runs on the thread,
            between two reads).
        depth: batches held ready at most (>= 1).
        on_start: run first on the thread (e.g. ``torch.cuda.set_device``: a new thread's
            current CUDA device is 0, and a dataloader with pinning workers reads it).
        paced: read only against credits (``grant``; the module's docstring says why).
    """

    def __init__(self, iterable: Iterable, prepare: Callable[[Any], Any], snapshot: Callable[[], Any],
                 depth: int, on_start: Callable[[], None] | None = None, paced: bool = False):
        if depth < 1:
            raise ValueError(f"Prefetcher: depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        # batches the thread may have read in all (unbounded unless paced), read, taken
        self._allowed = depth + 1 if paced else math.inf
        self._read_count, self._taken = 0, 0
        self._credit = threading.Condition()
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._read, args=(iter(iterable), prepare, snapshot, on_start),
                                        name="hymo-batches", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        """Queues ``item``, waiting for room; False if the prefetcher was closed meanwhile."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _take_credit(self) -> bool:
        """Waits until one more batch may be read (at once when not paced); False once closed."""
        with self._credit:
            while not self._stop.is_set():
                if self._read_count < self._allowed:
                    self._read_count += 1
                    return True
                self._credit.wait(timeout=0.05)
        return False

    def _allow(self, at_least: int | None = None) -> None:
        """Raises the allowance by one, or to at least ``at_least`` (no change when unpaced)."""
        with self._credit:
            allowed = max(self._allowed, at_least) if at_least is not None else self._allowed + 1
            if allowed != self._allowed:
                self._allowed = allowed
                self._credit.notify()

    def grant(self) -> None:
        """One more batch may be read (paced prefetchers; a no-op otherwise)."""
        self._allow()

    def _read(self, iterator: Iterator, prepare, snapshot, on_start) -> None:
        try:
            if on_start is not None:
                on_start()
            while self._take_credit():
                try:
                    batch = next(iterator)
                except StopIteration:
                    self._put(_END)
                    return
                if not self._put((prepare(batch), snapshot())):
                    return
        except BaseException as e:  # raised by the consumer, in order
            self._put(e)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        self._taken += 1  # the batch wanted may be read even if not granted: never wait for a grant
        self._allow(at_least=self._taken)
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def close(self) -> None:
        """Stops the thread and waits for it (at most the batch it is reading)."""
        self._stop.set()
        with self._credit:  # wake a thread waiting for a credit
            self._credit.notify_all()
        while True:  # unblock a thread waiting for room
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._done = True

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
