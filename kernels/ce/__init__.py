"""The fused readout's per-chunk cross-entropy: the loss of a chunk of logits and their gradient.

- ``chunk_torch.ce_chunk``: PyTorch (the reference; what the CPU path runs, compiled by Inductor).
- ``chunk.ce_chunk``: one Triton kernel (GPU; CPU only in Triton's interpreter, for the tests).

Both take ``(logits [c, V], targets [c], want_grad)`` and return ``(sum of the chunk's
cross-entropy over targets != IGNORE_INDEX in fp32, d sum / d logits in logits' dtype or None)``.
"""

from .chunk_torch import IGNORE_INDEX, ce_chunk

__all__ = ["IGNORE_INDEX", "ce_chunk"]
