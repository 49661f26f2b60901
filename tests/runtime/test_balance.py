"""``balance="auto"|"exact"|"off"``: the option, calibration, and oracle equality in every mode."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan.runtime.calibrate import StepSample, fit_rates, sample_step
from moonplan.runtime.config.sections import WARMUP_STEPS, balance_mode
from moonplan.runtime.fetch_list import HomeRows, fetch_list, plan_rows, row_offsets
from moonplan.stepcost import StepCost
from moonplan.testing import counts_and_options
from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_weights, split, tokens

# Rows cost 1 us each (compute), an expert copy 1 s; traffic and memory are free.
ROWS_AND_COPIES = StepCost(1e-6, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0)


def test_modes_and_deprecated_bools() -> None:
    for mode in ("auto", "exact", "off"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert balance_mode(mode) == mode
    with pytest.warns(DeprecationWarning, match="balance='exact'"):
        assert balance_mode(True) == "exact"
    with pytest.warns(DeprecationWarning, match="balance='off'"):
        assert balance_mode(False) == "off"
    for bad in ("on", "Exact", None, 1):
        with pytest.raises(ValueError, match="balance must be one of"):
            balance_mode(bad)  # type: ignore[arg-type]


def test_layer_default_is_auto_and_bools_warn() -> None:
    from moonplan import MoonMoE

    assert MoonMoE(8, 8, 4, 2).runtime.balance == "auto"
    with pytest.warns(DeprecationWarning):
        assert MoonMoE(8, 8, 4, 2, balance=False).runtime.balance == "off"
    with pytest.raises(ValueError, match="balance"):
        MoonMoE(8, 8, 4, 2, balance="balanced")


def _sample(rows: int, groups: int, experts_s: float, **kw) -> StepSample:
    phases = {"experts": experts_s, "counts": 1e-4, "dispatch": 1e-4 + 1e-6 * rows}
    phases |= {"combine": 1e-4 + 2e-6 * rows, "plan": 3e-4, "prefetch": kw.get("pf", 0.0)}
    return StepSample(rows, groups, kw.get("fetched", 0), rows, rows, phases)


@given(counts_and_options(), st.booleans())
def test_sample_from_the_plans_one_read_equals_its_tensors(drawn, use_previous: bool) -> None:
    """A step's sample takes its rows, groups and fetched weights from the plan's one host
    read (``plan_rows``): the same figures as the plan's tensors, ``align`` padding and
    resident slots included."""
    counts_RE, options = drawn
    R, E = counts_RE.shape
    previous = moonplan.plan(counts_RE.roll(1, 1), **options) if use_previous else None
    p = moonplan.plan(counts_RE, previous=previous, **options)
    rows, home = plan_rows(p), HomeRows.of(E, R)
    for rank in range(R):
        copies = fetch_list(p, rank, home, rows)
        fetched = len(copies.slot_N) + len(copies.direct_rank_D)
        bounds = row_offsets(p, rank, rows)
        got = sample_step(p, rank, 3, {"experts": 1.0}, bounds_W1=bounds, fetched=fetched)
        d_D = p.direct_expert()[rank]
        want_fetched = int((p.slot_new[rank] > 0).sum()) + int((d_D >= 0).sum())
        groups = int((p.row_count[rank] > 0).sum())
        received = int(p.alloc[:, rank].sum())
        want = (int(p.recv_size()[rank]), groups, want_fetched, 3, received, {"experts": 1.0})
        assert got == StepSample(*want)


def test_fit_rates_recovers_a_linear_expert_time() -> None:
    a, b = 2e-6, 5e-4
    samples = [_sample(r, g, a * r + b * g) for r, g in ((100, 2), (300, 3), (200, 5), (50, 1))]
    samples.append(_sample(120, 2, a * 120 + b * 2, fetched=2, pf=6e-3))
    cost = fit_rates(samples, copy_fallback_s=1.0, align=1, overlap=True)
    assert cost.row_flop_s == pytest.approx(a) and cost.weight_read_s == pytest.approx(b)
    assert cost.row_mem_s == pytest.approx(a)
    assert cost.copy_s_intra == cost.copy_s_inter == pytest.approx(3e-3)  # 6 ms / 2 experts
    assert cost.base_latency_s == pytest.approx(1e-4)
    assert cost.dispatch_row_s_intra == pytest.approx(1e-6)
    assert cost.combine_row_s_intra == pytest.approx(2e-6)
    assert cost.plan_s == pytest.approx(3e-4) and cost.overlap
    rows_ER = torch.tensor([[100], [0]])  # one rank, one expert with rows
    got = cost.experts_R(rows_ER)
    assert float(got[0]) == pytest.approx(a * 100 + b)  # the roofline gives the fitted line


def test_fit_rates_without_fetches_or_varying_groups() -> None:
    samples = [_sample(100, 2, 1e-3), _sample(200, 4, 2e-3)]  # groups ~ rows: rank 1
    cost = fit_rates(samples, copy_fallback_s=7e-4, align=4, overlap=False)
    assert cost.copy_s_intra == 7e-4 and cost.tile_rows == 4 and not cost.overlap
    assert cost.row_flop_s == pytest.approx(1e-5) and cost.weight_read_s == 0.0
    with pytest.raises(ValueError, match="at least one"):
        fit_rates([], copy_fallback_s=0.0, align=1, overlap=True)


# ---- multi-rank: oracle equality in every mode, calibration agreed across ranks ---------
def _hot_router(seed: int, offset: int, K: int, E: int):
    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed + int(x.shape[0]))
        T = offset + x.shape[0]
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])[offset:]
        ids[: ids.shape[0] // 2, 0] = 0  # expert 0 is hot
        w = torch.softmax(torch.randn(T, K, generator=g), -1)[offset:]
        return ids, w * (1 + 0 * x.sum())

    return route


def _steps(rank: int, world: int, cfg: dict) -> dict:
    from moonplan import MoonMoE

    H, F, E, K, sizes = 8, 12, cfg["E"], 2, cfg["sizes"]
    w = dense_weights(E, H, F, seed=5)
    layer = MoonMoE(
        H,
        F,
        E,
        K,
        balance=cfg["balance"],
        cost=cfg.get("cost"),
        router=_hot_router(9, sum(sizes[:rank]), K, E),
    )
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
    ys, dxs, gus, policies, choices = [], [], [], [], []
    for step in range(cfg["steps"]):
        x = split(tokens(sum(sizes), H, 30 + step), sizes)[rank].clone().requires_grad_(True)
        layer.zero_grad()
        y = layer(x)
        y.square().sum().backward()
        ys.append(y.detach())
        dxs.append(x.grad)
        gus.append(layer.gate_up.grad.clone())
        policies.append(layer.last_stats.policy)
        choices.append(layer.last_stats.choice)
    cost = layer.cost.as_tensor() if layer.cost is not None else None
    out = {"y": ys, "dx": dxs, "gate_up": gus, "policies": policies, "cost": cost}
    return out | {"choices": choices}


def _dense(cfg: dict, step: int) -> dict:
    """The dense fp64 layer's output and gradients on every token of the step."""
    E, K, sizes = cfg["E"], 2, cfg["sizes"]
    w = {
        k: v.double().requires_grad_(k == "gate_up") for k, v in dense_weights(E, 8, 12, 5).items()
    }
    x = tokens(sum(sizes), 8, 30 + step).double().requires_grad_(True)
    ids, wk = [], []
    for r, n in enumerate(sizes):
        i, v = _hot_router(9, sum(sizes[:r]), K, E)(torch.zeros(n, 8))
        ids.append(i)
        wk.append(v)
    y = _dense_diff(x, torch.cat(ids), torch.cat(wk).double(), w)
    y.square().sum().backward()
    return {"y": y.detach(), "dx": x.grad, "gate_up": w["gate_up"].grad}


def _dense_diff(x, ids, wk, w):
    F = w["down"].shape[2]
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = w["gate_up"][e] @ x[t]
            acc = acc + wk[t, k] * (w["down"][e] @ (torch.nn.functional.silu(gu[:F]) * gu[F:]))
        out.append(acc)
    return torch.stack(out)


def _check_against_dense(cfg: dict, got: list[dict]) -> None:
    world = len(got)
    E = cfg["E"]
    for step in range(cfg["steps"]):
        want = _dense(cfg, step)
        y = torch.cat([g["y"][step] for g in got]).double()
        dx = torch.cat([g["dx"][step] for g in got]).double()
        torch.testing.assert_close(y, want["y"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, want["dx"], rtol=1e-5, atol=1e-5)
        lo = 0
        for r in range(world):  # each rank's home experts' gradient
            n = got[r]["gate_up"][step].shape[0]
            torch.testing.assert_close(
                got[r]["gate_up"][step].double(), want["gate_up"][lo : lo + n], rtol=1e-5, atol=1e-5
            )
            lo += n
        assert lo == E


@pytest.mark.distributed
@pytest.mark.parametrize("balance", ["auto", "exact", "off"])
@pytest.mark.parametrize(
    ("world", "E", "sizes"), [(1, 4, [9]), (2, 5, [8, 6]), (4, 6, [5, 0, 7, 6])]
)
def test_every_mode_equals_the_dense_reference(balance: str, world: int, E: int, sizes) -> None:
    """Every step (auto: the exact warm-up, the calibration, then cost-chosen plans)."""
    steps = WARMUP_STEPS + 3 if balance == "auto" else 2
    cfg = {"E": E, "sizes": sizes, "balance": balance, "steps": steps}
    got = run_ranks(_steps, world, cfg, timeout=180)
    _check_against_dense(cfg, got)
    pols = got[0]["policies"]
    if balance == "off":
        assert set(pols) == {"static"}
    elif balance == "exact":
        assert set(pols) == {"exact"}
    else:  # exact while measuring; then a calibrated model, the same on every rank,
        # and one planner call a step that chooses (scoring every candidate or exiting)
        assert pols[: WARMUP_STEPS + 1] == ["exact"] * (WARMUP_STEPS + 1)
        assert all(g["policies"] == pols for g in got)
        warm = ["none"] * (WARMUP_STEPS + 1)
        assert all(g["choices"][: WARMUP_STEPS + 1] == warm for g in got)
        assert all(set(g["choices"][WARMUP_STEPS + 1 :]) <= {"full", "exit"} for g in got)
        assert all(g["choices"] == got[0]["choices"] for g in got)
        costs = [g["cost"] for g in got]
        assert all(c is not None and torch.equal(c, costs[0]) for c in costs)
        assert float(costs[0][-1]) > 0  # StepCost.exact_s: the exact call was timed


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "E", "sizes"), [(1, 4, [9]), (2, 5, [8, 6]), (4, 6, [5, 0, 7, 6])]
)
def test_auto_with_a_given_cost_equals_the_dense_reference(world, E, sizes) -> None:
    """No warm-up: every step is one planner call that chooses, or the lookup or exact
    call its slot placement serves where that is predicted faster, the same on every
    rank."""
    cost = ROWS_AND_COPIES.scaled(copy_s_intra=1e-5, copy_s_inter=1e-5)
    cfg = {"E": E, "sizes": sizes, "balance": "auto", "steps": 4, "cost": cost}
    got = run_ranks(_steps, world, cfg, timeout=180)
    _check_against_dense(cfg, got)
    assert all(set(g["choices"]) <= {"full", "exit", "lookup", "exact"} for g in got)
    assert all(g["policies"] == got[0]["policies"] for g in got)
    assert all(g["choices"] == got[0]["choices"] for g in got)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("copy_s", "want"),
    [(0.0, {"exact"}), (10.0, None)],  # free copies: exact; copies cost 10 s: never new ones
)
def test_a_given_cost_model_drives_the_choice(copy_s: float, want) -> None:
    cost = ROWS_AND_COPIES.scaled(copy_s_intra=copy_s, copy_s_inter=copy_s)
    cfg = {"E": 5, "sizes": [10, 8, 9], "balance": "auto", "steps": 2, "cost": cost}
    got = run_ranks(_steps, 3, cfg, timeout=120)
    _check_against_dense(cfg, got)
    pols = set(got[0]["policies"])
    if want is not None:
        assert pols == want
    else:
        assert "exact" not in pols
    assert all(torch.equal(g["cost"], cost.as_tensor()) for g in got)  # no calibration


def test_fit_rates_ignores_groups_when_rows_barely_vary() -> None:
    """Exact plans give every rank the same rows: a two-rate fit would be noise."""
    samples = [_sample(1000, g, 1.0 + 0.3 * (g % 2)) for g in (2, 3, 4, 5)]
    samples += [_sample(1001, 2, 1.0, fetched=1, pf=0.5), _sample(999, 3, 1.3, fetched=2, pf=0.2)]
    cost = fit_rates(samples, copy_fallback_s=1.0, align=1, overlap=True)
    assert cost.weight_read_s == 0.0
    assert cost.row_flop_s == pytest.approx(
        sum(1.0 + 0.3 * (g % 2) for g in (2, 3, 4, 5, 2, 3)) / 6000, rel=1e-3
    )
    assert cost.copy_s_intra == pytest.approx(0.1)  # the least contended fetch: 0.2 s / 2


def _growing_replan(rank: int, world: int) -> list[int]:
    import moonplan
    from moonplan import MoonMoE
    from moonplan.plan.static import static_plan

    def hot(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(x.shape[0], 1, dtype=torch.int64)  # expert 0 (rank 0) takes all
        return ids, torch.ones(x.shape[0], 1) + 0 * x.sum()

    layer = MoonMoE(8, 8, 6, 1, router=hot, balance="exact", max_tokens=1)
    rt = layer.runtime

    def plan(counts_RE: torch.Tensor, previous, rent=True):  # like "auto" losing its residents:
        if previous is None:  # without them another candidate (static) wins
            return static_plan(counts_RE, slots=rt.B)
        return moonplan.plan(counts_RE, slots=rt.B, previous=previous)

    rt.balancer.plan = plan  # type: ignore[method-assign]
    sizes = []
    for n in (2, 40):  # step 2 grows for the exact plan, then re-plans static: larger
        with torch.no_grad():
            layer(torch.randn(n, 8))
        sizes.append(int(layer.last_plan.recv_size()[rank]))
    return sizes


@pytest.mark.distributed
def test_growth_fits_the_plan_made_after_the_rebuild() -> None:
    got = run_ranks(_growing_replan, 3, timeout=60)
    assert got[0][1] == 120 and got[1][1] == got[2][1] == 0  # static: all on rank 0


def _growing_auto(rank: int, world: int, cost: StepCost) -> list[str]:
    from moonplan import MoonMoE

    def hot(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(x.shape[0], 2, dtype=torch.int64)
        ids[:, 1] = torch.arange(x.shape[0]) % 5 + 1
        return ids, torch.full((x.shape[0], 2), 0.5) + 0 * x.sum()

    layer = MoonMoE(8, 8, 6, 2, router=hot, balance="auto", cost=cost, max_tokens=1)
    pols = []
    for n in (2, 30, 60):  # buffers grow; the re-plan without residents may change policy
        with torch.no_grad():
            layer(torch.randn(n, 8))
        pols.append(layer.last_stats.policy)
    return pols


@pytest.mark.distributed
def test_buffers_grow_for_whatever_candidate_auto_picks() -> None:
    """Expensive copies: auto keeps residents or goes static, whose receive rows exceed an
    exact plan's; growth must fit the plan actually used (found by `moonplan profile`)."""
    cost = ROWS_AND_COPIES
    got = run_ranks(_growing_auto, 3, cost, timeout=120)
    assert all(p == got[0] for p in got) and "exact" not in got[0]


def test_agreement_keeps_every_option_of_the_model() -> None:
    from moonplan.comm.group import EPGroup
    from moonplan.runtime.calibrate import agree
    from moonplan.stepcost import StepCost

    cost = StepCost.from_hardware("h200-multinode", "deepseek-v3", overlap=False, exit_us=2.0)
    assert agree(EPGroup(None), cost) == cost  # one rank: the max is its own rates
