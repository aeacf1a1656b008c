import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter. triton.jit reads this
# variable when a kernel module is imported, and test modules outside tests/kernels import
# the model (and through it the kernels) too, so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    # GPU tests are collected everywhere (so they are seen to exist) and skipped without CUDA.
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def interpreted_launches_bounds_checked():
    """Every Triton launch the interpreter runs in a test is bounds-checked: a load or store
    outside its tensor arguments fails that test (hymo_kernels.gdn.interpret_bounds), where
    otherwise it would read a neighbour's bytes or corrupt them unseen."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from hymo_kernels.gdn.interpret_bounds import bounds_checked

    with bounds_checked():
        yield
