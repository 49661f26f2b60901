"""Token-level routing for the simulator: each token's top-k expert set, not just counts.

Legend:
    T steps, R ranks, E experts, S tokens per rank, K top-k, X tokens of one draw
    pop_E      float64 expert popularity (sums to 1)
    logits_E   float64 log-weights the tokens are sampled with
    ids_RSK    int64 expert ids of every record (token-major; K distinct ids per token)
    groups     ``(n_group, topk_group)``: group-limited routing (``None``: plain top-k)

Unique ``(token, destination)`` rows need to know which records share a token, which
per-(rank, expert) counts do not say. Tokens are sampled here so that their per-expert
counts follow the workload's popularity (:mod:`moonplan.simulate.workload`):

* **plain top-k** (``groups=None``): ``K`` distinct experts drawn one after the other,
  each proportionally to popularity among the experts not yet taken (the Plackett-Luce
  law of Gumbel top-k on ``log pop``, and of ``moonplan.traces``' exact sampler), by
  rejection: ``O(S*K)`` CDF look-ups, not ``O(S*E)`` scores;
* **group-limited** (``groups=(G, M)``, DeepSeek-V3's node-limited routing): experts
  form ``G`` groups of consecutive ids; a token first draws ``M`` distinct groups (the
  same law, each group weighted by its experts' total weight), then its ``K`` experts
  inside them. This keeps the property unique rows depend on (a token's experts lie
  in at most ``M`` groups); DeepSeek-V3 ranks the groups by the sum of their best
  ``K / M`` affinities instead, which a popularity alone does not determine. The
  restriction changes how often each expert is picked, so the logits are fitted
  (:func:`fit_logits`) until the sampled inclusion of every expert matches the
  workload's ``q_e`` (``workload.inclusion_probability``).

Which presets route group-limited: :data:`GROUP_LIMITS` (``docs/simulator.md``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

import torch

from moonplan.cost import ModelPreset
from moonplan.simulate.workload import inclusion_probability

GROUP_LIMITS: Mapping[str, tuple[int, int]] = MappingProxyType({"deepseek-v3": (8, 4)})
"""``(n_group, topk_group)`` per model preset name with group-limited routing.
DeepSeek-V3: 8 groups, a token's experts lie in its best 4 (the published model
configuration's ``n_group = 8``, ``topk_group = 4``; the DeepSeek-V3 report, §2.1.2
"node-limited routing": at most 4 nodes, scored by the sum of each node's best
``K / 4`` affinities). The other presets route plain top-k."""

_MAX_ROUNDS = 16
"""Rounds before a token still short of ids gets masked Gumbel-max draws."""


def group_limit(model: str) -> tuple[int, int] | None:
    """``(n_group, topk_group)`` of preset ``model`` (:data:`GROUP_LIMITS`), else ``None``."""
    return GROUP_LIMITS.get(str(model).strip().lower())


def sample_topk(
    logits_E: torch.Tensor,
    tokens: int,
    topk: int,
    gen: torch.Generator,
    groups: tuple[int, int] | None = None,
) -> torch.Tensor:
    """int64 ``[tokens, K]``: every token's ``K`` distinct experts (module docstring)."""
    E = logits_E.numel()
    _check_groups(E, topk, groups)
    w_E = torch.softmax(logits_E.to(torch.float64), 0)
    all_X1 = torch.ones(tokens, 1, dtype=torch.bool)
    if groups is None:
        return _draw_distinct(w_E, all_X1, topk, gen)
    G, M = groups
    picked_XM = _draw_distinct(w_E.view(G, E // G).sum(1), all_X1, M, gen)
    allowed_XG = torch.zeros(tokens, G, dtype=torch.bool).scatter_(1, picked_XM, True)
    return _draw_distinct(w_E, allowed_XG, topk, gen)


def _check_groups(E: int, K: int, groups: tuple[int, int] | None) -> None:
    if not 1 <= K <= E:
        raise ValueError(f"need 1 <= topk <= experts, got topk = {K}, experts = {E}")
    if groups is None:
        return
    G, M = groups
    if G < 1 or E % G or not 1 <= M <= G or K > M * (E // G):
        raise ValueError(
            f"group-limited routing needs groups dividing E = {E}, 1 <= topk_group <= groups "
            f"and room for K = {K} experts in topk_group groups; got {groups}"
        )


def _draw_distinct(
    w_E: torch.Tensor, allowed_XG: torch.Tensor, K: int, gen: torch.Generator
) -> torch.Tensor:
    """``[X, K]`` ids: ``K`` draws per row without replacement, proportional to ``w_E``,
    among the experts of the groups ``allowed_XG`` allows (``G`` groups of consecutive
    ids; ``[X, 1]``: one group, every expert).

    Each row's ids are the first ``K`` distinct allowed entries of an i.i.d. sequence
    drawn from ``w_E`` (rejection: the same law as drawing each from the allowed,
    untaken rest). The sequences start with ``1.5 K`` entries and grow by ``K`` while a
    row lacks ids; a row still short after ``_MAX_ROUNDS`` rounds gets its last ids by
    masked Gumbel-max draws (the same law).
    """
    X, E = allowed_XG.shape[0], w_E.numel()
    cdf_E = w_E.cumsum(0)
    cdf_E = cdf_E / cdf_E[-1]
    ids_XK = torch.empty(X, K, dtype=torch.int64)
    rows_Y = torch.arange(X)
    seq_YD = torch.zeros(X, 0, dtype=torch.int64)
    for i in range(_MAX_ROUNDS):
        D = K + (K + 1) // 2 if i == 0 else K
        u_YD = torch.rand(rows_Y.numel(), D, generator=gen, dtype=torch.float64)
        draw_YD = torch.searchsorted(cdf_E, u_YD, right=True).clamp_(max=E - 1)
        seq_YD = torch.cat([seq_YD, draw_YD], 1)
        ok_YD = _first_allowed(seq_YD, allowed_XG, rows_Y, E)
        have_YD = ok_YD.cumsum(1)
        full_Y = have_YD[:, -1] >= K
        pick_YD = (ok_YD & (have_YD <= K))[full_Y]
        ids_XK[rows_Y[full_Y]] = seq_YD[full_Y][pick_YD].view(-1, K)
        rows_Y, seq_YD = rows_Y[~full_Y], seq_YD[~full_Y]
        if not rows_Y.numel():
            return ids_XK
    ok_YD = _first_allowed(seq_YD, allowed_XG, rows_Y, E)
    for i, x in enumerate(rows_Y.tolist()):  # rare: an expert hot enough to repeat 16 K times
        have = seq_YD[i][ok_YD[i]][:K]
        ids_XK[x, : have.numel()] = have
        allowed_E = allowed_XG[x].repeat_interleave(E // allowed_XG.shape[1])
        for k in range(have.numel(), K):
            ids_XK[x, k] = _masked_gumbel(w_E, ids_XK[x, :k], allowed_E, gen)
    return ids_XK


def _first_allowed(
    seq_YD: torch.Tensor, allowed_XG: torch.Tensor, rows_Y: torch.Tensor, E: int
) -> torch.Tensor:
    """bool ``[Y, D]``: the entry's group is allowed for its row, and the entry is its
    first occurrence there."""
    sorted_YD, order_YD = torch.sort(seq_YD, dim=1, stable=True)
    first_YD = torch.ones_like(seq_YD, dtype=torch.bool)
    first_YD[:, 1:] = sorted_YD[:, 1:] != sorted_YD[:, :-1]
    first_YD = torch.empty_like(first_YD).scatter_(1, order_YD, first_YD)
    G = allowed_XG.shape[1]
    if G == 1:
        return first_YD
    return first_YD & allowed_XG[rows_Y].gather(1, seq_YD // (E // G))


def _masked_gumbel(
    w_E: torch.Tensor, taken_J: torch.Tensor, allowed_E: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """One draw from ``w_E`` over the allowed experts not in ``taken_J``."""
    free_E = allowed_E & (w_E > 0)
    free_E[taken_J] = False
    if not bool(free_E.any()):
        raise ValueError("too few experts with positive popularity to draw distinct top-k sets")
    u_E = torch.rand(w_E.numel(), generator=gen, dtype=torch.float64).clamp_(min=1e-300)
    z_E = torch.log(w_E) - torch.log(-torch.log(u_E))
    return z_E.masked_fill(~free_E, -math.inf).argmax()


def inclusion_rate(ids_XK: torch.Tensor, experts: int) -> torch.Tensor:
    """float64 ``[E]``: share of the tokens whose top-k contains each expert."""
    hits_E = torch.bincount(ids_XK.reshape(-1), minlength=experts).to(torch.float64)
    return hits_E / max(1, ids_XK.shape[0])


def fit_logits(
    pop_E: torch.Tensor,
    topk: int,
    gen: torch.Generator,
    groups: tuple[int, int] | None,
    *,
    start_E: torch.Tensor | None = None,
    iters: int = 4,
    sample: int = 1 << 14,
) -> torch.Tensor:
    """float64 ``[E]`` logits whose sampled inclusion matches ``q = inclusion_probability``.

    Plain top-k returns ``log pop`` (no fit: its law is the workload's exact one).
    Group-limited: starting from ``start_E`` (default ``log q``), ``iters`` rounds of
    ``logits += log(q / sampled inclusion)`` on ``sample`` tokens each.
    """
    p_E = pop_E.to(torch.float64)
    if groups is None:
        return torch.log(p_E)
    q_E = inclusion_probability(p_E, topk)
    logits_E = torch.log(q_E) if start_E is None else start_E.clone()
    for _ in range(iters):
        got_E = inclusion_rate(sample_topk(logits_E, sample, topk, gen, groups), q_E.numel())
        ratio_E = (q_E + 1e-9) / (got_E + 1e-9)
        logits_E = logits_E + torch.log(ratio_E).clamp(-2.0, 2.0)
    return logits_E


def drifting_tokens(
    pops: Iterable[torch.Tensor],
    ranks: int,
    tokens: int,
    topk: int,
    *,
    seed: int = 0,
    groups: tuple[int, int] | None = None,
) -> Iterator[torch.Tensor]:
    """``ids_RSK`` (int16; int32 above 32767 experts) of each step's popularity ``pops``
    (``workload.drifting_popularity``: the law of ``workload.drifting_counts``).

    Every rank routes ``tokens`` tokens, drawn with their own generator seeded ``seed``.
    The group-limited fit starts from the previous step's logits (the drift is small).
    """
    gen = torch.Generator().manual_seed(int(seed))
    logits_E = None
    for pop_E in pops:
        logits_E = fit_logits(
            pop_E, topk, gen, groups, start_E=logits_E, iters=4 if logits_E is None else 1
        )
        ids_XK = sample_topk(logits_E, ranks * tokens, topk, gen, groups)
        yield ids_XK.view(ranks, tokens, topk).to(_id_dtype(pop_E.numel()))


def _id_dtype(experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds expert ids (a sweep keeps every step's ids)."""
    return torch.int16 if experts <= torch.iinfo(torch.int16).max else torch.int32


def token_counts(ids_RSK: torch.Tensor, experts: int) -> torch.Tensor:
    """int64 ``[R, E]``: records each rank routes to each expert (the planner's counts)."""
    R = ids_RSK.shape[0]
    flat = (torch.arange(R)[:, None, None] * experts + ids_RSK).reshape(-1)
    return torch.bincount(flat, minlength=R * experts).view(R, experts)


def token_trace(
    model: ModelPreset, ranks: int, tokens: int, pops: Iterable[torch.Tensor], seed: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(counts_TRE, [ids_RSK per step])``: ``model``'s tokens (its top-k and
    :func:`group_limit`) by each step's popularity ``pops`` (:func:`drifting_tokens`)."""
    gm = group_limit(model.name)
    ids = list(drifting_tokens(pops, ranks, tokens, model.top_k, seed=seed, groups=gm))
    return torch.stack([token_counts(i, model.num_experts) for i in ids]), ids
