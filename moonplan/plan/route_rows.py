"""Unique ``(token, destination rank)`` rows of one source rank, and where they land.

Legend:
    R ranks, E experts, S tokens on this rank, K top-k, N = S*K records of this rank
    U unique (token, destination) rows of this rank (``U <= N``)

Token-buffer layout of destination ``d`` (the contract the transports implement,
``docs/design.md`` §3): one block per source rank, in source-rank order. Source
``s``'s block starts at ``sum_{s' < s} records(s', d)`` and has room for
``records(s, d)`` rows, the records ``s`` sends ``d`` under the plan (a token row
carries at least one record, so the block always fits). Both numbers follow from
the plan alone, so every source writes its rows without asking anyone; the buffer
of ``d`` needs ``plan.target[d]`` rows, fewer than its expert-grouped buffer. Inside
its block a source puts its rows in ascending token order; how many it uses
(``Route.unique_counts[d]``) only the source knows. What ``d`` cannot know is which
records share a row, so the source sends one int per record along: the record's
token-buffer row, written at the record's expert-grouped row ``dest_offset``
(``Route.token_row``); ``d`` then builds its expert-grouped rows with one local
gather ``grouped[o] = tokens[token_row_at[o]]``.
"""

from __future__ import annotations

import torch

from moonplan.plan.plan_type import Plan


def pair_records(plan: Plan) -> torch.Tensor:
    """``[R, R]`` int64: records source ``s`` sends destination ``d`` under the plan.

    Within expert ``e`` the sources take consecutive segments of ``counts[:, e]`` and
    the destinations consecutive segments of ``alloc[e, :]`` (``docs/design.md`` §3);
    the pair's records are the overlaps, summed over experts.
    """
    c_RE = plan.counts
    lo_RE = torch.cumsum(c_RE, 0) - c_RE
    hi_RE = lo_RE + c_RE
    a_ER = torch.cumsum(plan.alloc, 1) - plan.alloc
    b_ER = a_ER + plan.alloc
    lo = torch.maximum(lo_RE.T[:, :, None], a_ER[:, None, :])  # [E, S, D]
    hi = torch.minimum(hi_RE.T[:, :, None], b_ER[:, None, :])
    return (hi - lo).clamp(min=0).sum(0)


def token_block_start(plan: Plan, rank: int) -> torch.Tensor:
    """``[R]`` int64: first row of source ``rank``'s block in each destination's token
    buffer, ``sum_{s < rank} records(s, d)`` (a column of :func:`pair_records`'s
    exclusive cumsum, in ``O(E*R)``: the lower sources fill the prefix
    ``[0, lo_e)`` of expert ``e``'s line, so their records at ``d`` are that
    prefix's overlap with ``d``'s segment)."""
    lo_E = plan.counts[:rank].sum(0)
    a_ER = torch.cumsum(plan.alloc, 1) - plan.alloc
    b_ER = a_ER + plan.alloc
    return (torch.minimum(lo_E[:, None], b_ER) - a_ER).clamp(min=0).sum(0)


def count_rows(dest_N: torch.Tensor, S: int, K: int, num_ranks: int) -> torch.Tensor:
    """Distinct ``(token, destination)`` pairs of the records ``dest_N`` (token-major):
    a 0-d int64 tensor on ``dest_N``'s device (no host read: compare, then read once)."""
    tok_N = torch.arange(dest_N.numel(), device=dest_N.device) // max(K, 1)
    mask_X = torch.zeros(num_ranks * S, dtype=torch.bool, device=dest_N.device)
    mask_X[dest_N * S + tok_N] = True
    return mask_X.sum()


def unique_rows(
    dest_N: torch.Tensor, S: int, K: int, num_ranks: int, block_start_R: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unique ``(token, destination)`` rows of the records ``dest_N`` (token-major).

    Args:
        dest_N: ``[N]`` int64 destination rank of each record (record ``i`` is token ``i // K``).
        S, K, num_ranks: tokens, top-k and ``R``.
        block_start_R: ``[R]`` int64 first row of this source's block in each
            destination's token buffer (a row of :func:`token_block_start`).

    Returns:
        ``(token_U, dest_U, offset_U, unique_N, rows_R)``, int64: rows sorted by
        (destination, token); each row's token, destination and row in the
        destination's token buffer; each record's row index in ``[0, U)``; rows per
        destination.
    """
    dev = dest_N.device
    tok_N = torch.arange(dest_N.numel(), device=dev) // max(K, 1)
    flat_N = dest_N * S + tok_N
    mask_X = torch.zeros(num_ranks * S, dtype=torch.bool, device=dev)
    mask_X[flat_N] = True
    index_X = torch.cumsum(mask_X, 0) - 1
    unique_N = index_X[flat_N]
    U = int(index_X[-1]) + 1 if index_X.numel() else 0
    # Each row's (dest, token) position: every record of the row writes the same value.
    pos_U = torch.zeros(U, dtype=torch.int64, device=dev).scatter_(0, unique_N, flat_N)
    dest_U, token_U = pos_U // max(S, 1), pos_U % max(S, 1)
    rows_R = mask_X.view(num_ranks, S).sum(1)
    first_R = torch.cumsum(rows_R, 0) - rows_R
    offset_U = block_start_R[dest_U] + torch.arange(pos_U.numel(), device=dev) - first_R[dest_U]
    return token_U, dest_U, offset_U, unique_N, rows_R
