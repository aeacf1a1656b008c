"""torchrun for run_train.sh, without its failure report after a config error.

    python3 scripts/launch.py [torchrun arguments] -m hymo_recipes.train [training arguments]

When the ranks stop on a bad config (hymo_recipes.titan.train.parse_config), they note the one
line that names the setting in the file named by HYMO_CONFIG_ERROR_FILE and exit 1; this wrapper
then prints that line once and exits 1, where torchrun would add a ~40-line traceback and
failure table that say nothing more. Any other
failure gets torchrun's full report. Only torch is imported here (importing hymo_recipes.titan takes
seconds)."""

from __future__ import annotations

import os
import sys
import tempfile

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

CONFIG_ERROR_FILE = "HYMO_CONFIG_ERROR_FILE"  # read by hymo_recipes.titan.train.parse_config
# Where rank 0 notes why the run stopped early after a checkpoint (hymo_recipes.titan.checkpoints):
# a SIGTERM/SIGINT (torchrun, signalled too, then exits 0 with that line instead of its
# traceback) or training data that ran out (the ranks end normally; the line is printed last).
STOP_NOTE_FILE = "HYMO_STOP_NOTE_FILE"


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
    fd, stop_note = tempfile.mkstemp(prefix="hymo-stop-note-")
    os.close(fd)
    os.environ[STOP_NOTE_FILE] = stop_note
    try:
        torchrun(argv)
        with open(stop_note) as f:
            if note := f.read().strip():
                print(note, file=sys.stderr)
    except ChildFailedError:
        if os.path.getsize(path) == 0:
            raise
        with open(path) as f:  # every rank noted the same error: show each distinct line once
            for line in dict.fromkeys(f.read().splitlines()):
                print(line, file=sys.stderr)
        return 1
    except SignalException:
        with open(stop_note) as f:
            note = f.read().strip()
        if not note:
            raise
        print(note, file=sys.stderr)
        return 0
    finally:
        os.unlink(path)
        os.unlink(stop_note)
        os.environ.pop(STOP_NOTE_FILE)
        os.environ.pop(CONFIG_ERROR_FILE)  # else a later parse_config in this process writes a new file there
        if set_threads:
            os.environ.pop("OMP_NUM_THREADS", None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
