"""The one place HyMo imports TorchTitan (pinned to 0.2.2).

Newer TorchTitan moved or deleted several of these names (``TrainSpec``, the TOML configs), so a
version bump should only have to touch this list. Keep it a plain re-export list: no logic, no
side effects beyond the imports themselves. ``hymo_recipes.titan`` imports ``cpu_shims`` before
this module: without an accelerator TorchTitan must see device type "cpu" from its first import.
"""

from torchtitan.components.dataloader import DataloaderExhaustedError, ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.components.validate import Validator
from torchtitan.config import ConfigManager, JobConfig, TORCH_DTYPE_MAP
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset
from torchtitan.protocols import train_spec as train_spec_module  # its registry: _extra_train_specs
from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.utils import device_type as titan_device_type
from torchtitan.train import Trainer

__all__ = [
    "ConfigManager",
    "DATASETS",
    "DataloaderExhaustedError",
    "DatasetConfig",
    "HuggingFaceTextDataset",
    "HuggingFaceTokenizer",
    "IGNORE_INDEX",
    "JobConfig",
    "LRSchedulersContainer",
    "MetricsProcessor",
    "OptimizersContainer",
    "ParallelAwareDataloader",
    "StateDictAdapter",
    "TORCH_DTYPE_MAP",
    "Trainer",
    "TrainSpec",
    "Validator",
    "apply_ac",
    "dist_utils",
    "init_logger",
    "logger",
    "register_train_spec",
    "titan_device_type",
    "train_spec_module",
]
