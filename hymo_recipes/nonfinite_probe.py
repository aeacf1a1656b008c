"""Finds where a non-finite activation first appears (``[hymo] nonfinite_probe = true``).

The NaN guard (hymo_recipes/optim/nan_guard.py) says *that* a step went non-finite and which
parameters' gradients did; it cannot say which operation made the loss NaN. The probe keeps,
for every forward, references to the inputs and outputs of the model's units: its direct
children and the blocks inside its ModuleDict/ModuleList children (each decoder layer, each
MTP head). The tensors exist anyway for the backward, so this costs no memory and no device
sync. After the forward it checks the model's outputs once (one sync per step). Only if they
are non-finite does it look closer: the first unit whose output is non-finite while its
inputs are finite is where the NaN/Inf was born. That unit is then run again, eagerly
(``_orig_mod`` for a torch.compile'd block), on the same inputs, under no_grad and the same
autocast, with a hook on every submodule, and the probe reports the deepest submodule that
turns finite inputs into non-finite outputs. If the replay stays finite, the NaN came from
the compiled code or from something that does not repeat (a race, uninitialised memory).
The replay restores the unit's buffers (MoE load counters) afterwards.

A line is logged for each non-finite forward; every ``log_every`` forwards (0: never) an
all-finite line with the largest |output| of a unit, to watch activations grow.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

logger = logging.getLogger(__name__)



def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def _max_abs(ts: list[torch.Tensor]) -> float:
    """Largest |x| over the finite entries (0.0 when there are none)."""
    m = 0.0
    for t in ts:
        t = t.detach()
        if t.numel():
            m = max(m, float(torch.where(torch.isfinite(t), t.abs(), 0).max()))
    return m


def _all_finite(ts: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t.detach()).all()) for t in ts)


def _where_nonfinite(ts: list[torch.Tensor]) -> str:
    for t in ts:
        bad = ~torch.isfinite(t.detach())
        if bad.any():
            first = tuple(int(i) for i in bad.nonzero()[0])
            return f"{int(bad.sum())} of {t.numel()} entries of a {tuple(t.shape)} tensor, first at {first}"
    return "none"


class _FirstCulprit:
    """Hooks every submodule of ``root`` (eager replay); records the first birthplace."""

    def __init__(self, root: nn.Module, prefix: str):
        self.culprit: str | None = None
        self.detail = ""
        self.handles = [m.register_forward_hook(self._hook(n), with_kwargs=True)
                        for n, m in root.named_modules(prefix=prefix) if m is not root]

    def _hook(self, name: str):
        def hook(module: nn.Module, args, kwargs, output) -> None:
            # a module whose output holds rows it never writes says which ones it did
            outs = module.defined_outputs(output) if hasattr(module, "defined_outputs") else _tensors(output)
            if self.culprit is None and outs and not _all_finite(outs):
                ins = _tensors(args) + _tensors(kwargs)
                if _all_finite(ins):
                    self.culprit = f"{name} ({type(module).__name__})"
                    self.detail = (f"max |input| {_max_abs(ins):.3g}, max |finite output| "
                                   f"{_max_abs(outs):.3g}, non-finite: {_where_nonfinite(outs)}")

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _replay(name: str, module: nn.Module, args, kwargs, outs_seen) -> str:
    eager = getattr(module, "_orig_mod", module)
    kind = "compiled" if eager is not module else "eager"
    saved = {n: b.clone() for n, b in eager.named_buffers()}
    inner = _FirstCulprit(eager, prefix=name)
    # FSDP2 resharded the unit after its forward; the replay needs its whole parameters.
    fsdp = isinstance(module, FSDPModule)
    try:
        if fsdp:
            module.unshard()
        with torch.no_grad():
            outs = _tensors(eager(*args, **kwargs))
    finally:
        if fsdp:
            module.reshard()
        inner.remove()
        with torch.no_grad():
            for n, b in eager.named_buffers():
                b.copy_(saved[n])
    if inner.culprit is not None:
        return f"an eager replay is non-finite too, first in {inner.culprit} ({inner.detail})"
    if not _all_finite(outs):
        return "an eager replay is non-finite too, in an op of the unit's own forward"
    c, e = outs_seen[0].detach().float(), outs[0].float()
    ok = torch.isfinite(c)
    rel = float((c[ok] - e[ok]).norm() / e[ok].norm().clamp_min(1e-30))
    cause = ("the compiled code, or something that does not repeat (a race, uninitialised memory)"
             if kind == "compiled" else "something that does not repeat (a race, uninitialised memory)")
    return (f"an eager replay on the same inputs is finite (max |output| {_max_abs(outs):.3g}; "
            f"rel. diff to the {kind} run on its finite entries {rel:.2e}): {cause}")


def _units(model: nn.Module):
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            yield from ((f"{name}.{n}", m) for n, m in child.named_children())
        else:
            yield name, child


class NonfiniteProbe:
    """Forward hooks on ``model``'s units; see the module docstring."""

    def __init__(self, model: nn.Module, log_every: int = 0):
        self.log_every = log_every
        self.forwards = 0
        self.records: list = []
        self.handles = [m.register_forward_hook(self._keep(n), with_kwargs=True)
                        for n, m in _units(model)]
        self.handles += [model.register_forward_pre_hook(lambda *_: self.records.clear()),
                         model.register_forward_hook(self._check)]

    def _keep(self, name: str):
        def hook(module, args, kwargs, output) -> None:
            self.records.append((name, module, args, kwargs, output))

        return hook

    def _check(self, model, args, output) -> None:
        self.forwards += 1
        try:
            if _all_finite(_tensors(output)):
                if self.log_every and self.forwards % self.log_every == 0:
                    peak, where = max(((_max_abs(_tensors(r[4])), r[0]) for r in self.records),
                                      default=(0.0, ""))
                    logger.info(f"nonfinite_probe: forward {self.forwards}: all finite; largest "
                                f"|unit output| {peak:.3g} in {where}")
                return
            logger.warning(f"nonfinite_probe: forward {self.forwards}: {self._diagnose()}")
        finally:
            self.records.clear()

    def _diagnose(self) -> str:
        for name, module, args, kwargs, output in self.records:
            outs = _tensors(output)
            if _all_finite(outs):
                continue
            ins = _tensors(args) + _tensors(kwargs)
            if not _all_finite(ins):
                return f"{name} got non-finite inputs from outside the watched units"
            head = (f"non-finite output first appears in {name} ({type(module).__name__}) with finite "
                    f"inputs (max |input| {_max_abs(ins):.3g}, max |finite output| {_max_abs(outs):.3g}, "
                    f"non-finite: {_where_nonfinite(outs)})")
            return f"{head}; {_replay(name, module, args, kwargs, outs)}"
        return "the model's output is non-finite but no watched unit's was"

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
