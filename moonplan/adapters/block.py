"""``wrap``: a transformers MoE block whose experts run through moonplan.

Legend: R ranks, E experts, E_r this rank's home experts, H hidden, F expert FFN size.

The wrapped block is a shallow copy of the original, of the same class, whose
``experts`` child is replaced by a :class:`~moonplan.core.experts.MoonExperts`.
Its forward is therefore the block's own forward: the same router (softmax top-k,
DeepSeek-V3's group-limited sigmoid routing with its correction bias and scaling, ...),
the same shared experts and their gates, the same return value. Only the expert
computation changes: ``experts(hidden [S, H], top_k_index [S, K], top_k_weights [S, K])``
now plans, dispatches and combines over the EP group.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moonplan.adapters.detect import inspect_block
from moonplan.adapters.swap import with_experts
from moonplan.adapters.torchtitan import is_torchtitan_moe, wrap_moe
from moonplan.comm.group import EPGroup
from moonplan.core.experts import MoonExperts
from moonplan.runtime.config import MoEConfig


def wrap(
    module: nn.Module,
    *,
    group: EPGroup | object | None = None,
    config: MoEConfig | None = None,
    **options: Any,
) -> nn.Module:
    """Wrap one MoE block (collective: every rank of the group calls it, in the same order).

    Args:
        module: a supported block (see :mod:`moonplan.adapters.detect`), e.g. transformers'
            ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock`` or ``DeepseekV3MoE``, on
            the group's device and in its final dtype; identical on every rank. A
            torchtitan ``MoE`` (detected by structure) goes to
            :func:`moonplan.adapters.torchtitan.wrap_moe`.
        group: an :class:`EPGroup` or a torch ProcessGroup (default: the default group).
        config: a :class:`~moonplan.runtime.config.MoEConfig`; its sizes may stay ``None``
            (read from the block), a set one must match the block.
        **options: fields of :class:`~moonplan.runtime.config.MoEConfig`, replacing the
            config's: ``slots`` (a count, a byte budget ``"2GiB"``/``Bytes`` or a fraction of
            the home experts' bytes; default ``min(2, ceil(E/R))``), ``align``,
            ``max_tokens``, ``transport``, ``balance`` (``"auto"`` default, ``"exact"``,
            ``"off"``), ``overlap``, ``cost``, ``choose``.

    Returns:
        A module of the same class with the same forward signature and return value. It
        shares the router, the shared experts and every other child with ``module`` (same
        Parameter objects); its ``experts.gate_up_proj [E_r, 2F, H]`` and
        ``experts.down_proj [E_r, H, F]`` are copies of this rank's home experts, whose
        global ids are ``wrapped.home_experts`` (int64 ``[E_r]``). ``module`` itself is
        left as it was.

    Raises:
        UnsupportedBlockError: ``module`` is not a supported MoE block (the message says
            what was expected and what was found).
    """
    if is_torchtitan_moe(module):  # torchtitan's MoE: its routed_experts child is replaced
        return wrap_moe(module, group=group, config=config, **options)
    spec = inspect_block(module)
    experts = module.get_submodule(spec.experts_name)
    moon = MoonExperts(
        experts.get_parameter("gate_up_proj"),
        experts.get_parameter("down_proj"),
        spec.top_k,
        group=group,
        config=config,
        **options,
    )
    wrapped = with_experts(module, spec.experts_name, moon, moon)
    wrapped.home_range = moon.home_range  # type: ignore[assignment]
    return wrapped
