"""The CUDA planner kernel itself, run on the CPU, equals the reference plan.

``csrc/plan_kernel.cu`` is compiled as host C++ against a small emulation of the
CUDA features it uses (``tests/plan/kernel_emu``: one OS thread per CUDA thread,
barriers for ``__syncthreads`` / ``__syncwarp``, warp shuffles and ballots through
shared slots), then launched through the real launcher's argument builder
(``cuda_backend.allocate`` / ``kernel_args``). Scratch and outputs start as garbage
and shared memory as ``0xCD`` bytes, like on a device; writing past the shared
layout fails the test. A GPU run (``bench/gpu_check.py``) is still the final word.
"""

from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from moonplan.plan import cuda_backend as cb
from moonplan.plan.plan_fields import PlanFields
from moonplan.plan.reference import reference_plan, to_tensors
from tests.plan.draw import random_counts

ROOT = Path(__file__).resolve().parents[2]
EMU = Path(__file__).resolve().parent / "kernel_emu"


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed: cannot build the kernel emulation")
    lib = tmp_path_factory.mktemp("emu") / "libemu.so"
    cmd = [
        gxx,
        "-std=c++20",
        "-O1",
        "-shared",
        "-fPIC",
        "-pthread",
        f"-I{ROOT / 'csrc'}",
        f"-I{EMU}",
    ]
    r = subprocess.run([*cmd, str(EMU / "emu.cpp"), "-o", str(lib)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"g++ could not build the C++20 emulation: {r.stderr[-400:]}")
    dll = ctypes.CDLL(str(lib))
    dll.emu_main.restype = ctypes.c_int
    return dll


def _emu_plan(
    lib: ctypes.CDLL, counts: torch.Tensor, B: int, align: int, prev, flows
) -> PlanFields:
    R, E = counts.shape
    out, scratch = cb.allocate(R, E, B, torch.device("cpu"), prev is not None)
    for t in [*out, *scratch.values()]:
        t.random_(-1000, 1000)  # garbage, as a device allocation would hold
    prep_args, main_args, fused = cb.kernel_args(counts, prev, flows, B, align, out, scratch)

    def c(args: list) -> list:
        return [t(v) for v, t in args]

    if not fused:
        lib.emu_prep(
            ctypes.c_longlong(cb.prep_blocks(R, E)),
            ctypes.c_longlong(cb.PREP_THREADS),
            *c(prep_args),
        )
    block, smem = cb.block_threads(R), cb.shared_bytes(R, E)
    bad = lib.emu_main(ctypes.c_longlong(block), ctypes.c_longlong(smem), *c(main_args))
    assert bad < 0, f"shared memory written past the layout at byte {bad}"
    return out


def _reference(counts: torch.Tensor, B: int, align: int, prev, flows) -> PlanFields:
    pf = None if flows is None else [tuple(f) for f in flows.tolist() if f[0] >= 0]
    ps = None if prev is None else prev.tolist()
    return to_tensors(reference_plan(counts.tolist(), B, align, ps, pf), torch.device("cpu"))


@pytest.mark.slow  # a sweep of plan sequences through the emulated kernel (2.7-4.5 s)
def test_kernel_equals_reference_over_plan_sequences(emu: ctypes.CDLL) -> None:
    rng = random.Random(5)
    for _ in range(6):
        R, E = rng.choice([1, 2, 3, 5, 8]), rng.choice([1, 3, 7, 16, 33])
        M = -(-E // R)
        B, align = rng.choice([0, M, M + 1, max(M - 1, 0)]), rng.choice([1, 8, 3])
        prev = flows = None
        for _step in range(3):  # chained: each plan is the next one's previous=
            c = random_counts(rng, R, E, hot_max=50, picks_max=60)
            want = _reference(c, B, align, prev, flows)
            got = _emu_plan(emu, c, B, align, prev, flows)
            for k, v in want._asdict().items():
                assert torch.equal(getattr(got, k), v), (k, c.tolist(), B, align)
            prev, flows = want.slot_expert, want.flow
