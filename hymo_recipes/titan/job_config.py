"""HyMo's job-config knobs: the ``[hymo]`` section and HyMo's fields of ``[optimizer]`` and
``[lr_scheduler]``.

TOML configs turn them on with ``[job] custom_config_module = "hymo_recipes.titan.job_config"``
(HyMo's entry point, ``python -m hymo_recipes.train``, merges them in any case). TorchTitan's
ConfigManager merges this module's ``JobConfig`` into its own, field by field, so the sections
parse, reject unknown keys and take CLI overrides (``--hymo.gdn_backend triton``) like the
built-in ones; a field declared here for a built-in section overrides its default.

Only knobs that vary per run belong in ``[hymo]``; model shape lives in the flavors
(``hymo_recipes.model``). A ``[hymo]`` knob that names a model field carries that field's name
and values from the TOML to the model args (``HymoModelArgs.update_from_config``) and on to the
kernel, and is validated in one place, ``HymoModelArgs.validate``. HyMo's optimizer and
schedule fields live in TorchTitan's sections because the optimizer and lr-scheduler builders
see only their own section.

This module imports nothing but the standard library: ``./run_train.sh --help`` reads it.
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Hymo:
    vocab_size: int = 0
    """Rows of the token embedding (and of the tied output head). 0: the tokenizer's vocabulary
    (model.hf_assets_path), which the preflight reads before the Trainer starts; a larger value
    pads the embedding."""
    gdn_backend: str = "flavor"
    """Gated DeltaNet recurrence backend: "triton" (the GPU kernel), "torch_chunk" (the chunked
    PyTorch reference, for CPUs), "naive" (the per-token reference), or "flavor" to keep the
    flavor's. ``parallelize`` refuses a model built with another backend, and a backend this
    machine cannot run is an error before the Trainer starts: nothing falls back silently."""
    gdn_dot_precision: str = "flavor"
    """Operands of the Triton GDN kernel's dots for bf16 inputs: "table" (the kernel's launch
    table's choice, "bf16_t" at HyMo's head dims), "tf32", "bf16" (bf16 operands with fp32
    accumulation, except in the dots with the WY inverse T = (I + A)⁻¹ and inside it), "bf16_t"
    (T's dots in bf16 too, fla's choice), or "flavor" to keep the flavor's. Speed and error of
    each: BENCHMARKS.md. Values other than "table" need gdn_backend "triton"."""
    gdn_bwd_path: str = "flavor"
    """The Triton GDN kernel's backward: "table" (the kernel's launch table's choice,
    "local_sub" at HyMo's head dims), "local_sub" (saves every 16-token sub-chunk's start state:
    more memory, no recomputation), "local" (saves one state per chunk and re-runs each chunk's
    forward in the backward: the least memory, a slower backward), or "flavor" to keep the
    flavor's. Memory and time of each: BENCHMARKS.md. Values other than "table" need
    gdn_backend "triton"."""
    gdn_mixer_saves: str = "flavor"
    """What the fused GDN mixer keeps for its backward: "inputs" (the q/k/v/gate projections; the
    conv outputs and the gated norm's output are recomputed in the backward: the least memory),
    "outputs" (those kept too: 10 KiB more per token and GDN layer at the 750m's widths in bf16,
    7.5 GiB more per 8 x 4096-token microbatch; each mixer's fwd+bwd 5 % faster), or "flavor" to
    keep the flavor's. Measured: BENCHMARKS.md. It changes no result, and the PyTorch paths
    (gdn_backend other than "triton") take either value: they keep what autograd keeps."""
    mla_flex_options: str = "flavor"
    """Tiles and launch choices of flex attention, the MLA blocks' attention on the GPU with
    document masking, as its kernel_options: KEY=VALUE[,KEY=VALUE...], e.g.
    "bwd_num_stages=2,USE_TMA=true" (``fwd_`` / ``bwd_`` keys address one direction's kernel; keys
    and value types, integer, true/false or a name, are checked against the installed torch's
    flex attention); "" for Inductor's defaults for the GPU, "flavor" to keep the flavor's (the
    defaults in every shipped flavor). "BACKEND=FLASH" runs flash-attn-4's kernels (CuTe DSL, for
    Hopper and Blackwell) instead of Triton's: the ``flash`` extra, checked at startup; no
    deterministic mode. ``python -m benchmarks.attn_bench`` times choices at the 750m shape."""
    fused_loss_chunk: int = -1
    """Training's readout and cross-entropy in chunks of this many tokens, each chunk's gradient
    taken in the forward (hymo_recipes/model/linear_ce.py): no head's [batch, seq, vocab] logits
    and log-probabilities are kept for the backward. 0: the model returns full logits and the
    loss function computes the cross-entropy; -1 keeps the flavor's (8,192 in small and 750m, 0 in
    the debug model). The same losses up to float rounding; memory and time: BENCHMARKS.md."""
    mup_base_width: int = -1
    """muP (hymo_recipes/mup.py): the base width at which init and lrs were tuned; the model's
    dim is the target. 0 turns muP off, -1 keeps the flavor's (off in every shipped flavor).
    On: per-role init and lr multipliers, MLA softmax scale 1/d, logits × base/dim."""
    document_masking: bool = True
    """On by default. Each packed training and validation row is split at its documents' starts (its BOS
    tokens, or the tokens after EOS for a tokenizer without BOS; every row start is one): GDN
    state and the short conv, attention and RoPE positions restart there, so each document is
    computed as if it were alone, as at inference. The batch's rows run as one packed sequence
    (the GDN kernel's varlen path; on the GPU, attention through flex attention with a block
    mask, on the CPU SDPA with a dense mask). Off (``--hymo.no-document_masking``): the
    documents of a row see each other."""
    validation_document_masking: str = "auto"
    """Whether the held-out loss computes each document alone: "auto" (as document_masking),
    "on" (each document alone, as at inference, however the model was trained) or "off" (the
    packed rows as they are). "on" puts runs trained with and without document masking on the
    same held-out measure."""
    fsdp_units: str = "auto"
    """Which modules FSDP2 shards as units: "block" (one per block and MTP head, the root keeping
    the embedding and final norm: each gather and reduce overlaps neighbouring compute),
    "model" (the root alone: FSDP's hooks run once per forward and backward instead of once per
    block, for the host time they take; every parameter gathered at once, every gradient
    reduced after the backward) or "auto": on one data-parallel rank, where FSDP has nothing to
    shard and only casts and copies, "model" with fsdp_sync_once_per_step (the fastest there,
    for the unsharded gradient sums' 4 bytes per parameter); "block" on more ranks."""
    fsdp_sync_once_per_step: bool = False
    """Gradient accumulation without FSDP's per-microbatch work: on every microbatch of a step
    but the last, each FSDP unit keeps its gathered parameters after the backward and adds its
    gradients to an unsharded copy in the reduction dtype instead of reduce-scattering them
    (FSDP2's set_requires_gradient_sync / set_reshard_after_backward); the last microbatch
    reduce-scatters the sum and reshards. Costs the unsharded gradients (4 bytes per parameter
    in fp32) and the gathered parameters for the whole step on every rank. The same sums, added
    in another order over the ranks (bitwise the same on one rank); no effect without
    accumulation. On by itself with fsdp_units = "auto" on one rank."""
    fsdp_accumulate_kernel: bool = True
    """Where gradients are reduced once per step (fsdp_sync_once_per_step, or fsdp_units =
    "auto" on one rank) on a GPU, each microbatch's gradients are added into their fp32 sums
    (training.mixed_precision_reduce = "float32", the default) in one Triton launch per FSDP unit
    and gradient dtype (hymo_kernels.accum; the same sums bitwise) instead of FSDP2's one
    PyTorch add per parameter, whose mixed-dtype kernel moves one element per load. Sums in
    another dtype stay with FSDP2's adds (the log says so). Off: FSDP2's own adds."""
    fsdp_one_rank_copy: bool = True
    """On one data-parallel rank, where FSDP2 has nothing to gather, each unit's gather before
    the forward is one multi-tensor cast of its fp32 parameters into their bf16 storage
    (torch._foreach_copy_) instead of FSDP2's cast and copy per parameter, which the GPU waits
    for at the start of every step. The same rounding, so the same values. Off: FSDP2's own loop."""
    data_prefetch: bool = True
    """Read and prepare each step's training batches (cut from the token stream, collated, their
    documents found, pinned for the copy to the GPU) on a background thread while the step
    before computes, one batch per microbatch launched, instead of on the training thread at the
    start of each step, where the GPU waits for it (hymo_recipes/titan/prefetch.py). The same
    batches in the same order; a checkpoint saves the position of the batches the train step
    took, not of those read ahead.
    Applies to HyMo's dataloader (every run through HyMo's trainer builds it)."""
    allow_data_repeat: bool = False
    """Loop over the training (and validation) data when the run reads more than it holds. Off:
    such a run stops before anything is built, naming the file (a local dataset), or when the
    data runs out (a streamed one: after checkpointing the last whole step). On: one warning
    says how many passes the run makes."""
    nonfinite_probe: bool = False
    """Debugging: log, for each forward, the first module whose output is NaN/Inf while its
    inputs are finite (hymo_recipes/nonfinite_probe.py); with compile, which compiled block, and
    whether an eager replay of that block goes non-finite too. Syncs the device per module."""
    checkpoint_on_signal: bool = True
    """On SIGTERM or SIGINT (a preemption, Ctrl-C through torchrun) save a checkpoint at the end
    of the step in progress and stop with exit code 0 (checkpointing on; hymo_recipes/titan/
    checkpoints.py). torchrun gives its ranks 30 s after forwarding the signal
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) before it kills them. Off: the signal ends the run at once."""


@dataclass
class Optimizer:
    """HyMo's ``[optimizer]`` fields. The built-in ``lr``, ``beta1``, ``beta2``, ``eps`` and
    ``weight_decay`` configure CautiousAdamW (or AdamW for name = "AdamW"); ``implementation``
    applies to torch's AdamW only. The NaN guard's knobs live here too: the optimizer builder
    sees only this section, and skipping is a decision of the optimizer step."""

    name: Literal["NorMuon", "CautiousAdamW", "AdamW"] = "NorMuon"
    """"NorMuon": the partition table (NorMuon for matrices, CautiousAdamW for the rest).
    Baselines: "CautiousAdamW" puts every group of the table on CautiousAdamW (weight decay per
    table, lr = optimizer.lr); "AdamW" is TorchTitan's own optimizer, torch.optim.AdamW over all
    parameters in one group with weight_decay everywhere (``implementation`` applies). All three
    run in HyMo's container: same WSD schedule, NaN guard and MoE balancing."""

    lr: float = 2.4e-3
    """CautiousAdamW's (or AdamW's) learning rate. 2.4e-3 and ``moe_on_normuon`` on: the recipe
    that reached tuned AdamW's held-out loss in 0.65x its steps at hymo_small's shape, where the
    seed's 3e-4 with the MoE on CautiousAdamW never did (benchmarks/optim_steps.md)."""

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
    first step). Faster alone, no gain in 750m training (BENCHMARKS.md)."""
    normuon_fused: bool = False
    """Run NorMuon's passes over the update (momentum and cast; row norms; rescale, cautious
    decay and update) as HyMo's Triton kernels, one launch each per shape, reading and writing
    the gradients, states and parameters in place (hymo_kernels.normuon). CUDA only; not with
    normuon_compiled."""

    adamw_cautious_update: bool = True
    adamw_cautious_wd: bool = True
    adamw_compiled: bool = False
    """Run CautiousAdamW's multi-tensor step under torch.compile: a faster optimizer step for a
    longer compile before step 1 (BENCHMARKS.md). Off by default, for a quick start;
    hymo_750m.toml turns it on."""

    cuda_graph: bool = False
    """Replay NorMuon's and CautiousAdamW's steps as one CUDA graph after a warm-up step: the same
    updates without the GPU idling while the host launches the step's thousands of small kernels
    (hymo_recipes/optim/graph.py, BENCHMARKS.md). One CUDA GPU and one rank, HyMo's optimizers
    (not name = "AdamW"), compiled or not; it keeps a copy of the gradients (4 bytes per
    parameter; not of NorMuon's with normuon_fused, read by address) and the step's temporaries
    allocated."""
    cuda_graph_streams: int = 1
    """With cuda_graph: the CUDA streams the captured step spreads its param groups over, each
    group whole on one stream (the expert matrices' orthogonalisation beside the small
    matrices' and the element-wise passes; hymo_recipes/optim/graph.py); the kernels are those
    of one stream. It costs memory: the groups running together hold their temporaries
    together, each stream in its own blocks. 1: one after the other. Without cuda_graph it has no
    effect (the eager step runs on the current stream), so a config that sets it still runs with
    --optimizer.no-cuda_graph."""

    embed_weight_decay: float = 0.0
    """Weight decay of the (tied) token embedding, separate from optimizer.weight_decay."""
    moe_on_normuon: bool = True
    """The MoE router, routed experts (orthogonalised per expert) and shared experts on NorMuon;
    False puts them on CautiousAdamW (the seed's split)."""

    consecutive_nan_limit: int = 5
    """A step whose loss or gradient is NaN/Inf on any rank is skipped (nothing is updated);
    after this many skipped steps in a row training stops with an error. 0 never stops."""
    inject_nan_steps: list[int] = field(default_factory=list)
    """Test hook: 1-based train steps whose loss is made NaN (TOML ``[3, 5]``, command line
    ``--optimizer.inject_nan_steps 3 5``)."""


@dataclass
class LRScheduler:
    """HyMo's ``[lr_scheduler]`` fields: the warmup-stable-decay schedule (hymo_recipes/scheduler.py)."""

    warmup_fraction: float = 0.02
    stable_fraction: float = 0.83
    decay_fraction: float = 0.15
    """Fractions of lr_scheduler.total_steps (default training.steps); must sum to 1."""

    min_lr_factor: float = 0.05
    """Final lr as a fraction of the peak (the seed's min_lr_ratio)."""

    warmup_steps: int | None = None
    """Unused by HyMo (set warmup_fraction); must stay unset so the two cannot disagree."""


@dataclass
class JobConfig:
    hymo: Hymo = field(default_factory=Hymo)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
