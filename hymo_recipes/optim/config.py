"""HyMo's fields for TorchTitan's ``[optimizer]`` and ``[lr_scheduler]`` sections.

TorchTitan hands the optimizer builder only ``job_config.optimizer`` and the scheduler builder
only ``job_config.lr_scheduler``, so HyMo's knobs must live in those two sections. The custom
config module (``hymo_recipes/job_config.py``) declares ``optimizer: Optimizer`` and
``lr_scheduler: LRScheduler`` with the dataclasses below; TorchTitan's ConfigManager merges them
field by field into its own (a field declared here overrides the built-in's default).

Built-in ``[optimizer]`` fields keep their meaning for the AdamW side: ``lr``, ``beta1``,
``beta2``, ``eps``, ``weight_decay`` configure CautiousAdamW (or AdamW for name = "AdamW");
``implementation`` applies to torch's AdamW only. The NaN guard's knobs live here too: the
optimizer builder sees only this section, and skipping is a decision of the optimizer step.
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Optimizer:
    name: Literal["NorMuon", "CautiousAdamW", "AdamW"] = "NorMuon"
    """"NorMuon": the partition table (NorMuon for matrices, CautiousAdamW for the rest).
    Baselines: "CautiousAdamW" puts every group of the table on CautiousAdamW (weight decay per
    table, lr = optimizer.lr); "AdamW" is TorchTitan's own optimizer, torch.optim.AdamW over all
    parameters in one group with weight_decay everywhere (``implementation`` applies). All three
    run in HyMo's container: same WSD schedule, NaN guard and MoE balancing."""

    lr: float = 3e-4
    """CautiousAdamW's (or AdamW's) learning rate."""

    normuon_lr: float = 0.02
    normuon_momentum: float = 0.95
    normuon_beta2: float = 0.95
    normuon_eps: float = 1e-8
    normuon_weight_decay: float = 0.1
    normuon_cautious_wd: bool = True
    normuon_neuron_norm: bool = True
    """False gives plain Muon (with cautious weight decay if normuon_cautious_wd)."""
    normuon_nesterov: bool = True
    normuon_ns_steps: int = 5
    normuon_orthogonalizer: Literal["polar_express", "quintic"] = "polar_express"
    normuon_update_scale: Literal["jordan", "rms", "spectral"] = "jordan"
    normuon_ortho_dtype: Literal["bfloat16", "float32", "float64"] = "bfloat16"
    normuon_compiled: bool = False
    """Run NorMuon's per-shape elementwise maths under torch.compile (a one-off compile at the
    first step). Alone, 750m on an H200: 15.9 vs 19.6 ms per step eager; in 750m training on
    one H200 it gained nothing (22.2 vs 20.6 ms; benchmarks/LOG.md)."""

    adamw_cautious_update: bool = True
    adamw_cautious_wd: bool = True
    adamw_compiled: bool = False
    """Run CautiousAdamW's multi-tensor step under torch.compile: in 750m training on H200s
    33.6 vs ~72 ms per step on 1 GPU, 52.5 vs ~68 ms on 2, for 50-90 s more compile before
    step 1 (benchmarks/LOG.md). Off by default: at the configs' accumulated batch the optimizer
    step is under 2 % of a training step."""

    embed_weight_decay: float = 0.0
    """Weight decay of the (tied) token embedding, separate from optimizer.weight_decay."""
    moe_on_normuon: bool = False
    """Move the MoE router, routed experts (per expert) and shared experts to NorMuon."""

    consecutive_nan_limit: int = 5
    """A step whose loss or gradient is NaN/Inf on any rank is skipped (nothing is updated);
    after this many skipped steps in a row training stops with an error. 0 never stops."""
    inject_nan_steps: list[int] = field(default_factory=list)
    """Test hook: 1-based train steps whose loss is made NaN (TOML ``[3, 5]``, command line
    ``--optimizer.inject_nan_steps 3 5``)."""

@dataclass
class LRScheduler:
    warmup_fraction: float = 0.02
    stable_fraction: float = 0.83
    decay_fraction: float = 0.15
    """Fractions of lr_scheduler.total_steps (default training.steps); must sum to 1."""

    min_lr_factor: float = 0.05
    """Final lr as a fraction of the peak (the seed's min_lr_ratio)."""

    warmup_steps: int | None = None
    """Unused by HyMo (set warmup_fraction); must stay unset so the two cannot disagree."""
