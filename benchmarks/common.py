"""Helpers the micro-benchmarks share: the timer and its arguments, the device choice, the
relative error and the fixed draw of packed documents. Imports no kernel module, so a benchmark
that needs none (attn_bench) does not build the Triton kernels by importing it."""

from __future__ import annotations

import argparse
import time

import torch


def document_lengths(T: int, lo: int = 500, hi: int = 6000, seed: int = 0) -> list[int]:
    """Document lengths of lo-hi tokens filling T (the last one cut), a fixed draw."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < T:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - T
    return lengths


def rel_err(a, b) -> float:
    """Relative L2 error of a against b (in float64); inf if a is not finite, NaN if a is None."""
    if a is None:
        return float("nan")
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def timing_args(ap: argparse.ArgumentParser) -> None:
    """The GPU timer's warm-up and repetition (ms)."""
    ap.add_argument("--warmup-ms", type=int, default=25)
    ap.add_argument("--rep-ms", type=int, default=100)


def bench_device(ap: argparse.ArgumentParser, dry: bool) -> str:
    """"cuda", or "cpu" for the dry mode; without a GPU and without --dry, one line and exit."""
    device = "cuda" if torch.cuda.is_available() and not dry else "cpu"
    if device == "cpu" and not dry:
        ap.error("no GPU here: pass --dry for the CPU code paths")
    return device


def timer(device: str, warmup_ms: int, rep_ms: int):
    """f -> ms: the median of triton.testing.do_bench on the GPU; on the CPU one call's host
    time (the dry modes: the code path runs, the time says nothing)."""
    if device == "cuda":
        import triton

        return lambda f: triton.testing.do_bench(f, warmup=warmup_ms, rep=rep_ms, return_mode="median")

    def host(f):
        t0 = time.perf_counter()
        f()
        return 1e3 * (time.perf_counter() - t0)

    return host
