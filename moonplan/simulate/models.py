"""Model presets for the simulator: ``moonplan.cost.PRESETS``, the trend models and OLMoE.

``olmoe-1b-7b`` (OLMoE-1B-7B-0924, its published ``config.json``): 16 layers, hidden 2048,
64 experts of intermediate size 1024 in every layer, top-8, 16 attention heads (16 key-value
heads of 128), vocabulary 50304, untied output matrix. It has the expert count and top-k
of the shipped real traces (``moonplan/traces/data``, a small model trained here with 64
experts and top-8), so ``moonplan simulate --counts`` times those traces at a real
model's expert sizes.

The trend models reproduce published results (sources below; see docs/simulator.md):

* ``deepspeed-moe-1.3b-128``: DeepSpeed-MoE's 1.3B+MoE-128 (52B) model
  (arXiv:2201.05596, Table 1 and §5.5.1): 24 layers, hidden 2048, 16 heads,
  128 experts, top-1, an MoE layer every other layer, FFN size 4 x hidden.
* ``gshard-<E>e``: GShard's MoE transformer (arXiv:2006.16668, §5 and Table 1):
  36 layers, model dim 1024, FFN dim 8192, 16 heads, top-2, an MoE layer every
  other layer, with ``E`` in 128..2048 experts.

Both use a plain two-matrix FFN (``2*H*F_ffn`` weights), while ``moonplan.cost``
counts SwiGLU experts (``3*H*F``). To keep each expert's weight bytes and FLOPs, the
presets set ``F = round(2 * F_ffn / 3)``; every MoE layer is modelled the same way.
Vocabulary sizes (51200, 32000) are assumptions; they do not enter MoE-layer times.
"""

from __future__ import annotations

from moonplan.cost import PRESETS, GQAAttention, ModelPreset, get_preset


def _two_matrix_f(ffn: int) -> int:
    return round(2 * ffn / 3)


DEEPSPEED_MOE_128 = ModelPreset(
    name="deepspeed-moe-1.3b-128",
    hidden_size=2048,
    moe_intermediate_size=_two_matrix_f(4 * 2048),
    num_layers=24,
    num_experts=128,
    top_k=1,
    vocab_size=51200,
    attention=GQAAttention(num_heads=16, num_kv_heads=16, head_dim=128),
    num_dense_layers=12,
    dense_intermediate_size=_two_matrix_f(4 * 2048),
    source="DeepSpeed-MoE (arXiv:2201.05596) Table 1: 1.3B+MoE-128, 24 layers, hidden 2048, "
    "16 heads, 128 experts every other layer, top-1; FFN 4x hidden as 2 matrices",
    assumptions=("F = 2*8192/3 keeps the two-matrix FFN's bytes", "vocab 51200"),
)


def gshard_model(num_experts: int) -> ModelPreset:
    """GShard's 36-layer MoE transformer with ``num_experts`` experts (see module doc)."""
    return ModelPreset(
        name=f"gshard-{num_experts}e",
        hidden_size=1024,
        moe_intermediate_size=_two_matrix_f(8192),
        num_layers=36,
        num_experts=num_experts,
        top_k=2,
        vocab_size=32000,
        attention=GQAAttention(num_heads=16, num_kv_heads=16, head_dim=64),
        num_dense_layers=18,
        dense_intermediate_size=_two_matrix_f(8192),
        source="GShard (arXiv:2006.16668) §5/Table 1: 36 layers, model dim 1024, FFN 8192, "
        "16 heads, top-2, MoE every other layer",
        assumptions=("F = 2*8192/3 keeps the two-matrix FFN's bytes", "vocab 32000"),
    )


OLMOE_1B_7B = ModelPreset(
    name="olmoe-1b-7b",
    hidden_size=2048,
    moe_intermediate_size=1024,
    num_layers=16,
    num_experts=64,
    top_k=8,
    vocab_size=50304,
    attention=GQAAttention(num_heads=16, num_kv_heads=16, head_dim=128),
    untied_lm_head=True,
    source="OLMoE-1B-7B-0924 config.json: hidden 2048, intermediate 1024, 64 experts, top-8, "
    "16 layers, 16 heads, vocab 50304",
)


TREND_MODELS = ("deepspeed-moe-1.3b-128", "olmoe-1b-7b")
"""Extra preset names :func:`get_model` knows besides ``moonplan.cost.PRESETS`` and
``gshard-<E>e`` (the trend model and OLMoE)."""


def get_model(name: str) -> ModelPreset:
    """A ``moonplan.cost`` preset, the DeepSpeed-MoE trend model, OLMoE or ``gshard-<E>e``."""
    key = str(name).strip().lower()
    if key == DEEPSPEED_MOE_128.name:
        return DEEPSPEED_MOE_128
    if key == OLMOE_1B_7B.name:
        return OLMOE_1B_7B
    if key.startswith("gshard-") and key.endswith("e") and key[7:-1].isdigit():
        return gshard_model(int(key[7:-1]))
    if key in PRESETS:
        return get_preset(key)
    choices = ", ".join([*sorted(PRESETS), *TREND_MODELS, "gshard-<E>e"])
    raise ValueError(f"unknown model {name!r}; valid choices: {choices}")


def expert_bytes(model: ModelPreset, weight_bytes: float = 2.0) -> float:
    """Bytes of one expert's weights in one layer: ``3*H*F*weight_bytes``."""
    return 3.0 * model.hidden_size * model.moe_intermediate_size * weight_bytes
