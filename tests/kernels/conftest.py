import pytest
import torch

from hymo_kernels.gdn import chunk as gdn_chunk


@pytest.fixture
def nan_poison(monkeypatch):
    """Fills every floating tensor made by torch.empty / torch.empty_like with NaN (fla's
    fixture), so an output element that a kernel forgets to write fails the comparison."""

    def poisoned(make):
        def wrapper(*args, **kwargs):
            t = make(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(float("nan"))
            return t

        return wrapper

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))


@pytest.fixture
def tuning():
    """chunk.TUNING for one test (a kernel tiling per (K, V)), restored afterwards."""
    saved = dict(gdn_chunk.TUNING)
    yield gdn_chunk.TUNING
    gdn_chunk.TUNING.clear()
    gdn_chunk.TUNING.update(saved)
