"""HyMo's optimizer stack: NorMuon + CautiousAdamW, the parameter table and the containers.

- ``NorMuon`` (normuon.py): momentum → Polar Express / quintic orthogonalisation → per-neuron
  normalisation → cautious weight decay; FSDP2-aware (whole-matrix orthogonalisation).
- ``CautiousAdamW`` (cautious_adamw.py): AdamW with cautious update masking and cautious
  weight decay, multi-tensor (foreach, optionally torch.compile'd).
- partition.py: the declarative table (name pattern → optimizer, weight decay, lr multiplier).
- container.py: TorchTitan containers holding two optimizers per model part and saving every
  scheduler, timing the step; ``build_hymo_optimizers`` builds them from ``[optimizer]`` (the
  TrainSpec's ``build_optimizers_fn`` in hymo_recipes/__init__.py adds the step hooks).
- nan_guard.py: skip steps with a non-finite loss or gradient, stop after too many in a row
  (checked inside the container's step).
- config.py: the extra ``[optimizer]`` / ``[lr_scheduler]`` fields.
The WSD schedule itself is ``hymo_recipes.scheduler``.
"""

from hymo_recipes.optim.cautious_adamw import CautiousAdamW
from hymo_recipes.optim.container import (
    HymoLRSchedulersContainer,
    HymoOptimizersContainer,
    build_hymo_optimizers,
)
from hymo_recipes.optim.nan_guard import NonFiniteGuard, NonFiniteTrainingError
from hymo_recipes.optim.normuon import NorMuon, orthogonalize, update_scale_factor
from hymo_recipes.optim.partition import build_param_groups, hymo_param_table

__all__ = [
    "CautiousAdamW",
    "HymoLRSchedulersContainer",
    "HymoOptimizersContainer",
    "NonFiniteGuard",
    "NonFiniteTrainingError",
    "NorMuon",
    "build_hymo_optimizers",
    "build_param_groups",
    "hymo_param_table",
    "orthogonalize",
    "update_scale_factor",
]
