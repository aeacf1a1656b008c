"""Shims that let TorchTitan 0.2.2's Trainer run on a machine without an accelerator.

TorchTitan assumes a GPU in a few places; each shim below fixes one, from outside
site-packages, and only when no accelerator is present (on a GPU machine nothing here runs):

1. ``torchtitan.tools.utils`` picks its device type once, at import, and falls back to
   "cuda" when ``torch._utils._get_available_device_type()`` finds nothing. ``use_cpu_device()``
   makes that function answer "cpu" instead of None; it must run before torchtitan is first
   imported, so ``hymo_recipes/titan/__init__.py`` calls it first thing.
2. The device-memory monitor calls ``get_device_name``, ``get_device_properties``,
   ``memory_stats``, ``reset_peak_memory_stats`` and ``empty_cache`` on the device module,
   which ``torch.cpu`` lacks: ``install()`` adds them, reporting the process's resident memory.
3. ``set_pg_timeouts`` (after step 1) calls ``barrier(device_ids=["cpu"])``, which gloo
   rejects: ``install()`` swaps in a copy that calls ``barrier()`` without device ids (and
   without torch's warning for the mesh groups it cannot set a timeout on: those keep gloo's
   default timeout).
4. ``--profiling.enable_profiling`` passes ``[ProfilerActivity.CPU, None]`` to
   ``torch.profiler.profile`` when there is no GPU, which raises a TypeError: ``install()``
   wraps the Trainer's ``maybe_enable_profiling`` so that the None is dropped.

A fifth CPU difference, gloo's lack of PREMUL_SUM for FSDP2's gradient reduction, is handled
in ``parallelize.py`` on every backend (force plain SUM: same numbers).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from types import SimpleNamespace

import torch


def no_accelerator() -> bool:
    return not torch.accelerator.is_available()


def use_cpu_device() -> None:
    """Makes TorchTitan pick "cpu" as its device type (shim 1). Idempotent.

    Too late once torchtitan is imported; then this does nothing here (importing HyMo for its
    models or configs still works) and ``install()`` refuses to train.
    """
    if not no_accelerator() or "torchtitan.tools.utils" in sys.modules:
        return
    import torch._utils

    if getattr(torch._utils._get_available_device_type, "_hymo_cpu_shim", False):
        return
    original = torch._utils._get_available_device_type

    def _get_available_device_type():
        return original() or "cpu"

    _get_available_device_type._hymo_cpu_shim = True
    torch._utils._get_available_device_type = _get_available_device_type


# --- shim 2: a memory monitor for torch.cpu ------------------------------------------------

def _proc_status_bytes(key: str) -> int:
    """VmRSS / VmHWM (peak RSS) of this process from /proc, in bytes; -1 where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def _cpu_memory_stats(device=None) -> dict[str, int]:
    # TorchTitan reads the "peak" keys; on CPU both report the peak resident set size.
    peak = _proc_status_bytes("VmHWM")
    return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0, "num_ooms": 0}


def _cpu_reset_peak_memory_stats(device=None) -> None:
    # Writing "5" to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _cpu_get_device_properties(device=None):
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return SimpleNamespace(name="cpu", total_memory=total)


_CPU_DEVICE_MODULE_FUNCTIONS = {
    "get_device_name": lambda device=None: "cpu",
    "get_device_properties": _cpu_get_device_properties,
    "memory_stats": _cpu_memory_stats,
    "reset_peak_memory_stats": _cpu_reset_peak_memory_stats,
    "empty_cache": lambda: None,
}


# --- shim 3: set_pg_timeouts without device ids ---------------------------------------------

def _set_pg_timeouts_cpu(timeout, parallel_dims):
    """TorchTitan's set_pg_timeouts minus the device ids that gloo's barrier rejects."""
    torch.distributed.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Set timeout is now only supported")
        for group in groups + [None]:  # None: the default (world) group
            torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)


# --- shim 4: the profiler with the CPU activity only ---------------------------------------

def _cpu_profiling(original):
    """TorchTitan's maybe_enable_profiling, with None dropped from the profiler's activities."""
    if getattr(original, "_hymo_cpu_shim", False):
        return original

    @contextlib.contextmanager
    def maybe_enable_profiling(*args, **kwargs):
        real = torch.profiler.profile

        def profile(*a, activities=None, **kw):
            return real(*a, activities=[x for x in activities or () if x is not None] or None, **kw)

        torch.profiler.profile = profile
        try:
            with original(*args, **kwargs) as prof:
                torch.profiler.profile = real
                yield prof
        finally:
            torch.profiler.profile = real

    maybe_enable_profiling._hymo_cpu_shim = True
    return maybe_enable_profiling


def install() -> None:
    """Applies shims 2, 3 and 4 (and checks 1). A no-op where an accelerator is present."""
    if not no_accelerator():
        return
    from hymo_recipes.titan import api

    if api.titan_device_type != "cpu":
        raise RuntimeError(
            "torchtitan was imported before hymo_recipes.titan on a machine without an accelerator, so "
            f"it chose device type {api.titan_device_type!r}. Launch through HyMo's entry "
            "point (`python -m hymo_recipes.train`, as run_train.sh does), or import hymo_recipes.titan "
            "before torchtitan."
        )
    for name, fn in _CPU_DEVICE_MODULE_FUNCTIONS.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    api.dist_utils.set_pg_timeouts = _set_pg_timeouts_cpu
    trainer_module = sys.modules[api.Trainer.__module__]
    trainer_module.maybe_enable_profiling = _cpu_profiling(trainer_module.maybe_enable_profiling)
