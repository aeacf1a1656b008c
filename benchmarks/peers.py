"""TorchTitan's own models at HyMo's shapes, and an optimizer-step timer, for benchmarks/train_bench.py.

Imported through ``--experimental.custom_import benchmarks.peers`` by every run of the
benchmark (HyMo's too: it imports ``hymo_recipes.titan`` first, which registers HyMo's TrainSpec and,
on a machine without a GPU, its CPU shims). It adds flavors to TorchTitan's ``deepseek_v3``
and ``llama3`` model tables:

- ``deepseek_v3`` ``hymo_mla8`` / ``hymo_mla32``: HyMo 750m's MLA + MoE block (dim 896, 16 heads,
  q_lora_rank 224, kv_lora_rank 128, nope 96 / rope 32 / v 128, 16 routed + 1 shared SwiGLU
  experts of 2304, top-2, softmax scores) stacked 8 deep (HyMo's attention blocks alone) and
  32 deep (the all-attention model of HyMo's depth); every layer is MoE. TorchTitan's MLA has
  one KV group (HyMo's has 4), its MoE is dropless (HyMo's drops over capacity 1.5).
- ``llama3`` ``450m``: a dense Llama 3 of about 0.45 B parameters (dim 1280, 18 layers, 10 heads
  of 128, 5 KV heads).
- ``*_tiny`` versions of each for the CPU dry run.

Every flavor's vocabulary is 8,192 (the embedded Brown tokenizer's). The peers' TrainSpecs are
TorchTitan's with HyMo's dataloader, and every run trains through HyMo's train step
(hymo_recipes/titan/trainer.py): the runs differ only in the model and its optimizer. The timer wraps the
Trainer's optimizer step in CUDA events (host clock on CPU) and logs one line per step,
``bench: optimizer_step_ms=<ms>``, read back by train_bench; the elapsed time of step n is
read at step n + 1, so it adds no device synchronisation.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import time

import torch

import hymo_recipes.titan  # noqa: F401  (HyMo's TrainSpec and, without a GPU, the CPU shims first)
from torchtitan.models.deepseek_v3 import deepseekv3_args
from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.moe import MoEArgs
from torchtitan.tools.logging import logger
from torchtitan.protocols import train_spec as train_spec_module
from torchtitan.train import Trainer

from hymo_recipes.titan.dataloader import build_hymo_dataloader
from hymo_recipes.titan.trainer import HymoTrainer

VOCAB = 8192


def _mla_moe(n_layers: int, *, dim: int = 896, n_heads: int = 16, q_lora: int = 224, kv_lora: int = 128,
             nope: int = 96, rope: int = 32, v: int = 128, experts: int = 16, inter: int = 2304) -> DeepSeekV3ModelArgs:
    return DeepSeekV3ModelArgs(
        vocab_size=VOCAB, dim=dim, inter_dim=inter, moe_inter_dim=inter, n_layers=n_layers, n_dense_layers=0,
        n_heads=n_heads,
        moe_args=MoEArgs(num_experts=experts, num_shared_experts=1, top_k=2, score_func="softmax",
                         route_norm=False, score_before_experts=False),
        q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
    )


PEER_FLAVORS = {
    "deepseek_v3": {
        "hymo_mla8": _mla_moe(8),
        "hymo_mla32": _mla_moe(32),
        "hymo_mla_tiny": _mla_moe(2, dim=64, n_heads=4, q_lora=32, kv_lora=32, nope=16, rope=8, v=16, experts=4,
                                  inter=128),
    },
    "llama3": {
        "450m": TransformerModelArgs(dim=1280, n_layers=18, n_heads=10, n_kv_heads=5, vocab_size=VOCAB,
                                     multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000),
        "450m_tiny": TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                                          multiple_of=64, rope_theta=500000),
    },
}
deepseekv3_args.update(PEER_FLAVORS["deepseek_v3"])
llama3_args.update(PEER_FLAVORS["llama3"])


class _OptimizerTimer:
    """Wraps ``optimizers.step``: times each call, logs the previous call's time."""

    def __init__(self, step_fn):
        self.step_fn = step_fn
        self.pending = None

    def _report(self) -> None:
        if self.pending is None:
            return
        start, end = self.pending
        ms = start.elapsed_time(end) if torch.cuda.is_available() else (end - start) * 1e3
        logger.info(f"bench: optimizer_step_ms={ms:.3f}")
        self.pending = None

    def __call__(self, *args, **kwargs):
        self._report()
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.step_fn(*args, **kwargs)
            end.record()
        else:
            start = time.perf_counter()
            out = self.step_fn(*args, **kwargs)
            end = time.perf_counter()
        self.pending = (start, end)
        return out


def _timed(train_step):
    def timed_train_step(self, *args, **kwargs):
        if not isinstance(self.optimizers.step, _OptimizerTimer):
            self.optimizers.step = _OptimizerTimer(self.optimizers.step)
        return train_step(self, *args, **kwargs)

    return timed_train_step


# every run trains through HymoTrainer (hymo_recipes.titan.train.build_trainer); Trainer too,
# for a Trainer built some other way
for _cls in (Trainer, HymoTrainer):
    _cls.train_step = _timed(_cls.train_step)

# The peers read their data as HyMo does (HyMo's dataloader: tokenized ahead by a background
# thread), so that the runs differ only in the model and its optimizer; like HyMo's configs
# they loop over the embedded corpus, which is smaller than a run of 128-sequence steps reads.
for _name in PEER_FLAVORS:
    train_spec_module._extra_train_specs[_name] = dataclasses.replace(
        importlib.import_module(f"torchtitan.models.{_name}").get_train_spec(),
        build_dataloader_fn=functools.partial(build_hymo_dataloader, allow_repeat=True))

if not torch.cuda.is_available():
    # The CPU dry run only: TorchTitan's MoE counts tokens per expert with torch.histc on int64
    # indices, which has no CPU kernel; count them as floats there (same counts).
    _histc = torch.histc

    def _histc_any_dtype(input, *args, **kwargs):
        if input.device.type == "cpu" and not input.is_floating_point():
            return _histc(input.float(), *args, **kwargs).to(input.dtype)
        return _histc(input, *args, **kwargs)

    torch.histc = _histc_any_dtype
