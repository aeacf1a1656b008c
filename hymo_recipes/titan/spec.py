"""HyMo's TrainSpec: the builders TorchTitan's Trainer calls, bound to one run's shared state.

TorchTitan's Trainer builds the loss, the metrics processor and the optimizers separately, and
they never see each other; HyMo's loss leaves each step's per-head sums for the metrics, the
after-step hook leaves the MoE load, and the loss passes every training loss through the
optimizer container's NaN guard. ``HymoBuilders`` holds the one ``StepStats`` they share and
its own copies of the flavors (the Trainer writes the config into the flavor it builds), so
two Trainers built from two ``get_train_spec()`` share nothing. HyMo's entry point gives every
Trainer a spec of its own (``train.build_trainer``); the spec registered at import serves a
Trainer started any other way.

The builders also print the model in a few lines (flavor and shape when the metrics processor
is built, parameters, FLOPs per token and the optimizer partition when the optimizers are)
where TorchTitan would dump the model args as JSON (console.py silences that).
"""

from __future__ import annotations

import copy

from hymo_recipes.model import HymoModel, count_params, hymo_flavors
from hymo_recipes.titan.api import TrainSpec, logger
from hymo_recipes.titan.cpu_shims import no_accelerator
from hymo_recipes.titan.dataloader import build_hymo_dataloader
from hymo_recipes.titan.datasets import build_tokenizer
from hymo_recipes.titan.loss import build_mtp_loss
from hymo_recipes.titan.metrics import HymoMetricsProcessor, StepStats
from hymo_recipes.titan.optimizers import build_hymo_lr_schedulers, build_hymo_optimizers
from hymo_recipes.titan.parallelize import parallelize_hymo
from hymo_recipes.titan.state_dict_adapter import HymoStateDictAdapter
from hymo_recipes.titan.step_hooks import register_step_hooks
from hymo_recipes.titan.validate import build_hymo_validator


class HymoBuilders:
    """The TrainSpec builders of one Trainer (module docstring)."""

    def __init__(self):
        self.stats = StepStats()
        self.flavors = copy.deepcopy(hymo_flavors)
        self.metrics: HymoMetricsProcessor | None = None
        self.job_config = None

    def build_metrics_processor(self, job_config, parallel_dims, model_args=None, tag=None):
        self.job_config = job_config
        self.metrics = HymoMetricsProcessor(job_config, parallel_dims, tag, stats=self.stats)
        args = model_args if model_args is not None else self.flavors[job_config.model.flavor]
        logger.info(describe_model(job_config.model.flavor, args))
        return self.metrics

    def build_loss(self, job_config, **kwargs):
        # The Trainer has applied update_from_config to this same flavor object by now.
        weights = self.flavors[job_config.model.flavor].mtp_loss_weights
        return build_mtp_loss(job_config, mtp_loss_weights=weights, stats=self.stats, **kwargs)

    def build_optimizers(self, model_parts, optimizer_config, parallel_dims, ft_manager=None):
        """``build_hymo_optimizers`` (NorMuon + CautiousAdamW, or a baseline; skips non-finite
        steps) plus the after-step hooks every HyMo run needs: MoE balancing and per-head loss
        metrics (step_hooks.py)."""
        optimizers = build_hymo_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
        register_step_hooks(optimizers, model_parts, parallel_dims, self.stats)
        if self.job_config is not None:
            for line in describe_run(self.job_config, model_parts, optimizers, self.metrics):
                logger.info(line)
        return optimizers

    def train_spec(self) -> TrainSpec:
        return TrainSpec(
            model_cls=HymoModel,
            model_args=self.flavors,
            parallelize_fn=parallelize_hymo,
            pipelining_fn=None,
            build_optimizers_fn=self.build_optimizers,
            build_lr_schedulers_fn=build_hymo_lr_schedulers,
            build_dataloader_fn=build_hymo_dataloader,
            build_tokenizer_fn=build_tokenizer,
            build_loss_fn=self.build_loss,
            build_validator_fn=build_hymo_validator,
            build_metrics_processor_fn=self.build_metrics_processor,
            state_dict_adapter=HymoStateDictAdapter,
        )


def get_train_spec() -> TrainSpec:
    """A TrainSpec with builders of its own (``HymoBuilders``)."""
    return HymoBuilders().train_spec()


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f} M"


def describe_model(flavor: str, args) -> str:
    """One line: the flavor's shape after the config was applied."""
    n_mla = len(args.mla_layers)
    moe = (f"{args.moe_num_experts} experts, top-{args.moe_top_k}, {args.moe_num_shared_experts} shared"
           f", capacity {args.moe_capacity_factor:g}" if n_mla else "none")
    return (f"HyMo {flavor}: {args.n_layers} layers ({args.n_layers - n_mla} Gated DeltaNet, {n_mla} MLA + MoE), "
            f"dim {args.dim}, vocab {args.vocab_size:,}, max_seq_len {args.max_seq_len}; MoE {moe}; "
            f"MTP depth {args.mtp_depth}; GDN backend {args.gdn_backend}")


def describe_run(job_config, model_parts, optimizers, metrics) -> list[str]:
    """Parameters, FLOPs per token and the optimizer partition, a line each."""
    args = model_parts[0].model_args
    counts = count_params(model_parts[0], args)
    lines = [f"HyMo parameters: {_millions(counts.stored)} stored, {_millions(counts.active)} active per token "
             f"(embedding {_millions(counts.embedding)}, routed experts {_millions(counts.routed_experts)}, "
             f"MTP {_millions(counts.mtp)})"]
    flops = getattr(metrics, "num_flops_per_token", None)
    if flops:
        mfu = ("; MFU below is against TorchTitan's fallback peak, an A100's bf16 rate: not meaningful on a CPU"
               if no_accelerator() else "")
        lines.append(f"HyMo training FLOPs per token at seq_len {job_config.training.seq_len}: "
                     f"{flops / 1e6:,.1f} M{mfu}")
    parts = {}
    for name, opt in zip(getattr(optimizers, "optimizer_names", ()), optimizers.optimizers):
        tensors, numel = parts.get(name, (0, 0))
        params = [p for g in opt.param_groups for p in g["params"]]
        parts[name] = (tensors + len(params), numel + sum(p.numel() for p in params))
    lines.append("HyMo optimizers (hymo_recipes/optim/partition.py): " + "; ".join(
        f"{name} {_millions(numel)} in {tensors} tensors" for name, (tensors, numel) in parts.items()))
    return lines
