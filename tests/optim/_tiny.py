"""A tiny model with HyMo's parameter names, its data, a train step and DCP helpers.

Shared by the container and distributed tests. Shapes are chosen to exercise the awkward
cases: row counts that two ranks cannot split evenly (7 rows, 3 experts), two layers with
same-shape matrices (batched, owned by different ranks), and a matrix that gets no gradient.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

VOCAB, DIM, HID, E = 32, 12, 20, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM)
        self.attn = nn.Module()
        self.attn.q_proj = nn.Linear(DIM, HID, bias=False)
        self.attn.o_proj = nn.Linear(HID, DIM, bias=False)
        self.attn.q_conv1d = nn.Conv1d(HID, HID, 4, groups=HID, bias=False)
        self.attn.A_log = nn.Parameter(torch.zeros(4))
        # never used in forward: its grad stays None (must not hang the collectives)
        self.attn.unused_proj = nn.Linear(DIM, DIM, bias=False)
        self.ffn_norm = nn.RMSNorm(DIM)
        self.moe = nn.Module()
        self.moe.router = nn.Module()
        self.moe.router.gate = nn.Linear(DIM, E, bias=False)
        self.moe.experts = nn.Module()
        self.moe.experts.w1 = nn.Parameter(torch.randn(E, 8, DIM) / DIM**0.5)
        self.moe.experts.w2 = nn.Parameter(torch.randn(E, DIM, 8) / 8**0.5)

    def forward(self, x):
        h = self.attn_norm(x)
        q = self.attn.q_proj(h)  # [B, T, HID]
        q = self.attn.q_conv1d(F.pad(q.transpose(1, 2), (3, 0))).transpose(1, 2)
        x = x + self.attn.o_proj(F.silu(q)) * torch.sigmoid(self.attn.A_log.mean())
        h = self.ffn_norm(x)
        gates = torch.softmax(self.moe.router.gate(h), dim=-1)  # dense mixture [B, T, E]
        inner = F.silu(torch.einsum("btd,eid->btei", h, self.moe.experts.w1))
        out = torch.einsum("btei,edi->bted", inner, self.moe.experts.w2)
        return x + (gates.unsqueeze(-1) * out).sum(-2)


class TinyModel(nn.Module):
    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.norm = nn.RMSNorm(DIM)
        self.mtp_heads = nn.ModuleDict({"1": nn.Module()})
        self.mtp_heads["1"].w_in = nn.Linear(DIM, 7, bias=False)  # 7 rows: uneven over 2 ranks
        self.mtp_heads["1"].w_out = nn.Linear(7, DIM, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        h = self.norm(x)
        h = h + self.mtp_heads["1"].w_out(F.silu(self.mtp_heads["1"].w_in(h)))
        return h @ self.tok_embeddings.weight.T  # tied head


def make_model(seed: int = 0) -> TinyModel:
    torch.manual_seed(seed)
    return TinyModel()


def batch(step: int, rank: int = 0, world: int = 1, per_rank: int = 2, seq: int = 9):
    """Rank r's slice of step's global batch (the global batch does not depend on world)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (per_rank * 2, seq + 1), generator=g)
    rows = per_rank * 2 // world
    return tokens[rank * rows : (rank + 1) * rows]


def loss_fn(model, tokens):
    tokens = tokens.to(model.tok_embeddings.weight.device)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def optim_config(**overrides):
    """An [optimizer] section with HyMo's fields (the defaults of hymo_recipes/titan/job_config.py)."""
    from hymo_recipes.titan.job_config import Optimizer

    cfg = Optimizer()
    base = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, implementation="foreach",
                early_step_in_backward=False, normuon_ortho_dtype="float32")
    return types.SimpleNamespace(**{**vars(cfg), **base, **overrides})


def sched_config(**overrides):
    base = dict(warmup_steps=None, decay_ratio=None, total_steps=10, warmup_fraction=0.2,
                stable_fraction=0.4, decay_fraction=0.4, decay_type="linear", min_lr_factor=0.05)
    return types.SimpleNamespace(**{**base, **overrides})


class ModelState(Stateful):
    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd):
        set_model_state_dict(self.model, sd)


def train_steps(model, optimizers, schedulers, steps, rank=0, world=1, nan_grad_steps=()):
    """TorchTitan's order: zero_grad, forward/backward, optimizer step, scheduler step.
    ``nan_grad_steps``: steps whose first gradient gets a NaN before the optimizer step (the NaN
    guard skips them).

    Returns the global mean loss per step (all-reduced when distributed)."""
    import torch.distributed as dist

    losses = []
    for s in steps:
        optimizers.zero_grad()
        loss = loss_fn(model, batch(s, rank, world))
        loss.backward()
        if s in nan_grad_steps:
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("nan")
        optimizers.step()
        schedulers.step()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
    return losses
