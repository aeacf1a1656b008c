"""HyMo's training entry point: TorchTitan's unmodified Trainer, on GPUs or on CPUs.

    torchrun --nproc_per_node=2 -m hymo_recipes.train --job.config_file train_configs/debug_model.toml

(``run_train.sh`` runs this, as its TRAIN_FILE, through ``scripts/launch.py``: torchrun minus
its failure report after a config error.) It differs from ``python -m
torchtitan.train`` in four ways: ``hymo_recipes`` is imported before TorchTitan, so the
TrainSpec is registered and, without an accelerator, the CPU shims are in place
(``cpu_shims.py``); a config error (unknown key, bad TOML, missing file, or one of the checks in
``preflight.py``: value types, flavor, sequence lengths, GDN backend, schedule, a damaged
checkpoint to resume from) ends with one ``hymo: invalid job config`` line instead of a
traceback, before anything is built; under torchrun a rank ends when its launcher dies; and the
arguments can be passed in.
Running it as ``__main__`` registers nothing twice: the registration lives in
``hymo_recipes/__init__.py``, which Python imports once.
"""

from __future__ import annotations

import os
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from hymo_recipes import cpu_shims
from hymo_recipes._titan import ConfigManager, Trainer, init_logger, logger
from hymo_recipes.preflight import check_job_config


def parse_config(args: list[str]):
    """TorchTitan's ConfigManager (CLI > TOML > defaults) and HyMo's checks before the Trainer
    starts (preflight.py), with their errors made one line."""
    try:
        config = ConfigManager().parse_args(args)
        check_job_config(config)
    except (FileNotFoundError, tomllib.TOMLDecodeError, ValueError, NotImplementedError) as e:
        message = f"hymo: invalid job config ({' '.join(args)}): {e}"
        if note := os.environ.get("HYMO_CONFIG_ERROR_FILE"):  # set by scripts/launch.py (run_train.sh)
            with open(note, "a") as f:
                f.write(message + "\n")
        raise SystemExit(message) from None
    return config


def die_with_launcher() -> None:
    """Under torchrun, end this rank when its launcher dies, however it dies. torchrun starts
    ranks in sessions of their own, so a launcher killed with SIGKILL (which it cannot forward)
    would leave them training and writing checkpoints into the run's folder unseen, racing the
    next run there."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    launcher = os.getppid()
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
        logger.warning(f"prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): this rank outlives a killed launcher")
    elif os.getppid() != launcher:  # it died before the signal was armed
        os._exit(1)


def main(args: list[str] | None = None) -> None:
    """Mirrors ``torchtitan.train.main`` (which reads only sys.argv)."""
    init_logger()
    die_with_launcher()
    cpu_shims.install()
    config = parse_config(sys.argv[1:] if args is None else args)
    trainer: Trainer | None = None
    try:
        trainer = Trainer(config)
        if config.comm.mode == "local_tensor":
            logger.info("Local tensor mode enabled - skipping training execution")
            return
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ["WORLD_SIZE"]) != 1:
                raise ValueError("a seed checkpoint must be created by a single process")
            if not config.checkpoint.enable:
                raise ValueError("creating a seed checkpoint needs checkpoint.enable")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except Exception:
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        import torch.distributed

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")


if __name__ == "__main__":
    main()
