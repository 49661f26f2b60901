"""Routers: which ``K`` experts each token goes to, and with which weights.

Legend: S tokens, H hidden, E experts, K top-k, G expert groups (DeepSeek-V3).

Every router maps ``logits [S, E]`` (``router(x)`` of an ``nn.Linear(H, E)``) to
``(topk_ids [S, K] int64, topk_weight [S, K] float32)``. Routing math is done
in fp32, as the reference implementations do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

RouteFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def softmax_topk(logits_SE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's router: fp32 softmax over all experts, top-k, renormalised to sum 1."""
    prob_SE = torch.softmax(logits_SE.float(), dim=-1)
    weight_SK, ids_SK = torch.topk(prob_SE, top_k, dim=-1)
    return ids_SK, weight_SK / weight_SK.sum(-1, keepdim=True)


@dataclass(frozen=True)
class SigmoidGroupedConfig:
    """DeepSeek-V3's router settings (names follow its public config).

    Attributes:
        n_group: expert groups ``G`` (``E`` must be a multiple).
        topk_group: groups a token may pick from.
        norm_topk_prob: renormalise the selected weights to sum 1.
        routed_scaling_factor: multiplies the final weights.
    """

    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0


def sigmoid_grouped_topk(
    logits_SE: torch.Tensor,
    top_k: int,
    bias_E: torch.Tensor,
    cfg: SigmoidGroupedConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router: sigmoid scores, a selection-only bias, group-limited top-k.

    A group's score is the sum of its two best biased scores; each token keeps
    the ``topk_group`` best groups and picks its ``top_k`` experts among them by
    biased score. Weights come from the unbiased scores.
    """
    S, E = logits_SE.shape
    score_SE = torch.sigmoid(logits_SE.float())
    choice_SE = score_SE + bias_E.float()[None, :]
    G = cfg.n_group
    if E % G:
        raise ValueError(f"num_experts {E} is not a multiple of n_group {G}")
    per_group = choice_SE.view(S, G, E // G)
    group_SG = per_group.topk(min(2, E // G), dim=-1).values.sum(-1)
    keep_SG = torch.zeros_like(group_SG, dtype=torch.bool)
    keep_SG.scatter_(1, group_SG.topk(cfg.topk_group, dim=-1).indices, True)
    masked_SE = choice_SE.masked_fill(~keep_SG.repeat_interleave(E // G, dim=1), float("-inf"))
    ids_SK = masked_SE.topk(top_k, dim=-1).indices
    weight_SK = score_SE.gather(1, ids_SK)
    if cfg.norm_topk_prob:
        weight_SK = weight_SK / (weight_SK.sum(-1, keepdim=True) + 1e-20)
    return ids_SK, weight_SK * cfg.routed_scaling_factor
