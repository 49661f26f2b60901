"""``auto``'s rent-or-buy rule: copies that would pay over later steps are bought once
what going without them has cost adds up to their price.

Legend: C candidates (table order).

One step's scores cannot see that a replica copied now keeps serving: the step that
copies pays the whole copy, the steps after reuse it free (the ``resident`` candidate).
Scored one step at a time, ``auto`` would never make the first copy on a step where it
does not pay at once, even where the skew persists and the copied replicas would pay
many times over. The rule is the rent-or-buy (ski-rental) rule:

* ``scores[C]``: each candidate's predicted step time (its copies charged);
  ``free[C]``: the same with every copy already resident (no copy charged);
* ``b``, the least score, is the one-step choice; ``c``, the least free score, is what
  the step would run with the copies already there (ties to the earlier, both);
* ``rent = scores[b] - free[c]``: what this step loses by not having ``c``'s copies;
  ``price = scores[c] - scores[b]``: what buying them costs this step beyond ``b``;
* ``credit`` is the rent accrued since the last buy (``Choice.credit`` of ``previous``,
  0 without it). When ``credit + rent >= price`` the step buys: it runs ``c`` and the
  credit returns to 0. Otherwise it runs ``b`` and carries ``credit + rent`` (the rent
  taken as at least 0; the credit returns to 0 when ``b`` is ``c``: nothing to buy).

Buying ``c``, the most balanced plan with its copies, and not a cheaper part of it: on
the simulator's sweep, a rule that bought the paid-for candidate with the least free
score (often a level with a few copies) was slower at most points that bought
(``docs/planner-policy.md``, "Rent or buy").

The bound it keeps, from the rule alone: a step runs above its one-step best only by
what the steps since the last buy have already lost, so over any run ``auto`` costs at
most its one-step choices plus the rent they paid. In the ski-rental model (one price,
a rent that stops once bought) that is at most twice the better of renting forever and
buying at once, the best a rule without foresight can promise. No horizon or constant
enters it. ``docs/planner-policy.md``, "Rent or buy", has what it measures.

The early exit takes part through :func:`exit_rent`: a step it settles runs static EP,
and its rent is estimated without building anything.

The full call is bought the same way. Where the exit's plan is above the bound, a plan
that copies might beat it, by at most ``t_exit - bound`` this step (the bound holds every
such plan's planning too). Finding out costs a full call, ``checking = plan_s - exit_s``
beyond the exit's test, and where no such plan exists (across hosts, where every copy
crosses the slow link) each call pays that and ends in the exit's plan. So the exit
keeps its plan while the most that the steps since the last full call could have saved,
``pending``, stays below the price of one call, and makes the call once it does not:
between two calls the steps lose at most one call's price, and each call is made only
once that much could have been saved. ``pending`` returns to 0 with every full call.

Two forms with equal results: plain floats (:func:`settle`, :func:`exit_rent`) and
torch 0-d tensors (:func:`settle_torch`, :func:`exit_rent_torch`), no host read.
"""

from __future__ import annotations

import torch

from moonplan.stepcost.step_cost import StepCost


def settle(scores: list[float], free: list[float], credit: float) -> tuple[int, float]:
    """The winner's index and the credit carried to the next step (module docstring)."""
    b = min(range(len(scores)), key=lambda i: (scores[i], i))
    c = min(range(len(free)), key=lambda i: (free[i], i))
    if c == b:
        return b, 0.0
    rent, price = scores[b] - free[c], scores[c] - scores[b]
    if credit + rent >= price:
        return c, 0.0
    return b, credit + max(0.0, rent)


def settle_torch(
    scores_C: torch.Tensor, free_C: torch.Tensor, credit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`settle` on float64 tensors: ``(index int64 0-d, credit float64 0-d)``."""
    b, c = torch.argmin(scores_C), torch.argmin(free_C)  # the first least on ties
    s_b, s_c = _at(scores_C, b), _at(scores_C, c)  # gathers: indexing by a tensor reads it
    rent = s_b - _at(free_C, c)
    buy = (c != b) & (credit + rent >= s_c - s_b)
    zero = torch.zeros((), dtype=torch.float64, device=scores_C.device)
    kept = credit + torch.clamp(rent, min=0.0)
    return torch.where(buy, c, b), torch.where(buy | (c == b), zero, kept)


def _at(values_C: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``values_C[i]`` for an int64 0-d ``i`` on the device, without a host read."""
    return values_C.gather(0, i.view(1)).view(())


def call_price(cost: StepCost) -> float:
    """``checking``: the planning a full call costs beyond the exit's test
    (``plan_s - exit_s``, at least 0), the price :func:`exit_rent` weighs a call at."""
    return max(0.0, cost.plan_s - cost.exit_s)


def roundings(cost: StepCost) -> int:
    """Roundings of the ``resident`` candidate the exit builds where replicas are resident:
    whole records, and whole tiles where the GEMM tile is over one row (each its own
    rounds)."""
    return 2 if cost.tile_rows > 1 else 1


def exit_build_s(cost: StepCost) -> float:
    """The exit's least planning where it builds the ``resident`` candidate: its test and
    one round of each rounding (``exit_s + roundings * round_s``); each further round ran
    only where the last one paid for itself (``moonplan.plan.choice.resident``)."""
    return cost.exit_s + roundings(cost) * cost.round_s


def exit_rounds_s(cost: StepCost, rounds: int) -> float:
    """The exit's planning where its ``resident`` build ran ``rounds`` rounds in all: its
    test and those rounds (``exit_s + rounds * round_s``)."""
    return cost.exit_s + rounds * cost.round_s


def call_rounds_s(cost: StepCost, rounds: int) -> float:
    """A full call's planning where its ``resident`` build ran ``rounds`` rounds
    (``Choice.rounds``): the call and those rounds (``plan_s + rounds * round_s``). The
    exit's build runs before the call's other candidates, so its rounds add to the call;
    the call's own build runs beside them, and charging its rounds on top is an upper
    bound (a round is not charged less than it may cost)."""
    return cost.plan_s + rounds * cost.round_s


def exit_rent(
    t_exit: float,
    gap: float,
    bounds: tuple[float, float],
    carried: tuple[float, float],
    checking: float,
) -> tuple[bool, float, float]:
    """Whether the early exit is taken, the credit after it (taken) or the credit the full
    call settles with (not taken), and ``pending`` after the step.

    ``t_exit``: the exit's plan charged the test; ``gap``: its experts phase less
    ``experts_lb`` (``bound.experts_lb_s``, a phase no plan beats), the rent counted on
    an exit step (the imbalance copies could take off; what they would save on the links
    is left out, so that balanced counts accrue none); ``bounds``: the exit bound and
    its part for plans that copy (``bound.exit_bound``); ``carried``: ``previous``'s
    ``(credit, pending)``; ``checking``: the planning a full call costs beyond the test
    (``plan_s - exit_s``, at least 0).

    A buy costs at least ``bounds[1] - t_exit`` more than the exit's plan: the exit is
    taken while the credit plus the rent stays below that, and while the exit's plan is
    within the bound or ``pending`` plus this step's ``t_exit - bounds[0]`` stays below
    ``checking`` (module docstring). A full call that the bound alone would have skipped
    is made only to check whether to buy: its planning beyond the test is rent too, added
    to the credit. Every full call sets ``pending`` to 0."""
    credit, pending = carried
    within = t_exit <= bounds[0]
    after = credit + max(0.0, gap)
    owed = pending + max(0.0, t_exit - bounds[0])
    if after < bounds[1] - t_exit and (within or owed < checking):
        return True, after, owed
    return False, credit + (checking if within else 0.0), 0.0


def exit_rent_torch(
    t_exit: torch.Tensor,
    gap: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor],
    carried: tuple[torch.Tensor, torch.Tensor],
    checking: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`exit_rent` on float64 0-d tensors: ``(exited bool, credit, pending)``."""
    credit, pending = carried
    within = t_exit <= bounds[0]
    after = credit + torch.clamp(gap, min=0.0)
    owed = pending + torch.clamp(t_exit - bounds[0], min=0.0)
    exited = (after < bounds[1] - t_exit) & (within | (owed < checking))
    zero = torch.zeros((), dtype=torch.float64, device=t_exit.device)
    called = credit + torch.where(within, checking, zero)
    return exited, torch.where(exited, after, called), torch.where(exited, owed, zero)
