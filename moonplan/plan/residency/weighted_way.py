"""The weighted lookup as a way of serving a table: its shares fit to a window's steps,
scored only on steps they were not fit on.

Legend:
    S steps    R ranks    E experts    B slots per rank    T tables
    rows_SRE   int64 ``[S, R, E]`` the window's steps, each spread over the sources
    slot_TRB   int64 ``[T, R, B]`` the tables (``-1``: empty)
    weight_TER int64 ``[T, E, R]`` each table's weights (``shares.table_shares``)

A decision fits a table's weights to the mean step of its window (:func:`window_shares`)
and keeps them beside its verdict (:func:`verdict_shares`, a ``shares.Shares``); each step
splits its own records by them (``serving.weighted_plan``). Weights fit on the very steps
they are scored on predict those steps too well, so the window scores each step with
weights fit on the other half of the window (:func:`crossed_shares`), and the rent scores
the last step with weights fit on the steps before it (:func:`held_out_shares`). A window
of one step has no other step: there the weighted lookup is no way.
"""

from __future__ import annotations

import torch

from moonplan.plan.residency.shares import Shares, table_shares
from moonplan.stepcost import StepCost


def window_shares(cost: StepCost, rows_SRE: torch.Tensor, slot_TRB: torch.Tensor) -> torch.Tensor:
    """int64 ``[T, E, R]``, on ``slot_TRB``'s device: each table's weights for the mean
    step of ``rows_SRE`` (``shares.table_shares``)."""
    mean_E = rows_SRE.sum(1).to(torch.float64).mean(0)
    return table_shares(cost, mean_E.to(slot_TRB.device), slot_TRB)


def verdict_shares(cost: StepCost, rows_SRE: torch.Tensor, slot_RB: torch.Tensor) -> Shares:
    """The ``Shares`` a verdict keeps for the table ``slot_RB`` (int64 ``[R, B]``): its
    weights fit to the whole window ``rows_SRE``, on the host."""
    return Shares(window_shares(cost, rows_SRE, slot_RB.cpu()[None])[0].cpu())


def held_out_shares(cost: StepCost, rows_SRE: torch.Tensor, slot_RB: torch.Tensor) -> Shares:
    """The ``Shares`` the rent scores the window's last step with: fit on the steps before
    it (``S >= 2``)."""
    if rows_SRE.shape[0] < 2:
        raise ValueError("shares are fit on other steps than they are scored on: 1 step")
    return verdict_shares(cost, rows_SRE[:-1], slot_RB)


def crossed_shares(cost: StepCost, rows_SRE: torch.Tensor, slot_TRB: torch.Tensor) -> torch.Tensor:
    """int64 ``[S, T, E, R]``: the weights each step's weighted lookup is scored with, fit
    on the other half of the steps (``S >= 2``: even steps scored with the odd steps'
    mean, and the other way round). Fit on the steps they are scored on, they predicted
    one measured step 1.2% faster than the exact plan, which ran 0.5% faster than they
    did; on the real prefill-l0 trace a decision from one step chose them over the exact
    kernel and ran 1.072x EPLB where the exact kernel ran 1.032x (``docs/benchmarks.md``)."""
    S = rows_SRE.shape[0]
    if S < 2:
        raise ValueError(f"shares are fit on other steps than they are scored on: {S} step")
    even_TER = window_shares(cost, rows_SRE[0::2], slot_TRB)
    odd_TER = window_shares(cost, rows_SRE[1::2], slot_TRB)
    parity_S = (torch.arange(S, device=slot_TRB.device) % 2 == 0)[:, None, None, None]
    return torch.where(parity_S, odd_TER[None], even_TER[None])
