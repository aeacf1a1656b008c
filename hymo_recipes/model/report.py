"""Prints every flavor's parameter counts and FLOPs per token, and times the debugmodel on CPU.

    python -m hymo_recipes.model.report [--seq-len 4096] [--batch 4 --time-seq-len 256 --steps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from .args import HymoModelArgs, hymo_flavors
from .counts import count_params, training_flops_per_token
from .model import HymoModel


def describe(name: str, args: HymoModelArgs, seq_len: int) -> str:
    # counts need no recurrence backend (it holds no parameters); "naive" always imports
    args = dataclasses.replace(args, gdn_backend="naive")
    with torch.device("meta"):
        model = HymoModel(args)
    c = count_params(model, args)
    flops = training_flops_per_token(args, c, seq_len)
    return (
        f"{name:>10}: stored {c.stored / 1e6:8.2f} M  active/token {c.active / 1e6:7.2f} M  "
        f"(embedding {c.embedding / 1e6:.2f} M, routed experts {c.routed_experts / 1e6:.2f} M, "
        f"MTP {c.mtp / 1e6:.2f} M)  training FLOPs/token @ seq {seq_len}: {flops / 1e9:.3f} G"
    )


def time_debugmodel(batch: int, seq_len: int, steps: int) -> list[float]:
    """Seconds per forward + backward of the debugmodel (fp32, default threads), after one warm-up."""
    torch.manual_seed(0)
    args = hymo_flavors["debugmodel"]
    model = HymoModel(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        logits, mtp_logits = model(tokens)
        loss = logits.logsumexp(-1).mean() + sum(m.logsumexp(-1).mean() for m in mtp_logits)
        loss.backward()
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length for the attention FLOPs")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--time-seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    for name, args in hymo_flavors.items():
        print(describe(name, args, a.seq_len))
    times = time_debugmodel(a.batch, a.time_seq_len, a.steps)
    print(
        f"debugmodel fwd+bwd, B={a.batch} T={a.time_seq_len}, {torch.get_num_threads()} threads: "
        f"median {statistics.median(times) * 1e3:.0f} ms, min {min(times) * 1e3:.0f} ms over {len(times)} steps"
    )


if __name__ == "__main__":
    main()
