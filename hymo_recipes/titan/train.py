"""HyMo's training entry point: TorchTitan's Trainer (HymoTrainer: its data moves), on GPUs or on CPUs.

    torchrun --nproc_per_node=2 -m hymo_recipes.train --job.config_file train_configs/debug_model.toml

(``run_train.sh`` runs ``hymo_recipes.train``, which forwards here, through ``scripts/launch.py``:
torchrun minus its failure report after a config error.) It differs from ``python -m
torchtitan.train`` in these ways:

- ``hymo_recipes.titan`` is imported before TorchTitan, so the TrainSpec is registered and,
  without an accelerator, the CPU shims are in place (``cpu_shims.py``);
- HyMo's knobs (``job_config.py``) are part of every config, ``--help`` included;
- a config error (unknown key, bad TOML, missing file, or one of the checks in
  ``preflight.py``: value types, flavor, sequence lengths, GDN backend on this machine,
  tokenizer, schedule, a damaged checkpoint to resume from) ends with one ``hymo: invalid job
  config`` line instead of a traceback, before anything is built;
- every Trainer gets builders of its own (``build_trainer``; spec.py);
- the run holds its dump folder's lock from before the checks to its end (run_lock.py); each
  checkpoint gets a checksummed manifest, a resume loads the step the preflight checked, and
  SIGTERM/SIGINT saves a checkpoint at the next step boundary and ends the run (checkpoints.py);
- the terminal shows a few-line model summary instead of the model args as JSON, without the
  notices that do not apply to the run (``console.py``);
- under torchrun a rank ends when its launcher dies; and the arguments can be passed in.
"""

from __future__ import annotations

import contextlib
import os
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from hymo_recipes.titan import checkpoints, cli, console, cpu_shims, job_config, run_lock
from hymo_recipes.titan.api import ConfigManager, JobConfig, Trainer, init_logger, logger, train_spec_module
from hymo_recipes.titan.preflight import check_job_config
from hymo_recipes.titan.spec import get_train_spec
from hymo_recipes.titan.trainer import HymoTrainer

CONFIG_ERROR_FILE = "HYMO_CONFIG_ERROR_FILE"  # set by scripts/launch.py (run_train.sh)


def config_manager() -> ConfigManager:
    """TorchTitan's ConfigManager over its JobConfig merged with HyMo's (job_config.py), the way
    it merges a ``[job] custom_config_module``, so HyMo's knobs parse (and show in ``--help``)
    whether or not the TOML names that module."""
    return ConfigManager(ConfigManager._merge_configs(JobConfig, job_config.JobConfig))


def parse_config(args: list[str], *, this_machine: bool = True, lock: bool = False):
    """TorchTitan's ConfigManager (CLI > TOML > defaults) and HyMo's checks before the Trainer
    starts (preflight.py), with their errors, tyro's included (cli.py), made one line.
    ``this_machine``: whether to check that this machine can run the config (check.py: no).
    ``lock``: take the dump folder's lock (run_lock.py) before the checks, which read it."""
    try:
        manager = config_manager()
        with cli.one_line_errors():
            config = manager.parse_args(cli.bool_flags(args, manager.config_cls))
        if lock:
            run_lock.acquire_for_run(config)
        check_job_config(config, this_machine=this_machine)
    except run_lock.RunLockError as e:
        _config_error(f"hymo: {e}")
    except (FileNotFoundError, tomllib.TOMLDecodeError, ValueError, NotImplementedError) as e:
        _config_error(f"hymo: invalid job config ({' '.join(args)}): {e}")
    return config


def _config_error(message: str):
    """Stops this process on an error found before training. Under the launcher
    (scripts/launch.py) the message goes to its note file and the launcher prints it once, without
    torchrun's report: a rank that printed it itself could be stopped by torchrun before its
    output appeared, when another rank failed first."""
    if note := os.environ.get(CONFIG_ERROR_FILE):
        with open(note, "a") as f:
            f.write(message + "\n")
        raise SystemExit(1)
    raise SystemExit(message)


@contextlib.contextmanager
def own_train_spec():
    """Registers a TrainSpec with builders of its own under "hymo" while a Trainer is built (it
    looks its spec up and calls every builder in its constructor), then restores the one before."""
    registry = train_spec_module._extra_train_specs
    before = registry.get("hymo")
    registry["hymo"] = get_train_spec()
    try:
        yield
    finally:
        if before is None:
            registry.pop("hymo", None)
        else:
            registry["hymo"] = before


def build_trainer(config) -> Trainer:
    """The Trainer for a parsed config: TorchTitan's, with HyMo's train step (trainer.py), and
    for HyMo builders shared with no other Trainer. Any model of TorchTitan's registry trains
    through the same train step."""
    if config.model.name != "hymo":
        return HymoTrainer(config)
    with own_train_spec():
        return HymoTrainer(config)


def die_with_launcher() -> None:
    """Under torchrun, end this rank when its launcher dies, however it dies. torchrun starts
    each rank in a process group of its own (setsid), so a launcher killed with SIGKILL (which it
    cannot forward) would leave the ranks training and writing checkpoints into the run's folder
    unseen, racing the next run there."""
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
    console.quiet(cpu=cpu_shims.no_accelerator())
    die_with_launcher()
    cpu_shims.install()
    config = parse_config(sys.argv[1:] if args is None else args, lock=True)
    trainer: Trainer | None = None
    try:
        trainer = build_trainer(config)
        checkpoints.SaveGuard(trainer, config).install()  # manifests, resume choice, full disk, SIGTERM
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
    finally:
        run_lock.release_for_run()


if __name__ == "__main__":
    main()
