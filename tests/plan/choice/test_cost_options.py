"""``choice.cost_options``: every form of ``auto`` refuses a cost option none of them models.

Legend: R ranks, E experts (counts ``[R, E]``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moonplan
from moonplan.errors import PlanError
from moonplan.plan.choice import choose
from moonplan.plan.choice.cost_options import DISPATCH, OPTIONS, RATES, check_cost
from moonplan.stepcost import StepCost
from moonplan.stepcost.traffic import SCHEMES
from tests.plan.choice.costs import H200

CPU_PATHS = ("reference", "host", "tensor")  # "cuda": tests/plan/test_choice_cuda.py


@dataclasses.dataclass(frozen=True)
class _Priced(StepCost):
    """A cost model with an option the choice does not read."""

    energy_j: float = 0.0


def _counts() -> torch.Tensor:
    c = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    c[:, 1] += 50
    return c


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s not in DISPATCH])
def test_every_path_refuses_a_dispatch_scheme_it_does_not_score(path: str, scheme: str) -> None:
    with pytest.raises(PlanError, match=f"dispatch={scheme!r}"):
        choose(_counts(), 2, 1, None, H200.scaled(dispatch=scheme), path)


def test_the_public_call_refuses_it_too() -> None:
    for backend in ("reference", "torch"):
        with pytest.raises(PlanError, match="'record'"):
            moonplan.plan(_counts(), slots=2, policy="auto", cost=H200.scaled(dispatch="rank"),
                          backend=backend)  # fmt: skip


@pytest.mark.parametrize("path", CPU_PATHS)
def test_an_option_no_form_reads_is_refused_unless_at_its_default(path: str) -> None:
    fields = {f.name: getattr(H200, f.name) for f in dataclasses.fields(StepCost)}
    with pytest.raises(PlanError, match=r"StepCost\.energy_j"):
        choose(_counts(), 2, 1, None, _Priced(**fields, energy_j=1.0), path)
    got = choose(_counts(), 2, 1, None, _Priced(**fields), path)  # the default: modelled
    want = choose(_counts(), 2, 1, None, H200, path)
    assert got.choice is not None and want.choice is not None
    assert torch.equal(got.choice.scores, want.choice.scores)


def test_the_list_names_every_field_of_stepcost() -> None:
    """A new StepCost field fails here until someone decides whether the choice models it."""
    assert set(RATES) | set(OPTIONS) == {f.name for f in dataclasses.fields(StepCost)}
    assert set(DISPATCH) <= set(SCHEMES)
    check_cost(H200)
    check_cost(H200.scaled(overlap=False, domain=2, tile_rows=3))
