"""NorMuon: Muon with per-output-neuron second-moment normalisation (Li et al., arXiv 2510.05491).

Per matrix W [out, in] (3-D expert weights [E, out, in]: per expert, never across experts),
gradient G, following DESIGN.md §3:

    M ← β1 M + (1−β1) G ;  U = (1−β1) G + β1 M  if nesterov else M
    O = orthogonalise(U / ‖U‖_F)                     # Polar Express or quintic NS, 5 steps, bf16
    v ← β2 v + (1−β2) · mean_over_inputs(O²)         # one value per output neuron (row)
    Ô = O / (sqrt(v) + ε) · ‖O‖_F / ‖O / (sqrt(v) + ε)‖_F
    W ← W − lr·wd · m ⊙ W,   m = [Ô ⊙ W ≥ 0] if cautious_wd else 1
    W ← W − lr · s · Ô       s: "jordan" sqrt(max(1, out/in)) | "rms" 0.2·sqrt(max(out, in))
                                | "spectral" sqrt(out/in)

v has no bias correction: the rescale to ‖O‖_F cancels any uniform factor (up to ε).
``neuron_norm=False`` skips the v lines (plain Muon with cautious weight decay).

FSDP2: parameters and states are DTensors sharded by rows (Shard(0)). Orthogonalising a row
shard on its own is wrong (≈30% error), so same-shape matrices of a param group are spread over
the ranks: an all-to-all brings each matrix whole to one owner rank, the owner orthogonalises
its matrices as one batch, a second all-to-all returns the row shards. Rows are output neurons,
so the neuron normalisation runs on the local rows; the two Frobenius norms of the rescale are
summed over ranks with one small all-reduce. 3-D expert weights sharded on the expert dim hold
whole matrices locally and need no communication. The result equals the single-process step
up to float summation order.

Speed: a model has 100-300 NorMuon matrices of ~10 shapes, and a loop over parameters costs
~25 small kernels each (3,600 aten ops per step for hymo_small: launch-bound on a GPU). The
step instead works on batches: the matrices of one shape (and the experts of 3-D stacks of
that shape) are stacked once into [B, out, in], orthogonalised together, and the neuron norm,
rescale, cautious decay and update run once per batch on the stacked tensors; momentum and
Nesterov are multi-tensor (foreach) ops over the group, and one multi-tensor copy per batch
writes the parameters back (~800 aten ops per step for hymo_small, ~35 per batch besides the
orthogonalisation). ``compiled=True`` additionally fuses the per-batch elementwise maths.
tests/optim/test_normuon_batched.py keeps the per-parameter loop as the reference.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import hymo_kernels.normuon.fused as normuon_kernels
import hymo_kernels.normuon.ns as ns_kernels
from hymo_recipes.optim._base import BYTES_PER_S, GEMM_FLOPS_PER_S, LAUNCH_S, GroupStepOptimizer, write_if
from hymo_recipes.optim._dist import (
    all_reduce_sum,
    local,
    rows_of_rank,
    shard_spec,
    state_like_rows,
)

__all__ = [
    "NorMuon",
    "orthogonalize",
    "update_scale_factor",
    "QUINTIC_COEFFS",
    "POLAR_EXPRESS_COEFFS",
]

# Keller Jordan's quintic Newton–Schulz coefficients (modded-nanogpt / torch.optim.Muon).
QUINTIC_COEFFS = (3.4445, -4.7750, 2.0315)
# Polar Express (Amsel et al., arXiv 2505.16932), one optimal quintic per step, 5 steps.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

_ORTHO_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_UPDATE_SCALES = ("jordan", "rms", "spectral")
_ORTHOGONALIZERS = ("polar_express", "quintic")


def orthogonalize(
    x: Tensor, *, steps: int = 5, method: str = "polar_express", dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Approximate polar factor (U Vᵀ of x = U S Vᵀ) of each matrix in a batch.

    Args:
        x (Tensor):
            ``[..., m, n]``; every trailing matrix is orthogonalised on its own.
        steps (int):
            Iterations. Default: ``5``.
        method (str):
            ``"polar_express"`` (per-step optimal quintics; past 5 steps the last one repeats)
            or ``"quintic"`` (fixed 3.4445, −4.7750, 2.0315). Default: ``"polar_express"``.
        dtype (torch.dtype):
            Arithmetic dtype of the iteration; the result has this dtype. Default: ``bfloat16``.
    """
    shape = x.shape
    X = x.reshape(-1, shape[-2], shape[-1]).to(dtype)
    # Iterate on the wide orientation: the Gram matrix X Xᵀ is then min(m, n) square.
    transposed = shape[-2] > shape[-1]
    if transposed:
        X = X.mT
    coeffs, margin, eps = _iteration(method, steps)
    X = _iterate(X / (X.norm(dim=(-2, -1), keepdim=True) * margin + eps), coeffs)
    if transposed:
        X = X.mT
    return X.reshape(shape)


def _iteration(method: str, steps: int) -> tuple[list[tuple[float, float, float]], float, float]:
    """(coefficients per step, norm margin, eps): X / (‖X‖_F · margin + eps) starts the iteration."""
    if method not in _ORTHOGONALIZERS:
        raise ValueError(f"orthogonalizer must be one of {_ORTHOGONALIZERS}, got {method!r}")
    if method == "quintic":
        return [QUINTIC_COEFFS] * steps, 1.0, 1e-7
    # 1.02: Polar Express's safety margin, keeps the top singular value inside the interval
    # the polynomials were optimised for despite bf16 rounding.
    coeffs = list(POLAR_EXPRESS_COEFFS[:steps])
    coeffs += [POLAR_EXPRESS_COEFFS[-1]] * (steps - len(coeffs))
    return coeffs, 1.02, 1e-6


def _iterate(X: Tensor, coeffs: list[tuple[float, float, float]]) -> Tensor:
    if X.device.type == "cpu" and X.dtype in (torch.bfloat16, torch.float16):
        return _iterate_cpu_half(X, coeffs)
    for a, b, c in coeffs:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    return X


def _iterate_cpu_half(X: Tensor, coeffs: list[tuple[float, float, float]]) -> Tensor:
    """``_iterate`` for bf16 / fp16 on a CPU: each product formed in fp32 from the half-precision
    operands and rounded once to X's dtype, which is what a GPU's half-precision GEMM does (fp32
    accumulation); CPUs without native bf16 instructions run torch's bf16 matmul ~50x slower."""
    dt = X.dtype
    for a, b, c in coeffs:
        Xf = X.float()
        A = torch.bmm(Xf, Xf.mT).to(dt).float()
        B = torch.baddbmm(A, A, A, beta=b, alpha=c).to(dt).float()
        X = torch.baddbmm(Xf, B, Xf, beta=a, alpha=1.0).to(dt)
    return X


def update_scale_factor(kind: str, fan_out: int, fan_in: int) -> float:
    """Shape factor s of the update ``lr · s · Ô`` for a [fan_out, fan_in] matrix."""
    if kind == "jordan":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if kind == "rms":
        # Moonlight: matches AdamW's update RMS so AdamW's lr/wd carry over.
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    if kind == "spectral":
        # muP / spectral condition: update spectral norm ∝ sqrt(fan_out / fan_in).
        return math.sqrt(fan_out / fan_in)
    raise ValueError(f"update_scale must be one of {_UPDATE_SCALES}, got {kind!r}")


def _state_dtype(p: Tensor) -> torch.dtype:
    # State is fp32 (DESIGN §3) for fp32/bf16 params; fp64 params (reference tests) keep fp64.
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _as_scalar(x: float | Tensor) -> float | Tensor:
    # 0-d tensor lr/wd are kept as tensors (no host sync, no recompiles); anything else a float.
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError("lr / weight_decay tensors must have one element")
        return x
    return float(x)


class NorMuon(GroupStepOptimizer):
    """NorMuon for 2-D matrices and 3-D stacks of expert matrices ([E, out, in]).

    Args:
        params (iterable):
            Parameters or param groups. Each parameter must be 2-D or 3-D.
        lr (float or Tensor):
            Learning rate. Default: ``0.02``.
        momentum (float):
            β1 of the momentum EMA. Default: ``0.95``.
        beta2 (float):
            β2 of the per-neuron second moment. Default: ``0.95``.
        eps (float):
            Added to sqrt(v). Default: ``1e-8``.
        weight_decay (float or Tensor):
            Decoupled decay, multiplied by the scheduled lr. Default: ``0.1``.
        cautious_wd (bool):
            Decay only where Ô·W ≥ 0 (Chen et al., arXiv 2510.12402). Default: ``True``.
        neuron_norm (bool):
            Per-output-neuron normalisation; ``False`` gives Muon. Default: ``True``.
        nesterov (bool):
            Nesterov momentum. Default: ``True``.
        ns_steps (int):
            Orthogonalisation iterations. Default: ``5``.
        orthogonalizer (str):
            ``"polar_express"`` or ``"quintic"``. Default: ``"polar_express"``.
        update_scale (str):
            ``"jordan"``, ``"rms"`` or ``"spectral"``. Default: ``"jordan"``.
        ortho_dtype (str or torch.dtype):
            Arithmetic dtype of the orthogonalisation (``"bfloat16"``, ``"float32"``,
            ``"float64"``); bf16 by design, wider for tests. Default: ``"bfloat16"``.
        compiled (bool):
            Run the per-batch elementwise maths (neuron norm, rescale, cautious decay, update)
            under ``torch.compile``: a few fused kernels per batch instead of ~15 passes over
            the update. Same maths as eager up to float rounding; a one-off compile. Default:
            ``False`` (eager is already batched, and compiling costs seconds on CPU).
        fused (bool):
            Run the passes over the update as HyMo's Triton kernels (hymo_kernels.normuon): the
            momentum, the Nesterov input and the cast into the orthogonalisation's input in one
            launch per batch, reading the gradients and momentum buffers where they are; the
            neuron norm's row sums in one; the rescale, cautious decay and update in one, writing
            the parameters in place. Same maths as eager up to float rounding. CUDA (or Triton's
            interpreter), fp32 state, a bf16 or fp32 orthogonalisation; not with ``compiled``.
            Row-sharded matrices (FSDP over several ranks) keep the PyTorch passes around their
            all-to-all. One difference by design: the iteration's input is scaled by the fp32
            norm of U (formed in the momentum pass) where eager takes the norm of its bf16 cast,
            so with the bf16 iteration the two steps differ by bf16's rounding. Default: ``False``.

    State (created for every parameter at construction, fp32 (fp64 for fp64 params), sharded
    like the parameter so DCP sees the same keys on every rank): ``momentum_buffer`` (shape of p) and ``neuron_v``
    (``p.shape[:-1]``). A parameter whose ``grad`` is None takes a zero gradient, so every rank
    joins every collective.
    """

    def __init__(
        self,
        params,
        lr: float | Tensor = 0.02,
        momentum: float = 0.95,
        beta2: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float | Tensor = 0.1,
        cautious_wd: bool = True,
        neuron_norm: bool = True,
        nesterov: bool = True,
        ns_steps: int = 5,
        orthogonalizer: str = "polar_express",
        update_scale: str = "jordan",
        ortho_dtype: str | torch.dtype = "bfloat16",
        compiled: bool = False,
        fused: bool = False,
    ) -> None:
        if compiled and fused:
            raise ValueError("NorMuon: compiled and fused are two ways to run the same passes; pick one")
        if isinstance(ortho_dtype, torch.dtype):
            ortho_dtype = str(ortho_dtype).removeprefix("torch.")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            cautious_wd=cautious_wd,
            neuron_norm=neuron_norm,
            nesterov=nesterov,
            ns_steps=ns_steps,
            orthogonalizer=orthogonalizer,
            update_scale=update_scale,
            # A string, not a torch.dtype: param-group values go into DCP checkpoints.
            ortho_dtype=ortho_dtype,
        )
        self._check_hparams(defaults)
        # Not param-group values: they change no number and must not go into checkpoints.
        self._init_helpers(compiled, fused)
        super().__init__(params, defaults)

    def _init_helpers(self, compiled: bool, fused: bool = False) -> None:
        self._compiled = compiled
        self._fused = fused
        self._batch_cache: dict[tuple, list[_Batch]] = {}
        # the fused kernels' address tables, by (group, batch, tensor kind): (addresses, table)
        self._tables: dict[tuple, tuple[tuple[int, ...], Tensor]] = {}
        self._tables_held = False  # a CUDA graph reads the tables (prepare_capture until end_graph)
        self._stats_fn, self._apply_fn = _neuron_stats, _apply_update
        if compiled:
            # dynamic=True: one graph serves every matrix shape (a flavor has 10+ shapes, more
            # than dynamo's per-function recompile limit). lr·s and lr·wd may be floats that the
            # scheduler changes every step; dynamo traces floats as inputs, not constants.
            self._stats_fn = torch.compile(_neuron_stats, dynamic=True, fullgraph=True)
            self._apply_fn = torch.compile(_apply_update, dynamic=True, fullgraph=True)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, with the states kept in their own dtype: torch casts every floating state
        to its parameter's dtype, which would leave bf16 parameters with bf16 momentum and second
        moments (fp32 by design), so those are taken again from the saved tensors. The address
        tables of the fused kernels are dropped (new state tensors, new param group dicts)."""
        saved = state_dict["state"]  # torch's load leaves the caller's tensors as they are
        super().load_state_dict(state_dict)
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(saved_group["params"], group["params"]):
                st, src, dtype = self.state.get(p, {}), saved.get(pid, {}), _state_dtype(p)
                for key in ("momentum_buffer", "neuron_v"):
                    if key in st and key in src and st[key].dtype != dtype:
                        st[key] = src[key].to(device=st[key].device, dtype=dtype)
        self._tables.clear()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Optimizer pickles only defaults/state/param_groups: rebuild the helpers (eager).
        if "_stats_fn" not in self.__dict__:
            self._init_helpers(False)

    @staticmethod
    def _check_hparams(g: dict[str, Any]) -> None:
        lr = g["lr"]
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must have one element")
        if not float(lr) >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= g["momentum"] < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {g['momentum']}")
        if not 0.0 <= g["beta2"] < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {g['beta2']}")
        if not g["eps"] >= 0.0:
            raise ValueError(f"eps must be >= 0, got {g['eps']}")
        if not float(g["weight_decay"]) >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")
        if not (isinstance(g["ns_steps"], int) and 1 <= g["ns_steps"] < 100):
            raise ValueError(f"ns_steps must be an int in [1, 100), got {g['ns_steps']}")
        if g["orthogonalizer"] not in _ORTHOGONALIZERS:
            raise ValueError(
                f"orthogonalizer must be one of {_ORTHOGONALIZERS}, got {g['orthogonalizer']!r}"
            )
        if g["update_scale"] not in _UPDATE_SCALES:
            raise ValueError(
                f"update_scale must be one of {_UPDATE_SCALES}, got {g['update_scale']!r}"
            )
        if g["ortho_dtype"] not in _ORTHO_DTYPES:
            raise ValueError(
                f"ortho_dtype must be one of {tuple(_ORTHO_DTYPES)}, got {g['ortho_dtype']!r}"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._check_hparams(group)
        for p in group["params"]:
            if p.ndim not in (2, 3):
                raise ValueError(
                    f"NorMuon takes 2-D matrices and 3-D [E, out, in] expert stacks; got a "
                    f"parameter of shape {tuple(p.shape)} (route it to CautiousAdamW)"
                )
            if torch.is_complex(p):
                raise ValueError("NorMuon does not support complex parameters")
            shard_spec(p)  # refuses unsupported layouts now rather than at the first step
            if self._fused and (p.dtype == torch.float64 or group["ortho_dtype"] == "float64"):
                raise ValueError("NorMuon(fused=True) runs fp32 state and a bf16 or fp32 orthogonalisation; "
                                 "fp64 parameters or ortho_dtype take the PyTorch passes (fused=False)")
            # Pre-created so that DCP sees identical keys on every rank and torch's
            # "zero-grad step at lr 0" on load (state_dict._init_optim_state) never runs.
            state = self.state[p]
            if not state:
                dtype = _state_dtype(p)
                state["momentum_buffer"] = torch.zeros_like(p, dtype=dtype)
                state["neuron_v"] = state_like_rows(p, dtype)

    # --------------------------------------------------------------------------------------
    def _batches(self, params: list[Tensor]) -> list[_Batch]:
        # The grouping depends only on the parameters (shapes, dtypes, sharding), so it is built
        # once per param list: shard_spec walks the mesh and would cost host time every step.
        key = tuple((id(p), tuple(p.shape), p.dtype) for p in params)
        batches = self._batch_cache.get(key)
        if batches is None:
            batches = _make_batches(params)
            self._batch_cache[key] = batches
        return batches

    def _prepare_host_step(self, index: int, group: dict[str, Any]):
        # the scheduled lr is the one value that changes between steps; lr·s and lr·wd are formed
        # on the host as the eager step forms them, so the two round alike
        lr, wd = _as_scalar(group["lr"]), _as_scalar(group["weight_decay"])
        p = local(group["params"][0])
        device, dtype = p.device, _state_dtype(p)  # the update's dtype
        yield ("lr_wd", index), float(lr * wd), device, dtype
        for j, b in enumerate(self._batches(group["params"])):
            s = update_scale_factor(group["update_scale"], b.rows_global, b.cols)
            yield ("lr_s", index, j), float(lr * s), device, dtype

    def _step_group(self, group: dict[str, Any]) -> None:
        beta1, beta2, eps = group["momentum"], group["beta2"], group["eps"]
        index = self._group_index(group) if self.in_graph else None
        lr = _as_scalar(group["lr"])
        wd = _as_scalar(group["weight_decay"])
        # A tensor wd is applied unconditionally (multiplying by 0 is harmless; asking it
        # whether it is 0 would cost a device sync).
        apply_wd = isinstance(wd, Tensor) or wd != 0.0
        lr_wd = lr * wd if index is None else self._graph_scalar(("lr_wd", index))
        lr_wd = self._compiled_scalar(lr_wd, group["params"])
        ortho_kw = dict(
            steps=group["ns_steps"],
            method=group["orthogonalizer"],
            dtype=_ORTHO_DTYPES[group["ortho_dtype"]],
        )
        params = group["params"]
        batches = list(enumerate(self._batches(params)))
        ms, gs, vs, ws = self._local_lists(params)
        if self._fused:
            for j, b in batches:
                if b.row_group is None:
                    self._fused_batch(group, index, j, b, ms, gs, vs, ws, lr, lr_wd, apply_wd)
            batches = [(j, b) for j, b in batches if b.row_group is not None]
            if not batches:
                return
        # the parameters of the batches left to the PyTorch passes (every one unless fused)
        sub = sorted(i for _, b in batches for i in b.idxs) if self._fused else range(len(params))
        ms_t = [ms[i] for i in sub]
        gs_t = [gs[i] if gs[i].dtype == ms[i].dtype else gs[i].to(ms[i].dtype) for i in sub]

        # 1. Momentum and Nesterov input (fp32). Out of place for Nesterov: never write into
        # p.grad (it may alias a reduce-scatter buffer).
        if self.go is None:
            torch._foreach_lerp_(ms_t, gs_t, 1.0 - beta1)
        else:  # a CUDA graph's step that its flag may skip: the new momenta written through it
            write_if(self.go, ms_t, torch._foreach_lerp(ms_t, gs_t, 1.0 - beta1))
        us_t = torch._foreach_lerp(gs_t, ms_t, beta1) if group["nesterov"] else ms_t
        us: list[Tensor | None] = [None] * len(params)
        for i, u in zip(sub, us_t):
            us[i] = u
        del gs, gs_t, us_t

        # 2. Orthogonalise whole matrices, one stacked [B, m, k] tensor per batch; everything
        # after stays stacked (no split into per-parameter pieces until the final write-back).
        Os = [self._orthogonalize_batch(b, us, ortho_kw, self._compiled) for _, b in batches]
        del us

        # 3. Neuron second moment on local rows (rows are output neurons) and the squared
        # Frobenius norms of O and O / (sqrt(v) + eps) per matrix.
        stats: list[tuple[Tensor, Tensor] | None] = [None] * len(batches)
        if group["neuron_norm"]:
            v_dst, v_src = [], []
            for n, ((_, b), O) in enumerate(zip(batches, Os)):
                V, d, sq = self._stats_fn(O, b.stack(vs, 1), beta2, eps)
                stats[n] = (d, sq)
                v_dst += [vs[i] for i in b.idxs]
                v_src += b.unstack(V)
            write_if(self.go, v_dst, v_src)
            _all_reduce_row_sums([b for _, b in batches], stats)

        # 4. Rescale, cautious decoupled weight decay and the scaled update on a stacked copy
        # of W, one multi-tensor copy back per batch (per batch, not once at the end, so that
        # only one batch's O and W copies are alive at a time: with the experts on NorMuon
        # they are GBs).
        for n, (j, b) in enumerate(batches):
            lr_s = self._lr_s(group, index, j, b, lr)
            d, sq = stats[n] if stats[n] is not None else (None, None)
            O = Os[n]
            for mem, mat in b.chunks(O.device):
                W = self._apply_fn(
                    O[mat], b.stack(ws, 2, mem), None if d is None else d[mat],
                    None if sq is None else sq[:, mat], lr_s, lr_wd, apply_wd,
                    group["cautious_wd"],
                )
                write_if(self.go, [ws[i] for i in b.idxs[mem]], b.unstack(W, mem))
            Os[n] = stats[n] = O = None

    def _group_cost(self, group: dict[str, Any]) -> float:
        # per matrix [m, k] (s = min, l = max): each iteration step's three products,
        # 4·s²·l + 2·s³ FLOPs (at an eighth of the rate in fp32 or fp64); ~30 bytes per element
        # in the passes around them; per shape, the step's launches one after the other
        steps = group["ns_steps"]
        flops = nbytes = 0.0
        shapes = set()
        for p in group["params"]:
            w = local(p)
            m, k = w.shape[-2:]
            count = w.numel() // max(1, m * k)
            s, l = min(m, k), max(m, k)
            flops += steps * count * (4 * s * s * l + 2 * s**3)
            nbytes += 30 * w.numel()
            shapes.add((m, k))
        rate = GEMM_FLOPS_PER_S if group["ortho_dtype"] in ("bfloat16", "float16") else GEMM_FLOPS_PER_S / 8
        return flops / rate + nbytes / BYTES_PER_S + len(shapes) * (3 * steps + 4) * LAUNCH_S

    def _local_lists(self, params: list[Tensor]) -> tuple[list[Tensor], ...]:
        """Momentum buffers, gradients (their own dtype; zeros for a parameter without one),
        neuron second moments and weights: local shards as flat lists, so that the per-tensor
        maths is one multi-tensor (foreach) op for the whole group or one op (or launch) per
        batch, never one op per parameter."""
        ms, gs, vs, ws = [], [], [], []
        for p in params:
            st = self.state[p]
            m = local(st["momentum_buffer"])
            g = local(p.grad)
            # Zero, not skip: a skip on one rank would leave the others in a collective.
            gs.append(torch.zeros_like(m) if g is None else g)
            ms.append(m)
            vs.append(local(st["neuron_v"]))
            ws.append(local(p))
        return ms, gs, vs, ws

    def _lr_s(self, group: dict[str, Any], index: int | None, j: int, b: _Batch, lr: float | Tensor):
        """lr·s of batch j: formed here, or, inside a CUDA graph, the device scalar of its host half."""
        s = update_scale_factor(group["update_scale"], b.rows_global, b.cols)
        lr_s = lr * s if index is None else self._graph_scalar(("lr_s", index, j))
        return self._compiled_scalar(lr_s, group["params"])

    def _fused_batch(self, group: dict[str, Any], index: int | None, j: int, b: _Batch, ms, gs, vs, ws,
                     lr: float | Tensor, lr_wd: float | Tensor, apply_wd: bool) -> None:
        """One whole-matrix batch through the fused kernels (hymo_kernels.normuon): momentum and
        cast in one launch, the orthogonalisation's GEMMs, the row norms in one launch, then the
        rescale, decay and update of the parameters in place in one."""
        m, k = b.rows, b.cols
        transposed = m > k  # the iteration runs on the wide orientation
        grads, moms, weights = _members(b, gs, ms, ws)
        v_members = [vs[i] for i in b.idxs]
        g_tab, m_tab, w_tab, v_tab = self._batch_tables(group, j, b, grads, moms, weights, v_members)
        B = sum(b.counts)
        X = torch.empty((B, k, m) if transposed else (B, m, k), dtype=_ORTHO_DTYPES[group["ortho_dtype"]],
                        device=moms[0].device)
        go = self.go
        sumsq = normuon_kernels.momentum_pack_(grads, moms, X, group["momentum"], group["nesterov"], transposed,
                                               tables=(g_tab, m_tab), go=go)
        coeffs, margin, eps = _iteration(group["orthogonalizer"], group["ns_steps"])
        X = ns_kernels.iterate(X, 1.0 / (sumsq.sqrt() * margin + eps), coeffs)
        factor = None
        if group["neuron_norm"]:
            factor = normuon_kernels.neuron_factor_(normuon_kernels.row_sumsq(X, transposed), v_members,
                                                    group["beta2"], group["eps"], k, v_table=v_tab, go=go)
        normuon_kernels.apply_update_(X, factor, weights, self._lr_s(group, index, j, b, lr), lr_wd, apply_wd,
                                      group["cautious_wd"], transposed, w_table=w_tab, go=go)

    def _batch_tables(self, group: dict[str, Any], j: int, b: _Batch, grads, moms, weights, vs) -> list[Tensor]:
        """The address tables of batch j's gradients, momentum buffers, weights and neuron second
        moments, rebuilt only when an address changed (the gradients may move between steps).
        Under a CUDA graph ``prepare_capture`` builds them before the capture (a copy to the
        device cannot be captured from pageable memory, and none is needed) and points them at
        each step's gradients before its replay; once a graph holds them (``prepare_capture``
        until ``end_graph``) a table is only ever rewritten in place, never replaced."""
        out = []
        for kind, members, (m, k) in (("g", grads, (b.rows, b.cols)), ("m", moms, (b.rows, b.cols)),
                                      ("w", weights, (b.rows, b.cols)), ("v", vs, (1, b.rows))):
            key, ptrs = (id(group), j, kind), tuple((t.data_ptr(), t.dtype) for t in members)
            hit = self._tables.get(key)
            if hit is None or hit[0] != ptrs:
                if members[0].is_cuda and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("NorMuon(fused=True): an address table was not built before the CUDA graph's "
                                       "capture (GraphedStep calls prepare_capture first)")
                # Same members and dtypes at other addresses (the gradients of a new step): the
                # table is rewritten in place, so that a captured step reads them through it.
                same = hit is not None and [d for _, d in hit[0]] == [d for _, d in ptrs]
                if hit is not None and not same and self._tables_held:
                    raise RuntimeError(f"NorMuon(fused=True): batch [{b.rows}, {b.cols}]'s {kind} tensors changed "
                                       "count or dtype under a captured CUDA graph, which reads the tables it "
                                       "captured: the graph must be dropped first (GraphedStep.reset)")
                table = normuon_kernels.address_table(members, m, k, members[0].device, out=hit[1] if same else None)
                hit = self._tables[key] = (ptrs, table)
            out.append(hit[1])
        return out

    def grads_by_address(self) -> list[Tensor]:
        """The fused kernels read the gradients of whole-matrix batches through address tables
        (``prepare_capture`` points them at the step's gradients), so a CUDA graph of the step
        needs no static copy of them (row-sharded batches take the PyTorch passes)."""
        if not self._fused:
            return []
        out = []
        for g in self.param_groups:
            for b in self._batches(g["params"]):
                if b.row_group is None:
                    out += [g["params"][i] for i in b.idxs]
        return out

    def end_graph(self) -> None:
        super().end_graph()
        self._tables_held = False

    def prepare_capture(self) -> None:
        """Before a CUDA graph captures the step, and before each replay (``p.grad`` the tensors
        the step is to read): the fused kernels' address tables for them, built outside the
        capture, rewritten in place when an address changed (never replaced from here until
        ``end_graph``: the graph reads the tables it captured)."""
        if not self._fused:
            return
        for group in self.param_groups:
            if not group["params"]:
                continue
            ms, gs, vs, ws = self._local_lists(group["params"])
            for j, b in enumerate(self._batches(group["params"])):
                if b.row_group is None:
                    if len({gs[i].dtype for i in b.idxs}) > 1:
                        # the kernel would read float copies made inside the capture, whose
                        # addresses no table built here can hold
                        raise ValueError("NorMuon(fused=True) under a CUDA graph needs one gradient dtype per batch of "
                                         f"same-shape matrices; [{b.rows}, {b.cols}] has "
                                         f"{sorted(str(gs[i].dtype) for i in b.idxs)}")
                    self._batch_tables(group, j, b, *_members(b, gs, ms, ws), [vs[i] for i in b.idxs])
        self._tables_held = True

    def _compiled_scalar(self, x: float | Tensor, params: list[Tensor]) -> float | Tensor:
        """lr·s and lr·wd for the compiled maths and the fused kernels (which read them from device
        memory): always a 0-d tensor in the state dtype, the type
        a CUDA graph's device scalars have, so that eager and graphed steps share compiled graphs
        (a float and a tensor are two guards, and dynamo keeps at most 8 graphs per function).
        Eager maths keeps the float."""
        if not (self._compiled or self._fused):
            return x
        p = local(params[0])
        if isinstance(x, Tensor):  # the kernels read an fp32 scalar on the parameters' device
            return x.to(p.device, _state_dtype(p)) if self._fused else x
        return torch.full((), float(x), dtype=_state_dtype(p), device=p.device)

    @staticmethod
    def _orthogonalize_batch(b: _Batch, us: list[Tensor], ortho_kw: dict, row_major: bool = False) -> Tensor:
        dtype = us[b.idxs[0]].dtype
        if b.row_group is not None:
            mats = [us[i] for i in b.idxs]
            return _orthogonalize_row_sharded(mats, (b.rows_global, b.cols), b.row_group, ortho_kw)
        # Stacked in the state dtype, cast inside orthogonalize: a cat whose output dtype
        # differs from its inputs' leaves CUDA's one-kernel path for one copy per input.
        # row_major (the compiled maths): tall matrices come out of orthogonalize transposed,
        # and each layout would be a graph of its own; the cast writes them row-major instead.
        O = orthogonalize(b.stack(us, 2), **ortho_kw)
        if not row_major:
            return O.to(dtype)
        # .contiguous() too: .to() returns a same-dtype tensor as it is, whatever the format asked
        return O.to(dtype, memory_format=torch.contiguous_format).contiguous()


@dataclass(frozen=True)
class _Batch:
    """Parameters whose local matrices are stacked into one [B, rows, cols] tensor.

    ``counts[j]`` is the number of matrices parameter ``idxs[j]`` contributes (1 for 2-D, the
    local expert count for 3-D stacks). ``row_group`` is set for row-sharded 2-D matrices, which
    are gathered whole for the orthogonalisation; then ``rows`` is this rank's row count.
    """

    idxs: tuple[int, ...]
    counts: tuple[int, ...]
    rows: int
    rows_global: int
    cols: int
    row_group: dist.ProcessGroup | None = None
    mesh_key: tuple = ()
    ndims: tuple[int, ...] = ()

    @property
    def all_2d(self) -> bool:
        # then stack / unbind, with no view op per member
        return all(nd == 2 for nd in self.ndims)

    def stack(self, ts: list[Tensor], inner: int, mem: slice = slice(None)) -> Tensor:
        """Members' (``mem``: a slice of them) tensors of ``ts`` as one [B, ...] tensor
        (``inner``: dims per matrix)."""
        xs = [ts[i] for i in self.idxs[mem]]
        if self.all_2d:
            return torch.stack(xs)
        return torch.cat([x if x.ndim > inner else x.unsqueeze(0) for x in xs])

    def unstack(self, stacked: Tensor, mem: slice = slice(None)) -> list[Tensor]:
        """The inverse of ``stack``: views of ``stacked`` shaped like the members' tensors."""
        if self.all_2d:
            return list(stacked.unbind(0))
        pieces = stacked.split(self.counts[mem])
        return [x if nd == 3 else x[0] for x, nd in zip(pieces, self.ndims[mem])]

    def chunks(self, device: torch.device) -> list[tuple[slice, slice]]:
        """(member slice, matrix slice) pieces of the batch for the update stage.

        One piece on GPUs. On CPU, pieces of about _CPU_CHUNK_ELEMS elements: glibc maps
        allocations above 32 MiB fresh from the kernel, so batch-sized temporaries cost page
        faults worth several times the arithmetic, while small ones are recycled. Whole members only; the numbers do not depend on the split.
        """
        n = len(self.idxs)
        if device.type != "cpu":
            return [(slice(0, n), slice(0, sum(self.counts)))]
        per_matrix = max(1, self.rows * self.cols)
        out, start, mat0, mat = [], 0, 0, 0
        for j, c in enumerate(self.counts):
            mat += c
            if (mat - mat0) * per_matrix >= _CPU_CHUNK_ELEMS or j == n - 1:
                out.append((slice(start, j + 1), slice(mat0, mat)))
                start, mat0 = j + 1, mat
        return out


# 16 MiB of fp32 per temporary: under glibc's largest mmap threshold (32 MiB).
_CPU_CHUNK_ELEMS = 1 << 22


def _make_batches(params: list[Tensor]) -> list[_Batch]:
    local_b: dict[tuple, list[int]] = defaultdict(list)
    dist_b: dict[tuple, list[int]] = defaultdict(list)
    specs = [shard_spec(p) for p in params]
    for i, (p, spec) in enumerate(zip(params, specs)):
        # Row-sharded 2-D matrices need the gather; 3-D expert stacks sharded on the expert
        # dim hold whole matrices locally.
        if p.ndim == 2 and spec.row_group is not None:
            dist_b[(tuple(p.shape), p.dtype, spec.mesh_key)].append(i)
        else:
            # All local [m, k] matrices (2-D params and every expert of 3-D stacks) together.
            local_b[(tuple(p.shape[-2:]), p.dtype)].append(i)
    out = []
    for ((m, k), _), idxs in local_b.items():
        counts = tuple(local(params[i]).reshape(-1, m, k).shape[0] for i in idxs)
        out.append(_Batch(tuple(idxs), counts, m, m, k,
                          ndims=tuple(params[i].ndim for i in idxs)))
    for ((m, k), _, mesh_key), idxs in dist_b.items():
        spec = specs[idxs[0]]
        world, rank = dist.get_world_size(spec.row_group), dist.get_rank(spec.row_group)
        _, _, my_rows = rows_of_rank(m, world, rank)
        out.append(_Batch(tuple(idxs), (1,) * len(idxs), my_rows, m, k, spec.row_group,
                          mesh_key, ndims=(2,) * len(idxs)))
    return out


def _members(b: _Batch, gs: list[Tensor], ms: list[Tensor], ws: list[Tensor]) -> tuple[list[Tensor], ...]:
    """Batch b's gradients, momentum buffers and weights; the gradients in fp32 where their dtypes
    differ (a zero-filled stand-in beside bf16 gradients), as the fused kernels take one."""
    grads, moms, weights = ([xs[i] for i in b.idxs] for xs in (gs, ms, ws))
    if len({g.dtype for g in grads}) > 1:
        grads = [g.float() for g in grads]
    return grads, moms, weights


def _neuron_stats(O: Tensor, v: Tensor, beta2: float, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """O [B, m, k], v [B, m] -> (new v, d = sqrt(v) + eps, [2, B] = (‖O‖², ‖O / d‖²) per matrix).

    Row sums of O² come from a norm (no O²-sized temporary); ‖O / d‖² is Σ_rows (Σ_cols O²) / d²
    from the same row sums, not a second pass over O. Both equal the textbook formulas up to
    float rounding and summation order.
    """
    return _stats_from_rowsq(torch.linalg.vector_norm(O, dim=-1).square(), v, beta2, eps, O.shape[-1])


def _stats_from_rowsq(rowsq: Tensor, v: Tensor, beta2: float, eps: float, cols: int) -> tuple[Tensor, Tensor, Tensor]:
    """``_neuron_stats`` from the row sums of O² ([B, m]) and O's column count."""
    v = v.lerp(rowsq / cols, 1.0 - beta2)
    d = v.sqrt() + eps
    sq = torch.stack([rowsq.sum(dim=-1), (rowsq / d.square()).sum(dim=-1)])
    return v, d, sq


def _apply_update(
    O: Tensor,
    W: Tensor,
    d: Tensor | None,
    sq: Tensor | None,
    lr_s: float | Tensor,
    lr_wd: float | Tensor,
    apply_wd: bool,
    cautious_wd: bool,
) -> Tensor:
    """W [B, m, k] updated in place and returned: Ô = O / d rescaled to ‖O‖_F (when d is
    given), then the cautious decoupled decay and the scaled update. O is overwritten.

    O and W are stacked copies the caller owns, so the maths runs in place on them and on
    one scratch tensor: on CPU every fresh [B, m, k] tensor costs page faults (several times
    the arithmetic), on GPU an allocation and a pass; under torch.compile the
    mutations fuse into a few kernels that write W.
    """
    U = O
    if d is not None:
        # clamp: an all-zero update (zero grad and momentum) stays exactly zero.
        ratio = (sq[0] / sq[1].clamp_min(1e-30)).sqrt()
        # One per-row factor ratio / d: a single pass over O instead of a divide and a scale.
        U = U.mul_((ratio.unsqueeze(-1) / d).unsqueeze(-1))
    decay = None
    if apply_wd:
        Wu = W.to(U.dtype)
        if cautious_wd:
            # [Ô ⊙ W ≥ 0] before the lr scaling (an lr of 0 must not change the mask), then
            # the same scratch holds the decay.
            scratch = U * Wu
            keep = scratch >= 0
            if torch.compiler.is_compiling():
                decay = Wu * lr_wd * keep  # dynamo refuses out= with symbolic shapes
            else:
                decay = torch.mul(Wu, lr_wd, out=scratch).mul_(keep)
        else:
            decay = Wu * lr_wd
    delta = U.mul_(lr_s)
    if decay is not None:
        delta = delta.add_(decay)
    return W.sub_(delta.to(W.dtype))


def _all_reduce_row_sums(batches: list[_Batch], stats: list) -> None:
    """Sum the per-matrix norms of row-sharded batches over their ranks, in place.

    One all-reduce per mesh for every row-sharded matrix of the group ([2, n] sums).
    """
    by_mesh: dict[tuple, list[int]] = defaultdict(list)
    for j, b in enumerate(batches):
        if b.row_group is not None:
            by_mesh[b.mesh_key].append(j)
    for js in by_mesh.values():
        packed = torch.cat([stats[j][1] for j in js], dim=1)
        all_reduce_sum(packed, (batches[js[0]].row_group,))
        for j, part in zip(js, packed.split([stats[j][1].shape[1] for j in js], dim=1)):
            stats[j] = (stats[j][0], part)


def _orthogonalize_row_sharded(
    shards: list[Tensor], shape: tuple[int, int], pg: dist.ProcessGroup, ortho_kw: dict
) -> Tensor:
    """Orthogonalise n same-shape row-sharded matrices; returns this rank's rows of each
    result, stacked: [n, my_rows, in].

    Matrix j is owned by rank j % W (same shape, same cost: round-robin is balanced). Each rank
    sends the (zero-padded) rows it holds of every matrix to that matrix's owner, the owner
    orthogonalises its matrices as one batch, and the row blocks travel back the same way.
    Communication is in the orthogonalisation dtype (bf16 halves the bytes); casting before or
    after the all-to-all gives the same numbers.
    """
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    out_rows, in_cols = shape
    chunk, _, my_rows = rows_of_rank(out_rows, world, rank)
    n = len(shards)
    slots = -(-n // world)
    dtype = ortho_kw["dtype"]
    device = shards[0].device
    for u in shards:
        assert u.shape == (my_rows, in_cols), (u.shape, my_rows, in_cols)
    send = torch.zeros(world, slots, chunk, in_cols, dtype=dtype, device=device)
    # send[j % world, j // world] = shard j: matrices in slot-major order are matrix order, so
    # one stack (padded to slots·world) and one casting copy fill it.
    pad = [shards[0].new_zeros(my_rows, in_cols)] * (slots * world - n)
    send.permute(1, 0, 2, 3)[:, :, :my_rows].copy_(
        torch.stack(shards + pad).view(slots, world, my_rows, in_cols)
    )
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    # recv[src, slot] = rows of source rank src of my slot-th matrix -> whole matrices.
    full = recv.permute(1, 0, 2, 3).reshape(slots, world * chunk, in_cols)[:, :out_rows]
    n_mine = len(range(rank, n, world))
    result = torch.zeros(slots, world * chunk, in_cols, dtype=dtype, device=device)
    if n_mine:
        result[:n_mine, :out_rows] = orthogonalize(full[:n_mine], **ortho_kw)
    send_back = result.reshape(slots, world, chunk, in_cols).permute(1, 0, 2, 3).contiguous()
    recv_back = torch.empty_like(send_back)
    dist.all_to_all_single(recv_back, send_back, group=pg)
    # recv_back[owner, slot] = my rows of matrix (owner, slot); matrix j = (j % W, j // W), so
    # slot-major order is matrix order.
    out = torch.empty(slots, world, my_rows, in_cols, dtype=shards[0].dtype, device=device)
    out.copy_(recv_back.permute(1, 0, 2, 3)[:, :, :my_rows])
    return out.view(slots * world, my_rows, in_cols)[:n]
