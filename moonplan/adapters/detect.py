"""Which MoE blocks moonplan can wrap: detection by structure, not by class name.

Legend: E experts, H hidden, F expert FFN size, K top-k, S tokens.

A supported block (the transformers >= 5 layout: Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3,
OLMoE, GLM-4-MoE and many more share it) has

* a child ``experts`` whose own parameters are exactly ``gate_up_proj [E, 2F, H]``
  (gate rows, then up rows, concatenated) and ``down_proj [E, H, F]``, no bias, whose
  ``act_fn`` is SiLU with the default gate (``act_fn(gate) * up``), and whose forward
  takes ``(hidden_states [S, H], top_k_index [S, K], top_k_weights [S, K])``;
* a router child, ``gate`` or ``router`` (its ``weight``, if it has one, is ``[E, H]``),
  returning router logits, top-k weights and top-k indices; the block's forward passes
  the last two to ``experts``;
* the top-k ``K`` as an integer ``top_k`` of the router or of the block.

Everything else in the block (routing function, shared experts and their gates,
jitter, output shape) is the block's own code and is left untouched by wrapping.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F_
from torch import nn

from moonplan.core.experts import MoonExperts

ROUTER_NAMES = ("gate", "router")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
# transformers' layout flags (set by its ``use_experts_implementation``) and the values we need
_LAYOUT_FLAGS = {
    "is_transposed": False,
    "is_concatenated": True,
    "has_bias": False,
    "has_gate": True,
    "has_post_expert_norm": False,
}


class UnsupportedBlockError(TypeError):
    """A module is not a MoE block of a supported structure; says what was expected and found."""


@dataclass(frozen=True)
class BlockSpec:
    """What wrapping needs to know about a supported block.

    Attributes:
        experts_name: attribute of the experts child (``"experts"``).
        router_name: attribute of the router child (``"gate"`` or ``"router"``).
        num_experts, hidden, ffn, top_k: ``E``, ``H``, ``F``, ``K``.
    """

    experts_name: str
    router_name: str
    num_experts: int
    hidden: int
    ffn: int
    top_k: int


def inspect_block(module: nn.Module) -> BlockSpec:
    """The :class:`BlockSpec` of a supported MoE block.

    Raises:
        UnsupportedBlockError: naming the block's class, the expected structure and
            what was found instead.
    """
    try:
        return _inspect(module)
    except _Mismatch as exc:
        raise UnsupportedBlockError(
            f"cannot wrap {type(module).__name__}: expected {exc.expected}; found {exc.found}. "
            "Supported: blocks with a router child (gate/router, weight [E, H]) and an "
            "`experts` child holding gate_up_proj [E, 2F, H] and down_proj [E, H, F] "
            "(SiLU-gated); use moonplan.wrap_experts for other layers"
        ) from None


def is_supported(module: nn.Module) -> bool:
    """Whether :func:`inspect_block` accepts ``module``."""
    try:
        _inspect(module)
    except _Mismatch:
        return False
    return True


def looks_like_moe(module: nn.Module) -> bool:
    """A module with an ``experts`` child holding parameters (supported or not)."""
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and any(True for _ in experts.parameters())


class _Mismatch(Exception):
    def __init__(self, expected: str, found: str):
        super().__init__(expected, found)
        self.expected, self.found = expected, found


def _inspect(module: nn.Module) -> BlockSpec:
    experts = module._modules.get("experts")
    if experts is None:
        children = ", ".join(module._modules) or "none"
        raise _Mismatch("a child module named `experts`", f"children: {children}")
    if isinstance(experts, MoonExperts):
        raise _Mismatch("a block that is not wrapped yet", "its experts already run on moonplan")
    E, F, H = _expert_shapes(experts)
    _check_layout(experts)
    _check_activation(experts)
    _check_call(experts)
    router_name = _router_name(module, E, H)
    K = _top_k(module, module.get_submodule(router_name), E)
    return BlockSpec("experts", router_name, E, H, F, K)


def _expert_shapes(experts: nn.Module) -> tuple[int, int, int]:
    own = dict(experts.named_parameters(recurse=False))
    nested = [n for n, _ in experts.named_parameters() if "." in n]
    if sorted(own) != sorted(EXPERT_PARAMS) or nested:
        found = ", ".join(f"{n} {tuple(p.shape)}" for n, p in experts.named_parameters())
        raise _Mismatch(
            "experts parameters exactly gate_up_proj and down_proj", f"{found or 'none'}"
        )
    gu, dn = tuple(own["gate_up_proj"].shape), tuple(own["down_proj"].shape)
    ok = len(gu) == 3 and len(dn) == 3 and gu[1] % 2 == 0
    if not ok or dn != (gu[0], gu[2], gu[1] // 2):
        raise _Mismatch(
            "gate_up_proj [E, 2F, H] and down_proj [E, H, F]",
            f"gate_up_proj {gu} and down_proj {dn}",
        )
    if own["gate_up_proj"].dtype != own["down_proj"].dtype:
        raise _Mismatch("one dtype for both projections", f"{gu} and {dn} dtypes differ")
    return gu[0], gu[1] // 2, gu[2]


def _check_layout(experts: nn.Module) -> None:
    wrong = [
        f"{flag}={getattr(experts, flag)!r}"
        for flag, want in _LAYOUT_FLAGS.items()
        if hasattr(experts, flag) and bool(getattr(experts, flag)) != want
    ]
    if wrong:
        want = ", ".join(f"{f}={v}" for f, v in _LAYOUT_FLAGS.items())
        raise _Mismatch(f"the plain expert layout ({want})", ", ".join(wrong))
    gate_fn = getattr(type(experts), "_apply_gate", None)
    if gate_fn is not None and gate_fn is not _default_apply_gate():
        raise _Mismatch(
            "the default gate act_fn(gate) * up",
            f"a custom {type(experts).__name__}._apply_gate",
        )


def _default_apply_gate() -> object:
    """transformers' default ``_apply_gate`` (``None`` without transformers)."""
    try:
        from transformers.integrations import moe
    except ImportError:  # no transformers: only hand-written experts, which have no _apply_gate
        return None
    return getattr(moe, "_default_apply_gate", None)


def _check_activation(experts: nn.Module) -> None:
    act = getattr(experts, "act_fn", None)
    if not callable(act):
        raise _Mismatch("an act_fn (SiLU) on the experts", "no callable act_fn")
    probe = torch.linspace(-6.0, 6.0, 25)
    try:
        same = torch.allclose(act(probe), F_.silu(probe), rtol=1e-6, atol=1e-6)
    except Exception as exc:  # an activation we cannot even evaluate is not SiLU
        same, act = False, f"{act!r} ({type(exc).__name__})"
    if not same:
        raise _Mismatch("SiLU as the experts' act_fn (SwiGLU experts)", f"act_fn {act!r}")


def _check_call(experts: nn.Module) -> None:
    try:
        params = list(inspect.signature(experts.forward).parameters.values())
    except (TypeError, ValueError):
        return  # not introspectable: trust the structure checked so far
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != 3:
        names = ", ".join(p.name for p in params)
        raise _Mismatch(
            "experts.forward(hidden_states, top_k_index, top_k_weights)",
            f"experts.forward({names})",
        )


def _router_name(module: nn.Module, E: int, H: int) -> str:
    """The router child; its own ``weight``, where it has one, must be ``[E, H]``."""
    found = []
    for name in ROUTER_NAMES:
        child = module._modules.get(name)
        if child is None:
            continue
        weight = getattr(child, "weight", None)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) == (E, H):
            return name
        found.append(f"{name}.weight {tuple(weight.shape)}")
    raise _Mismatch(
        f"a router child ({' or '.join(ROUTER_NAMES)}) scoring E={E} experts from H={H}",
        ", ".join(found) or f"children: {', '.join(module._modules)}",
    )


def _top_k(module: nn.Module, router: nn.Module, E: int) -> int:
    for owner in (router, module):
        k = getattr(owner, "top_k", None)
        if isinstance(k, int) and not isinstance(k, bool):
            if not 1 <= k <= E:
                raise _Mismatch(f"top_k in [1, {E}]", f"top_k={k}")
            return k
    raise _Mismatch("an integer top_k on the router or the block", "none")
