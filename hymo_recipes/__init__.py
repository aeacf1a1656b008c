"""HyMo recipes: a TorchTitan recipe for hybrid Gated DeltaNet / MLA-MoE language models.

Importing this package registers the TrainSpec "hymo" with TorchTitan; a TOML turns it on with
``[experimental] custom_import = "hymo_recipes"`` and ``[model] name = "hymo"``.
"""

# On a machine without an accelerator TorchTitan must see device type "cpu" from its very first
# import, and every module below imports TorchTitan: this comes first (see cpu_shims.py).
from hymo_recipes import cpu_shims

cpu_shims.use_cpu_device()

from hymo_recipes import optim  # noqa: E402
from hymo_recipes._titan import TrainSpec, register_train_spec  # noqa: E402
from hymo_recipes.data import build_tokenizer  # noqa: E402  (also registers the datasets)
from hymo_recipes.data.dataloader import build_hymo_dataloader  # noqa: E402
from hymo_recipes.loss import build_mtp_loss  # noqa: E402
from hymo_recipes.metrics import build_hymo_metrics_processor  # noqa: E402
from hymo_recipes.model import HymoModel, hymo_flavors  # noqa: E402
from hymo_recipes.parallelize import parallelize_hymo  # noqa: E402
from hymo_recipes.scheduler import build_hymo_lr_schedulers  # noqa: E402
from hymo_recipes.step_hooks import register_step_hooks  # noqa: E402
from hymo_recipes.validate import build_hymo_validator  # noqa: E402


def build_hymo_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    """``hymo_recipes.optim.build_hymo_optimizers`` (NorMuon + CautiousAdamW, or a baseline;
    skips non-finite steps) plus the after-step hooks every HyMo run needs: MoE balancing and
    per-head loss metrics (step_hooks.py)."""
    optimizers = optim.build_hymo_optimizers(model_parts, optimizer_config, parallel_dims,
                                             ft_manager)
    register_step_hooks(optimizers, model_parts, parallel_dims)
    return optimizers


def build_hymo_loss(job_config, **kwargs):
    # The Trainer has applied update_from_config to this same flavor object by now.
    weights = hymo_flavors[job_config.model.flavor].mtp_loss_weights
    return build_mtp_loss(job_config, mtp_loss_weights=weights, **kwargs)


def get_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=HymoModel,
        model_args=hymo_flavors,
        parallelize_fn=parallelize_hymo,
        pipelining_fn=None,
        build_optimizers_fn=build_hymo_optimizers,
        build_lr_schedulers_fn=build_hymo_lr_schedulers,
        build_dataloader_fn=build_hymo_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_hymo_loss,
        build_validator_fn=build_hymo_validator,
        build_metrics_processor_fn=build_hymo_metrics_processor,
    )


register_train_spec("hymo", get_train_spec())
