"""HyMo's extra job-config knobs: one small ``[hymo]`` section.

TOML configs turn it on with ``[job] custom_config_module = "hymo_recipes.job_config"``;
TorchTitan's ConfigManager then merges this module's ``JobConfig`` into its own, field by
field, so the section parses, validates (unknown keys raise) and overrides from the CLI
(``--hymo.gdn_backend triton``) like the built-in ones.

Only knobs that really vary per run belong here; model shape lives in the flavors
(``hymo_recipes.model``). Extra fields for a *built-in* section are declared the same way:
``optimizer`` and ``lr_scheduler`` below add HyMo's fields (hymo_recipes/optim/config.py:
NorMuon/CautiousAdamW, the NaN guard, the WSD fractions) to TorchTitan's ``[optimizer]`` and
``[lr_scheduler]``, because the optimizer and lr-scheduler builders see only their section.
"""

from dataclasses import dataclass, field
from typing import Literal

from hymo_recipes.optim.config import LRScheduler, Optimizer


@dataclass
class Hymo:
    gdn_backend: Literal["flavor", "naive", "torch_chunk", "triton"] = "flavor"
    """Gated DeltaNet recurrence backend. "flavor" keeps the flavor's choice; "triton" is the
    GPU kernel, "torch_chunk" the chunked PyTorch reference (CPU), "naive" the per-token
    reference. Applied by ``HymoModelArgs.update_from_config``; ``parallelize_hymo`` refuses a
    model built with another backend, and a backend that cannot run raises: nothing falls back
    silently."""
    gdn_dot_precision: Literal["table", "tf32", "bf16", "bf16_t"] = "table"
    """Operands of the Triton GDN kernel's dots for bf16 inputs. "table" keeps the flavor's
    setting, which leaves the choice to the kernel's launch table ("bf16_t" at HyMo's head dims).
    "bf16" rounds the operands to bf16 (fp32 accumulation) except in the dots with the WY
    inverse T = (I + A)⁻¹ and inside the inverse: ~16 % less kernel time than "tf32" on an
    H200, ~1.5x the bf16 error (kernels/gdn/README.md). "bf16_t" rounds T's dots too (fla's
    choice): another 4-6 % less kernel time, and 200-step runs end level with "bf16" (six
    seeds, benchmarks/LOG.md). "tf32" forces tf32 operands. Values other than "table" need gdn_backend
    "triton"."""
    gdn_bwd_path: Literal["table", "local", "local_sub", "split"] = "table"
    """The Triton GDN kernel's backward. "table" keeps the flavor's setting, which leaves the choice
    to the kernel's launch table ("local_sub" at HyMo's head dims). "local_sub" saves every 16-token
    sub-chunk's start state for the backward (bf16 with bf16 dots: 128 B per token and head at
    K = V = 32, 84 MB per GDN layer for a 4 x 4096-token microbatch of 40 heads, where "local"
    saves 5.2 MB); "local" saves one state per 256-token chunk and re-runs each chunk's forward
    in the backward, 5 % slower at HyMo's shape on an H200 (12 % at K = V = 128; both measured
    with 128-token chunks); "split" saves
    what "local_sub" does and is slower. Values other than "table" need gdn_backend "triton"."""
    nonfinite_probe: bool = False
    """Debugging: log, for each forward, the first module whose output is NaN/Inf while its
    inputs are finite (hymo_recipes/nonfinite_probe.py); with compile, which compiled block, and
    whether an eager replay of that block goes non-finite too. Syncs the device per module."""


@dataclass
class JobConfig:
    hymo: Hymo = field(default_factory=Hymo)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
