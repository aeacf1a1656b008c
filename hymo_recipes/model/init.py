"""Weight initialisation shared by the blocks."""

from __future__ import annotations

import torch
from torch import nn


def trunc_normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0,
                  b: float = 2.0) -> None:
    """``nn.init.trunc_normal_`` drawn in fp32 and copied into ``tensor`` (whatever its dtype):
    the sampler is unstable in low precision. The same draws as TorchTitan's helper of this name,
    so a model initialised by either is the same model."""
    tmp = tensor.float()
    nn.init.trunc_normal_(tmp, mean=mean, std=std, a=a, b=b)
    tensor.copy_(tmp)
