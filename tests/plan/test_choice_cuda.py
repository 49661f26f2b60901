"""The fused CUDA choice (``moonplan.plan.choice_cuda``): it compiles here, and on a GPU it
is the reference's choice, captured in a CUDA graph, with no host synchronisation.

Legend: R ranks, E experts, B slots per rank, M = ceil(E/R), K levels, C = K + 4.

CPU-runnable: the nvcc and NVRTC compiles (slow, skipped without the tools), the reason
given without CUDA, the argument lists against the kernels' signatures, the buffer layout.
GPU tests carry the ``gpu`` marker and skip cleanly without a usable CUDA choice.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import moonplan
from moonplan.errors import PlanError
from moonplan.plan import api, choice_cuda
from moonplan.plan.choice import choose
from moonplan.plan.choice.table import LEVELS
from moonplan.plan.plan_fields import PlanFields
from moonplan.plan.plan_type import PLAN_TENSORS, Plan, plan_to
from moonplan.plan.residency.serving import serving_plan
from tests.plan.choice.costs import COMPUTE_ONLY, FORCED_S, H200, MULTI, full

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "csrc" / "choice_kernel.cu"
COST_PARAMS = 20  # MC_COST_PARAMS: tile, G, overlap and 17 doubles


# ---- CPU: compiles, capability, host-side arguments ------------------------------------------


@pytest.mark.slow  # nvcc (5-15 s)
def test_nvcc_compiles_for_sm90_without_warnings(tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    cmd = [nvcc, "-std=c++17", "-arch=sm_90", "-fmad=false", f"-I{ROOT / 'csrc'}", "-c"]
    res = subprocess.run([*cmd, str(KERNEL), "-o", str(tmp_path / "choice.o")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr.lower(), res.stderr


@pytest.mark.slow  # NVRTC (2-12 s)
def test_nvrtc_compiles_for_sm90() -> None:
    try:
        choice_cuda.cb.nvrtc_version()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    source, headers = choice_cuda.sources()
    assert all(k in source for k in choice_cuda.KERNELS)
    assert [h for h, _ in headers] == list(choice_cuda.HEADER_FILES)
    assert len(choice_cuda.compile_choice((9, 0))) > 1000


def test_without_cuda_the_path_says_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    ok, reason = choice_cuda.available()
    assert not ok and "CUDA" in reason
    c = torch.ones(2, 4, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="CUDA"):
        choose(c, 2, 1, None, H200, "cuda")
    with pytest.raises(RuntimeError, match="CUDA"):
        moonplan.plan(c, policy="auto", cost=H200, backend="cuda")


def test_the_cuda_backend_runs_the_kernel_and_others_keep_their_forms() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert api._path("cuda", cuda) == "cuda"
    assert api._path("torch", cuda) == "tensor"
    assert api._path("torch", cpu) == "host" and api._path("reference", cuda) == "reference"


def test_only_the_record_dispatch_scheme_is_scored() -> None:
    with pytest.raises(PlanError, match="record"):
        choice_cuda.cost_args(H200.scaled(dispatch="rank"), 4)
    with pytest.raises(PlanError, match="dispatch"):  # before the device is even looked for
        choose(
            torch.ones(2, 4, dtype=torch.int64), 2, 1, None, H200.scaled(dispatch="host"), "cuda"
        )


def _signature(name: str) -> list[str]:
    src = KERNEL.read_text()
    m = re.search(rf"{name}\(([^)]*)\)", src)
    assert m is not None, name
    return [p.strip() for p in m.group(1).split(",")]


def test_argument_lists_match_the_kernels() -> None:
    """As many arguments as each kernel declares (MC_COST_PARAMS expands to 20), doubles
    where the cost is, pointers into the one buffer at distinct, increasing offsets."""
    R, E, B = 3, 7, 2
    c = torch.zeros(R, E, dtype=torch.int64)
    buf, out, (index, scores, exited, credit, pending, rounds) = choice_cuda.allocate(
        R, E, B, LEVELS + 4, torch.device("cpu")
    )
    carry = choice_cuda.carry_of(None, torch.device("cpu"))
    args = choice_cuda.kernel_args(c, (None, None), (B, 8, LEVELS), H200, buf, carry)
    for name, a in zip(choice_cuda.KERNELS, args, strict=True):
        params = _signature(name)
        want = len(params) - 1 + COST_PARAMS if "MC_COST_PARAMS" in params else len(params)
        assert len(a) == want, name
    lay = choice_cuda.layout(R, E, B, LEVELS + 4)
    offsets = [at for at, _, _ in lay.out.values()] + list(lay.scratch.values())
    assert offsets == sorted(set(offsets)) and offsets[-1] < lay.words
    assert scores.dtype == torch.float64 and scores.shape == (LEVELS + 4,)
    assert exited.dtype == torch.bool and exited.dim() == 0
    assert credit.dtype == pending.dtype == torch.float64 and credit.dim() == pending.dim() == 0
    assert carry.tolist() == [0.0, 0.0]
    assert rounds.dtype == torch.int64 and rounds.dim() == 0
    assert index.dim() == 0 and out.row_offset.shape == (R, 2 * 3 + 1)


# ---- GPU --------------------------------------------------------------------------------------

needs_kernel = pytest.mark.skipif(
    not choice_cuda.available()[0], reason=f"no CUDA choice: {choice_cuda.available()[1]}"
)


def _differences(got: Plan, want: Plan) -> list[str]:
    bad = [k for k in PLAN_TENSORS if not torch.equal(getattr(got, k).cpu(), getattr(want, k))]
    assert got.choice is not None and want.choice is not None
    g, w = got.choice, want.choice
    if not torch.equal(g.scores.cpu().view(torch.int64), w.scores.view(torch.int64)):
        bad.append("scores")
    bad += [n for n in ("credit", "pending") if float(getattr(g, n)) != float(getattr(w, n))]
    ints = ("index", "exited", "rounds")
    return bad + [n for n in ints if int(getattr(g, n)) != int(getattr(w, n))]


def _case(rng: random.Random) -> tuple[torch.Tensor, int, int]:
    R, E = rng.choice([1, 2, 3, 5, 8, 13, 64]), rng.choice([1, 3, 7, 16, 33, 256])
    M = -(-E // R)
    c = torch.randint(0, 60, (R, E))
    c[:, rng.randrange(E)] += rng.choice([0, 500])
    return c, rng.randrange(0, 2 * M + 4), rng.choice([1, 3, 8])


@pytest.mark.gpu
@needs_kernel
def test_kernel_is_the_reference_on_random_chains() -> None:
    rng = random.Random(22)
    costs = [full(H200), H200.scaled(plan_s=FORCED_S), full(MULTI.scaled(domain=2)),
             full(COMPUTE_ONLY.scaled(overlap=False, tile_rows=16)), H200]  # fmt: skip
    for _ in range(60):
        c, B, align = _case(rng)
        cost = rng.choice(costs)
        prev_cpu = prev_gpu = None
        for _ in range(3):
            want = choose(c, B, align, prev_cpu, cost, "reference")
            got = choose(c.cuda(), B, align, prev_gpu, cost, "cuda")
            assert got.backend == "cuda"
            assert not _differences(got, want), (tuple(c.shape), B, align, cost)
            prev_cpu, prev_gpu = want, plan_to(want, torch.device("cuda"))
            c = c.roll(1, dims=1)


@pytest.mark.gpu
@needs_kernel
def test_rounds_at_a_tie_and_in_a_full_call() -> None:
    """``rounds`` where two ranks tie at the largest load (the rounds go on past a round
    that leaves it, ``resident.paid``) and where a full call builds ``resident`` itself
    (the build kernel's block writes it): the reference's, as in the emulated test."""
    c = torch.tensor([[60, 0, 120, 120], [0, 120, 0, 120], [0, 0, 120, 120], [0, 0, 60, 0]])
    prev = serving_plan(torch.zeros_like(c), torch.tensor([[3], [2], [3], [-1]]))
    tie = H200.scaled(round_s=0.0, tile_rows=1)
    own = torch.tensor([[0, 5, 60, 20], [5, 60, 200, 200]])
    own_prev = serving_plan(torch.zeros_like(own), torch.tensor([[-1], [1]]))
    dear = COMPUTE_ONLY.scaled(tile_rows=16, plan_s=1e-6, round_s=1e-7)
    for x, p, cost in ((c, prev, tie), (c, prev, full(tie)), (own, own_prev, dear)):
        want = choose(x, 1, 1, p, cost, "reference")
        got = choose(x.cuda(), 1, 1, plan_to(p, torch.device("cuda")), cost, "cuda")
        assert not _differences(got, want) and int(want.choice.rounds) > 1


@pytest.mark.gpu
@needs_kernel
def test_plan_auto_on_cuda_makes_no_host_synchronisation() -> None:
    c = torch.randint(0, 60, (8, 64))
    c[:, 5] += 2000
    dev = torch.device("cuda")
    prev = moonplan.plan(c.roll(3, 1).to(dev), slots=4)
    counts = c.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p = moonplan.plan(counts, slots=4, previous=prev, policy="auto", cost=full(H200),
                          check_input=False)  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert p.backend == "cuda"
    assert not _differences(p, choose(c, 4, 1, prev, full(H200), "reference"))


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("cost", [full(H200), H200.scaled(plan_s=FORCED_S)], ids=["full", "exit"])
def test_captured_in_a_cuda_graph_and_replayed_on_new_counts(cost) -> None:
    R, E, B = 8, 256, 2
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    static_RE = torch.randint(0, 40, (R, E), generator=g).to(dev)
    prev_RB = torch.full((R, B), -1, dtype=torch.int64, device=dev)
    prev_F3 = torch.full((R - 1, 3), -1, dtype=torch.int64, device=dev)

    def call() -> tuple[PlanFields, tuple]:
        return choice_cuda.choose_cuda(static_RE, B, 128, (prev_RB, prev_F3), cost, LEVELS)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fields, (index, scores, exited, _, _, rounds) = call()
    prev = None
    for seed in range(1, 5):
        c = torch.randint(0, 40, (R, E), generator=g)
        c[:, seed] += 3000
        static_RE.copy_(c)
        graph.replay()
        torch.cuda.synchronize()
        want = choose(c, B, 128, prev, cost, "reference")
        for k in PLAN_TENSORS[1:]:
            assert torch.equal(getattr(fields, k).cpu(), getattr(want, k)), (seed, k)
        assert torch.equal(scores.cpu().view(torch.int64), want.choice.scores.view(torch.int64))
        assert int(index) == int(want.choice.index) and bool(exited) == bool(want.choice.exited)
        assert int(rounds) == int(want.choice.rounds)
        prev_RB.copy_(fields.slot_expert)
        prev_F3.copy_(fields.flow)
        prev = want
