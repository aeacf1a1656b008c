"""HyMo model: arguments and flavors (args.py), blocks (gdn.py, mla.py, moe.py, mtp.py), model.py."""

from .args import HymoModelArgs, hymo_flavors
from .counts import ParamCounts, count_params, training_flops_per_token
from .model import HymoModel

__all__ = ["HymoModel", "HymoModelArgs", "ParamCounts", "count_params", "hymo_flavors", "training_flops_per_token"]
