"""HyMo's parameter names and their Hugging Face names: one table, used in both directions.

The HF names follow the conventions of the HF models with the same parts, so that tools that
pick layers by name (``q_proj``, ``o_proj``, ``mlp.experts``) find them: DeepSeek-V3's for MLA,
the MoE router and its selection bias (``e_score_correction_bias``), fla's for Gated DeltaNet
(``linear_attn.{q,k,v,a,b,g,o}_proj``, ``*_conv1d``, ``A_log``, ``dt_bias``, ``o_norm``), Llama's
for the norms and the embedding. Routed experts stay stacked ([E, out, in], as the fused-expert
HF models store them), MTP heads are ``mtp.<k>.*`` (as Qwen3-Next's are) and the EMA of the
expert loads, which only training reads, is ``mlp.gate.load_ema``. The map is a bijection over
every name a HyMo model has, tensors pass through untouched, so HyMo → HF → HyMo is the
identity. There is no ``lm_head.weight``: the output head is the tied embedding.

Pure Python: the adapter (TorchTitan), export, import and their tests share it.
"""

from __future__ import annotations

import re

# (HyMo name, HF name); {i}: a layer index, {k}: an MTP head index
_TABLE = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    # Gated DeltaNet (fla's names)
    *((f"layers.{{i}}.attn.{n}", f"model.layers.{{i}}.linear_attn.{n}")
      for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "a_proj.weight", "b_proj.weight",
                "g_proj.weight", "o_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
                "A_log", "dt_bias", "o_norm.weight")),
    # the optional dense SwiGLU of GDN blocks
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    # MLA (DeepSeek-V3's names)
    ("layers.{i}.attn.wq_a.weight", "model.layers.{i}.self_attn.q_a_proj.weight"),
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_a_layernorm.weight"),
    ("layers.{i}.attn.wq_b.weight", "model.layers.{i}.self_attn.q_b_proj.weight"),
    ("layers.{i}.attn.wkv_a.weight", "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"),
    ("layers.{i}.attn.kv_norm.weight", "model.layers.{i}.self_attn.kv_a_layernorm.weight"),
    ("layers.{i}.attn.wkv_b.weight", "model.layers.{i}.self_attn.kv_b_proj.weight"),
    ("layers.{i}.attn.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    # MoE
    ("layers.{i}.moe.router.gate.weight", "model.layers.{i}.mlp.gate.weight"),
    ("layers.{i}.moe.expert_bias", "model.layers.{i}.mlp.gate.e_score_correction_bias"),
    ("layers.{i}.moe.load_ema", "model.layers.{i}.mlp.gate.load_ema"),
    ("layers.{i}.moe.experts.w1", "model.layers.{i}.mlp.experts.gate_proj"),
    ("layers.{i}.moe.experts.w2", "model.layers.{i}.mlp.experts.down_proj"),
    ("layers.{i}.moe.experts.w3", "model.layers.{i}.mlp.experts.up_proj"),
    ("layers.{i}.moe.shared_experts.w1.weight", "model.layers.{i}.mlp.shared_experts.gate_proj.weight"),
    ("layers.{i}.moe.shared_experts.w2.weight", "model.layers.{i}.mlp.shared_experts.down_proj.weight"),
    ("layers.{i}.moe.shared_experts.w3.weight", "model.layers.{i}.mlp.shared_experts.up_proj.weight"),
    # MTP heads
    ("mtp_heads.{k}.norm.weight", "mtp.{k}.norm.weight"),
    ("mtp_heads.{k}.w_in.weight", "mtp.{k}.w_in.weight"),
    ("mtp_heads.{k}.w_out.weight", "mtp.{k}.w_out.weight"),
)


def _compile(template: str) -> re.Pattern:
    parts = re.split(r"(\{[ik]\})", template)
    return re.compile("".join(r"(\d+)" if p in ("{i}", "{k}") else re.escape(p) for p in parts) + r"\Z")


def _fill(template: str, numbers: tuple[str, ...]) -> str:
    it = iter(numbers)
    return re.sub(r"\{[ik]\}", lambda _: next(it), template)


_TO_HF = [(_compile(ours), hf) for ours, hf in _TABLE]
_FROM_HF = [(_compile(hf), ours) for ours, hf in _TABLE]


def _rename(name: str, rules, what: str) -> str:
    for pattern, template in rules:
        if m := pattern.match(name):
            return _fill(template, m.groups())
    raise KeyError(f"{name!r} is not a {what} name (hymo_recipes/hf/names.py lists them)")


def to_hf_name(name: str) -> str:
    """The HF name of HyMo's parameter or persistent buffer `name`; KeyError if it has none."""
    return _rename(name, _TO_HF, "HyMo parameter")


def from_hf_name(name: str) -> str:
    """The HyMo name of HF tensor `name`; KeyError if it is not one of HyMo's."""
    return _rename(name, _FROM_HF, "HyMo export tensor")


def to_hf(state_dict: dict) -> dict:
    """HyMo's state dict under HF names (the same tensor objects)."""
    return {to_hf_name(k): v for k, v in state_dict.items()}


def from_hf(hf_state_dict: dict) -> dict:
    """An HF-named state dict under HyMo's names (the same tensor objects)."""
    return {from_hf_name(k): v for k, v in hf_state_dict.items()}
