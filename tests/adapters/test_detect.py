"""Detection by structure: supported transformers blocks, and clear refusals otherwise.

Single process (one rank, no process group): wrapping still runs the whole runtime.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import transformers as tf

from moonplan import checkpoint
from moonplan.adapters import (
    UnsupportedBlockError,
    inspect_block,
    is_supported,
    wrap,
    wrap_model,
)
from tests.adapters.checks import rel_close
from tests.adapters.tiny import BLOCKS, F, H, make_block, make_model

# Families whose blocks share the structure; none is named in moonplan's code.
FAMILIES = [
    "Mixtral",
    "Qwen3Moe",
    "DeepseekV3",
    "Qwen2Moe",  # shared expert behind a sigmoid gate
    "Olmoe",
    "DeepseekV2",
    "Glm4Moe",
    "Ernie4_5_Moe",
    "Phimoe",
    "GraniteMoe",  # router child named `router`
    "Jamba",
    "Qwen3Next",
    "HunYuanMoEV1",  # router without its own `weight`
]


def test_inspect_reads_the_structure() -> None:
    spec = {kind: inspect_block(make_block(kind)) for kind in BLOCKS}
    assert (spec["mixtral"].num_experts, spec["mixtral"].top_k) == (6, 2)
    assert (spec["qwen3_moe"].num_experts, spec["qwen3_moe"].top_k) == (7, 3)
    assert (spec["deepseek_v3"].num_experts, spec["deepseek_v3"].top_k) == (8, 3)
    assert {(s.hidden, s.ffn, s.router_name) for s in spec.values()} == {(H, F, "gate")}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_of_the_structure_wraps_exactly(family: str) -> None:
    if not hasattr(tf, f"{family}ForCausalLM"):
        pytest.skip(f"this transformers has no {family}")
    model = make_model(family)
    block = next(m for _, m in model.named_modules() if is_supported(m))
    block.eval()  # no router jitter
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(block)
    wrapped = wrap(block)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(2))
    x1, x0 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y1, y0 = wrapped(x1), ref(x0)
    rel_close(y1, y0, what="output")
    y1.square().sum().backward()
    y0.square().sum().backward()
    rel_close(x1.grad, x0.grad, what="input grad")
    ref_params = dict(ref.named_parameters())
    for name, p in wrapped.named_parameters():
        if p.grad is not None:
            rel_close(p.grad, ref_params[name].grad, what=name)


def _refusal(module: nn.Module) -> str:
    assert not is_supported(module)
    with pytest.raises(UnsupportedBlockError) as info:
        wrap(module)
    text = str(info.value)
    assert "expected" in text and "found" in text
    return text


def test_a_plain_module_is_refused() -> None:
    text = _refusal(nn.Linear(4, 4))
    assert "child module named `experts`" in text and "children: none" in text


def test_biased_transposed_experts_are_refused() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = tf.GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=4)
    assert "gate_up_proj_bias" in _refusal(GptOssMLP(config))


def test_transposed_experts_are_refused() -> None:
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = tf.Llama4TextConfig(hidden_size=H, intermediate_size=F, num_local_experts=4)
    assert "gate_up_proj [E, 2F, H]" in _refusal(Llama4TextMoe(config))


def test_other_activation_and_call_are_refused() -> None:
    block = make_block("mixtral")
    block.experts.act_fn = nn.GELU()
    assert "SiLU" in _refusal(block)

    class OneArgExperts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 2 * F, H))
            self.down_proj = nn.Parameter(torch.zeros(4, H, F))
            self.act_fn = nn.SiLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    block = make_block("mixtral")
    block.experts = OneArgExperts()
    assert "experts.forward(x)" in _refusal(block)


def test_a_wrapped_block_is_not_wrapped_again() -> None:
    assert "already run on moonplan" in _refusal(wrap(make_block("qwen3_moe")))


def test_wrap_model_without_moe_blocks_raises() -> None:
    config = tf.LlamaConfig(
        hidden_size=H,
        intermediate_size=F,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=32,
    )
    with pytest.raises(UnsupportedBlockError, match="no supported MoE block in LlamaForCausalLM"):
        wrap_model(tf.LlamaForCausalLM(config))


def test_wrap_model_refuses_unsupported_moe_blocks_unless_told() -> None:
    model = make_model("GptOss")
    with pytest.raises(
        UnsupportedBlockError, match=r"model\.layers\.0\.mlp: cannot wrap GptOssMLP"
    ):
        wrap_model(model)
    with pytest.raises(UnsupportedBlockError, match="no supported MoE block"):
        wrap_model(model, strict=False)


def test_wrapped_block_keeps_names_and_shares_the_router() -> None:
    block = make_block("deepseek_v3")
    wrapped = wrap(block)
    assert type(wrapped) is type(block)
    E = block.experts.gate_up_proj.shape[0]
    names = ("gate_up_proj", "down_proj")
    experts = {f"experts.{t}": [f"experts.{t}.{e}" for e in range(E)] for t in names}
    want = [k for key in block.state_dict() for k in experts.get(key, [key])]
    assert sorted(wrapped.state_dict()) == sorted(want)  # one key per expert (checkpoints)
    checkpoint.per_expert_keys(wrapped, False)
    assert list(wrapped.state_dict()) == list(block.state_dict())  # the original keys
    assert wrapped.gate is block.gate and wrapped.shared_experts is block.shared_experts
    assert wrapped.experts is not block.experts  # the original keeps its own experts
    assert wrapped.home_experts.tolist() == list(range(8))
