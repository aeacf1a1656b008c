"""Chunked Gated DeltaNet in Triton: the public op, its torch.library registration and autograd.

``chunk_gated_delta_rule`` takes flash-linear-attention's arguments in the same order and
returns ``(o, final_state)``. The forward and the hand-written backward are a few launches of
the stage modules beside this one (``wy``, ``prep``, ``state_pass``, ``output``, ``backward``;
tiling in ``config``); DESIGN.md derives them.

The op is two ``torch.library.custom_op``s (forward, backward) with fake implementations and
``register_autograd``, so ``torch.compile(fullgraph=True)`` traces a model that calls it
without a graph break (fla's entry point is ``@torch.compiler.disable``). Eager calls run the
same launches through a plain ``torch.autograd.Function`` instead: the custom ops' dispatch
costs the host more than the kernels' GPU time at the HyMo shape.

No silent fallback: on a machine without Triton, or with CPU tensors outside Triton's
interpreter (``TRITON_INTERPRET=1``, used by the CPU tests), the call raises a RuntimeError
that says to pick ``gdn_backend = "torch_chunk"`` (or ``"naive"``) instead.
"""

from __future__ import annotations

import os

import torch

from ..runtime import unavailable_reason
from .config import BWD_PATHS, KERNELS, TABLE, TUNING, Config, KernelCfg, config_from_entry, get_config
from .naive import check_gdn_inputs
from .problem import Problem, _common, _overridden, make_problem, saved_states_dtype, saved_t_dtype

try:  # Triton is optional for the package: only this backend needs it (the stage modules import it)
    from .backward import run_bwd_local
    from .output import run_fwd_out
    from .prep import run_bwd_prep, run_fwd_prep
    from .state_pass import run_state_pass
    from .wy import run_wy_inverse

    _TRITON_ERROR: Exception | None = None
except Exception as e:  # noqa: BLE001 - any import failure means "no Triton backend"
    _TRITON_ERROR = e

# Whether the kernels were built for Triton's CPU interpreter (decided when triton.jit ran).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_HINT = 'set the model arg gdn_backend = "torch_chunk" (or "naive") to run the PyTorch reference'


def _forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, dot_bf16=None, t_bf16=None,
             bwd_path=None):
    p = make_problem(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, dot_bf16=dot_bf16, t_bf16=t_bf16,
                     bwd_path=bwd_path)
    tinv = run_wy_inverse(p)  # saved for the backward
    mn = run_fwd_prep(p, tinv)
    # saved for the backward: chunk start states [NC, H, K, V], or on the local_sub path every
    # sub-chunk's start state [NC·NS, H, K, V] (the pass fills slot 0 per chunk, _fwd_out the rest)
    states, final_state = run_state_pass(p, mn, initial_state, reverse=False)
    o = run_fwd_out(p, tinv, states)
    return o, final_state, states, tinv


def _backward(q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, scale, use_qk_l2norm,
              dot_bf16=None, t_bf16=None, bwd_path=None):
    p = make_problem(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, dot_bf16=dot_bf16, t_bf16=t_bf16,
                     bwd_path=bwd_path)
    if (states.shape[0] != p.NC * p.cfg.slots or tinv.shape[-1] != p.cfg.BC
            or tinv.dtype != saved_t_dtype(p.cfg, q.dtype) or states.dtype != saved_states_dtype(p.cfg, q.dtype)):
        raise RuntimeError(
            "gdn_chunk_bwd: the saved states do not match the launch config (config.TUNING or config.TABLE "
            "changed between the forward and the backward?)")
    mr = run_bwd_prep(p, tinv, do)
    dstates, dh0 = run_state_pass(p, mr, dht, reverse=True)
    dq, dk, dv, dg, db = run_bwd_local(p, tinv, do, states, dstates)
    return dq, dk, dv, dg, db, dh0


# ---------------------------------------------------------------------------------------------
# torch.library registration
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("hymo_kernels::gdn_chunk_fwd", mutates_args=())
def gdn_chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    dot_bf16: bool | None = None,
    t_bf16: bool | None = None,
    bwd_path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (o, final_state, and for the backward: saved states, sub-chunk inverses). The
    saved states are the chunk start states [NC, H, K, V], or with Config.local_sub_states the
    start state of every sub-chunk [NC·BT/BC, H, K, V], in bf16 with
    Config.states_bf16 (same schema; the shape and dtype follow the config)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    return _forward(q, k, v, g, beta, h0, cu_seqlens, scale, use_qk_l2norm, dot_bf16, t_bf16, bwd_path)


@gdn_chunk_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, dot_bf16=None, t_bf16=None,
      bwd_path=None):
    B, T, H, K, V, N, cfg, NC = _common(q, v, cu_seqlens)
    cfg = _overridden(cfg, dot_bf16, t_bf16, bwd_path)
    return (
        v.new_empty(B, T, H, V),
        q.new_empty(N, H, K, V, dtype=torch.float32),
        q.new_empty(NC * cfg.slots, H, K, V, dtype=saved_states_dtype(cfg, q.dtype)),
        q.new_empty(B, T, H, cfg.BC, dtype=saved_t_dtype(cfg, q.dtype)),
    )


@torch.library.custom_op("hymo_kernels::gdn_chunk_bwd", mutates_args=())
def gdn_chunk_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    states: torch.Tensor,
    tinv: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    dot_bf16: bool | None = None,
    t_bf16: bool | None = None,
    bwd_path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv, dg, dbeta, dh0); dh0 is computed whether or not h0 was given."""
    # gradients of a .sum() arrive as stride-0 expands
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None
    return _backward(q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, scale, use_qk_l2norm,
                     dot_bf16, t_bf16, bwd_path)


@gdn_chunk_bwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, scale, use_qk_l2norm, dot_bf16=None,
      t_bf16=None, bwd_path=None):
    B, T, H, K, V, N, cfg, NC = _common(q, v, cu_seqlens)
    return (
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
        torch.empty_like(beta), q.new_empty(N, H, K, V, dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, dot_bf16, t_bf16, bwd_path = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, output[2], output[3])
    ctx.scale = scale
    ctx.use_qk_l2norm = use_qk_l2norm
    ctx.dot_bf16, ctx.t_bf16, ctx.bwd_path = dot_bf16, t_bf16, bwd_path
    # no zero gradients for the outputs nobody differentiates (the saved states and T, often the
    # final state): autograd would fill them, ~60 MB per call at the HyMo shape
    ctx.set_materialize_grads(False)


def _input_grads(ctx, do, dht, bwd):
    """The backward of both paths (bwd: the custom op gdn_chunk_bwd or _backward)."""
    q, k, v, g, beta, initial_state, cu_seqlens, states, tinv = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do.contiguous()  # a .sum()'s gradient is a stride-0 expand
    dht = dht.contiguous() if dht is not None else None
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    dq, dk, dv, dg, db, dh0 = bwd(q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, ctx.scale,
                                  ctx.use_qk_l2norm, ctx.dot_bf16, ctx.t_bf16, ctx.bwd_path)
    return dq, dk, dv, dg, db, (dh0 if initial_state is not None else None), None, None, None, None, None, None


def _autograd_backward(ctx, do, dht, _dstates, _dtinv):
    return _input_grads(ctx, do, dht, gdn_chunk_bwd)


gdn_chunk_fwd.register_autograd(_autograd_backward, setup_context=_setup_context)


class _EagerGDN(torch.autograd.Function):
    """The eager path: the custom ops' launches in a plain autograd.Function. Through the custom
    ops a fwd+bwd costs the host more at the HyMo shape, and the host time is then above the
    kernels' GPU time (DESIGN.md, Host time); torch.compile keeps the custom ops
    (chunk_gated_delta_rule picks)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, dot_bf16, t_bf16, bwd_path):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0 = initial_state.contiguous() if initial_state is not None else None
        o, final_state, states, tinv = _forward(q, k, v, g, beta, h0, cu_seqlens, scale, use_qk_l2norm, dot_bf16,
                                                t_bf16, bwd_path)
        ctx.save_for_backward(q, k, v, g, beta, h0, cu_seqlens, states, tinv)
        ctx.scale, ctx.use_qk_l2norm = scale, use_qk_l2norm
        ctx.dot_bf16, ctx.t_bf16, ctx.bwd_path = dot_bf16, t_bf16, bwd_path
        ctx.set_materialize_grads(False)
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        return _input_grads(ctx, do, dht, _backward)


# ---------------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------------


def unavailable(device_type: str) -> str | None:
    """Why the Triton backend cannot run on tensors of this device type here (None: it can)."""
    return unavailable_reason(device_type, _TRITON_ERROR, _INTERPRET)


def _check_runnable(q: torch.Tensor) -> None:
    if why := unavailable(q.device.type):
        raise RuntimeError(f"the Triton GDN backend {why}; {_HINT}")


def _check_shapes_traced(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    """Shape-only validation while torch.compile traces (cu_seqlens values are not readable)."""
    B, T, H, K = q.shape
    if k.shape != q.shape or v.shape[:3] != (B, T, H) or g.shape != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError("expected q, k [B, T, H, K], v [B, T, H, V], g and beta [B, T, H]")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into B = 1, got B = {B}")
    N = cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape != (N, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, v.shape[-1])}")


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    dot_bf16: bool | None = None,
    t_bf16: bool | None = None,
    bwd_path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunked Triton kernels with a hand-written backward.

    Args:
        q, k: [B, T, H, K] read and write keys, bf16/fp16/fp32 (K and V powers of two, 16..256).
        v: [B, T, H, V] values.
        g: [B, T, H] log decay (≤ 0).
        beta: [B, T, H] write strength in (0, 1).
        scale: multiplies q.
            Default: K ** -0.5.
        initial_state: [N, H, K, V] state before the first token of each sequence (fp32 math).
            Default: None (zeros).
        output_final_state: also return the [N, H, K, V] fp32 state after each sequence.
            Default: False.
        cu_seqlens: [N + 1] cumulative document lengths of a packed batch (B must be 1).
            Default: None.
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6) inside the kernels.
            Default: False.
        dot_bf16: with bf16 inputs, run the dots on bf16 operands (``Config.dot_bf16``; not
            the WY inverse's): True, False, or None for the launch table's choice.
            Default: None.
        t_bf16: with dot_bf16 on, the dots with T = (I + A)⁻¹ on bf16 operands too
            (``Config.t_bf16``): True, False, or None for the launch table's choice.
            Default: None.
        bwd_path: the backward (``BWD_PATHS``): "local_sub" saves every 16-token sub-chunk's
            start state for it (K·V per 16 tokens and head, bf16 with bf16 dots: BT / 16 times
            what "local" saves; the table's choice at K = 32 and 128, the faster one);
            "local" saves the chunk start states only and re-runs each chunk's forward in the
            backward (the least memory). None: the launch table's choice.
            Default: None.

    Returns:
        o: [B, T, H, V] in v's dtype; final_state: [N, H, K, V] fp32, or None.
    """
    _check_runnable(q)
    if cu_seqlens is not None and torch.compiler.is_compiling():
        _check_shapes_traced(q, k, v, g, beta, initial_state, cu_seqlens)
    else:
        check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    K, V = q.shape[-1], v.shape[-1]
    for name, d in (("K", K), ("V", V)):
        if d not in (16, 32, 64, 128, 256):
            raise ValueError(f"{name} = {d}: the Triton GDN kernels need a power of two in 16..256")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {q.dtype}: use float32, bfloat16 or float16")
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32)
    scale = K**-0.5 if scale is None else float(scale)
    args = (q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel, dot_bf16, t_bf16, bwd_path)
    if torch.compiler.is_compiling():
        o, final_state, _, _ = gdn_chunk_fwd(*args)
    else:
        o, final_state = _EagerGDN.apply(*args)
    return o, (final_state if output_final_state else None)


__all__ = [
    "BWD_PATHS", "KERNELS", "TABLE", "TUNING", "Config", "KernelCfg", "Problem", "chunk_gated_delta_rule",
    "config_from_entry", "gdn_chunk_bwd", "gdn_chunk_fwd", "get_config", "make_problem", "unavailable",
]
