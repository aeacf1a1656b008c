"""The interpreter's bounds check (interpret_bounds): every load and store of an interpreted launch
must stay inside the launch's tensor arguments (the CPU tests run every kernel launch under it,
tests/conftest.py)."""

import pytest
import torch
import triton
import triton.language as tl

from hymo_kernels.gdn import interpret_bounds as IB

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks Triton's CPU interpreter")


@triton.jit
def _copy(x, y, n, shift, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if MASKED:
        tl.store(y + o, tl.load(x + o + shift, mask=o < n), mask=o < n)
    else:
        tl.store(y + o, tl.load(x + o + shift))


def _launch(x, y, n, shift=0, masked=True):
    _copy[(3,)](x, y, n, shift, BLOCK=4, MASKED=masked)


def test_in_bounds_launch_runs_and_copies():
    x, y = torch.arange(10.0), torch.zeros(10)
    with IB.bounds_checked():
        _launch(x, y, 10)
    assert torch.equal(x, y)


@pytest.mark.parametrize("x_slice, n, shift, masked, expect", [
    (slice(1, 11), 10, 0, False, "load of 2 of 4 masked-in element.*at byte 40 of 'x'"),  # unmasked tail
    (slice(1, 11), 12, 0, True, "load of 2 of 4 masked-in element.*at byte 40 of 'x'"),  # past the view
    (slice(1, 11), 10, -1, True, "load of 1 of 4 masked-in element.*4 bytes before 'x'"),  # before its start
    (slice(0, 12), 12, 0, True, "store of 2 of 4 masked-in element.*at byte 40 of 'y'"),  # store past the view
], ids=["unmasked-tail", "past-the-view", "before-the-start", "store-past-the-view"])
def test_stray_access_raises_before_it_happens(x_slice, n, shift, masked, expect):
    # Every tensor is a view into a larger buffer, so an access the check missed would land in
    # memory the test owns; y's guard region must stay untouched.
    xbuf, ybuf = torch.arange(20.0), torch.full((20,), -1.0)
    with IB.bounds_checked(), pytest.raises(Exception, match=expect):
        _launch(xbuf[x_slice], ybuf[:10], n, shift, masked)
    assert torch.equal(ybuf[10:], torch.full((10,), -1.0))


def test_checker_restores_the_interpreter_on_exit():
    from triton.runtime import interpreter as interp

    def hooks():
        b, e = interp.interpreter_builder, interp.GridExecutor
        return b.create_masked_load, b.create_masked_store, e._init_args_hst, e._restore_args_dev

    before = hooks()
    with pytest.raises(RuntimeError, match="inside"):
        with IB.bounds_checked():
            assert hooks() != before
            raise RuntimeError("inside")
    assert hooks() == before
