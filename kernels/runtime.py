"""Whether HyMo's Triton kernels can run on tensors of a device type, said in one line."""

from __future__ import annotations


def unavailable_reason(device_type: str, triton_error: Exception | None, interpret: bool) -> str | None:
    """Why a Triton kernel cannot run here (None: it can): Triton failed to import
    (``triton_error``), or the tensors are not CUDA ones and the kernels were not built for
    Triton's CPU interpreter (``interpret``: ``TRITON_INTERPRET=1`` when they were imported)."""
    if triton_error is not None:
        return f"needs Triton, which failed to import ({triton_error!r})"
    if device_type != "cuda" and not interpret:
        return (f"needs CUDA tensors (got {device_type}), or TRITON_INTERPRET=1 set before importing "
                "hymo_kernels to run it in Triton's (slow) CPU interpreter")
    return None
