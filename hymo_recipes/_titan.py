"""The one place HyMo imports TorchTitan (pinned to 0.2.2).

Newer TorchTitan moved or deleted several of these names (``TrainSpec``, the llama4/dsv3
``apply_*`` helpers), so a version bump should only have to touch this list.
Keep it a plain re-export list: no logic, no side effects beyond the imports themselves.
"""

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import JobConfig

# Private in 0.2.2: the bf16 grouped-GEMM expert kernel and the wrapper that pads each
# expert's token group to the alignment torch._grouped_mm needs (CUDA only).
from torchtitan.models.moe.moe import _run_experts_grouped_mm as run_experts_grouped_mm
from torchtitan.models.moe.utils import indices_padding_wrapper
from torchtitan.models.utils import trunc_normal_
from torchtitan.protocols.model import BaseModelArgs, ModelProtocol
from torchtitan.tools.logging import logger

__all__ = [
    "BaseModelArgs",
    "HuggingFaceTokenizer",
    "JobConfig",
    "ModelProtocol",
    "indices_padding_wrapper",
    "logger",
    "run_experts_grouped_mm",
    "trunc_normal_",
]

# Trainer plumbing: TrainSpec registration, builders, entry point (hymo_recipes/__init__.py,
# train.py, parallelize.py, data/, loss.py, metrics.py, validate.py, cpu_shims.py, optim/).
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.validate import Validator
from torchtitan.config import ConfigManager, TORCH_DTYPE_MAP
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec
from torchtitan.tools.logging import init_logger
from torchtitan.tools.utils import device_type as titan_device_type
from torchtitan.train import Trainer

__all__ += [
    "ConfigManager",
    "DATASETS",
    "DatasetConfig",
    "HuggingFaceTextDataset",
    "IGNORE_INDEX",
    "LRSchedulersContainer",
    "MetricsProcessor",
    "OptimizersContainer",
    "ParallelAwareDataloader",
    "TORCH_DTYPE_MAP",
    "Trainer",
    "TrainSpec",
    "Validator",
    "apply_ac",
    "dist_utils",
    "init_logger",
    "register_train_spec",
    "titan_device_type",
]
