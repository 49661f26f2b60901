"""Back-of-envelope cost of expert parallelism: parameters, weight memory, dispatch bytes.

Legend (``docs/design.md`` §2 names where they exist):

- ``H`` hidden size, ``F`` routed-expert intermediate size (SwiGLU: 3 matrices ``H x F``),
  ``E`` routed experts, ``K`` top-k, ``L`` transformer layers, ``L_moe`` of them MoE layers.
- ``EP`` size of the expert-parallel group (``R`` in the planner), ``TP`` tensor-parallel
  degree applied to the replicated (non-expert) parameters.
- ``S`` tokens per rank per layer; ``s`` bytes per element.

All results are exact integers (parameters) or bytes as ``float`` (a division by ``EP``
need not be whole); the ``*_gib`` / ``*_mib`` properties convert with ``2**30`` / ``2**20``.
Only weights and the dispatch/combine payload are counted: no KV cache, activations,
optimizer state, communication buffers, metadata, padding or norm weights. The formulas,
the presets and their sources are explained in ``docs/cost.md``, whose Mixtral 8x7B worked
figures the tests reproduce exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from moonplan.checks import check_int

GIB = 2**30
MIB = 2**20
ALL_TO_ALL = "all_to_all"
ALLGATHER_REDUCESCATTER = "allgather_reducescatter"
BACKENDS = (ALL_TO_ALL, ALLGATHER_REDUCESCATTER)


# --------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class GQAAttention:
    """Grouped-query attention: ``Q``/``O`` are ``H x heads*head_dim``, ``K``/``V`` are
    ``H x kv_heads*head_dim`` (no biases, norms not counted)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def params(self, hidden: int) -> int:
        """Attention parameters of one layer (int) for hidden size ``hidden``."""
        q_and_o = 2 * hidden * self.num_heads * self.head_dim
        k_and_v = 2 * hidden * self.num_kv_heads * self.head_dim
        return q_and_o + k_and_v


@dataclass(frozen=True)
class MLAAttention:
    """Multi-head latent attention (DeepSeek-V2/V3 style), five projections per layer:
    ``q_a: H x q_lora``, ``q_b: q_lora x heads*(nope+rope)``,
    ``kv_a: H x (kv_lora+rope)``, ``kv_b: kv_lora x heads*(nope+v)``, ``o: heads*v x H``.
    The two latent RMSNorm weights are not counted."""

    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def params(self, hidden: int) -> int:
        """Attention parameters of one layer (int) for hidden size ``hidden``."""
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        q_a = hidden * self.q_lora_rank
        q_b = self.q_lora_rank * self.num_heads * qk_head
        kv_a = hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        o = self.num_heads * self.v_head_dim * hidden
        return q_a + q_b + kv_a + kv_b + o


# --------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class ModelPreset:
    """Shape of an MoE transformer, enough to count parameters and EP traffic.

    ``hidden_size`` is ``H``; ``moe_intermediate_size`` is ``F`` of every routed and shared
    expert; the first ``num_dense_layers`` layers have a dense SwiGLU FFN of
    ``dense_intermediate_size`` instead of experts. ``untied_lm_head`` adds a
    ``vocab x H`` output matrix. ``source`` and ``assumptions`` say where the numbers
    come from (see ``docs/cost.md``).
    """

    name: str
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_experts: int
    top_k: int
    vocab_size: int
    attention: GQAAttention | MLAAttention
    num_dense_layers: int = 0
    dense_intermediate_size: int = 0
    num_shared_experts: int = 0
    untied_lm_head: bool = False
    source: str = ""
    assumptions: tuple[str, ...] = ()

    @property
    def num_moe_layers(self) -> int:
        """``L_moe``: layers with routed experts (these dispatch and combine)."""
        return self.num_layers - self.num_dense_layers


MIXTRAL_8X7B = ModelPreset(
    name="mixtral-8x7b",
    hidden_size=4096,
    moe_intermediate_size=14336,
    num_layers=32,
    num_experts=8,
    top_k=2,
    vocab_size=32000,
    attention=GQAAttention(num_heads=32, num_kv_heads=8, head_dim=128),
    source="Mixtral of Experts (arXiv:2401.04088) Table 1 and §2.1; counting convention of "
    "docs/cost.md (attention, router, embedding; no LM head, no norms)",
)
"""Mixtral 8x7B. Mixtral paper Table 1: dim 4096, hidden_dim 14336, n_layers 32,
head_dim 128, n_heads 32, n_kv_heads 8, vocab_size 32000, num_experts 8, top_k_experts 2.
As in the worked example of ``docs/cost.md`` the output head is not counted
(``untied_lm_head=False``), which gives expert 45,097,156,608 and replicated
1,474,297,856 parameters."""

DEEPSEEK_V3 = ModelPreset(
    name="deepseek-v3",
    hidden_size=7168,
    moe_intermediate_size=2048,
    num_layers=61,
    num_experts=256,
    top_k=8,
    vocab_size=129280,
    attention=MLAAttention(
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    num_dense_layers=3,
    dense_intermediate_size=18432,
    num_shared_experts=1,
    untied_lm_head=True,
    source="config.json of huggingface.co/deepseek-ai/DeepSeek-V3 (hidden_size, "
    "moe_intermediate_size, intermediate_size, num_hidden_layers, first_k_dense_replace, "
    "n_routed_experts, n_shared_experts, num_experts_per_tok, vocab_size, MLA ranks and head "
    "dims, tie_word_embeddings=false); DeepSeek-V3 report (arXiv:2412.19437) §4.2",
)
"""DeepSeek-V3 (main model only: the multi-token-prediction module, about 14B more
parameters, is excluded, as in the report's 671B total). From its config.json:
hidden_size 7168, moe_intermediate_size 2048, intermediate_size 18432 (3 dense layers,
first_k_dense_replace=3), num_hidden_layers 61, n_routed_experts 256, n_shared_experts 1,
num_experts_per_tok 8, vocab_size 129280, num_attention_heads 128, q_lora_rank 1536,
kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128,
tie_word_embeddings false. The router's expert-bias vector is not counted."""

KIMI_K3_LIKE = replace(
    DEEPSEEK_V3,  # Kimi K2 keeps DeepSeek-V3's shape but for what is changed here
    name="kimi-k3-like",
    num_experts=896,
    top_k=16,
    vocab_size=163840,
    attention=replace(DEEPSEEK_V3.attention, num_heads=64),
    num_dense_layers=1,
    source="896 routed experts, top-16: Kimi K3 as publicly described with MoonEP; every "
    "other number ASSUMED equal to Kimi K2's public config.json (moonshotai/Kimi-K2-Instruct)",
    assumptions=(
        "hidden_size 7168, moe_intermediate_size 2048, 61 layers (Kimi K2)",
        "first layer dense with intermediate_size 18432, 1 shared expert (Kimi K2)",
        "MLA with 64 heads, q_lora 1536, kv_lora 512, head dims 128/64/128 (Kimi K2)",
        "vocab_size 163840, untied LM head (Kimi K2)",
    ),
)
"""A Kimi-K3-shaped model. Only E=896 and K=16 come from the source (MoonEP's public
description of Kimi K3: 896 routed experts, 16 activated per token); all other dimensions
are assumptions copied from Kimi K2's public config.json. Use it for orders of magnitude,
not as K3's real size."""

PRESETS: Mapping[str, ModelPreset] = MappingProxyType(
    {p.name: p for p in (MIXTRAL_8X7B, DEEPSEEK_V3, KIMI_K3_LIKE)}
)
"""Read-only registry of the built-in presets, keyed by name."""


def get_preset(name: str) -> ModelPreset:
    """Return the preset called ``name`` (case-insensitive).

    Raises ``ValueError`` naming the valid choices when ``name`` is unknown.
    """
    preset = PRESETS.get(str(name).strip().lower())
    if preset is None:
        choices = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model preset {name!r}; valid choices: {choices}")
    return preset


# --------------------------------------------------------------------------- validation


def _check_bytes(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of bytes, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number of bytes, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamCount:
    """Parameter split of a model (all ints, in parameters, not bytes).

    ``expert`` = routed experts (sharded by EP); ``replicated`` = everything else that
    this model counts (attention, router, embedding, shared experts, dense FFNs, LM head);
    ``active`` = parameters one token touches: ``K`` routed experts per MoE layer plus
    all replicated parameters.
    """

    expert: int
    attention: int
    router: int
    embedding: int
    lm_head: int
    shared_experts: int
    dense_ffn: int
    active_expert: int

    @property
    def replicated(self) -> int:
        """Non-expert parameters (int)."""
        parts = (self.attention, self.router, self.embedding, self.lm_head)
        return sum(parts) + self.shared_experts + self.dense_ffn

    @property
    def total(self) -> int:
        """``expert + replicated`` (int)."""
        return self.expert + self.replicated

    @property
    def active(self) -> int:
        """Parameters used per token: ``active_expert + replicated`` (int)."""
        return self.active_expert + self.replicated


def expert_params(model: ModelPreset) -> int:
    """Parameters of one SwiGLU routed expert in one layer: ``3*H*F`` (int)."""
    return 3 * model.hidden_size * model.moe_intermediate_size


def count_params(model: ModelPreset) -> ParamCount:
    """Split ``model``'s parameters into routed-expert and replicated parts (see ``ParamCount``).

    Routed experts: ``E * 3*H*F * L_moe``. Replicated: attention of every layer, router
    ``H x E`` per MoE layer, embedding ``vocab x H``, LM head ``vocab x H`` if untied,
    shared experts ``3*H*F`` each per MoE layer, dense FFN ``3*H*F_dense`` per dense layer.
    """
    h, moe = model.hidden_size, model.num_moe_layers
    per_expert = expert_params(model)
    embedding = model.vocab_size * h
    return ParamCount(
        expert=per_expert * model.num_experts * moe,
        attention=model.attention.params(h) * model.num_layers,
        router=h * model.num_experts * moe,
        embedding=embedding,
        lm_head=embedding if model.untied_lm_head else 0,
        shared_experts=per_expert * model.num_shared_experts * moe,
        dense_ffn=3 * h * model.dense_intermediate_size * model.num_dense_layers,
        active_expert=per_expert * model.top_k * moe,
    )


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryPerRank:
    """Weight bytes held by one rank (floats, bytes): experts sharded by EP, the rest by TP."""

    expert_bytes: float
    replicated_bytes: float

    @property
    def total_bytes(self) -> float:
        """``expert_bytes + replicated_bytes``."""
        return self.expert_bytes + self.replicated_bytes

    @property
    def expert_gib(self) -> float:
        """Expert weights per rank in GiB (``2**30`` bytes)."""
        return self.expert_bytes / GIB

    @property
    def replicated_gib(self) -> float:
        """Replicated weights per rank in GiB."""
        return self.replicated_bytes / GIB

    @property
    def total_gib(self) -> float:
        """All weights per rank in GiB."""
        return self.total_bytes / GIB


def memory_per_rank(
    model: ModelPreset, *, ep: int, tp: int = 1, bytes_per_param: float = 2
) -> MemoryPerRank:
    """Weight memory of one rank: ``expert*s/EP + replicated*s/TP`` bytes.

    ``ep`` (int >= 1) is the EP group size, ``tp`` (int >= 1) divides every replicated
    parameter (a simplification: real TP keeps norms and often the router whole),
    ``bytes_per_param`` (``s``, > 0, default 2 = bf16). The expert term is the uniform
    average; with ``EP > E`` or ``E mod EP != 0`` some ranks hold more, some none.
    """
    check_int("ep", ep, 1)
    check_int("tp", tp, 1)
    s = _check_bytes("bytes_per_param", bytes_per_param)
    params = count_params(model)
    return MemoryPerRank(
        expert_bytes=params.expert * s / ep,
        replicated_bytes=params.replicated * s / tp,
    )


# --------------------------------------------------------------------------- communication


@dataclass(frozen=True)
class CommPerRank:
    """Bytes one rank sends for dispatch and for combine in one MoE layer (floats, bytes),
    and the layer count ``num_layers`` used for a whole forward pass."""

    backend: str
    dispatch_bytes: float
    combine_bytes: float
    num_layers: int

    @property
    def layer_bytes(self) -> float:
        """Dispatch + combine bytes of one MoE layer."""
        return self.dispatch_bytes + self.combine_bytes

    @property
    def forward_bytes(self) -> float:
        """Dispatch + combine bytes over all ``num_layers`` MoE layers of a forward pass."""
        return self.layer_bytes * self.num_layers

    @property
    def dispatch_mib(self) -> float:
        """Dispatch per layer in MiB (``2**20`` bytes)."""
        return self.dispatch_bytes / MIB

    @property
    def layer_mib(self) -> float:
        """Dispatch + combine per layer in MiB."""
        return self.layer_bytes / MIB

    @property
    def forward_mib(self) -> float:
        """Dispatch + combine over a forward pass in MiB."""
        return self.forward_bytes / MIB


def all_to_all_dispatch_bytes(
    tokens: int, top_k: int, hidden: int, ep: int, bytes_per_elem: float = 2
) -> float:
    """Direct all-to-all send volume of one rank in one layer: ``S*K*H*s*(EP-1)/EP`` bytes.

    Each of the ``S`` tokens sends ``K`` copies of its ``H``-vector; with uniform routing a
    fraction ``(EP-1)/EP`` of them leaves the rank. A lower bound (no metadata, no padding).
    """
    check_int("tokens", tokens, 0)
    check_int("top_k", top_k, 1)
    check_int("hidden", hidden, 1)
    check_int("ep", ep, 1)
    s = _check_bytes("bytes_per_elem", bytes_per_elem)
    return tokens * top_k * hidden * s * (ep - 1) / ep


def allgather_dispatch_bytes(tokens: int, hidden: int, ep: int, bytes_per_elem: float = 2) -> float:
    """Allgather dispatch volume of one rank in one layer: ``(EP-1)*S*H*s`` bytes.

    The allgather + reduce-scatter backend (vLLM's default ``allgather_reducescatter``)
    gives every rank a copy of all tokens, so it is independent of ``K``; the
    reduce-scatter combine moves the same amount back.
    """
    check_int("tokens", tokens, 0)
    check_int("hidden", hidden, 1)
    check_int("ep", ep, 1)
    s = _check_bytes("bytes_per_elem", bytes_per_elem)
    return (ep - 1) * tokens * hidden * s


def comm_per_rank(
    model: ModelPreset,
    *,
    ep: int,
    tokens: int,
    bytes_per_elem: float = 2,
    backend: str = ALL_TO_ALL,
) -> CommPerRank:
    """Dispatch/combine bytes of one rank per MoE layer for ``backend`` (see ``BACKENDS``).

    ``tokens`` is ``S`` (int >= 0, tokens on the rank entering each MoE layer); combine is
    counted equal to dispatch; a forward pass has ``model.num_moe_layers`` such layers.
    """
    if backend == ALL_TO_ALL:
        h, k = model.hidden_size, model.top_k
        dispatch = all_to_all_dispatch_bytes(tokens, k, h, ep, bytes_per_elem)
    elif backend == ALLGATHER_REDUCESCATTER:
        dispatch = allgather_dispatch_bytes(tokens, model.hidden_size, ep, bytes_per_elem)
    else:
        raise ValueError(f"unknown backend {backend!r}; valid choices: {', '.join(BACKENDS)}")
    return CommPerRank(backend, dispatch, dispatch, model.num_moe_layers)
