"""What a step counts as prefetch (no job, nothing exposed; a job's wait, exposed), and
what a step without autograd keeps (nothing for a backward).

Legend: S tokens per rank, H hidden, F ffn, E experts, K top-k.

Every record goes to expert 0 (rank 0's): under ``balance="exact"`` rank 1 fills a
slot with it on the first step and keeps it resident afterwards, rank 0 copies
nothing; under ``balance="off"`` (static) nobody copies anything. A step with nothing
to copy starts no background job, and its ``prefetch`` and ``prefetch_exposed`` are
exactly 0 (bookkeeping every policy pays is planning, not prefetch); a step that
copies shows the experts' wait for the job as exposed, and the profile's figures
agree (exposed never above the prefetch's own time where the wait dominates).

A step that autograd does not record (``no_grad``, ``inference_mode``) saves no tensor
for a backward, and its output equals a recorded step's.
"""

from __future__ import annotations

import time

import pytest
import torch

from moonplan.testing.dist import run_ranks

pytestmark = pytest.mark.distributed

S, H, F, E, K = 16, 8, 8, 4, 1
SLOW_S = 0.2  # the prefetch job made this slow on purpose


def _hot(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(x.shape[0], K, dtype=torch.int64)
    return ids, torch.ones(x.shape[0], K) + 0 * x.sum()


def _steps(rank: int, world: int) -> dict:
    from moonplan import MoonMoE
    from moonplan.profiling.session import profiling

    layers = {b: MoonMoE(H, F, E, K, slots=2, balance=b, router=_hot) for b in ("off", "exact")}
    store_cls = type(layers["exact"].runtime.store)
    original, jobs = store_cls.prefetch, {b: 0 for b in layers}

    def slow(self, fetch):
        time.sleep(SLOW_S)
        owner = next(b for b, layer in layers.items() if layer.runtime.store is self)
        jobs[owner] += 1
        return original(self, fetch)

    store_cls.prefetch = slow  # type: ignore[method-assign]
    phases: dict[str, list[dict[str, float]]] = {b: [] for b in layers}
    with profiling(list(layers.values())) as prof, torch.no_grad():
        for step in range(3):
            x = torch.randn(S, H, generator=torch.Generator().manual_seed(step))
            for b, layer in layers.items():
                layer(x).sum()
                phases[b].append(dict(layer.last_stats.phases))
    store_cls.prefetch = original  # type: ignore[method-assign]
    summary = prof.report.summary()
    for layer in layers.values():
        layer.runtime.close()
    return {"phases": phases, "jobs": jobs, "summary": summary}


@pytest.fixture(scope="module")
def got() -> list[dict]:
    return run_ranks(_steps, 2, timeout=120)


def test_nothing_to_copy_is_no_job_and_nothing_exposed(got: list[dict]) -> None:
    for r in got:  # static: no copies on any rank, no job, exactly zero
        assert r["jobs"]["off"] == 0
        assert all(p["prefetch"] == 0.0 == p["prefetch_exposed"] for p in r["phases"]["off"])
    idle, busy = got[0]["phases"]["exact"], got[1]["phases"]["exact"]
    assert got[0]["jobs"]["exact"] == 0  # rank 0 never copies
    assert all(p["prefetch"] == 0.0 == p["prefetch_exposed"] for p in idle)
    assert got[1]["jobs"]["exact"] == 1  # rank 1 fills its slot once; then it is resident
    first, *resident = busy
    assert first["prefetch"] >= SLOW_S  # the job's own time, measured where it ran
    assert 0.5 * SLOW_S <= first["prefetch_exposed"] <= first["prefetch"] + 0.05  # the wait
    assert all(p["prefetch"] == 0.0 == p["prefetch_exposed"] for p in resident)


def test_the_profile_agrees_exposed_within_the_prefetch(got: list[dict]) -> None:
    s = got[0]["summary"]  # identical on every rank: every rank's spans
    job_R, exposed_R = s["prefetch"]["rank_mean_ms"], s["prefetch_exposed"]["rank_mean_ms"]
    r = max(range(len(job_R)), key=job_R.__getitem__)  # the rank that copied
    assert job_R[r] >= 1e3 * SLOW_S / 3  # one slow job in 3 steps
    assert 0 < exposed_R[r] <= job_R[r] + 50


def _a2a_steps(rank: int, world: int) -> dict:
    """The same hot routing on the all-to-all transport, whose fetch is a collective:
    when one rank copies, every rank must run the job (or the copier waits forever)."""
    from moonplan import MoonMoE

    layers = {}
    for b in ("off", "exact"):
        torch.manual_seed(0)  # the same weights in both layers
        layers[b] = MoonMoE(H, F, E, K, slots=2, balance=b, router=_hot, transport="a2a")
    store_cls = type(layers["exact"].runtime.store)
    original, jobs = store_cls.prefetch, {b: 0 for b in layers}

    def counted(self, fetch):
        owner = next(b for b, layer in layers.items() if layer.runtime.store is self)
        jobs[owner] += 1
        return original(self, fetch)

    store_cls.prefetch = counted  # type: ignore[method-assign]
    outs: dict[str, list[torch.Tensor]] = {b: [] for b in layers}
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(S, H, generator=torch.Generator().manual_seed(10 * rank + step))
            for b, layer in layers.items():
                outs[b].append(layer(x))
    store_cls.prefetch = original  # type: ignore[method-assign]
    for layer in layers.values():
        layer.runtime.close()
    return {"jobs": jobs, "outs": outs}


def test_all_to_all_runs_the_fetch_on_every_rank_when_any_rank_copies() -> None:
    got = run_ranks(_a2a_steps, 2, timeout=120)  # a rank left out of the collective hangs
    for r in got:
        assert r["jobs"] == {"off": 0, "exact": 1}  # rank 0 copies nothing, yet joins once
        for y_exact, y_off in zip(r["outs"]["exact"], r["outs"]["off"], strict=True):
            torch.testing.assert_close(y_exact, y_off, rtol=1e-5, atol=1e-6)


# ---- a step without autograd records nothing for a backward -----------------------------
def _saved_per_step(rank: int, world: int) -> dict[str, dict]:
    """Tensors each step saves for backward (counted by ``saved_tensors_hooks``) under
    ``no_grad``, ``inference_mode`` and autograd, and each step's output."""
    from moonplan import MoonMoE

    torch.manual_seed(0)  # the same weights on every rank
    layer = MoonMoE(H, F, E, K, slots=2, balance="exact", router=_hot)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(rank))
    modes = {"no_grad": torch.no_grad, "inference": torch.inference_mode, "grad": torch.enable_grad}
    saved, outs = dict.fromkeys(modes, 0), {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[mode] += 1  # the mode of the step running now
        return t

    for mode, ctx in modes.items():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx():
            outs[mode] = layer(x).detach().clone()
    layer.runtime.close()
    return {"saved": saved, "outs": outs}


def test_a_step_without_autograd_saves_nothing_for_backward() -> None:
    """``needs_input_grad`` says only which inputs require grad, whatever the grad mode:
    the step must also ask whether autograd records it. Else under ``no_grad`` (and
    ``inference_mode``) it cloned the receive rows and built and kept the experts'
    graph for a backward that cannot come."""
    for r in run_ranks(_saved_per_step, 2, timeout=120):
        assert r["saved"]["no_grad"] == r["saved"]["inference"] == 0
        assert r["saved"]["grad"] > 0  # the hooks see what a recorded step saves
        assert torch.equal(r["outs"]["no_grad"], r["outs"]["grad"])
        assert torch.equal(r["outs"]["inference"], r["outs"]["grad"])
