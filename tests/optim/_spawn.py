"""Two-process gloo tests: spawn the ranks, and tell a failed check from gloo's teardown.

Rarely, after every check of a rank has passed, a gloo process aborts while it exits ("terminate
called without an active exception": a C++ thread of the process group destroyed while it still
runs). A worker therefore writes ``rank<r>.passed`` once its checks are done (before the closing
barrier), and ``rank<r>.err`` with its traceback when one fails. A SIGABRT after every rank's
``passed`` marker is that teardown abort: reported as a warning. Anything else fails the test
with every rank's own traceback.
"""

import os
import warnings

import torch.multiprocessing as mp


def mark_passed(tmp: str, rank: int) -> None:
    open(os.path.join(tmp, f"rank{rank}.passed"), "w").close()


def spawn_ranks(worker, world: int, tmp: str) -> None:
    try:
        mp.spawn(worker, args=(world, tmp), nprocs=world, join=True)
    except mp.ProcessExitedException as e:
        passed = all(os.path.exists(os.path.join(tmp, f"rank{r}.passed")) for r in range(world))
        errors = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.endswith(".err")]
        if passed and not errors and e.signal_name == "SIGABRT":
            warnings.warn(f"{e} after every rank passed its checks (gloo teardown)")
            return
        raise AssertionError(f"{e}; tracebacks of the ranks that raised:\n" + "\n".join(errors)) from e
