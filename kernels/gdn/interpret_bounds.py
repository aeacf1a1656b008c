"""Bounds checking for kernels run by Triton's CPU interpreter (TRITON_INTERPRET=1).

    with bounds_checked():
        chunk_gated_delta_rule(q, k, v, g, beta)   # raises OutOfBounds on a stray access

The interpreter reads and writes host memory through raw addresses, so a load or store that
leaves its tensor is not an error there: it returns whatever lies next to it, or silently
overwrites it, and the parity tests only fail if that happens to change a result. Inside this
context every masked-in lane of every ``tl.load`` / ``tl.store`` of an interpreted launch must
address an element of one of that launch's tensor arguments (the extent of the view passed,
not of its whole storage); the first one that does not raises :class:`OutOfBounds`, naming the
kernel, the program id, the access and the nearest tensor argument.

This is the CPU half of locating a GPU fault: an access outside its tensor that does not
depend on warps or layouts shows up here, in every tiling the interpreter tests run; one that
shows up only in compiled code is the compiler's (compute-sanitizer's memcheck is the GPU half).
The CPU tests turn it on for every test (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch


class OutOfBounds(AssertionError):
    """A masked-in lane of an interpreted load or store outside every tensor argument."""


@dataclasses.dataclass(frozen=True)
class Extent:
    name: str
    lo: int  # first byte of the view
    hi: int  # one past its last byte


def tensor_extent(name: str, t: torch.Tensor) -> Extent | None:
    """The bytes a view can address through its sizes and strides (None when it is empty)."""
    if t.numel() == 0:
        return None
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"argument {name!r} has a negative stride {t.stride()}")
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return Extent(name, t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def _describe(addr: int, itemsize: int, extents: list[Extent]) -> str:
    if not extents:
        return "the launch has no tensor arguments"

    def gap(e: Extent) -> int:
        return e.lo - addr if addr < e.lo else max(0, addr + itemsize - e.hi)

    e = min(extents, key=gap)
    where = f"{e.lo - addr} bytes before" if addr < e.lo else f"at byte {addr - e.lo} of"
    return f"it starts {where} {e.name!r}, the nearest argument ({e.hi - e.lo} bytes)"


def check_access(kernel: str, op: str, ptrs: np.ndarray, mask: np.ndarray, itemsize: int,
                 extents: list[Extent], program: tuple) -> None:
    """Raises OutOfBounds unless every masked-in address holds a whole element of one extent."""
    addr = np.broadcast_to(ptrs, np.broadcast_shapes(ptrs.shape, mask.shape))
    live = addr[np.broadcast_to(mask, addr.shape).astype(bool)].astype(np.uint64)
    if live.size == 0:
        return
    inside = np.zeros(live.shape, dtype=bool)
    for e in extents:
        inside |= (live >= e.lo) & (live + itemsize <= e.hi)
    if inside.all():
        return
    bad = live[~inside]
    first = int(bad[0])
    raise OutOfBounds(f"{kernel} (program {program}): {op} of {bad.size} of {live.size} masked-in element(s) "
                      f"outside its tensor arguments; the first, {first:#x}: {_describe(first, itemsize, extents)}")


_INDIRECT: list[list[torch.Tensor]] = []  # tensors reached through loaded addresses (indirect())


@contextlib.contextmanager
def indirect(tensors):
    """Tensors that the launches inside the block reach through addresses they load (a table of
    pointers), not as arguments: inside bounds_checked() their extents count as every such
    launch's own."""
    _INDIRECT.append(list(tensors))
    try:
        yield
    finally:
        _INDIRECT.pop()


@contextlib.contextmanager
def bounds_checked():
    """Checks every interpreted launch inside the block (see the module docstring)."""
    try:
        from triton.runtime import interpreter as interp

        builder = interp.interpreter_builder
        executor = interp.GridExecutor
        unwrap = interp._unwrap_tensor
        init_args, restore_args = executor._init_args_hst, executor._restore_args_dev
        masked_load, masked_store = builder.create_masked_load, builder.create_masked_store
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"this Triton's interpreter lacks what bounds_checked() hooks ({e}); the checker was "
                           "written against Triton 3.6-3.9's triton.runtime.interpreter") from e

    launch: dict = {}  # the running launch: kernel name and its arguments' extents

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        named = list(zip(self.arg_names, args_hst)) + list(kwargs_hst.items())
        extents = [tensor_extent(n, unwrap(a)) for n, a in named if hasattr(a, "data_ptr")]
        extents += [tensor_extent(f"indirect[{i}]", t) for group in _INDIRECT for i, t in enumerate(group)]
        launch.update(kernel=self.fn.__name__, extents=[e for e in extents if e is not None])
        return args_hst, kwargs_hst

    def restore_args_checked(self, *args, **kwargs):
        launch.clear()
        return restore_args(self, *args, **kwargs)

    def check(op, ptrs, mask):
        if launch:
            itemsize = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
            check_access(launch["kernel"], op, ptrs.data, mask.data, itemsize, launch["extents"],
                         builder.grid_idx)

    def load_checked(ptrs, mask, other, cache_policy, is_volatile):
        check("load", ptrs, mask)
        return masked_load(ptrs, mask, other, cache_policy, is_volatile)

    def store_checked(ptrs, value, mask, cache_policy):
        check("store", ptrs, mask)
        return masked_store(ptrs, value, mask, cache_policy)

    executor._init_args_hst, executor._restore_args_dev = init_args_checked, restore_args_checked
    builder.create_masked_load, builder.create_masked_store = load_checked, store_checked
    try:
        yield
    finally:
        executor._init_args_hst, executor._restore_args_dev = init_args, restore_args
        builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
        launch.clear()
