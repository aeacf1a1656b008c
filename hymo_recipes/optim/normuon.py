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
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

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
    if method not in _ORTHOGONALIZERS:
        raise ValueError(f"orthogonalizer must be one of {_ORTHOGONALIZERS}, got {method!r}")
    shape = x.shape
    X = x.reshape(-1, shape[-2], shape[-1]).to(dtype)
    # Iterate on the wide orientation: the Gram matrix X Xᵀ is then min(m, n) square.
    transposed = shape[-2] > shape[-1]
    if transposed:
        X = X.mT
    norm = X.norm(dim=(-2, -1), keepdim=True)
    if method == "quintic":
        X = X / (norm + 1e-7)
        coeffs = [QUINTIC_COEFFS] * steps
    else:
        # 1.02: Polar Express's safety margin, keeps the top singular value inside the
        # interval the polynomials were optimised for despite bf16 rounding.
        X = X / (norm * 1.02 + 1e-6)
        coeffs = list(POLAR_EXPRESS_COEFFS[:steps])
        coeffs += [POLAR_EXPRESS_COEFFS[-1]] * (steps - len(coeffs))
    for a, b, c in coeffs:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    if transposed:
        X = X.mT
    return X.reshape(shape)


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


class NorMuon(Optimizer):
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
    ) -> None:
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
        super().__init__(params, defaults)

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
            # Pre-created so that DCP sees identical keys on every rank and torch's
            # "zero-grad step at lr 0" on load (state_dict._init_optim_state) never runs.
            state = self.state[p]
            if not state:
                dtype = _state_dtype(p)
                state["momentum_buffer"] = torch.zeros_like(p, dtype=dtype)
                state["neuron_v"] = state_like_rows(p, dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["params"]:
                self._step_group(group)
        return loss

    # --------------------------------------------------------------------------------------
    def _step_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["momentum"], group["beta2"]
        lr = _as_scalar(group["lr"])
        wd = _as_scalar(group["weight_decay"])
        # A tensor wd is applied unconditionally (multiplying by 0 is harmless; asking it
        # whether it is 0 would cost a device sync).
        apply_wd = isinstance(wd, Tensor) or wd != 0.0
        ortho_kw = dict(
            steps=group["ns_steps"],
            method=group["orthogonalizer"],
            dtype=_ORTHO_DTYPES[group["ortho_dtype"]],
        )
        params = group["params"]
        specs = [shard_spec(p) for p in params]
        # Row-sharded 2-D matrices need the gather; 3-D expert stacks sharded on the expert
        # dim hold whole matrices locally.
        row_sharded = [p.ndim == 2 and s.row_group is not None for p, s in zip(params, specs)]

        # 1. Momentum and Nesterov input, on local shards (fp32).
        updates: list[Tensor] = []
        for p in params:
            m = local(self.state[p]["momentum_buffer"])
            g = local(p.grad)
            if g is None:
                # Zero, not skip: a skip on one rank would leave the others in a collective.
                g = torch.zeros_like(m)
            g = g.to(m.dtype)
            m.lerp_(g, 1.0 - beta1)
            # Out of place: never write into p.grad (it may alias a reduce-scatter buffer).
            updates.append(g.lerp(m, beta1) if group["nesterov"] else m)

        # 2. Orthogonalise whole matrices (batched by shape; gathered to owners if row-sharded).
        normed = self._orthogonalize_all(params, specs, row_sharded, updates, ortho_kw)

        # 3. Neuron normalisation on local rows (rows are output neurons), then rescale to
        # the orthogonalised update's Frobenius norm, per matrix.
        if group["neuron_norm"]:
            sq_o, sq_n = [], []
            for i, (p, O) in enumerate(zip(params, normed)):
                v = local(self.state[p]["neuron_v"])
                v.lerp_(O.square().mean(dim=-1), 1.0 - beta2)
                N = O / (v.sqrt() + group["eps"]).unsqueeze(-1)
                sq_o.append(O.square().sum(dim=(-2, -1)).reshape(-1))
                sq_n.append(N.square().sum(dim=(-2, -1)).reshape(-1))
                normed[i] = N
            ratios = _rescale_ratios(specs, row_sharded, sq_o, sq_n)
            for i, N in enumerate(normed):
                normed[i] = N * ratios[i].reshape(*N.shape[:-2], 1, 1)

        # 4. Cautious decoupled weight decay and the scaled update, on local shards.
        for p, N in zip(params, normed):
            w = local(p)
            s = update_scale_factor(group["update_scale"], p.shape[-2], p.shape[-1])
            delta = N * (lr * s)
            if apply_wd:
                decay = w.to(N.dtype) * (lr * wd)
                if group["cautious_wd"]:
                    decay = decay * (N * w >= 0)
                delta = delta + decay
            w.sub_(delta.to(w.dtype))

    def _orthogonalize_all(self, params, specs, row_sharded, updates, ortho_kw) -> list[Tensor]:
        out: list[Tensor | None] = [None] * len(params)
        local_batches: dict[tuple, list[int]] = defaultdict(list)
        dist_batches: dict[tuple, list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            if row_sharded[i]:
                dist_batches[(tuple(p.shape), specs[i].mesh_key)].append(i)
            else:
                local_batches[tuple(p.shape[-2:])].append(i)
        for (m, k), idxs in local_batches.items():
            # All local [m, k] matrices (2-D params and every expert of 3-D stacks) in one batch.
            mats = [updates[i].reshape(-1, m, k) for i in idxs]
            O = orthogonalize(torch.cat(mats), **ortho_kw).to(mats[0].dtype)
            for i, piece in zip(idxs, O.split([x.shape[0] for x in mats])):
                out[i] = piece.reshape(updates[i].shape)
        for (shape, _), idxs in dist_batches.items():
            pieces = _orthogonalize_row_sharded(
                [updates[i] for i in idxs], shape, specs[idxs[0]].row_group, ortho_kw
            )
            for i, piece in zip(idxs, pieces):
                out[i] = piece
        return out


def _rescale_ratios(specs, row_sharded, sq_o: list[Tensor], sq_n: list[Tensor]) -> list[Tensor]:
    """‖O‖_F / ‖Ô‖_F per matrix; row-sharded matrices sum their squares over ranks."""
    by_mesh: dict[tuple, list[int]] = defaultdict(list)
    for i, spec in enumerate(specs):
        if row_sharded[i]:
            by_mesh[spec.mesh_key].append(i)
    for idxs in by_mesh.values():
        # One all-reduce per mesh for every row-sharded matrix of the group: [2, n] sums.
        packed = torch.stack(
            [torch.cat([sq_o[i] for i in idxs]), torch.cat([sq_n[i] for i in idxs])]
        )
        all_reduce_sum(packed, (specs[idxs[0]].row_group,))
        for j, i in enumerate(idxs):
            sq_o[i], sq_n[i] = packed[0, j : j + 1], packed[1, j : j + 1]
    # clamp: an all-zero update (zero grad and momentum) stays exactly zero.
    return [(o / n.clamp_min(1e-30)).sqrt() for o, n in zip(sq_o, sq_n)]


def _orthogonalize_row_sharded(
    shards: list[Tensor], shape: tuple[int, int], pg: dist.ProcessGroup, ortho_kw: dict
) -> list[Tensor]:
    """Orthogonalise n same-shape row-sharded matrices; returns this rank's rows of each result.

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
    send = torch.zeros(world, slots, chunk, in_cols, dtype=dtype, device=device)
    for j, u in enumerate(shards):
        assert u.shape == (my_rows, in_cols), (u.shape, my_rows, in_cols)
        send[j % world, j // world, :my_rows] = u.to(dtype)
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
    # recv_back[owner, slot] = my rows of matrix (owner, slot).
    return [recv_back[j % world, j // world, :my_rows].to(shards[j].dtype) for j in range(n)]
