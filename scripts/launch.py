"""torchrun for run_train.sh, without its failure report after a config error.

    python3 scripts/launch.py [torchrun arguments] -m hymo_recipes.train [training arguments]

When every rank stops on a bad config (hymo_recipes.train.parse_config), rank 0 has already
printed the one line that names the setting; torchrun would add a ~40-line traceback and
failure table that say nothing more. The ranks note their config errors in the file named by
HYMO_CONFIG_ERROR_FILE, and this wrapper exits 1 quietly when the file is not empty. Any other
failure gets torchrun's full report. Only torch is imported here (importing hymo_recipes takes
seconds)."""

from __future__ import annotations

import os
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

CONFIG_ERROR_FILE = "HYMO_CONFIG_ERROR_FILE"  # read by hymo_recipes.train.parse_config


def main(argv: list[str]) -> int:
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
