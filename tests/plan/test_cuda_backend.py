"""The fused CUDA planner: it compiles here (nvcc, NVRTC) and matches the reference on a GPU.

Legend: R ranks, E experts, B slots per rank, M = ceil(E/R).

CPU-runnable: the nvcc and NVRTC compiles (skipped without the tools), the capability
check and the host-side argument lists. GPU tests carry the ``gpu`` marker and skip
cleanly without a usable CUDA backend.
"""

from __future__ import annotations

import itertools
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import moonplan
from moonplan import check_plan
from moonplan.plan import cuda_backend
from moonplan.plan.plan_fields import PlanFields
from moonplan.plan.reference import reference_fields

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "csrc" / "plan_kernel.cu"


# ---- CPU: compiles, capability, host-side layout ------------------------------------------


@pytest.mark.slow  # nvcc (2.5-8 s); .ci/run also compiles csrc/ with nvcc
def test_nvcc_compiles_for_sm90(tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    cmd = [nvcc, "-std=c++17", "-arch=sm_90", f"-I{ROOT / 'csrc'}", "-c", str(KERNEL)]
    res = subprocess.run(
        [*cmd, "-o", str(tmp_path / "plan_kernel.o")], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr.lower(), res.stderr


@pytest.mark.slow  # NVRTC compiles the kernel (1.5-12 s); .ci/run runs it
def test_nvrtc_compiles_for_sm90() -> None:
    try:
        cuda_backend.nvrtc_version()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    source, headers = cuda_backend.kernel_sources()
    assert [h for h, _ in headers] == list(cuda_backend.HEADER_FILES)
    cubin = cuda_backend.compile_cubin(source, (9, 0), headers)
    assert len(cubin) > 1000


def test_unavailable_without_cuda_names_the_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    ok, reason = cuda_backend.available()
    assert not ok
    assert "CUDA" in reason
    with pytest.raises(RuntimeError, match="CUDA"):
        cuda_backend.plan_cuda(torch.ones(2, 4, dtype=torch.int64), 2, 1, None)


def test_kernel_source_is_found_and_env_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "moonplan_plan_main" in cuda_backend.kernel_source()
    monkeypatch.setenv(cuda_backend.SOURCE_ENV, "/somewhere")
    paths = cuda_backend.source_candidates()
    assert paths[0] == Path("/somewhere") / cuda_backend.SOURCE_FILE
    assert paths[-1] == KERNEL


def _param_count(name: str) -> int:
    src = cuda_backend.kernel_source()  # both kernels are defined in plan_kernel.cu
    m = re.search(rf"{name}\(([^)]*)\)", src)
    assert m is not None, name
    return m.group(1).count(",") + 1


@pytest.mark.parametrize(("R", "E", "B", "prev"), [(4, 10, 3, False), (3, 2, 0, True)])
def test_argument_lists_match_the_kernels(R: int, E: int, B: int, prev: bool) -> None:
    counts_RE = torch.zeros(R, E, dtype=torch.int64)
    prev_RB = torch.full((R, B), -1, dtype=torch.int64) if prev else None
    out, scratch = cuda_backend.allocate(R, E, B, torch.device("cpu"), prev)
    flow_F3 = torch.full((R - 1, 3), -1, dtype=torch.int64) if prev else None
    prep, main, fused = cuda_backend.kernel_args(counts_RE, prev_RB, flow_F3, B, 1, out, scratch)
    assert len(prep) == _param_count(cuda_backend.PREP_KERNEL)
    assert len(main) == _param_count(cuda_backend.MAIN_KERNEL)
    assert fused
    M = -(-E // R)
    W = M + max(B, M)
    assert out.row_offset.shape == (R, W + 1)
    assert out.slot_expert.shape == (R, B)
    assert out.flow.shape == (R - 1, 3)


def test_sizes_and_launch_shapes() -> None:
    assert cuda_backend.block_threads(1) == 128
    assert cuda_backend.block_threads(8) == 256
    assert cuda_backend.block_threads(1024) == 1024
    # the documented limits fit in an H100/H200 block (227 KiB opt-in)
    assert cuda_backend.shared_bytes(1024, 4096) < 227 * 1024


# ---- GPU: bit-identical to the reference ---------------------------------------------------


@pytest.fixture(scope="module")
def cuda_ok() -> None:
    ok, reason = cuda_backend.available()
    if not ok:
        pytest.skip(f"CUDA planner unavailable: {reason}")


Prev = tuple[torch.Tensor, torch.Tensor] | None  # (slot_expert [R, B], flow [R-1, 3])


def _assert_same(counts_RE: torch.Tensor, B: int, align: int, prev: Prev) -> Prev:
    """Kernel == reference on every field; returns this plan as the next ``previous``."""
    dev = torch.device("cuda")
    slots = flows = None
    if prev is not None:
        slots, flows = prev[0].to(dev), prev[1].to(dev)
    got = cuda_backend.plan_cuda(counts_RE.to(dev), B, align, slots, flows)
    want = reference_fields(counts_RE, B, align, prev)
    assert isinstance(got, PlanFields)
    for key, ref in want._asdict().items():
        assert torch.equal(getattr(got, key).cpu(), ref), (key, counts_RE.tolist(), B, align, prev)
    return want.slot_expert, want.flow


def _random_counts(rng: random.Random, R: int, E: int) -> torch.Tensor:
    kind = rng.choice(["lognormal", "lognormal", "zero", "hot", "empty_ranks", "ties"])
    counts_RE = torch.zeros(R, E, dtype=torch.int64)
    if kind == "zero":
        return counts_RE
    if kind == "hot":
        counts_RE[:, rng.randrange(E)] = torch.tensor([rng.randrange(50) for _ in range(R)])
        return counts_RE
    if kind == "ties":
        counts_RE[:] = rng.choice([1, 2, 3])
        counts_RE[0, : rng.randrange(1, E + 1)] += rng.randrange(4)
        return counts_RE
    weights = [rng.lognormvariate(0, 1.5) for _ in range(E)]
    for s in range(R):
        if kind == "empty_ranks" and rng.random() < 0.5:
            continue
        for e in rng.choices(range(E), weights=weights, k=rng.randrange(80)):
            counts_RE[s, e] += 1
    return counts_RE


def _random_prev(rng: random.Random, R: int, E: int, B: int) -> Prev:
    """Random resident slots and random (donor, receiver) flows, padded like ``Plan.flow``."""
    prev_RB = torch.full((R, B), -1, dtype=torch.int64)
    for r in range(R):
        k = rng.randrange(min(B, E) + 1)
        prev_RB[r, :k] = torch.tensor(rng.sample(range(E), k), dtype=torch.int64)
        prev_RB[r] = prev_RB[r][torch.randperm(B)]
    flow_F3 = torch.tensor([[-1, -1, 0]] * (R - 1), dtype=torch.int64).view(R - 1, 3)
    for i in range(rng.randrange(R)):
        d, r = rng.sample(range(R), 2)
        flow_F3[i] = torch.tensor([d, r, rng.randrange(1, 20)])
    return prev_RB, flow_F3


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_matches_reference_random(cuda_ok: None, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        R = rng.choice([1, 2, 3, 4, 7, 8, 16, 33])
        E = rng.choice([1, 2, 5, 8, 17, 64, 100, 257])
        M = -(-E // R)
        B = rng.choice([0, 1, max(M - 1, 0), M, M + 1])
        align = rng.choice([1, 8, 128])
        counts_RE = _random_counts(rng, R, E)
        prev = _assert_same(counts_RE, B, align, None)
        prev = _assert_same(_random_counts(rng, R, E), B, align, prev)
        _assert_same(_random_counts(rng, R, E), B, align, prev)
        _assert_same(counts_RE, B, align, _random_prev(rng, R, E, B))


ADVERSARIAL = [
    ([[9, 1, 2, 0, 3, 5, 4, 8]] + [[0] * 8] * 3, 2),  # worked example, overshooting donor
    ([[5, 0, 0]] + [[0, 0, 0]] * 4, 1),  # E < R, one hot expert
    ([[0] * 7] * 3, 3),  # N = 0
    ([[1] * 7] * 3, 3),  # E mod R != 0, all ties
    ([[100] + [0] * 15, [0] * 16, [0] * 16, [0] * 16], 4),  # everything on one expert
    ([[3, 3, 3, 3, 3, 3]] * 2 + [[0] * 6] * 4, 1),  # empty source ranks
]


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "M"), ADVERSARIAL)
@pytest.mark.parametrize("align", [1, 8, 128])
def test_matches_reference_adversarial(cuda_ok: None, rows: list, M: int, align: int) -> None:
    counts_RE = torch.tensor(rows, dtype=torch.int64)
    for B in range(M + 2):
        prev = _assert_same(counts_RE, B, align, None)
        _assert_same(counts_RE.flip(1), B, align, prev)


@pytest.mark.gpu
def test_large_shapes_and_the_separate_prep_kernel(cuda_ok: None) -> None:
    rng = random.Random(7)
    for R, E in [(64, 896), (256, 896), (8, 4096), (1024, 1100)]:
        counts_RE = _random_counts(rng, R, E)
        M = -(-E // R)
        prev = _assert_same(counts_RE, M, 8, None)
        _assert_same(_random_counts(rng, R, E), M, 8, prev)


@pytest.mark.gpu
def test_public_api_backend_cuda(cuda_ok: None) -> None:
    counts_RE = _random_counts(random.Random(3), 8, 64).cuda()
    p = moonplan.plan(counts_RE, backend="cuda")
    assert p.backend == "cuda"
    check_plan(p, counts_RE)
    q = moonplan.plan(counts_RE, backend="cuda", previous=p)
    check_plan(q, counts_RE, previous=p)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(cuda_ok: None) -> None:
    rng = random.Random(11)
    R, E, B = 8, 96, 12
    static_RE = _random_counts(rng, R, E).cuda()
    prev_RB = torch.full((R, B), -1, dtype=torch.int64, device="cuda")
    prev_F3 = torch.full((R - 1, 3), -1, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compile and load outside the capture
        cuda_backend.plan_cuda(static_RE, B, 8, prev_RB, prev_F3)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_backend.plan_cuda(static_RE, B, 8, prev_RB, prev_F3)
    for _ in range(5):
        counts_RE = _random_counts(rng, R, E)
        static_RE.copy_(counts_RE)
        want = reference_fields(counts_RE, B, 8, (prev_RB, prev_F3))
        graph.replay()
        torch.cuda.synchronize()
        for key, ref in want._asdict().items():
            assert torch.equal(getattr(out, key).cpu(), ref), key
        prev_RB.copy_(out.slot_expert)
        prev_F3.copy_(out.flow)


@pytest.mark.parametrize(
    ("R", "E", "B", "prev"), [(4, 10, 3, True), (1, 1, 0, False), (3, 7, 5, True)]
)
def test_allocate_carves_disjoint_aligned_buffers_from_one(
    R: int, E: int, B: int, prev: bool
) -> None:
    out, scratch = cuda_backend.allocate(R, E, B, torch.device("cpu"), prev)
    bufs = [*out, *scratch.values()]
    assert len({t.untyped_storage().data_ptr() for t in bufs}) == 1  # one allocation
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in bufs)
    assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(spans))
    assert all(t.data_ptr() % 8 == 0 and t.is_contiguous() for t in bufs)
    assert {k: v.dtype for k, v in scratch.items() if v.dtype == torch.int32}.keys() == {
        "rep_e", "srt_e", "warm_d"
    }  # fmt: skip
    assert scratch["warm_d"].numel() == (R * B if prev else 1)
    assert scratch["rep_e"].numel() == R * -(-E // R)
