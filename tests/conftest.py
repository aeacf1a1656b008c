import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # GPU tests are collected everywhere (so they are seen to exist) and skipped without CUDA.
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
