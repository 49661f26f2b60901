"""A plan moved between devices (``plan_to``), and policies built on host copies of an
accelerator's counts (``moonplan.plan.api``): the same plan, on the counts' device."""

import dataclasses

import pytest
import torch

from moonplan.cost import get_preset
from moonplan.plan import plan
from moonplan.plan.plan_type import TENSOR_FIELDS, Plan, plan_to
from moonplan.stepcost import StepCost

POLICIES = ("resident", "bounded-0.1", "greedy", "auto")


def _counts(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pop_E = torch.rand(32, generator=g) ** 3 + 0.02
    return torch.stack(
        [torch.bincount(torch.multinomial(pop_E, 96, True, generator=g), minlength=32)
         for _ in range(8)]
    )  # fmt: skip


def _same(a: Plan, b: Plan) -> None:
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    assert (a.policy, a.planned, a.requested) == (b.policy, b.planned, b.requested)
    assert (a.choice is None) == (b.choice is None)
    if a.choice is not None and b.choice is not None:
        assert a.choice.name() == b.choice.name()
        assert a.choice.early_exit() == b.choice.early_exit()
        assert int(a.choice.rounds) == int(b.choice.rounds)
        assert torch.allclose(a.choice.scores.cpu(), b.choice.scores.cpu(), rtol=1e-9)


def test_every_tensor_field_is_listed() -> None:
    p = plan(_counts(0))
    tensors = {
        f.name for f in dataclasses.fields(p) if isinstance(getattr(p, f.name), torch.Tensor)
    }
    assert tensors == set(TENSOR_FIELDS)


def test_plan_to_its_own_device_is_the_same_object() -> None:
    p = plan(_counts(1))
    assert plan_to(p, torch.device("cpu")) is p


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", POLICIES)
def test_a_policy_on_cuda_counts_is_the_host_plan_on_cuda(policy: str) -> None:
    cost = StepCost.from_hardware("h200-node", get_preset("deepseek-v3"))
    c0, c1 = _counts(2), _counts(3)
    prev_h = plan(c0, policy="auto", cost=cost)
    prev_d = plan(c0.cuda(), policy="auto", cost=cost)
    want = plan(c1, previous=prev_h, policy=policy, cost=cost)
    got = plan(c1.cuda(), previous=prev_d, policy=policy, cost=cost)
    assert all(getattr(got, n).is_cuda for n in TENSOR_FIELDS)
    _same(got, want)
    back = plan_to(got, torch.device("cpu"))
    assert not back.counts.is_cuda
    _same(back, want)
