"""HyMo as a Hugging Face causal LM: Gated DeltaNet and MLA + MoE blocks, tied head, MTP heads.

Self-contained (torch and transformers only): it is copied into every export beside
configuration_hymo.py, and ``AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)``
loads it. It computes what HyMo's own model computes at inference (hymo_recipes/model and its
decode.py), in plain PyTorch:

- Gated DeltaNet: q, k, v projections → short causal depthwise conv + SiLU → L2-normalised q, k;
  β = sigmoid(b_proj x), g = log α = −exp(A_log)·softplus(a_proj x + dt_bias); the gated delta
  rule S_t = α_t S_{t−1} + β_t k_t (v_t − α_t S_{t−1}ᵀ k_t)ᵀ, o_t = S_tᵀ q_t / √K, computed in
  chunks of 64 tokens (the WY form: C×C matmuls within a chunk, one state update per chunk) in
  fp32; output o_proj(RMSNorm(o) ⊙ SiLU(g_proj x)). No D skip term.
- MLA: q = q_b(RMSNorm(q_a x)); [c_kv, k_rope] = kv_a x; [k_nope, v] = kv_b(RMSNorm(c_kv)) per
  KV group; RoPE on the rope slices only (interleaved pairs), none in ``nope_layers``; causal
  SDPA with grouped KV at ``attention_softmax_scale``.
- MoE: fp32 softmax router, top-k chosen from score + ``e_score_correction_bias`` (the balancing
  bias, selection only) and weighted by the unbiased score; routed SwiGLU experts stored stacked
  [E, out, in]; shared experts. Dropless, as HyMo is at inference.
- Output: the tied embedding, logits × ``logit_multiplier`` (muP's readout factor).
- MTP heads (``mtp.<k>``: RMSNorm → Linear → SiLU → Linear → the tied head, on the trunk's last
  hidden state before the final norm) are kept with their weights and not run, unless
  ``forward(..., output_mtp_logits=True)``; head k's logits at t predict token t + 1 + k.

Generation keeps, per layer, a cache of its own (``HymoCache``): for Gated DeltaNet the state
[B, H, K, V] (fp32) and the conv's last W − 1 inputs, for MLA the normalised latent and the
rotated shared rope key per token. Batches of prompts of different lengths run left-padded:
a padding token (``attention_mask`` 0) enters no state (its conv input, key, value, β and decay
are zeroed), is attended by no token, and positions count real tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

try:  # transformers >= 5: initialisers that leave tensors loaded from the checkpoint alone
    from transformers import initialization as init
except ImportError:  # transformers 4 calls _init_weights only on modules it did not load
    from torch.nn import init

from .configuration_hymo import HymoConfig

GDN_CHUNK = 64


# -- caches and outputs ----------------------------------------------------------------------------

class HymoCache:
    """Per-layer decoding state of a batch; ``seen``: the tokens (padding included) consumed.

    ``layers[i]`` is a dict: Gated DeltaNet {"conv": [B, W − 1, Cq + Ck + Cv], "state":
    [B, H, K, V]}, MLA {"latent": [B, L, kv_lora_rank], "k_rope": [B, L, qk_rope_head_dim]}.
    """

    is_compileable = False

    def __init__(self, num_layers: int):
        self.layers: list[dict | None] = [None] * num_layers
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorders the batch (beam search)."""
        for layer in self.layers:
            if layer is not None:
                for key, value in layer.items():
                    layer[key] = value.index_select(0, beam_idx.to(value.device))


@dataclass
class HymoModelOutput(ModelOutput):
    last_hidden_state: torch.FloatTensor | None = None
    trunk_hidden_state: torch.FloatTensor | None = None  # before the final norm: what MTP heads read
    cache: HymoCache | None = None


@dataclass
class HymoCausalLMOutput(ModelOutput):
    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: HymoCache | None = None
    mtp_logits: tuple[torch.FloatTensor, ...] | None = None


# -- pieces ----------------------------------------------------------------------------------------

def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def short_causal_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over time of x [B, T, C] with weight [C, 1, W] (weight[..., W − 1]
    on the current token), zeros before the row's start."""
    T, W = x.shape[1], weight.shape[-1]
    w = weight[:, 0, :].to(x.dtype)
    out = x * w[:, W - 1]
    for j in range(1, min(W, T + 1)):
        out = out + F.pad(x[:, : T - j], (0, 0, j, 0)) * w[:, W - 1 - j]
    return out


def chunk_gated_delta_rule(q, k, v, g, beta, scale: float, state: torch.Tensor | None, chunk: int = GDN_CHUNK):
    """The gated delta rule over q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H] from
    ``state`` [B, H, K, V] (zeros if None), in chunks: returns o [B, T, H, V] (v's dtype) and the
    final state (fp32; fp64 for fp64 inputs). Tokens padded at the end to a whole chunk have
    k = v = β = g = 0: they neither write nor decay the state."""
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    C = min(chunk, T)
    pad = (-T) % C
    n = (T + pad) // C

    def chunks(x):  # [B, T, H, *] -> [B, H, n, C, *]
        x = x.to(acc)
        if pad:  # at the end of the time dim (dim 1)
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(B, n, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g)[..., 0], chunks(beta)[..., 0]  # [B, H, n, C]
    gam = g.cumsum(-1)
    idx = torch.arange(C, device=q.device)
    causal, strict = idx[:, None] >= idx[None, :], idx[:, None] > idx[None, :]
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    a = (beta[..., None] * (k @ k.transpose(-1, -2) * decay)).masked_fill(~strict, 0.0)
    eye = torch.eye(C, dtype=acc, device=q.device)
    t_inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    w = t_inv @ ((beta * gam.exp())[..., None] * k)
    u = t_inv @ (beta[..., None] * v)
    qs = q * scale
    q_decayed = qs * gam.exp()[..., None]
    p = (qs @ k.transpose(-1, -2)) * decay
    k_to_end = k * (gam[..., -1:] - gam).exp()[..., None]
    g_end = gam[..., -1].exp()
    S = torch.zeros(B, H, K, V, dtype=acc, device=q.device) if state is None else state.to(acc)
    outs = []
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ S
        outs.append(q_decayed[:, :, c] @ S + p[:, :, c] @ v_new)
        S = g_end[:, :, c, None, None] * S + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).reshape(B, H, n * C, V)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), S


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotates consecutive pairs of the last dim of x [B, T, heads, D] by positions [B, T]."""
    D = x.shape[-1]
    freqs = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D))
    angles = positions.to(torch.float32)[..., None] * freqs  # [B, T, D/2]
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).to(x.dtype)


class HymoMLP(nn.Module):
    """SwiGLU: down(SiLU(gate x) ⊙ up x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HymoGatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * F.silu(gate.float())).to(x.dtype)


class HymoGatedDeltaNet(nn.Module):
    def __init__(self, config: HymoConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim, self.v_head_dim = config.gdn_num_heads, config.gdn_head_dim, config.gdn_v_head_dim
        key_dim, value_dim = self.n_heads * self.head_dim, self.n_heads * self.v_head_dim
        dim, W = config.hidden_size, config.gdn_conv_size
        self.q_proj = nn.Linear(dim, key_dim, bias=False)
        self.k_proj = nn.Linear(dim, key_dim, bias=False)
        self.v_proj = nn.Linear(dim, value_dim, bias=False)
        self.a_proj = nn.Linear(dim, self.n_heads, bias=False)
        self.b_proj = nn.Linear(dim, self.n_heads, bias=False)
        self.g_proj = nn.Linear(dim, value_dim, bias=False)
        self.o_proj = nn.Linear(value_dim, dim, bias=False)
        self.q_conv1d = nn.Conv1d(key_dim, key_dim, W, groups=key_dim, bias=False)
        self.k_conv1d = nn.Conv1d(key_dim, key_dim, W, groups=key_dim, bias=False)
        self.v_conv1d = nn.Conv1d(value_dim, value_dim, W, groups=value_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.o_norm = HymoGatedRMSNorm(self.v_head_dim, config.rms_norm_eps)
        self.splits = (key_dim, key_dim, value_dim)

    def forward(self, x, valid: torch.Tensor | None, cache: HymoCache | None):
        """x [B, T, D]; valid [B, T] (1: a token, 0: padding) or None (all tokens)."""
        B, T, _ = x.shape
        W = self.q_conv1d.weight.shape[-1]
        m = None if valid is None else valid.to(x.dtype)[..., None]
        inputs = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if m is not None:
            inputs = inputs * m
        past = cache.layers[self.layer_idx] if cache is not None else None
        lead = past["conv"] if past is not None else inputs.new_zeros(B, W - 1, inputs.shape[-1])
        full = torch.cat([lead, inputs], dim=1)
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        if past is None:  # the training conv's own zero padding: the same numbers on the row alone
            conv = short_causal_conv(inputs, weight)
        else:
            conv = short_causal_conv(full, weight)[:, W - 1:]
        q, k, v = F.silu(conv).split(self.splits, dim=-1)
        q = l2_normalize(q.view(B, T, -1, self.head_dim))
        k = l2_normalize(k.view(B, T, -1, self.head_dim))
        v = v.view(B, T, -1, self.v_head_dim)
        beta = torch.sigmoid(self.b_proj(x).float()).to(x.dtype)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        if m is not None:  # padding neither writes nor decays the state
            k, v, beta, g = k * m[..., None], v * m[..., None], beta * m, g * m.float()
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, self.head_dim**-0.5,
                                          past["state"] if past is not None else None)
        if cache is not None:
            cache.layers[self.layer_idx] = {"conv": full[:, -(W - 1):] if W > 1 else full[:, :0], "state": state}
        o = self.o_norm(o, self.g_proj(x).view(B, T, -1, self.v_head_dim)).reshape(B, T, -1)
        return self.o_proj(o)


class HymoMLA(nn.Module):
    def __init__(self, config: HymoConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.use_rope = layer_idx not in set(config.nope_layers)
        self.rope_base = config.rope_base
        self.kv_lora_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_head_dim = config.qk_nope_head_dim, config.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.scale = config.attention_softmax_scale
        H, G, dim = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        self.q_a_proj = nn.Linear(dim, config.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, G * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_head_dim, dim, bias=False)

    def forward(self, x, positions, valid, cache: HymoCache | None, causal_only: bool):
        """x [B, T, D]; positions [B, T]; valid [B, L] over the cache and these tokens (or None);
        causal_only: no cache, no padding (plain causal attention)."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, -1, self.qk_head_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(c_kv)
        k_rope = k_rope[:, :, None, :]
        if self.use_rope:
            q_rope = apply_rope(q_rope, positions, self.rope_base)
            k_rope = apply_rope(k_rope, positions, self.rope_base)
        k_rope = k_rope[:, :, 0]
        past = cache.layers[self.layer_idx] if cache is not None else None
        if past is not None:
            latent = torch.cat([past["latent"], latent], dim=1)
            k_rope = torch.cat([past["k_rope"], k_rope], dim=1)
        if cache is not None:
            cache.layers[self.layer_idx] = {"latent": latent, "k_rope": k_rope}
        L = latent.shape[1]
        kv = self.kv_b_proj(latent).view(B, L, -1, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if causal_only:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            i = torch.arange(L - T, L, device=x.device)[:, None]
            j = torch.arange(L, device=x.device)[None, :]
            mask = (j <= i)[None]
            if valid is not None:
                mask = mask & valid.bool()[:, None, :]
            mask = mask | (j == i)[None]  # a padding query attends itself: no empty row (its output is unused)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=self.scale, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class HymoRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("load_ema", torch.zeros(num_experts, dtype=torch.float32))  # training's balancing state


class HymoExperts(nn.Module):
    """Routed SwiGLU experts, stacked: gate_proj, up_proj [E, inter, dim], down_proj [E, dim, inter]."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(x @ self.gate_proj[e].transpose(0, 1)) * (x @ self.up_proj[e].transpose(0, 1))
        return h @ self.down_proj[e].transpose(0, 1)


class HymoMoE(nn.Module):
    def __init__(self, config: HymoConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = HymoRouter(config.hidden_size, config.n_routed_experts)
        self.experts = HymoExperts(config.hidden_size, config.moe_intermediate_size, config.n_routed_experts)
        self.shared_experts = (HymoMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts > 0 else None)

    def forward(self, x):
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        scores = F.softmax(F.linear(xf.float(), self.gate.weight.float()), dim=-1)
        _, idx = torch.topk(scores + self.gate.e_score_correction_bias, k=self.top_k, dim=-1)
        weights = scores.gather(-1, idx)  # [N, k] fp32, from the unbiased scores
        wdtype = self.experts.gate_proj.dtype
        routed = xf.new_zeros(xf.shape[0], self.top_k, shape[-1], dtype=wdtype)
        for e in torch.unique(idx).tolist():
            rows, slots = torch.nonzero(idx == e, as_tuple=True)
            routed[rows, slots] = self.experts.expert(e, xf[rows].to(wdtype))
        out = (weights[..., None] * routed.float()).sum(1).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(xf)
        return out.view(shape)


class HymoLinearAttentionLayer(nn.Module):
    """x + GDN(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)) if the model gives GDN blocks one."""

    def __init__(self, config: HymoConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.linear_attn = HymoGatedDeltaNet(config, layer_idx)
        if config.gdn_intermediate_size > 0:
            self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp = HymoMLP(config.hidden_size, config.gdn_intermediate_size)
        else:
            self.post_attention_layernorm = self.mlp = None

    def forward(self, x, positions, valid_now, valid_all, cache, causal_only):
        x = x + self.linear_attn(self.input_layernorm(x), valid_now, cache)
        if self.mlp is not None:
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class HymoAttentionLayer(nn.Module):
    """x + MLA(RMSNorm(x)), then x + MoE(RMSNorm(x))."""

    def __init__(self, config: HymoConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = HymoMLA(config, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = HymoMoE(config)

    def forward(self, x, positions, valid_now, valid_all, cache, causal_only):
        x = x + self.self_attn(self.input_layernorm(x), positions, valid_all, cache, causal_only)
        return x + self.mlp(self.post_attention_layernorm(x))


class HymoMTPHead(nn.Module):
    def __init__(self, dim: int, hidden: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.w_in = nn.Linear(dim, hidden, bias=False)
        self.w_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, h):
        return self.w_out(F.silu(self.w_in(self.norm(h))))


# -- models ----------------------------------------------------------------------------------------

class HymoPreTrainedModel(PreTrainedModel):
    config_class = HymoConfig
    base_model_prefix = "model"
    _no_split_modules = ["HymoLinearAttentionLayer", "HymoAttentionLayer"]
    _is_stateful = True  # Gated DeltaNet state: no cache cropping (assisted decoding)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # HymoCache, made by the model (prepare_inputs_for_generation)

    def _init_weights(self, module):
        """A model built from a config alone: plain normal init (exports carry trained weights)."""
        super()._init_weights(module)
        std = 0.02
        if isinstance(module, HymoExperts):
            for p in (module.gate_proj, module.up_proj, module.down_proj):
                init.normal_(p, mean=0.0, std=std)
        elif isinstance(module, HymoRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
            init.zeros_(module.load_ema)
        elif isinstance(module, HymoGatedDeltaNet):
            init.zeros_(module.A_log)  # A = 1
            init.zeros_(module.dt_bias)
        elif isinstance(module, (HymoGatedRMSNorm, nn.RMSNorm)):
            init.ones_(module.weight)


class HymoModel(HymoPreTrainedModel):
    def __init__(self, config: HymoConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        mla = set(config.mla_layers)
        self.layers = nn.ModuleList(
            (HymoAttentionLayer if i in mla else HymoLinearAttentionLayer)(config, i)
            for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs) -> HymoModelOutput:
        """attention_mask [B, seen + T] (1: token, 0: padding) covers the cache and these tokens."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        if use_cache and cache is None:
            cache = HymoCache(self.config.num_hidden_layers)
        seen = cache.seen if cache is not None else 0
        valid_all = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape != (B, seen + T):
                raise ValueError(f"attention_mask must be [batch, cached + new tokens] = [{B}, {seen + T}], got "
                                 f"{list(attention_mask.shape)}")
            valid_all = None if bool(attention_mask.all()) else attention_mask
        valid_now = None if valid_all is None else valid_all[:, -T:]
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = torch.arange(seen, seen + T, device=x.device)[None].expand(B, -1)
        causal_only = cache is None and valid_all is None
        for layer in self.layers:
            x = layer(x, position_ids, valid_now, valid_all, cache, causal_only)
        if cache is not None:
            cache.seen = seen + T
        return HymoModelOutput(last_hidden_state=self.norm(x), trunk_hidden_state=x, cache=cache)


class HymoForCausalLM(HymoPreTrainedModel, GenerationMixin):
    def __init__(self, config: HymoConfig):
        super().__init__(config)
        self.model = HymoModel(config)
        self.mtp = nn.ModuleDict({str(k): HymoMTPHead(config.hidden_size, config.mtp_intermediate_size,
                                                      config.rms_norm_eps)
                                  for k in range(1, config.mtp_depth + 1)})
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def _readout(self, h: torch.Tensor) -> torch.Tensor:
        mult = self.config.logit_multiplier
        return F.linear(h if mult == 1.0 else h * mult, self.model.embed_tokens.weight)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep: int = 0,
                output_mtp_logits: bool = False, return_dict=None, **kwargs) -> HymoCausalLMOutput:
        """Logits [B, T, V] (the last ``logits_to_keep`` positions if > 0); with labels, the mean
        next-token cross-entropy (labels are the inputs: shifted here, -100 ignored)."""
        if cache is None and isinstance(past_key_values, HymoCache):
            cache = past_key_values
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache)
        h = out.last_hidden_state
        logits = self._readout(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        mtp_logits = None
        if output_mtp_logits:
            mtp_logits = tuple(self._readout(head(out.trunk_hidden_state)) for head in self.mtp.values())
        return HymoCausalLMOutput(loss=loss, logits=logits, cache=out.cache, mtp_logits=mtp_logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, inputs_embeds=None, **kwargs):
        """Only the tokens the cache has not seen (all of them on the first call)."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, HymoCache):
            cache = None
        use_cache = kwargs.get("use_cache", True)
        if cache is not None:
            input_ids = input_ids[:, cache.seen:]
        elif inputs_embeds is not None:
            return {"inputs_embeds": inputs_embeds, "attention_mask": attention_mask, "use_cache": use_cache,
                    "logits_to_keep": 1}
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": cache, "use_cache": use_cache,
                "logits_to_keep": 1}
