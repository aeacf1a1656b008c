"""The HyMo model: Gated DeltaNet and MLA+MoE blocks, tied embedding, MTP heads.

Single-device code; parallelism is applied from outside (TorchTitan iterates ``layers``).
Shapes: B batch, T tokens, D = dim, V = vocab_size. With ``cu_seqlens`` [N + 1] marking N
documents over the B·T tokens taken row after row (every row starting one), the batch runs as
one packed sequence: GDN state and conv, attention and RoPE positions all restart at every
document start, so it computes what N separate forwards would (document masking; training
derives the boundaries from the batch's BOS tokens, ``documents_of``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .args import HymoModelArgs
from .gdn import GatedDeltaNet
from .linear_ce import IGNORE_INDEX, ce_chunk, linear_cross_entropy, linear_cross_entropy_reference
from .mla import MLA, document_attention_mask, precompute_rope_cache
from .moe import FeedForward, MoE
from .mtp import MTPHead


def documents_of(tokens: torch.Tensor, start_id: int | None = None, end_id: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens [N + 1] int32, positions [B·T] int64) of the documents of a packed batch
    tokens [B, T]: a document starts at every row start and at every ``start_id`` (BOS) token,
    or, without one, after every ``end_id`` (EOS) token. The rows are independent samples, so
    a document the packing split across two rows is two documents, as it is without masking.
    """
    if (start_id is None) == (end_id is None):
        raise ValueError("documents_of: give exactly one of start_id (BOS) and end_id (EOS)")
    if tokens.dim() != 2:
        raise ValueError(f"documents_of: tokens must be [B, T], got {tuple(tokens.shape)}")
    B, T = tokens.shape
    starts = tokens == start_id if start_id is not None else F.pad(tokens[:, :-1] == end_id, (1, 0))
    starts[:, 0] = True
    idx = torch.nonzero(starts.reshape(-1)).squeeze(1)
    cu = torch.cat([idx, idx.new_full((1,), B * T)]).to(torch.int32)
    return cu, positions_in_documents(cu, B * T)


def positions_in_documents(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T] index of each token inside its document, from cumulative lengths [N + 1]."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor [N + 1] of cumulative lengths")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {cu_seqlens.tolist()}")
    lengths = cu_seqlens.diff()
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    idx = torch.arange(T, device=cu_seqlens.device)
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=T)
    return idx - starts


class HeadLosses(NamedTuple):
    """What the forward returns when given labels: per head (main first, then MTP head 1, 2, ...)
    the sum of its cross-entropy over its valid targets and their count, both fp32 [1 + mtp_depth]."""

    sums: torch.Tensor
    counts: torch.Tensor


def _out_std(init_std: float, depth: int) -> float:
    """Depth-scaled std of projections that write into the residual stream (TorchTitan's)."""
    return init_std / math.sqrt(2 * (depth + 1))


class GDNBlock(nn.Module):
    """x + GDN(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)) if the flavor gives GDN blocks an FFN."""

    moe_enabled = False

    def __init__(self, layer_id: int, args: HymoModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.init_std = args.init_std
        self.attn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attn = GatedDeltaNet(args)
        if args.gdn_ffn_dim > 0:
            self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
            self.feed_forward = FeedForward(args.dim, args.gdn_ffn_dim)
        else:
            self.ffn_norm = None
            self.feed_forward = None

    def forward(self, x, rope_cache, cu_seqlens=None, positions=None, attn_mask=None):
        x = x + self.attn(self.attn_norm(x), cu_seqlens, positions)
        if self.feed_forward is not None:
            x = x + self.feed_forward(self.ffn_norm(x))
        return x

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        out_std = _out_std(self.init_std, self.layer_id)
        self.attn_norm.reset_parameters()
        self.attn.init_weights(self.init_std, out_std)
        if self.feed_forward is not None:
            self.ffn_norm.reset_parameters()
            self.feed_forward.init_weights(self.init_std, out_std)


class MLABlock(nn.Module):
    """x + MLA(RMSNorm(x)), then x + MoE(RMSNorm(x))."""

    moe_enabled = True

    def __init__(self, layer_id: int, args: HymoModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.init_std = args.init_std
        self.attn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attn = MLA(args, use_rope=layer_id not in args.nope_layers)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args)

    def forward(self, x, rope_cache, cu_seqlens=None, positions=None, attn_mask=None):
        x = x + self.attn(self.attn_norm(x), rope_cache, positions, attn_mask)
        return x + self.moe(self.ffn_norm(x))

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        out_std = _out_std(self.init_std, self.layer_id)
        self.attn_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attn.init_weights(self.init_std, out_std)
        self.moe.init_weights(self.init_std, out_std, buffer_device)


class HymoModel(nn.Module):
    """Hybrid GDN / MLA-MoE language model.

    ``forward(tokens)`` returns ``(logits, mtp_logits)``: logits [B, T, V] and a list of
    mtp_depth tensors [B, T, V] (empty if mtp_depth = 0), see mtp.py for their alignment.
    ``forward(tokens, labels=labels)`` returns their cross-entropy instead (``HeadLosses``),
    through ``linear_cross_entropy`` in chunks of ``fused_loss_chunk`` tokens: no head's full
    logits are ever held (training's path when ``fused_loss_chunk`` > 0).
    The output head is the embedding matrix (tied); there is no separate output weight.
    A plain ``nn.Module``: TorchTitan's Trainer needs ``HymoModel(args)`` (built on the meta
    device), ``init_weights(buffer_device=)`` and ``forward``, and iterates ``layers``.

    Args:
        model_args: a validated HymoModelArgs.
    """

    def __init__(self, model_args: HymoModelArgs):
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        self.layers = nn.ModuleDict()
        for i in range(model_args.n_layers):
            block = MLABlock if i in model_args.mla_layers else GDNBlock
            self.layers[str(i)] = block(i, model_args)
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.loss_chunk_fn = ce_chunk  # the fused loss's per-chunk work (parallelize may swap in a faster one)
        self.mtp_heads = nn.ModuleDict(
            {str(k): MTPHead(model_args.dim, model_args.mtp_inter_dim, model_args.norm_eps)
             for k in range(1, model_args.mtp_depth + 1)}
        )

    def _rope_cache(self) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Sets every parameter and buffer; the model may have been built on the meta device."""
        a = self.model_args
        buffer_device = buffer_device if buffer_device is not None else self.rope_cache.device
        with torch.device(buffer_device):
            self.rope_cache = self._rope_cache()
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=a.init_std)
        for layer in self.layers.values():
            layer.init_weights(buffer_device=buffer_device)
        self.norm.reset_parameters()
        for k, head in self.mtp_heads.items():
            head.init_weights(a.init_std, _out_std(a.init_std, a.n_layers - 1 + int(k)))
        if a.mup_base_width:  # muP: per-role init-std multipliers on the draws above
            from hymo_recipes.mup import apply_mup_init

            apply_mup_init(self)

    def forward(
        self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None, positions: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | HeadLosses:
        """
        Args:
            tokens: [B, T] token ids.
            cu_seqlens: [N + 1] cumulative document lengths over the B·T tokens, row after row;
                every row must start a document (a multiple of T is always a boundary).
            positions: [B·T] each token's index in its document, as ``positions_in_documents``
                gives it; callers that computed it on the host pass it (computing it here
                reads cu_seqlens on the host, a synchronisation on the GPU). With cu_seqlens only.
                Each document's positions count up by one from its first token, so that each
                token's document start (index − position) never decreases along the tokens:
                the GPU's attention mask is built from those starts (``mla.document_block_mask``).
            labels: [B, T] next-token targets (IGNORE_INDEX where there is none): return the
                heads' cross-entropy sums instead of their logits. Head k scores position t
                against labels[:, t + k] (``mtp.shift_for_head``).

        Returns:
            logits [B, T, V] and the list of MTP logits [B, T, V]; with labels, ``HeadLosses``.
        """
        B, T = tokens.shape
        if labels is not None and labels.shape != tokens.shape:
            raise ValueError(f"labels must be shaped like tokens {tuple(tokens.shape)}, got {tuple(labels.shape)}")
        if T > self.model_args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.model_args.max_seq_len}")
        attn_mask = None
        if cu_seqlens is not None:
            if positions is None:
                positions = positions_in_documents(cu_seqlens, B * T)
                if B > 1 and bool((positions.view(B, T)[:, 0] != 0).any()):
                    raise ValueError("cu_seqlens: every row of the batch must start a document")
            elif positions.shape != (B * T,):
                raise ValueError(f"positions must be [B·T] = [{B * T}], got {tuple(positions.shape)}")
            tokens = tokens.reshape(1, B * T)  # the rows as one packed sequence
            if self.model_args.mla_layers:
                attn_mask = document_attention_mask(positions)
        elif positions is not None:
            raise ValueError("positions are given with cu_seqlens only")

        h = self.tok_embeddings(tokens)
        mla_layers = self.model_args.mla_layers
        for layer_id, layer in self.layers.items():
            # the mask goes to the attention blocks only (a compiled GDN block never traces it),
            # chosen by index: compile and AC wrap the blocks, so their class is not MLABlock
            mask = attn_mask if int(layer_id) in mla_layers else None
            h = layer(h, self.rope_cache, cu_seqlens, positions, mask)
        if cu_seqlens is not None:
            h = h.view(B, T, -1)
        # each head's readout input, then its output, head after head (the main head first)
        heads = [self.norm, *self.mtp_heads.values()]
        if labels is not None:
            return self._head_losses(h, heads, labels)
        logits = [F.linear(self._readout_input(head, h), self.tok_embeddings.weight) for head in heads]
        return logits[0], logits[1:]

    def _readout_input(self, head: nn.Module, h: torch.Tensor) -> torch.Tensor:
        mult = self.logit_multiplier
        # muP's readout multiplier on the tied head, applied to its input (the same logits up to
        # rounding, for dim multiplications per token instead of vocab_size)
        return head(h) * mult if mult != 1.0 else head(h)

    def _head_losses(self, h: torch.Tensor, heads: list[nn.Module], labels: torch.Tensor) -> HeadLosses:
        chunk, weight = self.model_args.fused_loss_chunk, self.tok_embeddings.weight
        sums, counts = [], []
        for k, head in enumerate(heads):
            r = self._readout_input(head, h)
            # head k's targets at every position: labels shifted by k, none for the last k
            targets = F.pad(labels[:, k:], (0, k), value=IGNORE_INDEX) if k else labels
            sums.append(linear_cross_entropy(r, weight, targets, chunk, self.loss_chunk_fn) if chunk
                        else linear_cross_entropy_reference(r, weight, targets))
            counts.append((targets != IGNORE_INDEX).sum())
        return HeadLosses(torch.stack(sums), torch.stack(counts).float())

    @property
    def logit_multiplier(self) -> float:
        """Factor on every logit of the tied head: muP's 1/width_mult, 1.0 without muP. Code
        that computes logits itself (``F.linear(norm(h), tok_embeddings.weight)``) must apply it."""
        a = self.model_args
        return a.mup_base_width / a.dim if a.mup_base_width else 1.0
