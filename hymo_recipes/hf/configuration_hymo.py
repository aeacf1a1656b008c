"""The Hugging Face config of an exported HyMo model (``model_type = "hymo"``).

Self-contained (transformers only): it is copied into every export beside modeling_hymo.py and
loaded with ``trust_remote_code=True``. The fields are HyMo's model args under the names the HF
models of the same parts use where there is one (hidden_size, num_hidden_layers, rms_norm_eps,
num_attention_heads / num_key_value_heads for MLA's query heads and KV groups, q_lora_rank,
kv_lora_rank, qk_nope/rope_head_dim, v_head_dim, n_routed_experts, n_shared_experts,
num_experts_per_tok, moe_intermediate_size), and HyMo's own otherwise. ``logit_multiplier``
(muP's readout factor, 1.0 without muP) and ``attention_softmax_scale`` (MLA's, 1/√d or muP's
1/d) are written out rather than derived, so the model computes what was trained whatever
derived them. ``hymo`` holds what an import needs to rebuild the training checkpoint: the
flavor, every model arg and the tokenizer's identity.
"""

from __future__ import annotations

from transformers import PretrainedConfig


class HymoConfig(PretrainedConfig):
    model_type = "hymo"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size: int = 2048,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 512,
        mla_layers: list[int] | None = None,
        nope_layers: list[int] | None = None,
        gdn_num_heads: int = 8,
        gdn_head_dim: int = 32,
        gdn_v_head_dim: int = 32,
        gdn_conv_size: int = 4,
        gdn_intermediate_size: int = 0,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        q_lora_rank: int = 64,
        kv_lora_rank: int = 64,
        qk_nope_head_dim: int = 32,
        qk_rope_head_dim: int = 16,
        v_head_dim: int = 48,
        rope_base: float = 10_000.0,
        attention_softmax_scale: float | None = None,
        n_routed_experts: int = 8,
        n_shared_experts: int = 1,
        num_experts_per_tok: int = 2,
        moe_intermediate_size: int = 256,
        mtp_depth: int = 0,
        mtp_intermediate_size: int = 256,
        logit_multiplier: float = 1.0,
        hymo: dict | None = None,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.mla_layers = list(mla_layers if mla_layers is not None else [num_hidden_layers - 1])
        self.nope_layers = list(nope_layers or [])
        self.gdn_num_heads = gdn_num_heads
        self.gdn_head_dim = gdn_head_dim
        self.gdn_v_head_dim = gdn_v_head_dim
        self.gdn_conv_size = gdn_conv_size
        self.gdn_intermediate_size = gdn_intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        # HyMo's RoPE is the plain one (no scaling); not "rope_theta", which transformers
        # rewrites into its rope_parameters
        self.rope_base = rope_base
        self.attention_softmax_scale = (attention_softmax_scale if attention_softmax_scale is not None
                                        else (qk_nope_head_dim + qk_rope_head_dim) ** -0.5)
        self.n_routed_experts = n_routed_experts
        self.n_shared_experts = n_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.mtp_depth = mtp_depth
        self.mtp_intermediate_size = mtp_intermediate_size
        self.logit_multiplier = logit_multiplier
        self.hymo = hymo or {}
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
