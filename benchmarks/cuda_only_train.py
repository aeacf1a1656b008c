"""hymo_recipes.train with TorchTitan's profiler recording CUDA activity alone: no host events,
no shapes (``CUDA_ONLY=1 bash benchmarks/step_profile.sh`` runs it as run_train.sh's TRAIN_FILE).

The host-side profiler costs the host tens of microseconds per op, so in a host-bound stretch of
a step (the parameters' gather, a forward right after a host read) a full trace shows far more
GPU idle than an unprofiled step has. A CUDA-only trace keeps the step's own pace: its kernels,
copies and launches, its idle gaps where they really are (``trace_breakdown --idle`` prints the
GPU's busy share window by window), at the cost of not saying which host code was late."""

import runpy

import torch

_profile = torch.profiler.profile


def _cuda_only(*args, activities=None, **kwargs):
    kwargs["record_shapes"] = False
    kept = [a for a in activities or () if a is not None and a != torch.profiler.ProfilerActivity.CPU]
    if not kept:
        raise RuntimeError("CUDA_ONLY=1: no CUDA activity to record (is there a GPU?)")
    return _profile(*args, activities=kept, **kwargs)


if __name__ == "__main__":
    torch.profiler.profile = _cuda_only  # TorchTitan's maybe_enable_profiling looks it up per call
    runpy.run_module("hymo_recipes.train", run_name="__main__", alter_sys=True)
