"""muP for HyMo: width-independent init, learning rates and logits (off unless ``mup_base_width > 0``).

A flavor (or ``[hymo] mup_base_width``) names the base width d₀ at which init and learning rates
were tuned; the model's own ``dim`` is the target width d, and ``width_mult`` m = d / d₀. Every
parameter has one *role* (``MUP_ROLE_TABLE``, a table of name patterns, checked to be disjoint
and complete by tests/test_mup.py) and each role gets an init-std multiplier and, per optimizer,
an lr multiplier, relative to the flavor's ``init_std`` and the configured lrs (which are
therefore the base width's values: at m = 1 the init and the param groups are bitwise those of
the model without muP; only MLA's softmax scale, 1/d instead of 1/√d, differs).

Roles (in the sense of Tensor Programs V, arXiv 2203.03466, "input / hidden / output" weights):

- ``input``: fan-in fixed, fan-out ∝ width, or no fan-in at all. The token embedding
  [V, d] (V fixed), every RMSNorm weight, biases, GDN's per-head ``A_log`` / ``dt_bias`` and
  the depthwise short-conv kernels [C, 1, W] (fan-in W = 4 fixed; C ∝ width: vector-like).
- ``hidden``: fan-in and fan-out both ∝ width. Every projection of GDN (q/k/v/a/b/g/o; a and
  b map d → heads, and HyMo widens by adding heads) and MLA (wq_a, wq_b, wkv_a, wkv_b, wo; the
  LoRA ranks widen with d), the optional GDN feed-forward, the MoE experts (routed [E, out, in]
  stacks, per expert, and shared) and the MTP heads' two Linears.
- ``output``: fan-in ∝ width, fan-out fixed. The MoE router ``gate`` [E, d]: its E logits feed a
  softmax exactly as a readout's feed the loss, so it is a readout (decision: it is not a
  "hidden" weight, whose fan-out would grow). The LM head is the tied embedding: one tensor
  cannot follow two rules, so the weight keeps the ``input`` rule and the output role is
  realised as a logit multiplier 1/m on the main and MTP logits (the ``mup`` package's
  MuSharedReadout treatment; seed 002 does the same).

Rules (m = width_mult; ``init_std_multiplier`` / ``lr_multiplier``):

=========  =========  ==================  =========================================
role       init std   (Cautious)AdamW lr  NorMuon lr (on the orthogonalised update)
=========  =========  ==================  =========================================
input      1          1                   √m   (never used: no input param is on NorMuon)
hidden     m^-1/2     1/m                 1
output     1/m        1/m                 m^-1/2 (router with ``moe_on_normuon``)
=========  =========  ==================  =========================================

- Init: variance ∝ 1/fan_in for hidden weights, 1/fan_in² for readouts (TP5 Table 3; the
  spectral condition of Yang, Simon & Bernstein, arXiv 2310.17813, gives the same:
  ‖W‖_* ∝ √(fan_out/fan_in)). The depth scaling of residual-writing projections
  (``init_std / √(2(layer+1))``) is kept and multiplied like the other hidden weights.
  Implemented as an in-place rescale after the ordinary init (``apply_mup_init``): a draw of
  trunc_normal(0, σ) on ±2 times c is trunc_normal(0, σc) on ±2c, the same law since ±2 is
  ~100σ away; the RNG stream is the unscaled model's.
- AdamW (TP5 Table 8 / the ``mup`` package's MuAdam): matrix-like weights lr ∝ 1/fan_in, i.e.
  hidden and output lr × 1/m; vector-like (input) lr unchanged. Weight decay stays coupled
  (``W -= lr·wd·W`` with the group's lr), as in MuAdamW.
- NorMuon (DESIGN.md §3; ../shared/OPTIMIZER_NOTES.md "muP"): the orthogonalised update has
  spectral norm ≈ 1 whatever the width, and the spectral condition wants ΔW of spectral norm
  ∝ √(fan_out/fan_in). NorMuon already multiplies its update by the shape factor s of
  ``normuon_update_scale`` ("jordan" √max(1, out/in) by default); muP multiplies the group lr
  by the *width* part of √(fan_out/fan_in) relative to the base: √(m_out/m_in) with m_out, m_in
  the factors by which the role's fan-out and fan-in grow (hidden: m, m → 1; output: 1, m →
  m^-1/2; input: m, 1 → √m). So the total scale is s(base shape) · √(m_out/m_in) ∝
  √(fan_out/fan_in): the spectral scale, anchored so that at m = 1 nothing changes. (For hidden
  matrices both fans grow alike, the aspect ratio and so "jordan" s stay constant, and plain
  Muon/NorMuon lr already transfers; the NorMuon part of muP is the router rule, the init and
  the readout.) ``normuon_update_scale = "spectral"`` remains available and is compatible (its
  width dependence is the same), but is not switched on by muP.
- Attention: MLA's softmax scale becomes 1/d_qk instead of 1/√d_qk (TP5 §4, "attention logits
  scaled 1/d"); GDN normalises q and k to unit L2 norm, so its 1/√K read scale needs no change.
  HyMo widens by adding heads at fixed head dims (``scale_args_to_width``), so this factor is
  the same at every width; it matters when head dims grow.
- Readout: logits = (1/m) · RMSNorm(h) · Eᵀ (and the MTP heads' logits alike).

Width scaling (``scale_args_to_width``): dim, the head counts (GDN heads, MLA query heads and
KV groups), the MLA LoRA ranks and the inner dims of MoE experts, MTP heads and the optional
GDN feed-forward scale by width / dim; head dims, vocab, depth and expert count stay. A
flavor whose width-like dims do not follow dim (for example a fixed LoRA rank) still gets the
rules of its roles, which then hold only approximately for those matrices.

Seed 002's muP module (Adam only) differs: it calls biases "hidden" (here: input, vector-like),
and justifies 1/d attention by "correlation growing with width" of q/k under muP's init
(rather: after training, q and k become correlated, so q·k grows like d, not √d).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Iterable, Literal

import torch
from torch import nn

__all__ = [
    "ROLES",
    "MUP_ROLE_TABLE",
    "mup_role",
    "classify_params",
    "width_mult",
    "init_std_multiplier",
    "lr_multiplier",
    "output_multiplier",
    "attention_scale",
    "apply_mup_init",
    "apply_mup_to_param_groups",
    "part_width_mult",
    "scale_args_to_width",
    "transfer_lr",
    "transfer_init_std",
]

Role = Literal["input", "hidden", "output"]
ROLES: tuple[str, ...] = ("input", "hidden", "output")

# (fnmatch glob over the canonical FQN, with `*` spanning dots; role). The patterns are
# disjoint: each parameter must match exactly one (mup_role raises otherwise).
MUP_ROLE_TABLE: tuple[tuple[str, str], ...] = (
    # embedding (and the tied head's weight): fan-in = vocab, fixed
    ("tok_embeddings.weight",                          "input"),
    # every RMSNorm: final, attn_norm, ffn_norm, GDN o_norm, MLA q_norm / kv_norm, MTP norm
    ("*norm.weight",                                   "input"),
    ("*.bias",                                         "input"),
    # GDN per-head scalars and the depthwise short-conv kernels [C, 1, W]
    ("layers.*.attn.A_log",                            "input"),
    ("layers.*.attn.dt_bias",                          "input"),
    ("layers.*.attn.[qkv]_conv1d.weight",              "input"),
    # GDN projections (q, k, v, a, b, g, o)
    ("layers.*.attn.[qkvabgo]_proj.weight",            "hidden"),
    # MLA projections
    ("layers.*.attn.wq_[ab].weight",                   "hidden"),
    ("layers.*.attn.wkv_[ab].weight",                  "hidden"),
    ("layers.*.attn.wo.weight",                        "hidden"),
    # optional dense SwiGLU of GDN blocks
    ("layers.*.feed_forward.w[123].weight",            "hidden"),
    # MoE: routed expert stacks [E, out, in] (per expert), shared experts; the router reads out
    ("layers.*.moe.experts.w[123]",                    "hidden"),
    ("layers.*.moe.shared_experts.w[123].weight",      "hidden"),
    ("layers.*.moe.router.gate.weight",                "output"),
    # MTP heads (their norm is matched above)
    ("mtp_heads.*.w_in.weight",                        "hidden"),
    ("mtp_heads.*.w_out.weight",                       "hidden"),
)

# Width exponents (fan_out, fan_in) of each role: fan ∝ m^exponent.
_FAN_EXPONENTS = {"input": (1, 0), "hidden": (1, 1), "output": (0, 1)}
_ADAMW_NAMES = ("cautious_adamw", "adamw")
_NORMUON_NAMES = ("normuon",)


def _canonical(fqn: str) -> str:
    from hymo_recipes.optim.partition import canonical_name

    return canonical_name(fqn)


def mup_role(fqn: str) -> str:
    """The role of one parameter, by its (canonical) FQN; ValueError if no or several rows match."""
    name = _canonical(fqn)
    hits = [role for pattern, role in MUP_ROLE_TABLE if fnmatch.fnmatchcase(name, pattern)]
    if len(hits) != 1:
        what = "no row" if not hits else f"{len(hits)} rows"
        raise ValueError(f"parameter {name!r} matches {what} of the muP role table (hymo_recipes/mup.py)")
    return hits[0]


def classify_params(named_params: Iterable[tuple[str, nn.Parameter]]) -> dict[str, str]:
    """{canonical FQN: role} for every parameter; ValueError naming every unclassified one."""
    out, bad = {}, []
    for fqn, _ in named_params:
        try:
            out[_canonical(fqn)] = mup_role(fqn)
        except ValueError as e:
            bad.append(str(e))
    if bad:
        raise ValueError("; ".join(bad))
    return out


def width_mult(args) -> float:
    """m = dim / mup_base_width for HymoModelArgs with muP on, else 1.0."""
    base = getattr(args, "mup_base_width", 0)
    return args.dim / base if base else 1.0


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"muP role must be one of {ROLES}, got {role!r}")


def init_std_multiplier(role: str, m: float) -> float:
    """Factor on the base width's init std: input 1, hidden m^-1/2, output m^-1."""
    _check_role(role)
    return {"input": 1.0, "hidden": m**-0.5, "output": 1.0 / m}[role]


def lr_multiplier(role: str, m: float, optimizer: str) -> float:
    """Factor on the base width's lr for ``optimizer`` in ("normuon", "cautious_adamw", "adamw").

    AdamW: input 1, hidden 1/m, output 1/m (TP5). NorMuon: √(m_out / m_in), the width part of
    the spectral scale √(fan_out / fan_in): input √m, hidden 1, output m^-1/2.
    """
    _check_role(role)
    if optimizer in _ADAMW_NAMES:
        return 1.0 if role == "input" else 1.0 / m
    if optimizer in _NORMUON_NAMES:
        e_out, e_in = _FAN_EXPONENTS[role]
        return m ** (0.5 * (e_out - e_in))
    raise ValueError(f"no muP lr rule for optimizer {optimizer!r}")


def output_multiplier(m: float) -> float:
    """The readout multiplier on the logits of the tied head: 1/m."""
    return 1.0 / m


def attention_scale(head_dim: int, mup: bool) -> float:
    """MLA's softmax scale: 1/d with muP, 1/√d without."""
    return 1.0 / head_dim if mup else head_dim**-0.5


@torch.no_grad()
def apply_mup_init(model: nn.Module, m: float | None = None) -> None:
    """Rescale an initialised HyMo model in place by the init-std multiplier of each role.

    Called by ``HymoModel.init_weights`` when muP is on; ``m`` defaults to the model args'.
    """
    if m is None:
        m = width_mult(model.model_args)
    for fqn, p in model.named_parameters():
        c = init_std_multiplier(mup_role(fqn), m)
        if c != 1.0:
            p.mul_(c)


def apply_mup_to_param_groups(
    groups: dict[str, list[dict]], named_params: Iterable[tuple[str, nn.Parameter]], m: float
) -> dict[str, list[dict]]:
    """muP lr multipliers on the partition's param groups ({optimizer: [group, ...]}).

    A group whose parameters have several roles is split into one group per role (named
    ``<group>/<role>``); each group's ``lr_mult`` is multiplied by ``lr_multiplier(role, m,
    optimizer)``; everything else of the group (weight decay, ...) is kept.
    """
    role_of = {id(p): mup_role(fqn) for fqn, p in named_params}
    out: dict[str, list[dict]] = {}
    for opt, gs in groups.items():
        new: list[dict] = []
        for g in gs:
            by_role: dict[str, list] = {}
            for p in g["params"]:
                by_role.setdefault(role_of[id(p)], []).append(p)
            for role, params in by_role.items():
                name = g.get("group", "group")
                new.append({
                    **g,
                    "params": params,
                    "group": name if len(by_role) == 1 else f"{name}/{role}",
                    "lr_mult": g.get("lr_mult", 1.0) * lr_multiplier(role, m, opt),
                    "mup_role": role,
                })
        out[opt] = new
    return out


def part_width_mult(part: nn.Module) -> float | None:
    """m of a model part with muP on (its ``model_args``), else None (muP off or not a HymoModel)."""
    args = getattr(part, "model_args", None)
    if args is None or not getattr(args, "mup_base_width", 0):
        return None
    return width_mult(args)


def _scaled(value: int, r: float) -> int:
    return max(1, round(value * r))


def scale_args_to_width(args, width: int, **overrides):
    """A copy of HymoModelArgs ``args`` widened (or narrowed) to ``dim = width``.

    Scales by r = width / args.dim: the GDN and MLA head counts, the KV groups (the largest
    divisor of the new query-head count not above r·n_kv_heads), the MLA LoRA ranks and the
    inner dims of the MoE experts, MTP heads and GDN feed-forward (each at least 1). Head dims,
    vocab, depth, layout and expert count stay; ``mup_base_width`` stays too, so the widened
    model's width_mult is width / mup_base_width. ``overrides`` replace fields afterwards.
    """
    r = width / args.dim
    n_heads = _scaled(args.n_heads, r)
    kv_target = _scaled(args.n_kv_heads, r)
    n_kv = max(d for d in range(1, n_heads + 1) if n_heads % d == 0 and d <= kv_target)
    fields = dict(
        dim=width,
        gdn_n_heads=_scaled(args.gdn_n_heads, r),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        q_lora_rank=_scaled(args.q_lora_rank, r),
        kv_lora_rank=_scaled(args.kv_lora_rank, r),
        moe_inter_dim=_scaled(args.moe_inter_dim, r),
        mtp_inter_dim=_scaled(args.mtp_inter_dim, r),
        gdn_ffn_dim=_scaled(args.gdn_ffn_dim, r) if args.gdn_ffn_dim else 0,
    )
    fields.update(overrides)
    return dataclasses.replace(args, **fields)


def transfer_lr(base_lr: float, base_width: int, target_width: int, *, role: str = "hidden",
                optimizer: str = "cautious_adamw") -> float:
    """The muP lr at ``target_width`` of a ``role`` parameter whose lr was tuned at ``base_width``."""
    return base_lr * lr_multiplier(role, target_width / base_width, optimizer)


def transfer_init_std(base_std: float, base_width: int, target_width: int, *, role: str = "hidden") -> float:
    """The muP init std at ``target_width`` of a ``role`` parameter with std ``base_std`` at ``base_width``."""
    return base_std * init_std_multiplier(role, target_width / base_width)
