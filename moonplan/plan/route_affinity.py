"""Affinity: which of a source's records of a split expert go to which destination.

Legend:
    R ranks, E experts, S tokens on this rank, K top-k
    N records of this rank, sorted by expert (stable: local order kept inside an expert)
    C = R*W rows of the plan sorted by (expert, rank) (``route._row_cells``)
    P records of experts that this source splits over several destinations

The plan fixes how many of this source's records of expert ``e`` each destination
takes (``take`` of the cells). Which ones is free: the offsets of the
destination's segment stay the same set, so no other rank notices. The rule
(deterministic, the same in ``route_reference``):

1. Records of experts this source sends to one destination only are fixed; they
   say which destinations already receive which tokens.
2. For each destination ``d`` in ascending rank order: among the still-unassigned
   records of split experts whose token ``d`` already receives (step 1), ``d``
   takes the first ones in local order, up to its remaining share of the expert.
3. The rest fill the remaining shares: destinations in ascending rank, records in
   local order.

Inside a destination's segment the records keep local order. ``route`` keeps
plain order instead when this rule sends more rows (it can: a rank's share taken
by a token that was also elsewhere may push another token to a second rank).
"""

from __future__ import annotations

import torch


def affinity_cells(
    cell_N: torch.Tensor,
    e_N: torch.Tensor,
    tok_N: torch.Tensor,
    take_C: torch.Tensor,
    e_C: torch.Tensor,
    dest_C: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cells (rows) of the records of split experts under the affinity rule.

    Args:
        cell_N: ``[N]`` cell of each record in plain routing order (segments in order).
        e_N, tok_N: ``[N]`` expert and token of each expert-sorted record.
        take_C, e_C, dest_C: ``[C]`` records of this source each cell takes, its
            expert (clamped to ``>= 0``) and its rank.
        num_experts, num_ranks, num_tokens: ``E``, ``R``, ``S``.

    Returns:
        ``None`` when this source splits no expert (plain order is the rule's answer);
        else ``(idx_P, cell_P)``: the positions in expert-sorted order of the records
        of split experts (whole experts, ascending) and their new cells.
    """
    E, R, dev = num_experts, num_ranks, cell_N.device
    live_C = take_C > 0
    cells_E = torch.bincount(e_C[live_C], minlength=E)
    split_N = cells_E[e_N] > 1
    if not bool(split_N.any()):
        return None
    fixed_N = ~split_N
    have_RS = torch.zeros(R, num_tokens, dtype=torch.bool, device=dev)
    have_RS[dest_C[cell_N[fixed_N]], tok_N[fixed_N]] = True
    cap_ER = torch.zeros(E, R, dtype=torch.int64, device=dev)
    cap_ER.index_put_((e_C, dest_C), take_C, accumulate=True)
    cap_ER = torch.where(cells_E[:, None] > 1, cap_ER, 0)
    idx_P = split_N.nonzero().reshape(-1)  # still expert-sorted, local order inside
    e_P, tok_P = e_N[idx_P], tok_N[idx_P]
    P = idx_P.numel()
    start_P = _expert_start(e_P, E)
    dest_P = torch.full((P,), -1, dtype=torch.int64, device=dev)
    for d in torch.nonzero(cap_ER.sum(0)).reshape(-1).tolist():
        cand_P = (dest_P < 0) & have_RS[d, tok_P]
        rank_P = _rank_within(cand_P, start_P)
        hit_P = cand_P & (rank_P < cap_ER[e_P, d])
        dest_P[hit_P] = d
        cap_ER[:, d] -= torch.bincount(e_P[hit_P], minlength=E)
    rest_P = dest_P < 0
    pos_P = _rank_within(rest_P, start_P)
    cum_X = torch.cumsum(cap_ER.reshape(-1), 0)
    line_E = cum_X.view(E, R)[:, -1] - cap_ER.sum(1)  # where expert e's shares start
    slot_P = torch.searchsorted(cum_X, line_E[e_P] + pos_P, right=True)
    dest_P = torch.where(rest_P, slot_P % R, dest_P)
    cell_ER = torch.full((E, R), -1, dtype=torch.int64, device=dev)
    live_idx = live_C.nonzero().reshape(-1)
    cell_ER[e_C[live_idx], dest_C[live_idx]] = live_idx
    return idx_P, cell_ER[e_P, dest_P]


def _expert_start(e_P: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[P]``: index of the first record of each record's expert (``e_P`` sorted)."""
    n_E = torch.bincount(e_P, minlength=num_experts)
    return (torch.cumsum(n_E, 0) - n_E)[e_P]


def _rank_within(flag_P: torch.Tensor, start_P: torch.Tensor) -> torch.Tensor:
    """``[P]``: flagged records before each record within its expert."""
    cum_X = torch.cat([start_P.new_zeros(1), torch.cumsum(flag_P.to(torch.int64), 0)])
    return cum_X[:-1] - cum_X[start_P]
