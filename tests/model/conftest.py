import pytest
import torch

from hymo_recipes.model import HymoModel, HymoModelArgs

# Every block type, MoE and MTP, at sizes that run in milliseconds.
TINY = dict(
    vocab_size=97,
    dim=64,
    n_layers=4,
    max_seq_len=256,
    mla_layers=(3,),
    gdn_n_heads=2,
    gdn_head_dim=16,
    gdn_v_head_dim=16,
    gdn_backend="torch_chunk",
    n_heads=4,
    n_kv_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_num_experts=4,
    moe_top_k=2,
    moe_inter_dim=32,
    mtp_depth=2,
    mtp_loss_weights=(0.3, 0.1),
    mtp_inter_dim=32,
)


@pytest.fixture
def tiny_args():
    """tiny_args(**overrides) -> HymoModelArgs."""

    def make(**overrides) -> HymoModelArgs:
        return HymoModelArgs(**{**TINY, **overrides})

    return make


@pytest.fixture
def tiny_model(tiny_args):
    """tiny_model(seed=0, **overrides) -> initialised HymoModel on CPU, fp32."""

    def make(seed: int = 0, **overrides) -> HymoModel:
        torch.manual_seed(seed)
        model = HymoModel(tiny_args(**overrides))
        model.init_weights()
        return model

    return make
