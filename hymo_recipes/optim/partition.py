"""Which optimizer, weight decay and lr multiplier each parameter gets: one declarative table.

A rule is (group name, FQN glob, optimizer, weight decay, lr multiplier). Rules are tried in
order and the first match wins, like a TP plan: specific rows (norms, A_log, conv) come before
the broad "every matrix of an attention block" rows. Every trainable parameter must match a
rule; an unmatched one is an error that names it, and so is a parameter routed to NorMuon that
is not a matrix (or a 3-D expert stack on an expert rule).

Default split:
- NorMuon: the 2-D matrices of GDN and MLA blocks, of optional dense feed-forwards, of MTP; the
  MoE router (no decay: a gate) and the routed and shared experts (routed expert stacks
  [E, out, in] orthogonalised per expert).
- CautiousAdamW: token embedding (tied head) with its own weight decay; norms, biases, A_log,
  dt_bias and conv kernels without decay.
- ``moe_on_normuon=False`` puts the router and the experts on CautiousAdamW: the split of
  DESIGN.md §3 (seed 000), which needed more steps than tuned AdamW in
  benchmarks/optim_steps.md, where this default needed 0.65x.

FQNs are matched after dropping wrapper segments (``_orig_mod.`` from torch.compile,
``_checkpoint_wrapped_module.`` from activation checkpointing), so the table holds for the
parallelized model as well as for the plain one.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Iterable

import torch.nn as nn

__all__ = [
    "NORMUON",
    "CAUTIOUS_ADAMW",
    "Rule",
    "hymo_param_table",
    "canonical_name",
    "assign_parameters",
    "build_param_groups",
]

NORMUON = "normuon"
CAUTIOUS_ADAMW = "cautious_adamw"
OPTIMIZERS = (NORMUON, CAUTIOUS_ADAMW)

_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class Rule:
    """One row of the table.

    Args:
        name (str):
            Param-group name (logged; rows sharing a name must agree on wd and lr_mult).
        pattern (str):
            fnmatch glob over the canonical FQN (``*`` also spans dots).
        optimizer (str):
            ``"normuon"`` or ``"cautious_adamw"``.
        weight_decay (float):
            Decoupled weight decay of the group.
        lr_mult (float):
            Multiplier on the optimizer's base lr. Default: ``1.0``.
        expert_stack (bool):
            The parameters are 3-D [E, out, in] expert stacks (NorMuon: per expert).
            Default: ``False``.
    """

    name: str
    pattern: str
    optimizer: str
    weight_decay: float
    lr_mult: float = 1.0
    expert_stack: bool = False

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"rule {self.name!r}: optimizer must be one of {OPTIMIZERS}")
        if self.weight_decay < 0 or self.lr_mult < 0:
            raise ValueError(f"rule {self.name!r}: weight_decay and lr_mult must be >= 0")


def hymo_param_table(
    *,
    normuon_weight_decay: float = 0.1,
    adamw_weight_decay: float = 0.1,
    embed_weight_decay: float = 0.0,
    moe_on_normuon: bool = True,
) -> list[Rule]:
    """HyMo's table (parameter names: notes CONTRACT "Parameter names", hymo_recipes/model)."""
    moe_opt = NORMUON if moe_on_normuon else CAUTIOUS_ADAMW
    moe_wd = normuon_weight_decay if moe_on_normuon else adamw_weight_decay
    A, N = CAUTIOUS_ADAMW, NORMUON
    return [
        #    group             pattern                                  optimizer wd
        Rule("embedding",      "tok_embeddings.weight",                 A, embed_weight_decay),
        Rule("embedding",      "output.weight",                         A, embed_weight_decay),
        # every RMSNorm: final, attn_norm, ffn_norm, GDN o_norm, MLA q_norm/kv_norm, MTP norm
        Rule("no_decay",       "*norm.weight",                          A, 0.0),
        Rule("no_decay",       "*.bias",                                A, 0.0),
        Rule("no_decay",       "layers.*.attn.A_log",                   A, 0.0),
        Rule("no_decay",       "layers.*.attn.dt_bias",                 A, 0.0),
        # depthwise causal conv kernels [C, 1, 4]: not matrices
        Rule("no_decay",       "layers.*.attn.*_conv1d.weight",         A, 0.0),
        # the router is a gate: never decayed, whichever optimizer runs it
        Rule("router",         "layers.*.moe.router.gate.weight",       moe_opt, 0.0),
        Rule("experts",        "layers.*.moe.experts.w[123]",           moe_opt, moe_wd,
             expert_stack=True),
        Rule("shared_experts", "layers.*.moe.shared_experts.w[123].weight", moe_opt, moe_wd),
        # GDN q/k/v/a/b/g/o projections and MLA wq_a/wq_b/wkv_a/wkv_b/wo (norms matched above)
        Rule("hidden",         "layers.*.attn.*.weight",                N, normuon_weight_decay),
        Rule("hidden",         "layers.*.feed_forward.*.weight",        N, normuon_weight_decay),
        Rule("hidden",         "mtp_heads.*.w_in.weight",               N, normuon_weight_decay),
        Rule("hidden",         "mtp_heads.*.w_out.weight",              N, normuon_weight_decay),
    ]


def canonical_name(fqn: str) -> str:
    """The FQN without torch.compile / checkpoint / FSDP1 wrapper segments."""
    for seg in _WRAPPER_SEGMENTS:
        fqn = fqn.replace(seg, "")
    return fqn


def assign_parameters(
    named_params: Iterable[tuple[str, nn.Parameter]], rules: list[Rule]
) -> dict[str, tuple[Rule, nn.Parameter]]:
    """Map each trainable parameter's canonical FQN to its rule (first match wins).

    Frozen parameters (requires_grad False) are left out. Raises ValueError naming every
    unmatched parameter, and every parameter whose shape its optimizer cannot take.
    """
    out: dict[str, tuple[Rule, nn.Parameter]] = {}
    unmatched, bad_shape = [], []
    for fqn, p in named_params:
        if not p.requires_grad:
            continue
        name = canonical_name(fqn)
        rule = next((r for r in rules if fnmatch.fnmatchcase(name, r.pattern)), None)
        if rule is None:
            unmatched.append(f"{name} {tuple(p.shape)}")
            continue
        if rule.optimizer == NORMUON:
            ok = p.ndim == 3 if rule.expert_stack else p.ndim == 2
            if not ok:
                want = "3-D [E, out, in]" if rule.expert_stack else "2-D"
                bad_shape.append(f"{name} {tuple(p.shape)} (rule {rule.name!r} wants {want})")
                continue
        out[name] = (rule, p)
    errors = []
    if unmatched:
        errors.append(
            "parameters matched by no rule of the optimizer table "
            "(hymo_recipes/optim/partition.py): " + ", ".join(unmatched)
        )
    if bad_shape:
        errors.append("parameters NorMuon cannot take: " + ", ".join(bad_shape))
    if errors:
        raise ValueError("; ".join(errors))
    return out


def build_param_groups(
    named_params: Iterable[tuple[str, nn.Parameter]], rules: list[Rule]
) -> dict[str, list[dict]]:
    """Param groups per optimizer: ``{"normuon": [...], "cautious_adamw": [...]}``.

    One group per rule name (in order of first appearance in the model, identical on every
    rank); each group dict holds ``params``, ``group``
    (the name), ``weight_decay`` and ``lr_mult``; the container turns ``lr_mult`` into ``lr``.
    Empty groups are not created (DCP cannot restore a group without parameters).
    """
    assigned = assign_parameters(named_params, rules)
    groups: dict[tuple[str, str], dict] = {}
    for rule, p in assigned.values():
        key = (rule.optimizer, rule.name)
        g = groups.get(key)
        if g is None:
            g = groups[key] = dict(
                params=[], group=rule.name, weight_decay=rule.weight_decay, lr_mult=rule.lr_mult
            )
        elif (g["weight_decay"], g["lr_mult"]) != (rule.weight_decay, rule.lr_mult):
            raise ValueError(
                f"rules named {rule.name!r} disagree on weight_decay/lr_mult; give them "
                f"different names"
            )
        g["params"].append(p)
    out: dict[str, list[dict]] = {}
    for (opt, _), g in groups.items():
        out.setdefault(opt, []).append(g)
    return out
