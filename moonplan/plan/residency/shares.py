"""The weighted lookup's weights and allocation: each expert's records split over its
holders in fixed proportions, chosen once from the window's mean step.

Legend:
    T tables    E experts    R ranks    B slots per rank    N the experts poured (those
    replicated in some table)    X some experts    K levels    1 a kept dimension of size 1
    slot_TRB      int64 ``[T, R, B]`` the expert in each slot of each table (``-1``: empty)
    resident_ER   bool ``[E, R]`` expert ``e`` sits in one of rank ``r``'s slots
    hold_TER      bool ``[T, E, R]`` its holders: its home, and the ranks it is resident on
    mean_E        float ``[E]`` records per expert in the window's mean step
    give_TER      float64 ``[T, E, R]`` each expert's share of them on each rank
    load_TR       float64 ``[T, R]`` each rank's predicted load over the mean step, in rows
    weight_ER     int64 ``[E, R]`` the weights, each expert's summing to about
                  :data:`SHARE_SCALE` (``weight_TER``: one such table per slot table)

A step applies the weights to its own records per expert (:func:`weighted_alloc`), with
no planner call. The weights balance the ranks' predicted load over the mean step (a
water-filling):

* a rank's load is linear in its records, ``rows + wr * busy`` in row units: ``busy``
  the experts it runs (the memory side of ``StepCost``'s roofline pays a weight read
  each; :func:`read_rows` gives ``wr``);
* experts held only at home load their home; each replicated expert starts split evenly
  over its holders, then ``passes`` times, in order of most records first (ties: the
  lower expert), is taken off and poured over its holders, least loaded first, up to a
  common level (:func:`pour_level`; a holder that stays above it gets none and does not
  pay the read);
* a weight is the share over the expert's mean records, in units of ``1 / SHARE_SCALE``;
  an expert without records in the mean step (or whose weights round to nothing) weighs
  on its home alone.

:func:`shares_reference` is the readable rule, one table, in Python floats;
:func:`table_shares` the same rule in torch ops over many tables at once (CPU or CUDA),
float for float the reference's arithmetic on the CPU (sums in the same order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moonplan.plan.home import home_map
from moonplan.plan.torch_backend import resident_map
from moonplan.stepcost import StepCost

SHARE_SCALE = 1 << 20
"""The weights' fixed point: an expert's weights sum to about this."""


def weighted_alloc(T_E: torch.Tensor, weight_ER: torch.Tensor) -> torch.Tensor:
    """int64 ``[E, R]``: the records per expert ``T_E`` (int64 ``[E]``) split over the
    ranks in proportion to ``weight_ER`` (int64 ``[E, R]``, every row with a positive sum),
    rounded by the floor of the running total (rank ``r`` takes ``floor(T * W[:r+1] / W)
    - floor(T * W[:r] / W)``): each expert's total kept exactly, nothing on a rank of
    weight 0, the same on every rank. No host read (``torch.vmap``-able)."""
    cum_ER = torch.cumsum(weight_ER, 1)
    upto_ER = (T_E[:, None] * cum_ER) // cum_ER[:, -1:]
    return torch.diff(upto_ER, dim=1, prepend=torch.zeros_like(upto_ER[:, :1]))


@dataclass(frozen=True)
class Shares:
    """A weighted lookup as a verdict keeps it (``serving.weighted_plan`` serves it).

    Attributes:
        weight_ER: int64 ``[E, R]``, :func:`table_shares` of the table it was fit for.
    """

    weight_ER: torch.Tensor

    def to(self, device: torch.device | str) -> Shares:
        """The weights on ``device``."""
        return Shares(self.weight_ER.to(device))


def home_onehot(
    num_experts: int, num_ranks: int, device: torch.device | None = None
) -> torch.Tensor:
    """bool ``[E, R]``: each expert's home rank (``home.home_map``)."""
    ranks_R = torch.arange(num_ranks, device=device)
    return home_map(num_experts, num_ranks, device)[:, None] == ranks_R


def holders(resident_ER: torch.Tensor) -> torch.Tensor:
    """bool ``[..., E, R]``: the resident pairs ``resident_ER`` (bool ``[..., E, R]``) and
    each expert's home."""
    E, R = resident_ER.shape[-2:]
    return resident_ER | home_onehot(E, R, resident_ER.device)


def read_rows(
    cost: StepCost, mean_E: torch.Tensor, n_TE: torch.Tensor, num_ranks: int
) -> torch.Tensor:
    """float64 ``[T]``: a weight read in row units (``wr``) for each table whose experts
    have ``n_TE`` holders (int64 ``[T, E]``) among ``num_ranks`` ranks, in the mean step
    ``mean_E`` (float64 ``[E]``, on ``n_TE``'s device). No host read.

    A row costs the roofline side's seconds plus dispatch's and combine's per row
    received (the fast link's rate inside the domain, the network's across, in
    proportion to the ranks each side); a read costs ``weight_read_s``, in rows at that
    slope, where the mean step's average rank (its rows, and a read for each expert with
    records on each of its holders) is on the memory side; nothing on the compute side."""
    R = num_ranks
    near = cost.domain_size(R) / R
    link = max(cost.dispatch_row_s_intra * near, cost.dispatch_row_s_inter * (1 - near))
    link += max(cost.combine_row_s_intra * near, cost.combine_row_s_inter * (1 - near))
    rows = mean_E.sum() / R
    busy_T = (n_TE * (mean_E > 0)).sum(1) / R
    memory_T = cost.weight_read_s * busy_T + cost.row_mem_s * rows > cost.row_flop_s * rows
    slope = cost.row_mem_s + link
    return memory_T.to(torch.float64) * (cost.weight_read_s / slope if slope > 0 else 0.0)


def pour_level(total: float, level_K: list[float]) -> float:
    """The common level that ``total`` poured over holders at the levels ``level_K``
    (ascending) reaches, least loaded first: the least over ``k`` of ``(total + level_K[0]
    + ... + level_K[k-1]) / k``. (That average falls while the next holder is below it and
    rises from the first ``k`` whose average the next one reaches: its least is where the
    pouring stops.) The sums run in order, as ``torch.cumsum`` does on the CPU."""
    acc, level = 0.0, math.inf
    for k, c in enumerate(level_K, 1):
        acc += c
        level = min(level, (total + acc) / k)
    return level


def _charge(x: float, wr: float) -> float:
    """A share ``x``'s load on its rank: its rows, and a read if it has any."""
    return x + wr if x > 0 else x


def shares_reference(
    cost: StepCost, mean_E: torch.Tensor, resident_ER: torch.Tensor, passes: int = 3
) -> torch.Tensor:
    """int64 ``[E, R]`` on the host: the weighted lookup's weights (module docstring) over
    the resident pairs ``resident_ER`` (bool ``[E, R]``) for the mean step ``mean_E``
    (float ``[E]``): the readable rule, in Python floats, one expert at a time."""
    E, R = resident_ER.shape
    hold_ER = holders(resident_ER.cpu())
    mean = mean_E.to(torch.float64).cpu().tolist()
    wr = float(read_rows(cost, mean_E.to(torch.float64).cpu(), hold_ER.sum(1)[None], R)[0])
    held = [[r for r, h in enumerate(row) if h] for row in hold_ER.tolist()]
    home = home_map(E, R).tolist()
    order = sorted((e for e in range(E) if mean[e] > 0 and len(held[e]) > 1),
                   key=lambda e: (-mean[e], e))  # fmt: skip
    give = [{home[e]: mean[e]} for e in range(E)]  # held at home only: all there
    for e in order:  # replicated: even to start
        give[e] = dict.fromkeys(held[e], mean[e] / len(held[e]))
    load = [0.0] * R
    for e in range(E):
        for r, x in give[e].items():
            load[r] += _charge(x, wr)
    for _ in range(passes):
        for e in order:
            for r, x in give[e].items():
                load[r] -= _charge(x, wr)
            level = pour_level(mean[e], sorted(load[r] + wr for r in held[e]))
            give[e] = {r: max(0.0, level - (load[r] + wr)) for r in held[e]}
            for r, x in give[e].items():
                load[r] += _charge(x, wr)
    give_ER = [[0.0] * R for _ in range(E)]
    for e in range(E):
        for r, x in give[e].items():
            give_ER[e][r] = x
    give_1ER = torch.tensor([give_ER], dtype=torch.float64)
    return weights_of(give_1ER, torch.tensor(mean, dtype=torch.float64), home_onehot(E, R))[0]


def weights_of(give_TXR: torch.Tensor, mean_X: torch.Tensor, home_XR: torch.Tensor) -> torch.Tensor:
    """int64 ``[T, X, R]``: the weights of the shares ``give_TXR`` (float64 ``[T, X, R]``)
    of some experts ``X`` whose mean step records are ``mean_X`` (float64 ``[X]``) and
    homes ``home_XR`` (bool ``[X, R]``, :func:`home_onehot`'s rows): ``round(share /
    mean * SHARE_SCALE)`` (half to even); an expert without records, or whose weights all
    round to 0, all on its home."""
    has_X1 = (mean_X > 0)[:, None]
    frac_TXR = torch.where(has_X1, give_TXR / torch.where(has_X1, mean_X[:, None], 1.0), 0.0)
    weight_TXR = torch.round(frac_TXR * SHARE_SCALE).to(torch.int64)
    none_TX1 = weight_TXR.sum(2, keepdim=True) == 0
    return torch.where(none_TX1 & home_XR, SHARE_SCALE, weight_TXR)


def table_shares(
    cost: StepCost, mean_E: torch.Tensor, slot_TRB: torch.Tensor, passes: int = 3
) -> torch.Tensor:
    """int64 ``[T, E, R]`` on ``slot_TRB``'s device: :func:`shares_reference` of each slot
    table (int64 ``[T, R, B]``) for the mean step ``mean_E`` (float ``[E]``), all tables
    at once in torch ops; on the CPU, float for float the reference (its sums in its
    order). The order of the experts depends on ``mean_E`` alone, so one sequence of
    pourings, over the experts replicated in any table, serves every table (:func:`_pour`);
    one host read, for how many they are."""
    T, R, B = slot_TRB.shape
    E = mean_E.shape[0]
    dev = slot_TRB.device
    mean_E = mean_E.to(device=dev, dtype=torch.float64)
    tagged_TRB = slot_TRB + E * torch.arange(T, device=dev)[:, None, None]  # table t: t*E + e
    tagged_RX = torch.where(slot_TRB >= 0, tagged_TRB, -1).transpose(0, 1).reshape(R, T * B)
    hold_TER = holders(resident_map(tagged_RX, T * E).view(T, E, R))
    n_TE = hold_TER.sum(2)
    wr_T = read_rows(cost, mean_E, n_TE, R)
    rep_TE = (n_TE > 1) & (mean_E > 0)
    start_TER = hold_TER * torch.where(rep_TE, mean_E / n_TE, mean_E)[:, :, None]  # even
    idx_E = torch.sort(mean_E, descending=True, stable=True).indices
    sel_N = idx_E[rep_TE.any(0)[idx_E]]  # the experts poured, most records first
    give_TNR = _pour(start_TER, sel_N, hold_TER[:, sel_N], rep_TE[:, sel_N], mean_E, wr_T, passes)
    home_ER = home_onehot(E, R, dev)
    weight_TER = (home_ER * SHARE_SCALE).repeat(T, 1, 1)  # held at home only: all there
    return weight_TER.index_copy_(1, sel_N, weights_of(give_TNR, mean_E[sel_N], home_ER[sel_N]))


def _pour(
    start_TER: torch.Tensor,
    sel_N: torch.Tensor,
    hold_TNR: torch.Tensor,
    rep_TN: torch.Tensor,
    mean_E: torch.Tensor,
    wr_T: torch.Tensor,
    passes: int,
) -> torch.Tensor:
    """float64 ``[T, N, R]``: the shares of the experts ``sel_N`` (int64 ``[N]``, most
    records first; holders ``hold_TNR``, replicated where ``rep_TN``) after ``passes``
    pourings each, in turn, from the shares ``start_TER`` (float64 ``[T, E, R]``, every
    expert's), which also give the starting loads, summed in expert order as the
    reference sums them. A pouring takes the expert's load off its holders (its share
    ``x`` and, where ``x > 0``, a read: its charge), pours, and puts the new charge back.
    In a table where the expert is not replicated (its share, all on its home, stays in
    the loads as it started), it is poured as an expert of no records and no charge: 0,
    exactly, on its one holder, and no load changes; its starting shares come back."""
    R = start_TER.shape[2]
    wr_T1 = wr_T[:, None]
    load_TR = torch.addcmul(start_TER, start_TER.sign(), wr_T1[:, :, None]).cumsum(1)[:, -1]
    start_TNR = start_TER.index_select(1, sel_N)
    give_TNR = start_TNR * rep_TN[:, :, None]
    charge_TNR = torch.addcmul(give_TNR, give_TNR.sign(), wr_T1[:, :, None])  # and a read
    above_TNR = torch.where(hold_TNR, wr_T1[:, :, None], math.inf)  # level over the load
    total_TN1 = (mean_E[sel_N] * rep_TN)[:, :, None]
    give, charge = list(give_TNR.unbind(1)), list(charge_TNR.unbind(1))
    above, total = above_TNR.unbind(1), total_TN1.unbind(1)
    k_R = torch.arange(1, R + 1, device=start_TER.device, dtype=torch.float64)
    for _ in range(passes):
        for n in range(len(give)):
            off_TR = load_TR - charge[n]
            level_TR = off_TR + above[n]
            acc_TR = torch.sort(level_TR, 1).values.cumsum_(1)
            level_T1 = acc_TR.add_(total[n]).div_(k_R).amin(1, keepdim=True)  # as pour_level
            give[n] = (level_T1 - level_TR).clamp_min_(0.0)
            charge[n] = torch.addcmul(give[n], give[n].sign(), wr_T1)
            load_TR = off_TR + charge[n]
    give_TNR = torch.stack(give, 1) if give else give_TNR
    return torch.where(rep_TN[:, :, None], give_TNR, start_TNR)
