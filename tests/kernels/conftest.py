import pytest
import torch

from hymo_kernels.gdn import config as gdn_config


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
    """config.TUNING for one test (a kernel tiling per (K, V)), restored afterwards."""
    saved = dict(gdn_config.TUNING)
    yield gdn_config.TUNING
    gdn_config.TUNING.clear()
    gdn_config.TUNING.update(saved)


@pytest.fixture(params=list(gdn_config.BWD_PATHS))
def bwd_path(request, monkeypatch):
    """Runs a test with each backward path: every TABLE entry gets its Config fields (a test
    that sets config.TUNING itself applies the returned fields to its Config)."""
    fields = gdn_config.BWD_PATHS[request.param]
    for key, entry in list(gdn_config.TABLE.items()):
        monkeypatch.setitem(gdn_config.TABLE, key, dict(entry, **fields))
    return fields
