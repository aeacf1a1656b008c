"""Helpers of the Triton GDN kernel tests: inputs, relative errors and the parity check of
every output and gradient against the float64 recurrence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hymo_kernels.gdn.chunk import chunk_gated_delta_rule
from hymo_kernels.gdn.naive import naive_recurrent_gated_delta_rule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ‖ours − ref‖ / ‖ref‖ per tensor. fp32: fp32 dots and accumulation, so near rounding.
# bf16 (GPU only): fla's own tolerances against the naive recurrence.
TOL = {
    torch.float32: dict(o=2e-5, ht=2e-5, q=2e-5, k=2e-5, v=2e-5, g=5e-5, beta=5e-5, h0=2e-5),
    torch.bfloat16: dict(o=5e-3, ht=5e-3, q=8e-3, k=8e-3, v=8e-3, g=2e-2, beta=2e-2, h0=5e-3),
}
NAMES = ("q", "k", "v", "g", "beta")


def make_inputs(B, T, H, K, V, *, n_states, dtype, device=DEVICE, normalize_k=True, seed=0):
    """Random inputs in `dtype`; k unit-norm (the model normalises it), g = logsigmoid(·)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    k = rnd(B, T, H, K)
    if normalize_k:
        k = F.normalize(k, dim=-1)
    x = dict(
        q=rnd(B, T, H, K), k=k, v=rnd(B, T, H, V),
        g=F.logsigmoid(rnd(B, T, H) + 2.0), beta=torch.rand(B, T, H, generator=gen, dtype=torch.float64),
        h0=rnd(n_states, H, K, V) if n_states else None,
    )
    return {n: (t.to(device=device, dtype=dtype if n != "h0" else torch.float32) if t is not None else None)
            for n, t in x.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any(), "NaN in output (unwritten element or overflow)"
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def l2n(x):
    return x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()


def run_and_compare(x, *, cu_seqlens=None, l2norm=False, tol, output_final_state=True, seed=1):
    """Forward + backward through ours and the float64 recurrence; returns the errors."""
    ours = {n: (t.clone().requires_grad_() if t is not None else None) for n, t in x.items()}
    ref = {n: (t.detach().double().requires_grad_() if t is not None else None) for n, t in x.items()}
    o, ht = chunk_gated_delta_rule(
        ours["q"], ours["k"], ours["v"], ours["g"], ours["beta"], initial_state=ours["h0"],
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=l2norm)
    rq, rk = (l2n(ref["q"]), l2n(ref["k"])) if l2norm else (ref["q"], ref["k"])
    ro, rht = naive_recurrent_gated_delta_rule(
        rq, rk, ref["v"], ref["g"], ref["beta"], initial_state=ref["h0"], output_final_state=True,
        cu_seqlens=cu_seqlens)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    dht = torch.randn(rht.shape, generator=gen, dtype=torch.float64).to(o.device)
    if output_final_state:
        torch.autograd.backward([o, ht], [do.to(o.dtype), dht.float()])
        torch.autograd.backward([ro, rht], [do, dht])
    else:
        assert ht is None
        o.backward(do.to(o.dtype))
        ro.backward(do)
    errs = {"o": rel_err(o, ro)}
    if output_final_state:
        errs["ht"] = rel_err(ht, rht)
    for n in ("q", "k", "v", "g", "beta", "h0"):
        if ours[n] is not None:
            assert ours[n].grad is not None and ours[n].grad.dtype == ours[n].dtype, n
            errs[n] = rel_err(ours[n].grad, ref[n].grad)
    bad = {n: e for n, e in errs.items() if not e <= tol[n]}
    assert not bad, f"errors over tolerance: {bad} (all: {errs})"
    return errs
