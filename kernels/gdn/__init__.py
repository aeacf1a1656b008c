"""Gated DeltaNet recurrence: one entry point, several backends.

Every backend has flash-linear-attention's signature
``(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None)``
and returns ``(o, final_state)``:

- ``"naive"``: per-token recurrence in PyTorch (``naive.py``), the ground truth for tests.
- ``"torch_chunk"``: the chunked (WY) algorithm in plain PyTorch (``chunk_torch.py``), fp32 math.
- ``"triton"``: the chunked Triton kernel with a hand-written backward (``chunk.py``, the op;
  the stages beside it; DESIGN.md).

There is no silent fallback: asking for ``"triton"`` where it cannot run raises.
"""

from __future__ import annotations

import importlib

from .config import BWD_PATHS
from .naive import naive_recurrent_gated_delta_rule

# backend name -> (module, function); modules import lazily so the CPU path never needs Triton.
BACKENDS = {
    "naive": ("hymo_kernels.gdn.naive", "naive_recurrent_gated_delta_rule"),
    "torch_chunk": ("hymo_kernels.gdn.chunk_torch", "chunk_gated_delta_rule_torch"),
    "triton": ("hymo_kernels.gdn.chunk", "chunk_gated_delta_rule"),
}

# gdn_dot_precision (model arg, [hymo] knob) -> the Triton op's precision arguments ({}: its table's
# choices): tf32 dots; bf16 dots with T = (I + A)⁻¹'s in tf32; bf16 dots with T's too (Config.t_bf16)
GDN_DOT_PRECISIONS = {
    "table": {},
    "tf32": {"dot_bf16": False},
    "bf16": {"dot_bf16": True, "t_bf16": False},
    "bf16_t": {"dot_bf16": True, "t_bf16": True},
}

# gdn_bwd_path (model arg, [hymo] knob): "table" (the launch table's choice) or the Triton op's
# bwd_path, config.BWD_PATHS (config.py imports no Triton, like this module)
GDN_BWD_PATHS = ("table", *BWD_PATHS)

# gdn_mixer_saves (model arg, [hymo] knob): what the fused mixer (mixer.py) keeps for its
# backward, "inputs" (conv outputs and the gated norm's output recomputed) or "outputs" (kept);
# each value is the ``keep`` argument of its two ops
GDN_MIXER_SAVES = {"inputs": False, "outputs": True}


def get_backend(name: str):
    """Returns the recurrence function of a backend, or raises a ValueError naming the choices."""
    if name not in BACKENDS:
        raise ValueError(f"unknown GDN backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, fn = BACKENDS[name]
    return getattr(importlib.import_module(module), fn)


def gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, *, backend: str = "torch_chunk"):
    """Runs the recurrence with the named backend (see the module docstring)."""
    return get_backend(backend)(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens)


__all__ = ["BACKENDS", "GDN_BWD_PATHS", "GDN_DOT_PRECISIONS", "GDN_MIXER_SAVES", "gated_delta_rule", "get_backend", "naive_recurrent_gated_delta_rule"]
