"""HyMo's optimizer stack: NorMuon + CautiousAdamW, the parameter table and the containers.

- ``NorMuon`` (normuon.py): momentum → Polar Express / quintic orthogonalisation → per-neuron
  normalisation → cautious weight decay; FSDP2-aware (whole-matrix orthogonalisation).
- ``CautiousAdamW`` (cautious_adamw.py): AdamW with cautious update masking and cautious
  weight decay, multi-tensor (foreach, optionally torch.compile'd).
- partition.py: the declarative table (name pattern → optimizer, weight decay, lr multiplier).
- nan_guard.py: skip steps with a non-finite loss or gradient, stop after too many in a row
  (checked inside the optimizer container's step).
- graph.py: ``GraphedStep``, both optimizers' steps captured once as a CUDA graph and replayed.
The WSD schedule itself is ``hymo_recipes.scheduler``. TorchTitan's side (the containers
holding two optimizers per model part, the builders, the ``[optimizer]`` / ``[lr_scheduler]``
fields) is ``hymo_recipes.titan``: nothing here imports TorchTitan.
"""

from hymo_recipes.optim.cautious_adamw import CautiousAdamW
from hymo_recipes.optim.nan_guard import NonFiniteGuard, NonFiniteTrainingError
from hymo_recipes.optim.normuon import NorMuon, orthogonalize, update_scale_factor
from hymo_recipes.optim.partition import build_param_groups, hymo_param_table

__all__ = [
    "CautiousAdamW",
    "NonFiniteGuard",
    "NonFiniteTrainingError",
    "NorMuon",
    "build_param_groups",
    "hymo_param_table",
    "orthogonalize",
    "update_scale_factor",
]
