"""HyMo's training entry point: TorchTitan's unmodified Trainer, on GPUs or on CPUs.

    torchrun --nproc_per_node=2 -m hymo_recipes.train --job.config_file train_configs/debug_model.toml

(``run_train.sh`` runs exactly this, as its TRAIN_FILE.) It differs from ``python -m
torchtitan.train`` in three ways: ``hymo_recipes`` is imported before TorchTitan, so the
TrainSpec is registered and, without an accelerator, the CPU shims are in place
(``cpu_shims.py``); a config error (unknown key, bad TOML, missing file) ends with one
``hymo: invalid job config`` line instead of a traceback; and the arguments can be passed in.
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


def parse_config(args: list[str]):
    """TorchTitan's ConfigManager (CLI > TOML > defaults), with its errors made one line."""
    try:
        return ConfigManager().parse_args(args)
    except (FileNotFoundError, tomllib.TOMLDecodeError, ValueError) as e:
        raise SystemExit(f"hymo: invalid job config ({' '.join(args)}): {e}") from None


def main(args: list[str] | None = None) -> None:
    """Mirrors ``torchtitan.train.main`` (which reads only sys.argv)."""
    init_logger()
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
