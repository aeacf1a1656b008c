"""HyMo model arguments: one dataclass, every field defaulted (the defaults are the 750m model).

It is what TorchTitan's Trainer takes as a flavor's model args: a dataclass (the Trainer logs
``dataclasses.asdict`` of it) with ``update_from_config(job_config)`` and
``get_nparams_and_flops(model, seq_len)``.

The MoE fields are HyMo's own rather than TorchTitan's ``MoEArgs``: HyMo's router (softmax
top-k with a selection-only bias moved by an EMA band rule, capacity-factor dropping) has
knobs ``MoEArgs`` lacks, and ``MoEArgs`` carries choices HyMo does not implement (sigmoid
scores, group-limited routing, TorchTitan's sign-rule bias update).
"""

from __future__ import annotations

import functools
import re
import typing
from dataclasses import dataclass

from hymo_kernels.gdn import BACKENDS, GDN_BWD_PATHS, GDN_DOT_PRECISIONS, GDN_MIXER_SAVES


@dataclass
class HymoModelArgs:
    # Shape
    vocab_size: int = 64_256  # a run takes the tokenizer's ([hymo] vocab_size, set by the preflight)
    dim: int = 896
    n_layers: int = 32
    norm_eps: float = 1e-6
    max_seq_len: int = 4096  # length of the RoPE table; update_from_config sets training.seq_len
    init_std: float = 0.02  # std of the embedding and of every input projection

    # Layout: the layers listed here are MLA + MoE blocks, all others Gated DeltaNet blocks
    mla_layers: tuple[int, ...] = (3, 7, 11, 15, 19, 23, 27, 31)
    nope_layers: tuple[int, ...] = ()  # MLA layers without RoPE (the NoPE-hybrid ablation)

    # Gated DeltaNet
    gdn_n_heads: int = 40
    gdn_head_dim: int = 32  # K: key / state rows per head
    gdn_v_head_dim: int = 32  # V: value / state columns per head
    gdn_conv_size: int = 4  # short causal depthwise conv on q, k, v
    gdn_backend: str = "torch_chunk"  # "naive" | "torch_chunk" | "triton" (hymo_kernels.gdn)
    # operands of the Triton kernel's dots for bf16 inputs: "table" (its launch table's choice),
    # "tf32", "bf16" or "bf16_t" (hymo_kernels.gdn GDN_DOT_PRECISIONS; Config.dot_bf16 and
    # Config.t_bf16); the triton backend only
    gdn_dot_precision: str = "table"
    # the Triton kernel's backward: "table" (its launch table's choice), "local" (saves the chunk
    # start states only: the least memory) or "local_sub" (hymo_kernels.gdn GDN_BWD_PATHS)
    gdn_bwd_path: str = "table"
    # with the Triton backend: the conv, SiLU, q/k norm and gated output norm fused around the
    # kernel (hymo_kernels.gdn.mixer), which keeps far fewer activations; False runs them in PyTorch
    gdn_fused_mixer: bool = True
    # what the fused mixer keeps for its backward: "inputs" (the projections; the conv outputs and
    # the gated norm's output are recomputed: the least memory) or "outputs" (those kept too:
    # three [B, T, H·K]-sized tensors and one like the output more per layer, no recompute). It
    # changes no result, only memory and time, so the PyTorch paths (another backend, or
    # gdn_fused_mixer False), which keep what autograd keeps, take either value.
    gdn_mixer_saves: str = "inputs"
    gdn_A_init_range: tuple[float, float] = (0.0, 16.0)  # A ~ U(lo, hi), A_log = log A
    gdn_dt_min: float = 1e-3  # dt ~ logU(dt_min, dt_max), dt_bias = softplus⁻¹(dt)
    gdn_dt_max: float = 0.1
    gdn_dt_init_floor: float = 1e-4
    gdn_ffn_dim: int = 0  # hidden size of an optional dense SwiGLU on GDN blocks; 0 = none

    # MLA
    n_heads: int = 16
    n_kv_heads: int = 4  # KV groups: query head h reads KV group h // (n_heads // n_kv_heads)
    q_lora_rank: int = 224
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 96
    qk_rope_head_dim: int = 32  # k_rope is one such slice per token, shared by all heads
    v_head_dim: int = 128
    rope_theta: float = 10_000.0
    # flex attention's kernel_options for the GPU's packed (document-masked) path, as
    # KEY=VALUE[,KEY=VALUE...] (parse_flex_options); "": Inductor's defaults for the GPU;
    # "BACKEND=FLASH": flash-attn-4's Hopper/Blackwell kernels instead of Triton's (the flash extra)
    mla_flex_options: str = ""

    # MoE (on MLA blocks)
    moe_num_experts: int = 16
    moe_num_shared_experts: int = 1
    moe_top_k: int = 2
    moe_inter_dim: int = 2304
    moe_capacity_factor: float = 1.5  # 0 = dropless
    moe_bias_update_speed: float = 1e-3  # step of the selection bias per optimizer step
    moe_load_ema_alpha: float = 0.02
    moe_balance_band: float = 0.05  # no bias change while EMA load is within ±5% of the mean
    moe_mixed_precision: bool = True  # expert matmuls in the expert weights' dtype
    moe_use_grouped_mm: bool = True  # torch._grouped_mm on CUDA for bf16; per-expert loop otherwise

    # Training's readout and loss: with labels the forward returns the heads' cross-entropy
    # computed this many tokens at a time, each chunk's gradient taken in the forward
    # (model/linear_ce.py), so no head's [B, T, vocab] logits are kept; 0 = the forward returns
    # the logits and the loss function computes the cross-entropy. The same losses up to float rounding.
    fused_loss_chunk: int = 8192

    # MTP
    mtp_depth: int = 2
    mtp_loss_weights: tuple[float, ...] = (0.3, 0.1)
    mtp_inter_dim: int = 2304

    # muP (hymo_recipes/mup.py): the width at which init_std and the lrs were tuned; 0 = off.
    # On: hidden-matrix init × (dim/base)^-1/2, router init × base/dim, per-role lr multipliers
    # in the optimizer's param groups, MLA softmax scale 1/d, logits × base/dim.
    mup_base_width: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        mla = set(self.mla_layers)
        return tuple(i for i in range(self.n_layers) if i not in mla)

    @property
    def mup_width_mult(self) -> float:
        """muP's width multiplier dim / mup_base_width (1.0 with muP off)."""
        return self.dim / self.mup_base_width if self.mup_base_width else 1.0

    def validate(self) -> None:
        """Raises a ValueError naming the first inconsistent field."""
        for name in ("vocab_size", "dim", "n_layers", "max_seq_len", "gdn_n_heads", "gdn_head_dim",
                     "gdn_v_head_dim", "gdn_conv_size", "n_heads", "n_kv_heads", "q_lora_rank",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "moe_num_experts", "moe_top_k", "moe_inter_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("norm_eps", "init_std", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

        mla = tuple(self.mla_layers)
        if any(not 0 <= i < self.n_layers for i in mla):
            raise ValueError(f"mla_layers {mla} must lie in [0, n_layers = {self.n_layers})")
        if list(mla) != sorted(set(mla)):
            raise ValueError(f"mla_layers must be strictly increasing, got {mla}")
        if not set(self.nope_layers) <= set(mla):
            raise ValueError(f"nope_layers {tuple(self.nope_layers)} must be a subset of mla_layers {mla}")

        if self.gdn_backend not in BACKENDS:
            raise ValueError(f"unknown gdn_backend {self.gdn_backend!r}; choose one of {sorted(BACKENDS)}")
        if self.gdn_dot_precision not in GDN_DOT_PRECISIONS:
            raise ValueError(f"unknown gdn_dot_precision {self.gdn_dot_precision!r}; choose one of "
                             f"{sorted(GDN_DOT_PRECISIONS)}")
        if self.gdn_dot_precision != "table" and self.gdn_backend != "triton":
            raise ValueError(f"gdn_dot_precision = {self.gdn_dot_precision!r} sets the Triton kernel's dots; "
                             f"gdn_backend is {self.gdn_backend!r} (use \"table\", or gdn_backend = \"triton\")")
        parse_flex_options(self.mla_flex_options)  # raises on a malformed spec
        if self.gdn_bwd_path not in GDN_BWD_PATHS:
            raise ValueError(f"unknown gdn_bwd_path {self.gdn_bwd_path!r}; choose one of {list(GDN_BWD_PATHS)}")
        if self.gdn_mixer_saves not in GDN_MIXER_SAVES:
            raise ValueError(f"unknown gdn_mixer_saves {self.gdn_mixer_saves!r}; choose one of {list(GDN_MIXER_SAVES)}")
        if self.gdn_bwd_path != "table" and self.gdn_backend != "triton":
            raise ValueError(f"gdn_bwd_path = {self.gdn_bwd_path!r} picks the Triton kernel's backward; "
                             f"gdn_backend is {self.gdn_backend!r} (use \"table\", or gdn_backend = \"triton\")")
        lo, hi = self.gdn_A_init_range
        if not 0 <= lo < hi:
            raise ValueError(f"gdn_A_init_range must satisfy 0 <= lo < hi, got {self.gdn_A_init_range}")
        if not 0 < self.gdn_dt_min <= self.gdn_dt_max:
            raise ValueError(f"need 0 < gdn_dt_min <= gdn_dt_max, got {self.gdn_dt_min}, {self.gdn_dt_max}")
        if self.gdn_dt_init_floor < 0 or self.gdn_ffn_dim < 0:
            raise ValueError("gdn_dt_init_floor and gdn_ffn_dim must be >= 0")

        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}): "
                "each KV group serves the same number of query heads"
            )
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")

        if self.moe_top_k > self.moe_num_experts:
            raise ValueError(f"moe_top_k ({self.moe_top_k}) exceeds moe_num_experts ({self.moe_num_experts})")
        if self.moe_num_shared_experts < 0:
            raise ValueError(f"moe_num_shared_experts must be >= 0, got {self.moe_num_shared_experts}")
        if self.moe_capacity_factor < 0:
            raise ValueError(f"moe_capacity_factor must be >= 0 (0 = dropless), got {self.moe_capacity_factor}")
        if self.moe_bias_update_speed < 0:
            raise ValueError(f"moe_bias_update_speed must be >= 0, got {self.moe_bias_update_speed}")
        if not 0 < self.moe_load_ema_alpha <= 1:
            raise ValueError(f"moe_load_ema_alpha must lie in (0, 1], got {self.moe_load_ema_alpha}")
        if not 0 <= self.moe_balance_band < 1:
            raise ValueError(f"moe_balance_band must lie in [0, 1), got {self.moe_balance_band}")

        if self.fused_loss_chunk < 0:
            raise ValueError(f"fused_loss_chunk must be >= 0 (0 = full logits), got {self.fused_loss_chunk}")
        if self.mup_base_width < 0:
            raise ValueError(f"mup_base_width must be >= 0 (0 = muP off), got {self.mup_base_width}")

        if self.mtp_depth < 0:
            raise ValueError(f"mtp_depth must be >= 0, got {self.mtp_depth}")
        if len(self.mtp_loss_weights) != self.mtp_depth:
            raise ValueError(
                f"mtp_loss_weights has {len(self.mtp_loss_weights)} entries for mtp_depth = {self.mtp_depth}"
            )
        if any(w < 0 for w in self.mtp_loss_weights):
            raise ValueError(f"mtp_loss_weights must be >= 0, got {tuple(self.mtp_loss_weights)}")
        if self.mtp_depth > 0 and self.mtp_inter_dim <= 0:
            raise ValueError(f"mtp_inter_dim must be positive, got {self.mtp_inter_dim}")

    def update_from_config(self, job_config, **kwargs) -> None:
        """TorchTitan's config hook (the Trainer calls it on the flavor before building the model).

        Takes the longest sequence run (``training.seq_len``, ``validation.seq_len``) as
        ``max_seq_len`` and applies the ``[hymo]`` knobs that name model fields (``vocab_size``,
        ``gdn_backend``, ``gdn_dot_precision``, ``gdn_bwd_path``, ``gdn_mixer_saves``, ``mla_flex_options``,
        ``fused_loss_chunk``,
        ``mup_base_width``; 0, "flavor" or -1 keeps the flavor's), then validates. A pure function of the config: it
        reads no file and probes no device. The tokenizer's vocabulary and whether the machine
        can run the backend are settled before the Trainer starts (``hymo_recipes.titan.preflight``).
        """
        lengths = {"training.seq_len": job_config.training.seq_len}
        if job_config.validation.enable:
            lengths["validation.seq_len"] = job_config.validation.seq_len
        for name, n in lengths.items():
            if n <= self.mtp_depth:
                raise ValueError(f"{name} = {n} leaves no target for MTP head {self.mtp_depth} (mtp_depth = "
                                 f"{self.mtp_depth} needs sequences of at least {self.mtp_depth + 1} tokens)")
        self.max_seq_len = max(lengths.values())  # the RoPE table must reach the longest sequence run

        hymo = getattr(job_config, "hymo", None)  # present with HyMo's job config (hymo_recipes.titan.job_config)
        if hymo is not None:
            if hymo.vocab_size:
                self.vocab_size = hymo.vocab_size
            for name in ("gdn_backend", "gdn_dot_precision", "gdn_bwd_path", "gdn_mixer_saves"):
                if getattr(hymo, name) != "flavor":
                    setattr(self, name, getattr(hymo, name))
            if getattr(hymo, "mla_flex_options", "flavor") != "flavor":
                self.mla_flex_options = hymo.mla_flex_options
            if getattr(hymo, "fused_loss_chunk", -1) >= 0:  # -1 keeps the flavor's
                self.fused_loss_chunk = hymo.fused_loss_chunk
            if getattr(hymo, "mup_base_width", -1) >= 0:  # -1 keeps the flavor's
                self.mup_base_width = hymo.mup_base_width

        if job_config.parallelism.context_parallel_degree > 1:
            raise NotImplementedError("context parallelism is not supported: the GDN recurrence spans the sequence")
        self.validate()

    def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
        """(stored parameters, training FLOPs per token) — TorchTitan's contract; see counts.py."""
        from .counts import count_params, training_flops_per_token

        counts = count_params(model, self)
        return counts.stored, training_flops_per_token(self, counts, seq_len)


@functools.cache
def flex_option_types() -> dict[str, type]:
    """The kernel_options this torch's flex attention takes and each one's value type (int, bool
    or str), from its ``FlexKernelOptions``; {} where torch has no such table (then any key is
    passed on)."""
    try:
        from torch.nn.attention.flex_attention import FlexKernelOptions
    except ImportError:
        return {}
    kinds = {"int": int, "bool": bool}
    out = {}
    for name, hint in FlexKernelOptions.__annotations__.items():
        text = getattr(hint, "__forward_arg__", str(hint))
        m = re.search(r"\[(\w+)\]", text)
        out[name] = kinds.get(m[1] if m else text, str)
    return out


@functools.cache
def flex_option_choices() -> dict[str, tuple[str, ...]]:
    """The kernel_options of this torch's flex attention that take one of a few names, and the
    names (``BACKEND``: AUTO, TRITON, FLASH, TRITON_DECODE in torch 2.11); {} where torch has no
    such table."""
    try:
        from torch.nn.attention.flex_attention import FlexKernelOptions

        hints = typing.get_type_hints(FlexKernelOptions)
    except Exception:  # noqa: BLE001 - no table, or one this Python cannot resolve: names unchecked
        return {}
    return {name: typing.get_args(h) for name, h in hints.items() if typing.get_origin(h) is typing.Literal}


def parse_flex_options(spec: str) -> dict[str, int | bool | str]:
    """Flex attention's ``kernel_options`` from ``KEY=VALUE[,KEY=VALUE...]`` (the model arg
    ``mla_flex_options``; e.g. "bwd_num_stages=2,USE_TMA=true"); "" gives {} (Inductor's
    defaults). A ``fwd_`` / ``bwd_`` prefix addresses one direction's kernel. Keys and value
    types are checked against this torch's flex attention (``flex_option_types``): integers,
    true/false, or a name (``BACKEND``)."""
    known = flex_option_types()
    out: dict[str, int | bool | str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = (x.strip() for x in item.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"mla_flex_options: options are KEY=VALUE[,KEY=VALUE...], got {spec!r}")
        base = key.removeprefix("fwd_").removeprefix("bwd_")
        if known and base not in known:
            raise ValueError(f"mla_flex_options: {key!r} is not a flex attention option of this torch; its options "
                             f"are {', '.join(sorted(known))} (each may take a fwd_ or bwd_ prefix)")
        if names := flex_option_choices().get(base):
            if key != base:
                raise ValueError(f"mla_flex_options: {base} applies to both directions: {key!r} takes no fwd_ or "
                                 "bwd_ prefix")
            if value not in names:
                raise ValueError(f"mla_flex_options: {key} takes one of {', '.join(names)}, got {value!r}")
        kind = known.get(base) or (bool if value.lower() in ("true", "false") else int if value.lstrip("-").isdigit()
                                   else str)
        if kind is bool and value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        elif kind is int and value.lstrip("-").isdigit():
            out[key] = int(value)
        elif kind is str and value.isidentifier():
            out[key] = value
        else:
            wanted = {bool: "true or false", int: "an integer", str: "a name"}[kind]
            raise ValueError(f"mla_flex_options: {key} takes {wanted}, got {value!r}")
    return out


def _every(n_layers: int, k: int) -> tuple[int, ...]:
    """Every k-th layer, the last of each group of k (3:1 GDN:MLA for k = 4)."""
    return tuple(range(k - 1, n_layers, k))


hymo_flavors: dict[str, HymoModelArgs] = {
    # Every block type, MoE and MTP, small enough to train on a CPU in seconds.
    "debugmodel": HymoModelArgs(
        vocab_size=2048,
        dim=256,
        n_layers=4,
        max_seq_len=512,
        mla_layers=_every(4, 4),
        gdn_n_heads=8,
        gdn_head_dim=32,
        gdn_v_head_dim=32,
        gdn_backend="torch_chunk",
        n_heads=4,
        n_kv_heads=2,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=48,
        moe_num_experts=8,
        moe_num_shared_experts=1,
        moe_top_k=2,
        moe_inter_dim=256,
        # Balancing that acts within the 60-step debug run: the 750m's 0.001 per step is made
        # for tens of thousands of steps and would leave one expert far over the mean load and
        # many assignments dropped here; a faster bias step with a ~10-step load EMA balances
        # within the run (the MoE ranges: README).
        moe_bias_update_speed=0.01,
        moe_load_ema_alpha=0.1,
        mtp_depth=2,
        mtp_loss_weights=(0.3, 0.1),
        mtp_inter_dim=256,
        # Its logits are small: the reference loss path, whose numbers the README shows (the
        # fused one agrees to float rounding, which 60 steps of discrete routing amplify).
        fused_loss_chunk=0,
    ),
    # The 750m structure scaled down (~150M stored with the 64K vocabulary), for one GPU.
    "small": HymoModelArgs(
        vocab_size=64_256,
        dim=512,
        n_layers=16,
        mla_layers=_every(16, 4),
        gdn_n_heads=16,
        gdn_backend="triton",
        n_heads=8,
        n_kv_heads=2,
        q_lora_rank=128,
        kv_lora_rank=64,
        moe_inter_dim=896,
        mtp_inter_dim=896,
    ),
    # DESIGN.md §2: the seed's numbers.
    "750m": HymoModelArgs(
        vocab_size=64_256,
        dim=896,
        n_layers=32,
        mla_layers=_every(32, 4),
        gdn_n_heads=40,
        gdn_head_dim=32,
        gdn_v_head_dim=32,
        gdn_backend="triton",
        n_heads=16,
        n_kv_heads=4,
        q_lora_rank=224,
        kv_lora_rank=128,
        qk_nope_head_dim=96,
        qk_rope_head_dim=32,
        v_head_dim=128,
        moe_num_experts=16,
        moe_num_shared_experts=1,
        moe_top_k=2,
        moe_inter_dim=2304,
        moe_capacity_factor=1.5,
        mtp_depth=2,
        mtp_loss_weights=(0.3, 0.1),
        mtp_inter_dim=2304,
    ),
}
