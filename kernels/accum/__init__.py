"""Gradient accumulation: fp32 sums += gradients, a whole list of pairs at once.

- ``add_torch.accumulate_``: one PyTorch add per pair (the reference; what FSDP2 runs).
- ``add.accumulate_``: every pair in one Triton launch with 16-byte loads (GPU; CPU only in
  Triton's interpreter, for the tests). Bitwise the reference's sums.
"""

from .add_torch import accumulate_

__all__ = ["accumulate_"]
