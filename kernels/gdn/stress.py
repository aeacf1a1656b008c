"""The collapsed-keys stress case of the Triton GDN kernel (GPU): bf16 inputs whose sub-chunk
keys are nearly parallel, where the WY inverse's Neumann terms are large and tf32 in the
inverse gave NaN (see ``wy._unit_lower_inverse``). Used by the GPU tests and the benchmark."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .naive import naive_recurrent_gated_delta_rule

# ‖Δo‖/‖o‖ and ‖Δh‖/‖h‖ bound of the stress case (bf16)
STRESS_TOL = 2e-2


def collapsed_keys_inputs(B: int, T: int, H: int, K: int, seed: int = 0) -> dict:
    """float64 q, k, v, g, beta (CPU) of the collapsed-keys case: unit keys at cos ≈ 0.99 to one
    direction per head, β = 0.98, g = −1e-3 (slow decay), unit queries, Gaussian values (V = K)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    u = F.normalize(rnd(1, 1, H, K), dim=-1)
    return dict(q=F.normalize(rnd(B, T, H, K), dim=-1), k=F.normalize(u + 0.05 * rnd(B, T, H, K), dim=-1),
                v=rnd(B, T, H, K), g=torch.full((B, T, H), -1e-3, dtype=torch.float64),
                beta=torch.full((B, T, H), 0.98, dtype=torch.float64))


def collapsed_keys_errors(K: int, T: int = 4096, B: int = 2, H: int = 4, seed: int = 0,
                          device: str = "cuda") -> dict:
    """bf16 forward where a sub-chunk's keys are nearly parallel (cos ≈ 0.99), β ≈ 0.98 and the
    decay slow: the regime HyMo's GDN keys reach when representations collapse early in
    training. Returns ‖ours − ref‖/‖ref‖ for o and the final state against the float64
    recurrence (nan where ours is not finite)."""
    from .chunk import chunk_gated_delta_rule

    x = collapsed_keys_inputs(B, T, H, K, seed)
    ref_o, ref_ht = naive_recurrent_gated_delta_rule(
        *(x[n].to(device) for n in ("q", "k", "v", "g", "beta")), output_final_state=True)
    o, ht = chunk_gated_delta_rule(*(x[n].to(device).bfloat16() for n in ("q", "k", "v", "g", "beta")),
                                   output_final_state=True)
    err = {}
    for name, a, b in (("o", o, ref_o), ("ht", ht, ref_ht)):
        a = a.double()
        err[name] = float("nan") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()
    return err
