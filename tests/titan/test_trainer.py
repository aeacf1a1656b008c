"""HymoTrainer's data moves: on the GPU from pinned memory without blocking the host, values intact."""

import pytest
import torch

import hymo_recipes.titan  # noqa: F401  (CPU shims first)
from hymo_recipes.titan.trainer import HymoTrainer


class _Device:
    def __init__(self, device):
        self.device = torch.device(device)

    _to_device = HymoTrainer._to_device


def test_cpu_move_is_a_plain_to():
    t = torch.arange(10)
    assert _Device("cpu")._to_device(t) is t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_move_is_non_blocking_and_exact():
    host = torch.randint(0, 8192, (8, 4096))
    # a long kernel in flight: a blocking copy would wait for it, a non-blocking one returns at once
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):
        a = a @ a / 8192
    done = torch.cuda.Event()
    moved = _Device("cuda")._to_device(host)
    done.record()
    assert not done.query(), "the copy waited for the GPU"
    assert moved.device.type == "cuda" and torch.equal(moved.cpu(), host)


def test_only_a_streamed_dataset_that_does_not_loop_needs_the_ranks_agreement_on_running_out():
    from types import SimpleNamespace

    from datasets import Dataset, IterableDataset

    from hymo_recipes.titan.dataloader import HymoTextDataset
    from hymo_recipes.titan.trainer import data_can_run_out

    def loader(data, repeat):
        ds = object.__new__(HymoTextDataset)  # only what the check reads
        ds._data, ds.allow_repeat = data, repeat
        return SimpleNamespace(dataset=ds)

    sized = Dataset.from_dict({"text": ["a", "b"]})
    stream = IterableDataset.from_generator(lambda: iter([{"text": "a"}]))
    assert data_can_run_out(loader(stream, False))
    assert not data_can_run_out(loader(stream, True))
    assert not data_can_run_out(loader(sized, False))
    assert data_can_run_out(SimpleNamespace(dataset=None))  # a dataset of another kind: agree to be safe
