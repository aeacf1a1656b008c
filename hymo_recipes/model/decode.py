"""Cached decoding for HyMo: O(1) per token in the GDN layers, O(context) in the MLA layers.

``HymoDecoder(model)`` runs a trained ``HymoModel`` on its own parameters (nothing is copied or
re-laid out, the training forward is untouched):

- **prefill**: the prompts of a batch are packed into one row with ``cu_seqlens`` (the training
  forward's document masking), so each prompt is computed exactly as if it ran alone, whatever
  the other prompts' lengths; past ``max_tokens`` (``PREFILL_MAX_TOKENS`` by default) into
  several rows of consecutive prompts, one forward each, their caches concatenated along the
  batch (a forward's activations grow with its tokens, and on the CPU its attention mask with
  their square). GDN layers run the configured chunked backend (the chunked PyTorch
  reference on CPU, the Triton kernel on GPU) with ``output_final_state=True``; MLA layers run
  the training attention and keep their latent cache. (On GPU the prefill runs the PyTorch conv
  around the Triton recurrence, not the fused mixer op of training, which keeps no final state:
  the same math.)
- **step**: one token per sequence. Each sequence keeps its own length (a right-padded cache
  with per-sequence lengths, no left padding): its RoPE position is its own length and its
  attention sees only its own cached tokens.

The cache, per layer (``DecodeCache``):

- GDN: the recurrent state S [B, H, K, V] in fp32 (as the kernels keep it) and the short conv's
  last W − 1 *inputs* (the q/k/v projections before the conv) [B, W − 1, Cq + Ck + Cv], zeros
  before a sequence's start (the training conv's zero padding). A step is the conv from those
  inputs, SiLU, the L2 norms, one recurrent step (``hymo_kernels.gdn.recurrent_torch``; with
  the Triton backend all of these one fused kernel, ``hymo_kernels.gdn.recurrent``), the
  gated norm and o_proj: its cost does not depend on the context length.
- MLA: per token, the *normalised* latent ``kv_norm(c_kv)`` [B, L, kv_lora_rank] (the norm is
  per token, so it is applied once, at write time) and the *rotated* shared rope key
  [B, L, qk_rope_head_dim] (unrotated in NoPE layers); kv_lora_rank + qk_rope_head_dim values
  per token per MLA layer. Weight absorption (DeepSeek-V2 §2.1): wkv_b, viewed per KV group as
  [G, nope + v, kv_lora_rank], is split into W_uk [G, nope, r] and W_uv [G, v, r]; query head h
  of group g = h // (n_heads / n_kv_heads) scores a cached token by
  (W_uk[g]ᵀ q_nope_h) · c + q_rope_h · k_rope and reads W_uv[g] (Σ p c), so the cache is never
  expanded to per-head keys and values (GQA: the R = n_heads / n_kv_heads heads of a group
  share their group's W_uk / W_uv).

MoE at inference is dropless (as with ``moe_capacity_factor = 0``) in prefill and steps:
capacity dropping ranks a token against the other tokens of the forward, so it would make a
prompt's output depend on the other prompts of the batch (and one token per step never fills
an expert anyway). Nothing is counted into the balancing buffers. MTP heads are not run.
Sequences may run past ``max_seq_len``: the RoPE table is extended with the same formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hymo_kernels.gdn.mixer_torch import l2_normalize, short_causal_conv
from hymo_kernels.gdn.recurrent_torch import gated_delta_rule_step

from .gdn import GatedDeltaNet
from .mla import MLA, apply_rope, document_attention_mask, precompute_rope_cache
from .model import GDNBlock, HymoModel, positions_in_documents
from .moe import MoE

PREFILL_MAX_TOKENS = 32768  # tokens per prefill forward (HymoDecoder.prefill's max_tokens)


def _readout(model: HymoModel, h: torch.Tensor) -> torch.Tensor:
    """The main head's logits as HymoModel.forward computes them (the tied head, muP's multiplier)."""
    mult = model.logit_multiplier
    x = model.norm(h)
    return F.linear(x if mult == 1.0 else x * mult, model.tok_embeddings.weight)


@dataclass
class GDNLayerCache:
    state: torch.Tensor  # [B, H, K, V] fp32 recurrent state
    conv: torch.Tensor  # [B, W - 1, Cq + Ck + Cv] last conv inputs, oldest first


@dataclass
class MLALayerCache:
    kv: torch.Tensor  # [B, L, kv_lora_rank] kv_norm(c_kv) per token
    k_rope: torch.Tensor  # [B, L, qk_rope_head_dim] rotated shared rope key per token


@dataclass
class DecodeCache:
    """Per-layer caches of a batch; ``lengths`` [B] are the tokens each sequence holds."""

    lengths: torch.Tensor
    layers: dict[str, GDNLayerCache | MLALayerCache] = field(default_factory=dict)
    max_length: int = 0  # max(lengths), kept on the host (no device sync per step)

    @staticmethod
    def cat(caches: list[DecodeCache]) -> DecodeCache:
        """The caches of consecutive groups of sequences as one batch (their MLA caches must
        have equal room)."""
        layers = {}
        for name, first in caches[0].layers.items():
            each = [c.layers[name] for c in caches]
            if isinstance(first, GDNLayerCache):
                layers[name] = GDNLayerCache(state=torch.cat([c.state for c in each]),
                                             conv=torch.cat([c.conv for c in each]))
            else:
                layers[name] = MLALayerCache(kv=torch.cat([c.kv for c in each]),
                                             k_rope=torch.cat([c.k_rope for c in each]))
        return DecodeCache(lengths=torch.cat([c.lengths for c in caches]), layers=layers,
                           max_length=max(c.max_length for c in caches))

    @property
    def capacity(self) -> int:
        """Tokens the MLA caches hold room for (they grow when a step needs more)."""
        caps = [c.kv.shape[1] for c in self.layers.values() if isinstance(c, MLALayerCache)]
        return min(caps) if caps else 1 << 62

    def nbytes_per_sequence(self, length: int | None = None) -> dict[str, int]:
        """Bytes one sequence of ``length`` tokens (default: the longest) keeps: the fixed GDN part
        and the per-token MLA part."""
        length = self.max_length if length is None else length
        gdn = mla = 0
        for c in self.layers.values():
            if isinstance(c, GDNLayerCache):
                gdn += (c.state[0].numel() * c.state.element_size() + c.conv[0].numel() * c.conv.element_size())
            else:
                mla += length * (c.kv.shape[-1] * c.kv.element_size() + c.k_rope.shape[-1] * c.k_rope.element_size())
        return {"gdn": gdn, "mla": mla}


def dropless_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward without capacity dropping and without counting loads: x [..., dim] -> [..., dim].

    The same routing, sort and expert calls as training with capacity factor 0."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    N, k = xf.shape[0], moe.top_k
    weights, idx = moe.router(xf, moe.expert_bias)  # [N, k] fp32, [N, k]
    flat = idx.reshape(-1)
    token = torch.arange(N * k, device=x.device) // k
    order = torch.argsort(flat * N + token)
    counts = torch.zeros(moe.num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    routed, at = moe.experts(xf, token[order], counts)
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(N * k, device=x.device)
    routed = routed[at[unsort]].view(N, k, -1)
    out = torch.bmm(weights[:, None, :], routed.float()).squeeze(1).to(x.dtype)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(xf)
    return out.view(shape)


# -- GDN -----------------------------------------------------------------------------------------

def _conv_weights(attn: GatedDeltaNet) -> torch.Tensor:
    """[Cq + Ck + Cv, W] depthwise kernels of the q, k, v convs, in cache order."""
    return torch.cat([attn.q_conv1d.weight, attn.k_conv1d.weight, attn.v_conv1d.weight])[:, 0, :]


def gdn_prefill(attn: GatedDeltaNet, x: torch.Tensor, cu_seqlens: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, GDNLayerCache]:
    """The GDN mixer on packed prompts x [1, T, dim] (PyTorch conv path, the configured chunked
    backend) -> (output [1, T, dim], the cache after each prompt)."""
    _, T, _ = x.shape
    xq, xk, xv = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = F.silu(short_causal_conv(xq, attn.q_conv1d.weight, positions))
    k = F.silu(short_causal_conv(xk, attn.k_conv1d.weight, positions))
    v = F.silu(short_causal_conv(xv, attn.v_conv1d.weight, positions))
    q = l2_normalize(q.view(1, T, -1, attn.head_dim))
    k = l2_normalize(k.view(1, T, -1, attn.head_dim))
    v = v.view(1, T, -1, attn.v_head_dim)
    beta, g = attn._gates(x)
    o, state = attn._rule(q, k, v, g, beta, cu_seqlens=cu_seqlens, output_final_state=True, **attn._rule_kwargs)
    gate = attn.g_proj(x).view(1, T, -1, attn.v_head_dim)
    out = attn.o_proj(attn.o_norm(o, gate).reshape(1, T, -1))

    # the last W - 1 conv inputs of each prompt, oldest first; zeros before its first token
    W = attn.q_conv1d.weight.shape[-1]
    inputs = torch.cat([xq, xk, xv], dim=-1)[0]  # [T, C]
    back = torch.arange(W - 1, 0, -1, device=x.device)  # slot s holds token end - (W - 1 - s)
    idx = cu_seqlens[1:, None] - back[None, :]  # [N, W - 1]
    valid = idx >= cu_seqlens[:-1, None]
    conv = inputs[idx.clamp(min=0)] * valid[..., None].to(inputs.dtype)
    return out, GDNLayerCache(state=state.float().contiguous(), conv=conv)


def gdn_step(attn: GatedDeltaNet, x: torch.Tensor, cache: GDNLayerCache) -> torch.Tensor:
    """One token per sequence: x [B, dim] -> [B, dim]; updates ``cache`` (state and conv inputs).
    With the fused Triton mixer (gdn_backend "triton") and a conv size of 2-4, conv, norms and
    recurrence are one kernel that updates the cache in place (hymo_kernels.gdn.recurrent)."""
    B = x.shape[0]
    xs = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)  # [B, C]
    beta, g = attn._gates(x)  # [B, H]
    w = _conv_weights(attn)  # [C, W]; w[:, W-1] multiplies the current token
    W = w.shape[-1]
    if attn.fused:  # Triton imported only on this path
        from hymo_kernels.gdn import recurrent
    if attn.fused and 2 <= W <= recurrent.MAX_W:
        o = recurrent.gdn_decode_step(xs, cache.conv, w, g, beta, cache.state, attn.head_dim, attn.v_head_dim)
    else:
        window = torch.cat([cache.conv, xs[:, None]], dim=1)  # [B, W, C], the current token last
        w = w.to(xs.dtype)
        # the taps in short_causal_conv's order (current token first), so the sums round alike
        y = window[:, W - 1] * w[:, W - 1]
        for j in range(1, W):
            y = y + window[:, W - 1 - j] * w[:, W - 1 - j]
        cache.conv = window[:, 1:]
        y = F.silu(y)
        key_dim = attn.q_proj.out_features
        q, k, v = y.split([key_dim, key_dim, attn.v_proj.out_features], dim=-1)
        q = l2_normalize(q.view(B, -1, attn.head_dim))
        k = l2_normalize(k.view(B, -1, attn.head_dim))
        v = v.view(B, -1, attn.v_head_dim)
        o, cache.state = gated_delta_rule_step(q, k, v, g, beta, cache.state)
    gate = attn.g_proj(x).view(B, -1, attn.v_head_dim)
    return attn.o_proj(attn.o_norm(o, gate).reshape(B, -1))


# -- MLA -----------------------------------------------------------------------------------------

def _latent(attn: MLA, x: torch.Tensor, rope: torch.Tensor,
            positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache entries of tokens x [T, dim] at positions [T]: (kv_norm(c_kv) [T, r], rope key [T, dr])."""
    c_kv, k_rope = attn.wkv_a(x).split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    if attn.use_rope:
        k_rope = apply_rope(k_rope[None, :, None, :], rope, positions)[0, :, 0]
    return attn.kv_norm(c_kv), k_rope


def mla_prefill(attn: MLA, x: torch.Tensor, rope: torch.Tensor, cu_seqlens: torch.Tensor, positions: torch.Tensor,
                capacity: int, attn_mask=None) -> tuple[torch.Tensor, MLALayerCache]:
    """The MLA mixer on packed prompts x [1, T, dim] (the training attention with document
    masking; ``attn_mask``: ``document_attention_mask(positions)``, shared by the layers) ->
    (output [1, T, dim], the latent cache with room for ``capacity`` tokens)."""
    out = attn(x, rope, positions, attn_mask)
    kv, k_rope = _latent(attn, x[0], rope, positions)
    lengths = cu_seqlens.diff()
    N = lengths.numel()
    row = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=x.shape[1])
    cache = MLALayerCache(kv=kv.new_zeros(N, capacity, kv.shape[-1]),
                          k_rope=k_rope.new_zeros(N, capacity, k_rope.shape[-1]))
    cache.kv[row, positions] = kv
    cache.k_rope[row, positions] = k_rope
    return out, cache


def _grow(cache: MLALayerCache, needed: int) -> None:
    L = cache.kv.shape[1]
    if needed <= L:
        return
    extra = max(needed, 2 * L) - L
    def more(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(t.shape[0], extra, t.shape[-1])], dim=1)

    cache.kv, cache.k_rope = more(cache.kv), more(cache.k_rope)


def mla_step(attn: MLA, x: torch.Tensor, rope: torch.Tensor, cache: MLALayerCache, lengths: torch.Tensor,
             max_length: int | None = None) -> torch.Tensor:
    """One token per sequence with weight absorption: x [B, dim] at positions ``lengths`` [B] -> [B, dim].

    Appends the token's latent and rope key to ``cache`` and attends over each sequence's own
    lengths[b] + 1 cached tokens. ``max_length``: max(lengths) if the caller knows it."""
    B = x.shape[0]
    H, G = attn.n_heads, attn.n_kv_heads
    R = H // G
    dn, dr, dv, r = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(B, H, dn + dr)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    if attn.use_rope:
        q_rope = apply_rope(q_rope[None], rope, lengths)[0]  # the batch as the time axis: one position each
    kv, k_rope = _latent(attn, x, rope, lengths)
    L = (int(lengths.max()) if max_length is None else max_length) + 1
    _grow(cache, L)
    batch = torch.arange(B, device=x.device)
    cache.kv[batch, lengths] = kv
    cache.k_rope[batch, lengths] = k_rope

    c, kr = cache.kv[:, :L], cache.k_rope[:, :L]  # [B, L, r], [B, L, dr]
    wkv_b = attn.wkv_b.weight.view(G, dn + dv, r)
    w_uk, w_uv = wkv_b[:, :dn], wkv_b[:, dn:]  # [G, dn, r], [G, dv, r]
    q_lat = torch.einsum("bgnd,gdc->bgnc", q_nope.reshape(B, G, R, dn), w_uk)  # W_ukᵀ q_nope, [B, G, R, r]
    scores = (torch.einsum("bgnc,blc->bgnl", q_lat, c)
              + torch.einsum("bgnd,bld->bgnl", q_rope.reshape(B, G, R, dr), kr)).float() * attn.softmax_scale
    visible = torch.arange(L, device=x.device)[None, :] <= lengths[:, None]  # [B, L]
    p = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(dim=-1).to(c.dtype)
    o_lat = torch.einsum("bgnl,blc->bgnc", p, c)  # Σ p c, [B, G, R, r]
    o = torch.einsum("bgnc,gvc->bgnv", o_lat, w_uv)  # W_uv (Σ p c), [B, G, R, dv]
    return attn.wo(o.reshape(B, H * dv))


# -- the model -----------------------------------------------------------------------------------

class HymoDecoder:
    """Prefill and per-token steps of a HymoModel with a DecodeCache (module docstring).

    Args:
        model: a HymoModel (not FSDP-wrapped); put it in eval mode. Calls run under no_grad.
    """

    def __init__(self, model: HymoModel):
        self.model = model
        self.args = model.model_args
        self._rope = model.rope_cache

    def rope(self, length: int) -> torch.Tensor:
        """The model's RoPE table, extended (same formula) when sequences run past max_seq_len."""
        if self._rope.shape[0] < length:
            a = self.args
            n = max(length, 2 * self._rope.shape[0])
            self._rope = precompute_rope_cache(a.qk_rope_head_dim, n, a.rope_theta).to(self._rope)
        return self._rope

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]] | list[torch.Tensor], capacity: int | None = None,
                all_logits: bool = False, max_tokens: int | None = PREFILL_MAX_TOKENS
                ) -> tuple[torch.Tensor | list[torch.Tensor], DecodeCache]:
        """Runs the prompts (token id lists of any lengths ≥ 1) as one packed row, or as several
        when they hold more than ``max_tokens`` tokens.

        Args:
            prompts: B token sequences.
            capacity: tokens per sequence the MLA caches get room for (default: the longest
                prompt + 64); they grow when needed.
            all_logits: return every position's logits instead of each prompt's last.
            max_tokens: the most tokens one forward packs (consecutive prompts; a longer prompt
                alone); None: every prompt in one forward.
                Default: PREFILL_MAX_TOKENS.

        Returns:
            logits [B, vocab] of each prompt's last token (or a list of [len_b, vocab]) and the cache.
        """
        model = self.model
        device = model.tok_embeddings.weight.device
        seqs = [torch.as_tensor(p, dtype=torch.long, device=device).reshape(-1) for p in prompts]
        if not seqs or any(s.numel() == 0 for s in seqs):
            raise ValueError("every prompt needs at least one token")
        sizes = [s.numel() for s in seqs]
        longest = max(sizes)
        capacity = max(longest + 1, longest + 64 if capacity is None else capacity)
        if max_tokens is not None and len(seqs) > 1 and sum(sizes) > max_tokens:
            groups, start, held = [], 0, 0
            for i, n in enumerate(sizes):
                if held and held + n > max_tokens:
                    groups.append((start, i))
                    start, held = i, 0
                held += n
            groups.append((start, len(seqs)))
            parts = [self.prefill(seqs[a:b], capacity, all_logits, max_tokens=None) for a, b in groups]
            cache = DecodeCache.cat([c for _, c in parts])
            if all_logits:
                return [lg for part, _ in parts for lg in part], cache
            return torch.cat([lg for lg, _ in parts]), cache
        lengths = torch.tensor(sizes, dtype=torch.long, device=device)
        cu = F.pad(lengths.cumsum(0), (1, 0))
        tokens = torch.cat(seqs)[None]
        T = tokens.shape[1]
        positions = positions_in_documents(cu, T)
        rope = self.rope(capacity)

        cache = DecodeCache(lengths=lengths.clone(), max_length=longest)
        # attention within each prompt: a block mask on the GPU (no T x T tensor), dense elsewhere
        attn_mask = document_attention_mask(positions) if model.model_args.mla_layers else None
        h = model.tok_embeddings(tokens)
        for name, layer in model.layers.items():
            if isinstance(layer, GDNBlock):
                out, cache.layers[name] = gdn_prefill(layer.attn, layer.attn_norm(h), cu, positions)
                h = h + out
                if layer.feed_forward is not None:
                    h = h + layer.feed_forward(layer.ffn_norm(h))
            else:
                out, cache.layers[name] = mla_prefill(layer.attn, layer.attn_norm(h), rope, cu, positions, capacity,
                                                      attn_mask)
                h = h + out
                h = h + dropless_moe(layer.moe, layer.ffn_norm(h))
        if all_logits:
            logits = _readout(model, h[0])
            return list(logits.split(lengths.tolist())), cache
        return _readout(model, h[0, cu[1:] - 1]), cache

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
        """Feeds one token per sequence (tokens [B]) at each sequence's next position; returns
        the logits [B, vocab] and advances ``cache``."""
        model = self.model
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=model.tok_embeddings.weight.device).reshape(-1)
        if tokens.numel() != cache.lengths.numel():
            raise ValueError(f"step takes one token per sequence: {cache.lengths.numel()}, got {tokens.numel()}")
        lengths = cache.lengths
        rope = self.rope(cache.max_length + 1)
        h = model.tok_embeddings(tokens)  # [B, dim]
        for name, layer in model.layers.items():
            c = cache.layers[name]
            if isinstance(layer, GDNBlock):
                h = h + gdn_step(layer.attn, layer.attn_norm(h), c)
                if layer.feed_forward is not None:
                    h = h + layer.feed_forward(layer.ffn_norm(h))
            else:
                h = h + mla_step(layer.attn, layer.attn_norm(h), rope, c, lengths, cache.max_length)
                h = h + dropless_moe(layer.moe, layer.ffn_norm(h))
        cache.lengths = lengths + 1
        cache.max_length += 1
        return _readout(model, h)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, greedy: bool = False, generator: torch.Generator | None = None,
                 eos_id: int | None = None, on_step=None) -> list[list[int]]:
        """Samples up to ``max_new_tokens`` per prompt; a sequence stops after it samples ``eos_id``
        (kept in its output). ``on_step(step, new_tokens [B] list, done [B] list)`` is called after
        every sampled token (for streaming). Returns the new tokens of each prompt."""
        B = len(prompts)
        out: list[list[int]] = [[] for _ in range(B)]
        if max_new_tokens <= 0:
            return out
        logits, cache = self.prefill(prompts, capacity=max(len(p) for p in prompts) + max_new_tokens)
        done = [False] * B
        for step in range(max_new_tokens):
            nxt = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy, generator=generator)
            ids = nxt.tolist()
            for b, t in enumerate(ids):
                if not done[b]:
                    out[b].append(t)
                    done[b] = eos_id is not None and t == eos_id
            if on_step is not None:
                on_step(step, ids, list(done))
            if all(done) or step == max_new_tokens - 1:
                break
            logits = self.step(nxt, cache)
        return out


def sample(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           greedy: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens [B] from logits [B, vocab]: argmax if ``greedy`` (or temperature 0), else a
    draw from softmax(logits / temperature) restricted to the top_k (0: all) most likely tokens
    and to the smallest set whose probability reaches top_p (1: all)."""
    if greedy or temperature == 0:
        return logits.argmax(dim=-1)
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1 and top_k >= 0, got {temperature}, {top_p}, {top_k}")
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # the mass before a token already reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    # the draw on the CPU: the same seed gives the same tokens on any device
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
