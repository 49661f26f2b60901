"""Tiny transformers MoE blocks and models from configs, random weights (no hub access).

Legend: R ranks, E experts, H hidden, F expert FFN size, K top-k, S tokens, V vocabulary.

Every factory is deterministic in its seed, so each forked rank builds the same module.
Importing this module imports transformers (test modules ``importorskip`` it first), in the
parent process, so that forked ranks do not import it again.
"""

from __future__ import annotations

import torch
import transformers as tf
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

H, F, V = 16, 12, 64

# Enough fields for every family used in the tests; each config ignores what it does not know.
MODEL_FIELDS = dict(
    hidden_size=H,
    intermediate_size=24,
    moe_intermediate_size=F,
    shared_expert_intermediate_size=F,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    vocab_size=V,
    max_position_embeddings=64,
    num_experts=6,
    num_local_experts=6,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    q_lora_rank=8,
    kv_lora_rank=8,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
)


def _config(kind: str):
    if kind == "mixtral":  # softmax top-k, renormalised; E mod R != 0 for R = 4
        return tf.MixtralConfig(
            hidden_size=H, intermediate_size=F, num_local_experts=6, num_experts_per_tok=2
        )
    if kind == "qwen3_moe":  # softmax top-k without renormalisation, K = 3, E = 7
        return tf.Qwen3MoeConfig(
            hidden_size=H,
            moe_intermediate_size=F,
            num_experts=7,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        )
    if kind == "deepseek_v3":  # group-limited sigmoid routing, correction bias, scaling
        routing = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
        return tf.DeepseekV3Config(
            hidden_size=H,
            moe_intermediate_size=F,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=1,
            **routing,
        )
    raise ValueError(kind)


BLOCKS = ("mixtral", "qwen3_moe", "deepseek_v3")


def make_block(kind: str, seed: int = 0) -> nn.Module:
    """A block of ``kind`` with random weights (std 0.3: routing far from ties) and bias."""
    cls = {
        "mixtral": MixtralSparseMoeBlock,
        "qwen3_moe": Qwen3MoeSparseMoeBlock,
        "deepseek_v3": DeepseekV3MoE,
    }[kind]
    config = _config(kind)
    config._experts_implementation = "eager"
    block = cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for b in block.buffers():  # DeepSeek-V3's e_score_correction_bias
            b.copy_(torch.randn(b.shape, generator=g) * 0.2)
    return block


def make_model(family: str, seed: int = 0, **fields) -> nn.Module:
    """``{family}ForCausalLM`` (e.g. ``"Mixtral"``) from :data:`MODEL_FIELDS`, random init."""
    chosen = {**MODEL_FIELDS, **fields}
    if family.startswith("Deepseek"):  # MLA: head sizes come from the qk_*/v_head_dim fields
        chosen.pop("head_dim")
    config = getattr(tf, f"{family}Config")(**chosen)
    torch.manual_seed(seed)
    return getattr(tf, f"{family}ForCausalLM")(config)


def batch(rank: int, sizes: list[int], seed: int) -> torch.Tensor:
    """Rank ``rank``'s token ids ``[2, sizes[rank]]`` (int64 in ``[0, V)``)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(0, V, (2, sizes[rank]), generator=g)
