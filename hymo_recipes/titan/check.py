"""The config check: every check a run makes before it trains, in one process, without the
machine the run is for (``CHECK=1 ./run_train.sh``, or ``python -m hymo_recipes.titan.check
--job.config_file <toml> [overrides]``; ``NGPU``: the run's process count, default 1).

It parses the config and runs the preflight (preflight.py: value types, flavor, sequence
lengths, tokenizer, schedule, optimizer values, batch sizes against the process count, the data
and the checkpoint a resume would load), builds the model on the meta device (no memory),
builds the optimizers on it (the partition: tensors and parameters per optimizer) and prints a
memory estimate per GPU under FSDP2 at the run's process count: parameters, gradients and
optimizer states, sharded over the data-parallel ranks, plus the gathered parameters: two blocks
when FSDP reshards after the forward, every block when it does not (one rank, by default). Not
included: activations, which depend on the batch, compile and activation checkpointing
(measured in BENCHMARKS.md). Not checked, being properties of the machine that runs: whether it
can run the GDN backend and compile it. No step runs and nothing is written; meta tensors hold
no memory, so hymo_750m checks on a small CPU machine.
"""

from __future__ import annotations

import copy
import os
import sys

from hymo_recipes.titan import console, cpu_shims  # noqa: F401 - cpu_shims first (hymo_recipes/titan/__init__.py)
from hymo_recipes.titan.api import TORCH_DTYPE_MAP, init_logger, logger

GIB = 1 << 30


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_lines(model, optimizers: dict, config, dp: int) -> list[str]:
    """The estimate per GPU (module docstring), one line each."""
    import torch

    params = list(model.parameters())
    p_bytes = _tensor_bytes(params)
    state = [v for opt in optimizers.values() for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    o_bytes = _tensor_bytes(state)
    from hymo_recipes.titan.parallelize import reshard_after_forward

    gathered = TORCH_DTYPE_MAP[config.training.mixed_precision_param].itemsize
    block = max((sum(p.numel() for p in layer.parameters()) for layer in model.layers.values()), default=0)
    if reshard_after_forward(config.parallelism.fsdp_reshard_after_forward, dp):
        # FSDP2 gathers one block ahead (forward and backward prefetch): two blocks at a time
        gather_bytes, gathers = 2 * block * gathered, "all-gathered blocks"
    else:  # every block's gathered copy stays from its forward to its backward
        gather_bytes, gathers = sum(p.numel() for p in params) * gathered, "gathered copies kept for the backward"
    total = (2 * p_bytes + o_bytes) / dp + gather_bytes
    return [f"HyMo memory per GPU at {dp} data-parallel rank(s) (FSDP2, sharded): parameters {_size(p_bytes / dp)}, "
            f"gradients {_size(p_bytes / dp)}, optimizer states {_size(o_bytes / dp)}, {gathers} "
            f"{_size(gather_bytes)} ({config.training.mixed_precision_param}); {_size(total)} in all, "
            "activations not included (BENCHMARKS.md measures them)"]


def main(args: list[str] | None = None) -> None:
    import torch

    from hymo_recipes.model import HymoModel, hymo_flavors
    from hymo_recipes.scheduler import wsd_schedule
    from hymo_recipes.titan.data_checks import dp_degree, gradient_accumulation
    from hymo_recipes.titan.optimizers import optimizers_for_part
    from hymo_recipes.titan.spec import describe_model
    from hymo_recipes.titan.train import parse_config

    init_logger()
    console.quiet(cpu=cpu_shims.no_accelerator())
    os.environ["WORLD_SIZE"] = os.environ.get("NGPU", "1")  # the run's process count, for the preflight
    argv = sys.argv[1:] if args is None else args
    config = parse_config(argv, this_machine=False)
    if config.model.name != "hymo":
        raise SystemExit(f"hymo check: [model] name is {config.model.name!r}; the check knows HyMo's models only")
    dp = dp_degree(config)
    model_args = copy.deepcopy(hymo_flavors[config.model.flavor])
    model_args.update_from_config(config)
    with torch.device("meta"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype])
        try:
            model = HymoModel(model_args)
        finally:
            torch.set_default_dtype(previous)
        optimizers = optimizers_for_part(model, config.optimizer)
    logger.info(describe_model(config.model.flavor, model_args))
    from hymo_recipes.titan.spec import describe_run

    for line in describe_run(config, [model], _Named(optimizers), None):
        logger.info(line)
    t = config.training
    accumulation = gradient_accumulation(config, dp)
    schedule = wsd_schedule(config.lr_scheduler, t.steps)
    logger.info(f"HyMo batch: {t.local_batch_size} sequences of {t.seq_len} per rank and microbatch, {dp} data-parallel "
                f"rank(s), {accumulation} microbatch(es) per step: {t.local_batch_size * dp * accumulation * t.seq_len:,} "
                f"tokens per step, {t.steps:,} steps; schedule: warmup {schedule.warmup_steps:,}, stable "
                f"{schedule.stable_steps:,}, decay {schedule.decay_steps:,} steps")
    for line in memory_lines(model, optimizers, config, dp):
        logger.info(line)
    logger.info(f"hymo check: {config.job.config_file} passed at {os.environ['WORLD_SIZE']} process(es) "
                f"(not checked here: whether the machine that runs it can run GDN backend {model_args.gdn_backend!r}"
                f"{' and compile' if config.compile.enable else ''})")


class _Named:
    """The optimizers of one part, in the shape ``describe_run`` reads from a container."""

    def __init__(self, optimizers: dict):
        self.optimizer_names = list(optimizers)
        self.optimizers = list(optimizers.values())


if __name__ == "__main__":
    main()
