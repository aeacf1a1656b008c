"""_spawn.spawn_ranks: a teardown abort after every rank passed is a warning; else a failure."""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _spawn import mark_passed, spawn_ranks  # noqa: E402


def _abort_after_passing(rank, world, tmp):
    mark_passed(tmp, rank)
    if rank == 1:  # once both have passed (as after the workers' closing barrier)
        while not os.path.exists(os.path.join(tmp, "rank0.passed")):
            time.sleep(0.01)
        os.abort()  # as gloo's exit-time "terminate called without an active exception"


def _abort_before_passing(rank, world, tmp):
    if rank == 1:
        os.abort()
    mark_passed(tmp, rank)


def test_abort_after_every_rank_passed_is_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="after every rank passed its checks"):
        spawn_ranks(_abort_after_passing, 2, str(tmp_path))


def test_abort_before_passing_fails(tmp_path):
    with pytest.raises(AssertionError, match="SIGABRT"):
        spawn_ranks(_abort_before_passing, 2, str(tmp_path))
