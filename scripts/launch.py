"""torchrun for run_train.sh, without its failure report after a config error.

    python3 scripts/launch.py [torchrun arguments] -m hymo_recipes.train [training arguments]

When every rank stops on a bad config (hymo_recipes.titan.train.parse_config), rank 0 has already
printed the one line that names the setting; torchrun would add a ~40-line traceback and
failure table that say nothing more. The ranks note their config errors in the file named by
HYMO_CONFIG_ERROR_FILE, and this wrapper exits 1 quietly when the file is not empty. Any other
failure gets torchrun's full report. Only torch is imported here (importing hymo_recipes.titan takes
seconds)."""

from __future__ import annotations

import os
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

CONFIG_ERROR_FILE = "HYMO_CONFIG_ERROR_FILE"  # read by hymo_recipes.titan.train.parse_config


def nproc_per_node(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--nproc_per_node=") or arg.startswith("--nproc-per-node="):
            return arg.split("=", 1)[1]
        if arg in ("--nproc_per_node", "--nproc-per-node") and i + 1 < len(argv):
            return argv[i + 1]
    return None


def main(argv: list[str]) -> int:
    # torchrun gives each of several local ranks one OpenMP thread unless OMP_NUM_THREADS is set,
    # and prints a five-line banner saying so; setting it here does the same, without the banner.
    n = nproc_per_node(argv)
    set_threads = "OMP_NUM_THREADS" not in os.environ and n is not None and n.isdigit() and int(n) > 1
    if set_threads:
        os.environ["OMP_NUM_THREADS"] = "1"
    fd, path = tempfile.mkstemp(prefix="hymo-config-error-")
    os.close(fd)
    os.environ[CONFIG_ERROR_FILE] = path
    try:
        torchrun(argv)
    except ChildFailedError:
        if os.path.getsize(path) == 0:
            raise
        return 1
    finally:
        os.unlink(path)
        os.environ.pop(CONFIG_ERROR_FILE)  # else a later parse_config in this process writes a new file there
        if set_threads:
            os.environ.pop("OMP_NUM_THREADS", None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
