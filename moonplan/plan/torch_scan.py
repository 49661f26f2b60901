"""Torch twin of the reference planner's two scans (group balancing, group split).

Legend:
    R ranks, E experts, M = ceil(E/R)
    X_R       load - target (> 0 donor, < 0 receiver)
    quota_RR  [donor, receiver] records the donor group sends the receiver
    warm_RR   [donor, receiver] the receiver has a slot resident with an expert of the donor group
    ids_RM    global expert id of the m-th expert of group d (E where the group has fewer)
    rem_RM    records of that expert not yet assigned

Both scans are sequences of data-dependent argmax steps (see reference.py).
They run as a fixed number of masked steps (``R - 1`` flows; ``R + M - 2``
split steps) so that no value is read on the host: the scan is CUDA-graph
capturable. Where reading is free (CPU tensors) the loops stop as soon as
there is nothing left to do; the result is identical either way.
"""

from __future__ import annotations

import torch


def _can_stop_early(t: torch.Tensor, stop_early: bool | None) -> bool:
    """Early exit reads a flag on the host: free on CPU, a sync on accelerators
    (``stop_early=None`` decides by the device; ``False`` never reads, for the
    device path on any device)."""
    return t.device.type == "cpu" if stop_early is None else stop_early


def balance_groups_torch(
    load_R: torch.Tensor,
    X_R: torch.Tensor,
    warm_RR: torch.Tensor | None,
    prev_F3: torch.Tensor | None,
    stop_early: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 (``reference.balance_groups``) as masked tensor steps.

    Args:
        load_R: int64 ``[R]`` static loads.
        X_R: int64 ``[R]`` load minus target.
        warm_RR: bool ``[R, R]`` resident (donor, receiver) pairs, or ``None``.
        prev_F3: int64 ``[R-1, 3]`` previous flows (``-1`` padded), or ``None``.
        stop_early: stop once nothing is left (a host read a step; ``None``: on CPU only).

    Returns:
        ``(quota_RR, flow_F3)``: records group ``d`` sends rank ``r``, and the flows in
        decision order, ``(-1, -1, 0)`` padded to ``R - 1`` rows.
    """
    R = X_R.shape[0]
    X_R = X_R.clone()
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    if prev_F3 is not None:
        steps += _keep_previous_torch(load_R, X_R, prev_F3)
    stop_early = _can_stop_early(X_R, stop_early)
    for _ in range(max(R - 1, 0)):
        # Sum(X) == 0, so with no donor left there is no receiver either: the step
        # then moves q = 0 records and changes nothing.
        x_max, d = X_R.clamp(min=0).max(0)  # largest excess, lowest rank
        if stop_early and not bool(x_max):
            break
        x_min, r = X_R.clamp(max=0).min(0)  # largest deficit, lowest rank
        if warm_RR is not None:
            d, r = _prefer_warm(X_R, warm_RR, d, r)
            x_min = _at(X_R, r).clamp(max=0)
        _add(X_R, d, x_min)  # the donor gives the receiver's whole deficit (it may overshoot)
        _add(X_R, r, -x_min)
        steps.append((d, r, -x_min))
    return _record(steps, R, X_R.device)


def _keep_previous_torch(
    load_R: torch.Tensor, X_R: torch.Tensor, prev_F3: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Step 1a (``reference.keep_previous_flows``); updates ``X_R`` in place."""
    given_R = torch.zeros_like(X_R)
    filled_R = torch.zeros_like(X_R, dtype=torch.bool)
    steps = []
    for i in range(prev_F3.shape[0]):
        d, r = prev_F3[i, 0].clamp(min=0), prev_F3[i, 1].clamp(min=0)
        need = -_at(X_R, r)
        ok = (prev_F3[i, 0] >= 0) & (need > 0) & ~_at(filled_R, r) & ~_at(filled_R, d)
        ok &= _at(load_R, d) - _at(given_R, d) >= need
        q = torch.where(ok, need, 0)
        _add(given_R, d, q)
        _add(X_R, d, -q)
        _add(X_R, r, q)
        filled_R.index_put_((r.view(1),), (_at(filled_R, r) | ok).view(1))
        steps.append((d, r, q))
    return steps


def _at(t_R: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``t_R[i]`` for a 0-d index tensor without reading it on the host (plain indexing
    with a 0-d tensor calls ``.item()``: a sync on accelerators, an error on "meta")."""
    return t_R.gather(0, i.view(1)).view(())


def _add(t_R: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> None:
    """``t_R[i] += v`` for 0-d ``i`` and ``v``, in place, without a host read."""
    t_R.index_add_(0, i.view(1), v.view(1))


def _record(
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], R: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quota matrix and the compacted, padded flow list of the recorded steps."""
    quota_RR = torch.zeros(R, R, dtype=torch.int64, device=device)
    F = max(R - 1, 0)
    if not steps:
        return quota_RR, torch.tensor([[-1, -1, 0]] * F, dtype=torch.int64, device=device).view(
            F, 3
        )
    d_S, r_S, q_S = (torch.stack(x) for x in zip(*steps, strict=True))
    quota_RR.index_put_((d_S, r_S), q_S, accumulate=True)
    real_S = q_S > 0
    flow_S3 = torch.where(
        real_S[:, None], torch.stack([d_S, r_S, q_S], 1), torch.tensor([-1, -1, 0], device=device)
    )
    order_S = torch.sort(
        (~real_S).to(torch.int8), stable=True
    ).indices  # real flows first, in order
    flow_S3 = flow_S3[order_S]
    pad = flow_S3.new_tensor([[-1, -1, 0]]).expand(max(F - flow_S3.shape[0], 0), 3)
    return quota_RR, torch.cat([flow_S3, pad])[:F]


def _prefer_warm(
    X_R: torch.Tensor, warm_RR: torch.Tensor, d: torch.Tensor, r: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Among warm (donor, receiver) pairs: largest deficit, then largest excess, then ids."""
    R = X_R.shape[0]
    valid_RR = warm_RR & (X_R > 0)[:, None] & (X_R < 0)[None, :]
    big = torch.iinfo(torch.int64).max
    xr_min = torch.where(valid_RR, X_R[None, :], big).min()
    valid_RR = valid_RR & (X_R[None, :] == xr_min)
    xd_max = torch.where(valid_RR, X_R[:, None], -big).max()
    valid_RR = valid_RR & (X_R[:, None] == xd_max)
    flat = torch.argmax(valid_RR.t().reshape(-1).to(torch.int8))  # first (r, d) in id order
    has = valid_RR.any()
    return torch.where(has, flat % R, d), torch.where(has, flat // R, r)


def split_groups_torch(
    quota_RR: torch.Tensor,
    ids_RM: torch.Tensor,
    rem_RM: torch.Tensor,
    resident_ER: torch.Tensor | None,
    alloc_ER: torch.Tensor,
    stop_early: bool | None = None,
) -> None:
    """Step 2 (``reference.split_group``) for every donor group at once, in lockstep.

    Updates ``alloc_ER`` (int64 ``[E, R]``), ``quota_RR`` and ``rem_RM`` in place; the
    records left in ``rem_RM`` stay on the home rank (added by the caller).
    ``stop_early`` as in :func:`balance_groups_torch`.
    """
    R, M = rem_RM.shape
    E = alloc_ER.shape[0]
    valid_RM = ids_RM < E
    safe_RM = ids_RM.clamp(max=E - 1)
    group_R = torch.arange(R, device=rem_RM.device)
    flat_alloc = alloc_ER.view(-1)
    stop_early = _can_stop_early(rem_RM, stop_early)
    for _ in range(max(R + M - 2, 1)):
        has_R = (quota_RR > 0).any(1)
        if stop_early and not bool(has_R.any()):
            break
        r_R = torch.argmax(quota_RR, dim=1)  # largest quota, lowest rank
        q_R = quota_RR[group_R, r_R]
        live_RM = (rem_RM > 0) & valid_RM
        if resident_ER is not None:
            warm_RM = live_RM & resident_ER[safe_RM, r_R[:, None]]
            live_RM = torch.where(warm_RM.any(1, keepdim=True), warm_RM, live_RM)
        m_R = torch.argmax(torch.where(live_RM, rem_RM, -1), dim=1)  # most records, lowest id
        take_R = torch.where(has_R, torch.minimum(q_R, rem_RM[group_R, m_R]), 0)
        e_R = safe_RM[group_R, m_R]
        flat_alloc.index_add_(0, e_R * R + r_R, take_R)
        rem_RM[group_R, m_R] -= take_R
        quota_RR[group_R, r_R] -= take_R
