"""NorMuon's passes over the update, around the orthogonalisation's GEMMs, for one batch of
same-shape matrices (hymo_recipes/optim/normuon.py, ``fused=True``).

- ``fused_torch``: the PyTorch reference of each pass.
- ``fused``: each pass as one Triton launch over the batch, reading and writing the
  parameters, gradients and momentum buffers where they are (GPU; CPU only in Triton's
  interpreter, for the tests).
- ``ns_torch``: the reference of the orthogonalisation's iteration from the unscaled matrices.
- ``ns``: that iteration as three batched-GEMM launches a step, the addends and the scale in
  the epilogues, the symmetric products' upper tiles only.
"""

from .fused_torch import apply_update_, momentum_pack_, neuron_factor_, row_sumsq

__all__ = ["apply_update_", "momentum_pack_", "neuron_factor_", "row_sumsq"]
