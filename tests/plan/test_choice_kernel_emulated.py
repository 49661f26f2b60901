"""The CUDA choice kernel itself, run on the CPU, equals ``choose(path="reference")``.

Legend: R ranks, E experts, B slots, M = ceil(E/R), K levels, C = K + 4 candidates.

``csrc/choice_kernel.cu`` (which includes ``csrc/plan_kernel.cu``) is compiled as host C++
with ``-ffp-contract=off`` against the emulation of ``tests/plan/kernel_emu`` (every CUDA
thread a fiber of one OS thread, yielding at barriers; the slow test below also builds it
with one OS thread per CUDA thread), then its three kernels are launched in order through
the real launcher's buffer and argument lists (``choice_cuda.allocate`` / ``kernel_args``).
The buffer starts as garbage and shared memory as ``0xCD`` bytes, like on a device; a
kernel writing past its shared layout fails the test. Every plan field, ``scores`` bit for
bit (inf included), ``index``, ``exited``, the rent-or-buy ``credit`` and ``pending`` (bit
for bit; each step reads the previous plan's), ``rounds`` (of the call's ``resident``
build: the exit's, else a full call's own), the early-exit bound's two parts (bit for bit:
the first kernel leaves them in its scratch) and whether the first kernel built
``resident`` are compared. A GPU run
(``tests/plan/test_choice_cuda.py``, ``bench/gpu_check.py``) is still the final word.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import random
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moonplan
from moonplan.plan import choice_cuda as cc
from moonplan.plan.choice import choose, resident
from moonplan.plan.choice import reference as ref
from moonplan.plan.choice.bound import exit_bound, kept_section_s, links_reference, nocopy_s
from moonplan.plan.choice.rent import exit_build_s
from moonplan.plan.choice.resident import ROUND_LIMIT, resident_reference
from moonplan.plan.choice.table import LEVELS, RESIDENT, placed_index, table
from moonplan.plan.home import home_list
from moonplan.plan.plan_fields import PlanFields
from moonplan.plan.plan_type import Plan
from moonplan.plan.reference import previous_flows
from moonplan.plan.residency.serving import serving_plan
from moonplan.stepcost import StepCost
from moonplan.testing import counts
from tests.plan.choice.costs import (
    COMPUTE_ONLY,
    DECODE,
    FORCED_S,
    H200,
    MULTI,
    costs,
    full,
    rows_only,
    tiles_costs,
)
from tests.plan.draw import counts_like, random_counts

ROOT = Path(__file__).resolve().parents[2]
EMU = Path(__file__).resolve().parent / "kernel_emu"
KERNELS = ("emu_choice_first", "emu_choice_build", "emu_choice_layout")


def _build(tmp: Path, fibers: bool) -> ctypes.CDLL:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed: cannot build the kernel emulation")
    lib = tmp / ("libchoice_fibers.so" if fibers else "libchoice_threads.so")
    cmd = [gxx, "-std=c++20", "-O1", "-ffp-contract=off", "-U_FORTIFY_SOURCE", "-shared",
           "-fPIC", "-pthread", f"-I{ROOT / 'csrc'}", f"-I{EMU}"]  # fmt: skip
    cmd += ["-DEMU_FIBERS"] if fibers else []
    r = subprocess.run([*cmd, str(EMU / "choice_emu.cpp"), "-o", str(lib)], capture_output=True,
                       text=True)  # fmt: skip
    if r.returncode != 0:
        if not _cxx20(gxx, tmp):
            pytest.skip("this g++ cannot compile C++20: cannot build the kernel emulation")
        # a C++20 compiler refused it: the kernel's source or the wrappers are wrong
        pytest.fail(f"g++ could not build the C++20 emulation: {r.stderr[-2000:]}")
    dll = ctypes.CDLL(str(lib))
    for name in KERNELS:
        getattr(dll, name).restype = ctypes.c_longlong
    return dll


def _cxx20(gxx: str, tmp: Path) -> bool:
    """Whether ``gxx`` compiles a C++20 translation unit (a concept and a ``consteval``)."""
    src = tmp / "cxx20.cpp"
    src.write_text("template <class T> concept C = true;\nconsteval int f() { return 1; }\n"
                   "int g() { return f(); }\n")  # fmt: skip
    r = subprocess.run([gxx, "-std=c++20", "-c", str(src), "-o", str(tmp / "cxx20.o")],
                       capture_output=True)  # fmt: skip
    return r.returncode == 0


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return _build(tmp_path_factory.mktemp("choice_emu"), fibers=True)


class Case(NamedTuple):
    """One call of the choice: counts ``c`` (int64 ``[R, E]``), ``B`` slots per rank, the row
    padding ``align``, the previous plan (``None``: none), the cost model, the levels."""

    c: torch.Tensor
    B: int
    align: int
    prev: Plan | None
    cost: StepCost
    levels: int = LEVELS


class Scratch(NamedTuple):
    """What the first kernel leaves in ``misc``: the early-exit bound's two parts
    (``misc[1:3]``) and whether it built the ``resident`` candidate (``misc[4]``)."""

    bounds: tuple[float, float]
    built: bool


def _emu_choose(
    lib: ctypes.CDLL, case: Case, carry: torch.Tensor | None = None
) -> tuple[PlanFields, tuple[torch.Tensor, ...], Scratch]:
    """The three kernels, in launch order, on CPU tensors (``previous``'s credit in); the
    outputs' views (the layout tensors; ``index``, ``scores``, ``exited``, ``credit``,
    ``pending``, ``rounds``) and what the first kernel left in its scratch (:class:`Scratch`).
    ``carry``: the first kernel's ``(credit, pending)`` in place of ``previous``'s
    (``rent=False`` passes a credit of ``-inf``)."""
    c, B, align, prev, cost, levels = case
    R, E = c.shape
    C = len(table(levels))
    buf, out, choice = cc.allocate(R, E, B, C, torch.device("cpu"))
    buf.random_(-1000, 1000)  # garbage, as a device allocation would hold
    pair = (None, None) if prev is None else (prev.slot_expert, prev.flow)
    carried = None
    if prev is not None and prev.choice is not None:
        carried = (prev.choice.credit, prev.choice.pending)
    if carry is None:
        carry = cc.carry_of(carried, torch.device("cpu"))
    args = cc.kernel_args(c, pair, (B, align, levels), cost, buf, carry)
    block, smem = cc.block_threads(R), cc.shared_bytes(R, E)
    grids = (1, C - 1, 1)
    L = ctypes.c_longlong
    for name, grid, sm, a in zip(KERNELS, grids, smem, args, strict=True):
        head = [L(block), L(sm)] if grid == 1 else [L(grid), L(block), L(sm)]
        bad = getattr(lib, name)(*head, *(t(v) for v, t in a))
        assert bad < 0, f"{name} wrote shared memory past its layout at byte {bad}"
    misc = cc.layout(R, E, B, C).scratch["misc"]
    bounds = buf[misc + 1 : misc + 3].view(torch.float64).tolist()
    return out, choice, Scratch((bounds[0], bounds[1]), int(buf[misc + 4]) != 0)


def _reference_step(case: Case) -> ref.Step:
    c, B, align, prev, _, _ = case
    slots = None if prev is None else prev.slot_expert.tolist()
    return ref.Step(
        c.tolist(), B, align, slots, previous_flows(None if prev is None else prev.flow)
    )


def _reference_bound(case: Case) -> tuple[float, float]:
    """``bound.exit_bound``'s two parts with the inputs ``choose_reference`` gives it."""
    cost, step = case.cost, _reference_step(case)
    counts = step.counts
    R, E = len(counts), len(counts[0])
    home = home_list(E, R)
    static = ref._static_alloc(counts, home)
    full = None if step.resident else ref._time(cost, step, static, cost.plan_s)
    totals = ref._totals(cost, counts)
    links = links_reference(counts, step.resident, home, cost.domain_size(R))
    return exit_bound(cost, R, totals, links, full)


def _reference_built(case: Case) -> bool:
    """Whether ``choose_reference``'s exit builds the ``resident`` candidate: residents, and
    static and placed charged ``exit_s`` both above ``bound.nocopy_s`` (exit taken or not)."""
    cost, step = case.cost, _reference_step(case)
    if not step.resident:
        return False
    counts = step.counts
    R, E = len(counts), len(counts[0])
    home = home_list(E, R)
    cheap = min(
        ref._time(cost, step, a, cost.exit_s)
        for a in (ref._static_alloc(counts, home), ref._placed(step))
    )
    links = links_reference(counts, step.resident, home, cost.domain_size(R))
    kept = kept_section_s(cost, counts, step.resident, home)
    return cheap > nocopy_s(cost, R, ref._totals(cost, counts), links, exit_build_s(cost), kept)


def _check(
    lib: ctypes.CDLL,
    c: torch.Tensor,
    B: int,
    align: int,
    prev: Plan | None,
    cost: StepCost,
    levels: int = LEVELS,
) -> Plan:
    """Assert the emulated kernel's choice and bound are the reference's; return the
    reference plan."""
    inputs = Case(c, B, align, prev, cost, levels)
    got, (index, scores, exited, credit, pending, rounds), scratch = _emu_choose(lib, inputs)
    want = choose(c, B, align, prev, cost, "reference", levels)
    case = (tuple(c.shape), B, align, cost, c.tolist() if c.numel() <= 64 else "")
    bounds, want_bounds = scratch.bounds, _reference_bound(inputs)
    assert [_bits(b) for b in bounds] == [_bits(b) for b in want_bounds], (bounds, want_bounds)
    assert scratch.built == _reference_built(inputs), case  # kernel 1 built resident
    for k, v in got._asdict().items():
        assert torch.equal(v, getattr(want, k)), (k, *case)
    ch = want.choice
    assert ch is not None
    bits = scores.view(torch.int64), ch.scores.view(torch.int64)
    assert torch.equal(*bits), (scores.tolist(), ch.scores.tolist(), *case)
    assert int(index) == int(ch.index), case
    assert bool(exited) == bool(ch.exited), case
    assert _bits(float(credit)) == _bits(float(ch.credit)), (credit, ch.credit)
    assert _bits(float(pending)) == _bits(float(ch.pending)), (pending, ch.pending)
    assert int(rounds) == int(ch.rounds), (int(rounds), int(ch.rounds), *case)
    # a build runs one round at least: the exit's, or a full call's own (candidate 2's block)
    assert (int(rounds) > 0) == (scratch.built or not bool(exited)), case
    return want


def _bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float64).view(torch.int64))


def _chain(
    lib: ctypes.CDLL,
    steps: list[torch.Tensor],
    B: int,
    align: int,
    cost: StepCost | list[StepCost],
) -> list[Plan]:
    """Each step's plan (and credit) is the next one's ``previous``; the reference plans,
    in order (``cost``: one for every step, or one per step)."""
    costs = cost if isinstance(cost, list) else [cost] * len(steps)
    prev, plans = None, []
    for c, step_cost in zip(steps, costs, strict=True):
        prev = _check(lib, c, B, align, prev, step_cost)
        plans.append(prev)
    return plans


def _hot(R: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 20, (R, E), generator=g)
    c[:, seed % E] += 400
    return c


# ---- quick cases (the default suite) ----------------------------------------------------------


def test_quick_cases_equal_the_reference(emu: ctypes.CDLL) -> None:
    """A chain of previous plans on a hot expert with every candidate built, the early exit
    taken, E < R, E mod R != 0, empty and all-zero counts, one rank."""
    plans = _chain(emu, [_hot(4, 10, s) for s in range(3)], 3, 8, full(H200))
    assert not any(bool(p.choice.exited) for p in plans)
    exit_cost = H200.scaled(plan_s=FORCED_S)  # every candidate's planning costs 1e9 s
    ch = _check(emu, _hot(4, 10, 3), 3, 1, plans[-1], exit_cost).choice
    assert ch is not None and bool(ch.exited) and int(ch.index) == 0
    assert math.isfinite(float(ch.scores[2]))  # residents: the exit scored resident, static won
    _check(emu, _hot(5, 3, 1), 1, 3, None, full(MULTI.scaled(domain=2)))
    c = _hot(3, 7, 2)
    c[1] = 0
    _check(emu, c, 4, 1, None, full(COMPUTE_ONLY.scaled(tile_rows=3, overlap=False)))
    _check(emu, torch.zeros(3, 5, dtype=torch.int64), 2, 1, None, full(H200))
    _check(emu, _hot(1, 4, 0), 0, 1, None, H200)


def test_every_cost_regime(emu: ctypes.CDLL) -> None:
    """Exit taken and not, ``plan_s < exit_s``, one and several fast-link domains, the
    overlapped and the serial schedule: the same plan and scores as the reference."""
    c0, c1 = _hot(6, 13, 0), _hot(6, 13, 5)
    regimes = {
        "exit": H200.scaled(plan_s=FORCED_S),
        "full": full(H200),
        "plan below exit": H200.scaled(plan_s=1e-6, exit_s=1e-5),
        "domains of 2": full(MULTI.scaled(domain=2)),
        "domains of 4, serial": full(MULTI.scaled(domain=4, overlap=False)),
        "free copies, serial": full(COMPUTE_ONLY.scaled(overlap=False, tile_rows=16)),
    }
    exited = {}
    for name, cost in regimes.items():
        p = _chain(emu, [c0, c1], 2, 1, cost)
        exited[name] = bool(p[-1].choice.exited)
    assert exited["exit"] and not exited["full"] and not exited["domains of 2"]


def _lognormal(R: int, E: int, S: int, seeds: range) -> list[torch.Tensor]:
    from bench._gpu_planner import lognormal_counts

    return [lognormal_counts(R, E, S, 8, seed) for seed in seeds]


def _exited(p: Plan) -> bool:
    return p.choice is not None and bool(p.choice.exited)


def test_the_terms_of_the_copies_and_the_bound(emu: ctypes.CDLL) -> None:
    """Cases that the cost model's copies beside the home section and the bound's terms
    decide (each exit asserted here is taken only with the term named, on the reference)."""
    # copies beside the home section (overlap), every candidate scored: a hot expert
    _chain(emu, [_hot(8, 64, s) for s in range(2)], 2, 1, full(H200))
    slow = H200.scaled(plan_s=2e-4, exit_s=0.0)  # a dear planner call
    # the kept reads decide the exit, without residents and with them
    assert _exited(_chain(emu, _lognormal(4, 256, 4, range(2)), 2, 1, slow)[1])
    plans = _chain(emu, _lognormal(4, 256, 16, range(3)), 2, 1, [full(slow), slow, slow])
    assert _exited(plans[2]) and bool(plans[1].slot_expert.ge(0).any())
    # the link rows decide it, without residents (domains of 2) and with them
    two = slow.scaled(domain=2)
    assert _exited(_chain(emu, _lognormal(4, 256, 16, range(3)), 2, 1, [full(two), two, two])[2])
    plans = _chain(emu, _lognormal(4, 16, 64, range(4)), 2, 1, [full(H200), H200, H200, H200])
    assert _exited(plans[3]) and bool(plans[2].slot_expert.ge(0).any())
    # 16 records over 64 experts a rank: ceil(Z/R) experts on a rank is the experts' bound
    _chain(emu, _lognormal(8, 64, 2, range(2)), 2, 1, H200)
    # compute-bound, one record on each of five experts: ceil(Z/R) tiles on some rank
    c = torch.zeros(4, 16, dtype=torch.int64)
    c[[0, 1, 2, 3, 0], [0, 3, 6, 9, 12]] = 1
    _check(emu, c, 2, 1, None, COMPUTE_ONLY.scaled(tile_rows=16))
    # residents, dear copies: the bound is its copying part alone (resident stands for the rest)
    first = _check(emu, _hot(4, 16, 0), 2, 1, None, full(H200.scaled(copy_s_intra=0.0)))
    _check(emu, _hot(4, 16, 1), 2, 1, first, H200.scaled(copy_s_intra=100 * H200.copy_s_intra))
    # a rank receiving a copy reads its kept experts and the copy twice (test_bound.py)
    _check(emu, torch.full((4, 8), 10, dtype=torch.int64), 2, 1, None, DECODE)
    _check(emu, torch.full((4, 8), 10, dtype=torch.int64), 2, 1, None, DECODE.scaled(overlap=False))
    # a rank's padded rows are a whole number of tiles (test_bound.py)
    c = torch.zeros(4, 4, dtype=torch.int64)
    c[0] = torch.tensor([20, 20, 20, 1])
    _check(emu, c, 0, 1, None, full(rows_only(tile_rows=16)))
    # the resident candidate rounded to whole tiles (kept where faster, with and without the
    # exit) and to records (test_choice.py)
    prev = moonplan.plan(torch.tensor([[30, 30, 0], [30, 30, 0]]), slots=2)
    c = torch.tensor([[5, 2, 0], [3, 5, 0]])
    compute, links = tiles_costs()
    dear = compute.scaled(copy_s_intra=1.0, copy_s_inter=1.0)
    dear_links = links.scaled(copy_s_intra=1.0, copy_s_inter=1.0)  # records kept, exit taken
    cases = ((compute, 2, False), (dear, 2, True), (links, 1, False), (dear_links, 2, True))
    for cost, index, exited in cases:
        ch = _check(emu, c, 2, 1, prev, cost).choice
        assert ch is not None and (int(ch.index), bool(ch.exited)) == (index, exited)
    # several domains (the links' harmonic rate), the serial schedule
    _chain(emu, _lognormal(16, 64, 16, range(3)), 2, 1, MULTI.scaled(domain=4))
    _chain(emu, _lognormal(16, 64, 64, range(3)), 3, 1, full(MULTI.scaled(domain=4, overlap=False)))


def test_the_call_waits_until_it_could_have_paid(emu: ctypes.CDLL) -> None:
    """``rent=False`` (a credit of ``-inf``), one hot expert and a full call dearer than the
    test: the first kernel keeps static EP while ``pending`` stays below the call's price,
    then calls, bit for bit as the reference."""
    c = torch.full((4, 8), 40, dtype=torch.int64)
    c[:, 0] = 4000
    cost = H200.scaled(plan_s=2e-3, exit_s=1e-6)
    prev: Plan | None = None
    seen = []
    for _ in range(8):
        pending = 0.0 if prev is None or prev.choice is None else float(prev.choice.pending)
        carry = torch.tensor([-math.inf, pending], dtype=torch.float64)
        got, (index, scores, exited, _, owed, _), _ = _emu_choose(
            emu, Case(c, 2, 1, prev, cost), carry
        )
        want = choose(c, 2, 1, prev, cost, "reference", rent=False)
        ch = want.choice
        assert ch is not None
        for k, v in got._asdict().items():
            assert torch.equal(v, getattr(want, k)), k
        assert torch.equal(scores.view(torch.int64), ch.scores.view(torch.int64))
        assert (int(index), bool(exited)) == (int(ch.index), bool(ch.exited))
        assert _bits(float(owed)) == _bits(float(ch.pending))
        seen.append((bool(exited), float(owed)))
        prev = want
    call = next(i for i, (exited, _) in enumerate(seen) if not exited)
    assert call >= 2 and all(p > 0.0 for _, p in seen[:call]) and seen[call][1] == 0.0


def test_rent_or_buy(emu: ctypes.CDLL) -> None:
    """The rent-or-buy rule (``choice/rent.py``): a step that buys the least free score's
    plan (not the least score) and spends the credit; an exit that carries a credit in and
    accrues more; a full call with nothing to buy, which clears it; credit carried over
    full calls and exits."""
    plans = _chain(emu, _lognormal(4, 16, 64, range(4)), 2, 1, [full(H200), H200, H200, H200])
    ch = plans[2].choice
    assert ch is not None and int(ch.index) != int(torch.argmin(ch.scores))  # a buy
    assert float(ch.credit) == 0.0 and float(plans[1].choice.credit) > 0.0
    plans = _chain(emu, _lognormal(4, 16, 2, range(2)), 2, 1, [full(H200), H200])
    assert float(plans[0].choice.credit) > 0.0 and _exited(plans[1])
    assert float(plans[1].choice.credit) > float(plans[0].choice.credit)
    # a full call whose least score is its least free score too: nothing to buy, credit 0
    plans = _chain(emu, _lognormal(4, 64, 16, range(3)), 2, 1, H200)
    assert float(plans[1].choice.credit) > 0.0 and not _exited(plans[2])
    assert float(plans[2].choice.credit) == 0.0
    _chain(emu, _lognormal(16, 64, 16, range(4)), 2, 1, MULTI.scaled(domain=4))
    # one persistently hot expert, dear copies: static while the rent accrues, then a buy
    hot = torch.full((4, 8), 40, dtype=torch.int64)
    hot[:, 0] = 4000
    plans = _chain(emu, [hot] * 8, 2, 1, H200.scaled(copy_s_intra=4e-3))
    assert plans[0].policy == "static" and any(p.new_copies() > 0 for p in plans)
    assert _exited(plans[-1]) and plans[-1].policy == "resident"  # the exit keeps the replicas


def test_placed_wins_the_exit(emu: ctypes.CDLL) -> None:
    """Hand-made slot tables (``test_choice.py``): ``placed`` wins the exit and ``resident``
    is not built (its score ``inf``); ``placed`` with more replicas on a rank than ``M``
    (``B = 3 > M = 2``), all in its slots, which the layout keeps."""
    c = torch.tensor([[50, 50, 0, 0], [50, 50, 0, 0]])
    prev = serving_plan(torch.zeros_like(c), torch.tensor([[-1], [1]]))  # 1 in rank 1's slot
    cost = DECODE.scaled(exit_s=1.0, round_s=50.0, plan_s=1000.0)
    ch = _check(emu, c, 1, 1, prev, cost).choice
    assert ch is not None and bool(ch.exited) and int(ch.index) == placed_index()
    assert math.isinf(float(ch.scores[RESIDENT])) and float(ch.scores[-1]) == 201.0
    c = torch.tensor([[0, 0, 10, 34, 10, 10]] * 3)
    prev = serving_plan(torch.zeros_like(c), torch.tensor([[2, 4, 5], [-1, -1, -1], [-1, -1, -1]]))
    rows = cost.scaled(weight_read_s=1.0)
    p = _check(emu, c, 3, 1, prev, rows)
    assert p.policy == "placed" and p.alloc[:, 0].tolist() == [0, 0, 30, 0, 30, 30]
    _check(emu, c, 3, 1, prev, full(rows))


def test_resident_at_the_exit_and_in_the_full_call(emu: ctypes.CDLL) -> None:
    """The exit builds ``resident`` only above ``bound.nocopy_s`` (charged
    ``rent.exit_build_s``: ``exit_s`` and one ``round_s`` a rounding): built, it ties
    ``placed`` and wins as the earlier entry, or wins outright with ``round_s > 0``; where
    the exit skips it, the full call builds it in its block of the build kernel (whole
    tiles, kept where faster)."""
    c = torch.tensor([[90, 10, 0, 0], [90, 10, 0, 0]])
    prev = serving_plan(torch.zeros_like(c), torch.tensor([[-1], [1]]))
    rows = DECODE.scaled(exit_s=1.0, plan_s=1000.0, weight_read_s=1.0)
    ch = _check(emu, c, 1, 1, prev, rows).choice
    assert ch is not None and bool(ch.exited) and int(ch.index) == RESIDENT
    assert float(ch.scores[RESIDENT]) == float(ch.scores[-1]) == 182.0
    ch = _check(emu, c, 1, 1, prev, rows.scaled(round_s=0.5)).choice
    assert ch is not None and int(ch.index) == placed_index()  # the build cannot pay
    # skipped at the exit (round_s), built in the full call: whole tiles win (tiles_costs)
    prev = moonplan.plan(torch.tensor([[30, 30, 0], [30, 30, 0]]), slots=2)
    c = torch.tensor([[5, 2, 0], [3, 5, 0]])
    compute, links = tiles_costs()
    for cost, index in ((compute, RESIDENT), (links, 1), (full(compute), RESIDENT)):
        case = Case(c, 2, 1, prev, cost.scaled(round_s=1e-5 if cost.exit_s == 0 else FORCED_S))
        assert not _reference_built(case)
        ch = _check(emu, *case).choice
        assert ch is not None and not bool(ch.exited) and int(ch.index) == index
        assert math.isfinite(float(ch.scores[RESIDENT]))
    # built at the exit with round_s > 0: resident wins (records, whole tiles); static wins
    # with the exit forced, and a full call
    c = _hot(4, 8, 1)
    prev = serving_plan(torch.zeros_like(c), torch.tensor([[7, 6], [0, 5], [7, 1], [3, 0]]))
    for base in (H200, COMPUTE_ONLY.scaled(tile_rows=16)):
        cost = base.scaled(copy_s_intra=1.0, copy_s_inter=1.0, exit_s=1e-6, round_s=1e-6)
        assert _reference_built(Case(c, 2, 1, prev, cost))
        ch = _check(emu, c, 2, 1, prev, cost).choice
        assert ch is not None and bool(ch.exited) and int(ch.index) == RESIDENT
    plans = _chain(emu, [_hot(4, 10, s) for s in range(3)], 3, 8, full(H200))
    for cost in (H200.scaled(plan_s=FORCED_S, round_s=2e-6), H200.scaled(round_s=2e-6)):
        case = Case(_hot(4, 10, 3), 3, 1, plans[-1], cost)
        assert _reference_built(case)
        _check(emu, *case)
    _chain(emu, [_hot(6, 13, s) for s in range(4)], 2, 1, MULTI.scaled(domain=2, round_s=1e-5))


def test_the_rounds_follow_their_price(emu: ctypes.CDLL) -> None:
    """Each rounding of the exit's ``resident`` build runs rounds while the last one lowered
    the largest load by at least ``resident.least_units`` (``choice/resident.py``, "How many
    rounds"): with ``round_s = 0`` while it falls at all (as without a cost model), fewer as
    a round costs more, one a rounding where a round is dearer than any drop or where rows
    cost nothing, ``ROUND_LIMIT`` a rounding where the load still falls there; the exit's
    gate charges one round a rounding (``rent.exit_build_s``). The kernel's ``rounds`` and
    whether it built ``resident`` are the reference's every time (``_check``)."""
    c = _hot(4, 8, 1)
    slots = [[7, 6], [0, 5], [7, 1], [3, 0]]
    prev = serving_plan(torch.zeros_like(c), torch.tensor(slots))
    home = home_list(8, 4)
    dear = {128: 5e-5, 16: 1e-4, 1: 1e-5}  # a round dearer than any drop, still built

    def rounds(cost: StepCost, case: tuple[torch.Tensor, Plan] = (c, prev)) -> int:
        assert _reference_built(Case(case[0], 2, 1, case[1], cost))
        ch = _check(emu, case[0], 2, 1, case[1], cost).choice
        assert ch is not None and bool(ch.exited)
        return int(ch.rounds)

    for base in (H200, COMPUTE_ONLY.scaled(tile_rows=16), H200.scaled(tile_rows=1)):
        base = base.scaled(copy_s_intra=1.0, copy_s_inter=1.0, exit_s=1e-6)
        t = base.tile_rows
        roundings = 2 if t > 1 else 1
        falls = sum(resident_reference(c.tolist(), slots, home, x)[1] for x in {1, t})
        seen = [rounds(base.scaled(round_s=x)) for x in (0.0, 1e-10, 1e-8, 1e-6, dear[t])]
        assert seen[0] == falls and seen[-1] == roundings, (t, seen)
        assert all(a > b for a, b in itertools.pairwise(seen)), (t, seen)
        if base.weight_read_s > 0:  # rows cost nothing (resident.NEVER): one round a rounding
            free_rows = base.scaled(row_flop_s=0.0, row_mem_s=0.0)
            assert rounds(free_rows) == falls
            assert rounds(free_rows.scaled(round_s=1e-9)) == roundings
    # the exit's gate charges one round a rounding (rent.exit_build_s, two with 128-row tiles):
    # just above the dearest round it still builds with, it builds nothing, as the reference
    base = H200.scaled(copy_s_intra=1.0, copy_s_inter=1.0, exit_s=1e-6)
    lo, hi = dear[128], 1e-3
    for _ in range(30):
        mid = (lo + hi) / 2
        built = _reference_built(Case(c, 2, 1, prev, base.scaled(round_s=mid)))
        lo, hi = (mid, hi) if built else (lo, mid)
    assert rounds(base.scaled(round_s=lo)) == 2
    ch = _check(emu, c, 2, 1, prev, base.scaled(round_s=hi)).choice  # one round would build
    assert ch is not None and int(ch.rounds) == 0
    # the largest load still falls after ROUND_LIMIT rounds in each rounding: the limit stops them
    c = _hot(4, 8, 2)
    prev = serving_plan(torch.zeros_like(c), torch.tensor([[3, 6], [6, 0], [2, 0], [3, 0]]))
    for t in (1, 128):
        cost = H200.scaled(copy_s_intra=1.0, copy_s_inter=1.0, exit_s=1e-6, tile_rows=t)
        assert rounds(cost, (c, prev)) == (2 if t > 1 else 1) * ROUND_LIMIT


def test_ties_at_the_top_run_more_rounds(emu: ctypes.CDLL) -> None:
    """Two ranks tied at the largest load: the first round lowers one of them and leaves
    the largest load where it was, with fewer ranks at it (``resident.paid``), so the rounds
    go on with ``round_s = 0`` (the largest load alone would stop them after one); the
    kernel's count of ranks at the top gives the reference's rounds, at the exit and in a
    full call, one rounding and two; where no round can pay, one round all the same."""
    c = torch.tensor([[60, 0, 120, 120], [0, 120, 0, 120], [0, 0, 120, 120], [0, 0, 60, 0]])
    slots = [[3], [2], [3], [-1]]
    prev = serving_plan(torch.zeros_like(c), torch.tensor(slots))
    R, E = c.shape
    hold = resident._holders_reference(E, R, slots, home_list(E, R))
    a = [[0] * R for _ in range(E)]  # the even start in units (one row a tile)
    for e, hs in enumerate(hold):
        units = int(c[:, e].sum()) << resident.SCALE_BITS
        for i, r in enumerate(hs):
            a[e][r] = units // len(hs) + (1 if i < units % len(hs) else 0)
    before = resident._loads_reference(a, R)
    resident._round_reference(a, hold, R)
    after = resident._loads_reference(a, R)
    assert max(after) == max(before) and after.count(max(after)) < before.count(max(before))
    free = H200.scaled(round_s=0.0)
    n = resident_reference(c.tolist(), slots, home_list(E, R), 1, free)[1]
    assert n > 1
    cases = (
        (free.scaled(tile_rows=1), True, n),  # the exit builds it and takes it
        (full(free.scaled(tile_rows=1)), False, n),  # built by kernel 1, a full call
        (free, True, None),  # two roundings
        (full(COMPUTE_ONLY.scaled(round_s=0.0)), False, n),
    )
    for cost, exited, want in cases:
        assert _reference_built(Case(c, 1, 1, prev, cost))
        ch = _check(emu, c, 1, 1, prev, cost).choice
        assert ch is not None and bool(ch.exited) == exited
        assert int(ch.rounds) > 1 and (want is None or int(ch.rounds) == want)
    # where rows cost nothing no round pays (resident.NEVER): one round, tie or not
    no_rows = free.scaled(row_flop_s=0.0, row_mem_s=0.0, round_s=1e-9, tile_rows=1)
    for cost in (no_rows, full(no_rows)):
        ch = _check(emu, c, 1, 1, prev, cost).choice
        assert ch is not None and int(ch.rounds) == 1


def test_a_full_call_reports_its_own_rounds(emu: ctypes.CDLL) -> None:
    """``Choice.rounds`` in a full call where the exit built no ``resident``: the full
    call's own build (candidate 2's block writes it over the first kernel's 0), both
    roundings together; 0 where the exit is taken without a build; one round without
    resident replicas (records over the homes: no pair moves, nothing falls)."""
    c = torch.tensor([[0, 5, 60, 20], [5, 60, 200, 200]])
    prev = serving_plan(torch.zeros_like(c), torch.tensor([[-1], [1]]))
    tiles = COMPUTE_ONLY.scaled(tile_rows=16, plan_s=1e-6)
    dear = tiles.scaled(round_s=1e-7)  # the gate's one round a rounding: no build at the exit
    assert _reference_built(Case(c, 1, 1, prev, tiles.scaled(round_s=0.0)))
    assert not _reference_built(Case(c, 1, 1, prev, dear))
    ch = _check(emu, c, 1, 1, prev, dear).choice
    assert ch is not None and not bool(ch.exited) and int(ch.rounds) > 2  # > one a rounding
    ch = _check(emu, c, 1, 1, prev, dear.scaled(plan_s=FORCED_S)).choice
    assert ch is not None and bool(ch.exited) and int(ch.rounds) == 0
    c = _hot(4, 10, 0)
    for prev in (None, serving_plan(torch.zeros_like(c), torch.full((4, 3), -1))):
        ch = _check(emu, c, 3, 8, prev, full(H200)).choice
        assert ch is not None and not bool(ch.exited) and int(ch.rounds) == 1


# ---- sweeps (slow) ------------------------------------------------------------------------------


@pytest.mark.slow  # hypothesis: 3-step chains through the emulated kernel (about 10 s)
@given(st.data())
@settings(deadline=None)
def test_hypothesis_counts_chains_and_costs(emu: ctypes.CDLL, data: st.DataObject) -> None:
    """Random and adversarial counts, chains of previous plans, B from 0 to 2M + 3."""
    first = data.draw(counts(max_ranks=7, max_experts=14, max_records_per_rank=300))
    R, E = first.shape
    M = -(-E // R)
    B = data.draw(st.integers(0, 2 * M + 3))
    align = data.draw(st.sampled_from([1, 3, 8]))
    cost = data.draw(costs())
    cost = full(cost) if data.draw(st.booleans()) else cost
    steps = [first] + [counts_like(data, first) for _ in range(2)]
    _chain(emu, steps, B, align, cost)


def _random_cost(rng: random.Random) -> StepCost:
    base = rng.choice([H200, MULTI, COMPUTE_ONLY])
    copy = rng.choice([0.0, 0.01, 1.0, 100.0])
    cost = base.scaled(
        copy_s_intra=base.copy_s_intra * copy,
        copy_s_inter=base.copy_s_inter * copy,
        plan_s=rng.choice([0.0, 2e-5, 1e-2]),
        exit_s=rng.choice([0.0, 1e-6, 1e-2]),
        round_s=rng.choice([0.0, 1e-5, 1e-2]),
        tile_rows=rng.choice([1, 3, 16]),
        overlap=rng.random() < 0.5,
        domain=rng.choice([base.domain, 1, 2, 3]),
    )
    return full(cost) if rng.random() < 0.4 else cost


@pytest.mark.slow  # 240 three-step chains through the emulated kernel (about 30 s)
def test_sweep_of_chains(emu: ctypes.CDLL) -> None:
    """Seeded sweep: R up to 9, E up to 20 (E < R, E mod R != 0), B from 0 to 2M + 3, align
    1/3/8, every cost regime; every kind of candidate wins somewhere, a low and a high level."""
    rng = random.Random(22)
    won = set()
    for _ in range(240):
        R, E = rng.choice([1, 2, 3, 4, 5, 6, 8, 9]), rng.choice([1, 2, 3, 5, 7, 8, 13, 16, 20])
        M = -(-E // R)
        B, align = rng.randrange(0, 2 * M + 4), rng.choice([1, 3, 8])
        steps = [
            random_counts(rng, R, E, hot_max=300, picks_max=200, uniform=True) for _ in range(3)
        ]
        plans = _chain(emu, steps, B, align, _random_cost(rng))
        won |= {p.policy for p in plans}
    assert won >= {"static", "exact", "resident", "greedy", "level-1", "placed"}, won
    assert any(int(p[6:]) > LEVELS // 2 for p in won if p.startswith("level-")), won


@pytest.mark.slow  # the bench shapes through the emulated kernel, 1024 fibers a block (~10 s)
@pytest.mark.parametrize("shape", [(8, 256, 512, 8), (13, 100, 64, 4), (40, 17, 64, 2),
                                   (64, 896, 256, 8)])  # fmt: skip
def test_bench_shapes_and_levels(emu: ctypes.CDLL, shape: tuple[int, int, int, int]) -> None:
    from bench._gpu_planner import lognormal_counts

    R, E, S, K = shape
    B = min(2, -(-E // R))
    for cost in (full(H200), full(MULTI), full(COMPUTE_ONLY.scaled(domain=3, tile_rows=16))):
        steps = [lognormal_counts(R, E, S, K, seed) for seed in (1, 2)]
        _chain(emu, steps, B, 128, cost)


@pytest.mark.slow  # a few seconds
def test_wide_keys_and_other_level_counts(emu: ctypes.CDLL) -> None:
    """N >= 2^51 (the balance's wide keys), and K = 1, 2, 3 levels (C = K + 4 candidates)."""
    g = torch.Generator().manual_seed(3)
    c = torch.randint(0, 2**49, (4, 9), generator=g)
    c[:, 2] += 2**50
    _chain(emu, [c, c.roll(1, 1)], 2, 1, full(COMPUTE_ONLY))
    for levels in (1, 2, 3):
        c = _hot(5, 11, levels)
        p = _check(emu, c, 3, 1, None, full(H200), levels)
        _check(emu, c.roll(1, 1), 3, 1, p, full(COMPUTE_ONLY), levels)


@pytest.mark.slow  # the OS-thread build (real concurrency, ~1 s per call): a few chains
def test_os_thread_build_agrees(tmp_path: Path) -> None:
    lib = _build(tmp_path, fibers=False)
    _chain(lib, [_hot(4, 10, s) for s in range(2)], 3, 8, full(H200))
    _chain(lib, [_hot(3, 7, s) for s in range(2)], 2, 1, full(MULTI.scaled(domain=2)))
