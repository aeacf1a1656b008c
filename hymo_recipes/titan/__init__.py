"""HyMo's TorchTitan seam: every module here imports TorchTitan, nothing outside does.

Importing this package registers the TrainSpec "hymo" with TorchTitan; a TOML turns it on with
``[experimental] custom_import = "hymo_recipes.titan"`` and ``[model] name = "hymo"``.

- train.py: the entry point (``python -m hymo_recipes.train`` forwards to it); cli.py: the
  command line around TorchTitan's parser; preflight.py: the checks of a parsed config, before
  anything is built (data_checks.py: the data; resume_schedule.py: the lr at a resume);
  check.py: the config check (``CHECK=1 ./run_train.sh``); job_config.py: HyMo's knobs;
  help.py: ``./run_train.sh --help``; console.py: what the terminal is spared.
- spec.py: the TrainSpec and its builders; loss.py, metrics.py, step_hooks.py, validate.py:
  the MTP loss, HyMo's metrics, the after-step hook (MoE balancing), validation.
- optimizers.py: the containers for two optimizers per model part and their builders;
  parallelize.py: activation checkpointing, per-block compile, FSDP2.
- datasets.py, dataloader.py: the dataset table, the tokenizer, the resumable dataloader.
- checkpoints.py, run_lock.py: checkpoint manifests, the step a resume loads, saves on
  SIGTERM/SIGINT and full disks; the dump folder's lock.
- cpu_shims.py: what TorchTitan's Trainer needs to run without an accelerator; api.py: the
  TorchTitan names HyMo uses, in one list.
"""

# On a machine without an accelerator TorchTitan must see device type "cpu" from its very first
# import, and every module below imports TorchTitan: this comes first (see cpu_shims.py).
from hymo_recipes.titan import cpu_shims

cpu_shims.use_cpu_device()

from hymo_recipes.titan.api import register_train_spec  # noqa: E402
from hymo_recipes.titan.spec import get_train_spec  # noqa: E402

register_train_spec("hymo", get_train_spec())
