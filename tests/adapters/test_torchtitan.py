"""torchtitan's MoE wrapped by moonplan equals the unwrapped module on 1-4 ranks.

Legend: R ranks, E experts, D model dim, F expert FFN size, K top-k, B batch, L sequence.

Oracles: the unwrapped torchtitan ``MoE`` (its experts compute in bf16, so do the wrapped
ones by default: the outputs differ by one more bf16 rounding of the routed sum, hence
the bf16 tolerance), and, with ``compute_dtype=float32``, the same MoE whose routed
experts are replaced by a per-record fp32 loop (tight tolerance). Outputs, input,
router and shared-expert gradients are local (each rank's own tokens); home expert
gradients are those of the total loss over every rank's tokens.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F_

pytest.importorskip("torchtitan", reason="torchtitan is not installed (the 'torchtitan' extra)")

from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import (
    GroupedExperts,
    MoE,
    RoutedExperts,
    TokenChoiceTopKRouter,
)
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from moonplan.adapters.torchtitan import (
    WEIGHTS,
    MoonRoutedExperts,
    UnsupportedTorchtitanMoE,
    is_torchtitan_moe,
    torchtitan_moe_problem,
    wrap_moe,
)
from moonplan.testing.dist import run_ranks
from tests.adapters.checks import forward_backward, inputs, rel_close

pytestmark = pytest.mark.distributed

D, F, E, K = 16, 24, 6, 2
SIZES = {1: [7], 2: [5, 8], 3: [6, 0, 9], 4: [3, 7, 0, 5]}  # sequence length per rank (B=2)
BF16_TOL = 2e-2
EXPERT_PREFIX = "routed_experts.inner_experts."


def make_moe(score_func: str = "sigmoid", shared: bool = True, seed: int = 0) -> MoE:
    """A torchtitan MoE from its configs, random weights (deterministic in ``seed``)."""

    def lin(i: int, o: int) -> Linear.Config:
        return Linear.Config(in_features=i, out_features=o)

    cfg = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=lin(D, E), top_k=K, score_func=score_func, route_norm=True
        ),
        shared_experts=FeedForward.Config(w1=lin(D, F), w2=lin(F, D), w3=lin(D, F))
        if shared
        else None,
    )
    moe = cfg.build()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        # a hot expert and a non-zero load-balancing bias: skewed routing, bias in use
        moe.router.gate.weight[1] += 0.5
        moe.expert_bias_E.copy_(torch.linspace(-0.05, 0.05, E))
    return moe


def fp32_oracle(moe: MoE) -> MoE:
    """A copy of ``moe`` whose routed experts are a per-record fp32 loop (the spec)."""
    ref = copy.deepcopy(moe)
    inner = ref.routed_experts.inner_experts

    def routed(x_BLD, scores_BLK, ids_BLK, counts_E=None):
        x_TD, y_TD = x_BLD.reshape(-1, D), torch.zeros(x_BLD.numel() // D, D)
        ids, scores = ids_BLK.reshape(-1, K), scores_BLK.reshape(-1, K)
        for t in range(x_TD.shape[0]):
            for k in range(K):
                e, x = int(ids[t, k]), x_TD[t]
                h = F_.silu(inner.w1_EFD[e] @ x) * (inner.w3_EFD[e] @ x)
                y_TD[t] = y_TD[t] + scores[t, k] * (inner.w2_EDF[e] @ h)
        return y_TD.view(x_BLD.shape)

    ref.routed_experts.forward = routed
    return ref


def _reference(dtype: torch.dtype, moe: MoE) -> MoE:
    return fp32_oracle(moe) if dtype == torch.float32 else copy.deepcopy(moe)


def _rank(rank: int, world: int, sizes: list[int], dtype: torch.dtype, score: str) -> dict:
    moe = make_moe(score)
    ref = _reference(dtype, moe)
    wrapped = wrap_moe(moe, compute_dtype=dtype)
    xs, cs = inputs(sizes, D)
    return {
        **forward_backward(wrapped, ref, xs[rank], cs[rank]),
        "tokens": wrapped.tokens_per_expert_E.clone(),
        "tokens0": ref.tokens_per_expert_E.clone(),
        "copies": wrapped.routed_experts.inner_experts.runtime.last_stats.copies,
    }


def _total_expert_grads(dtype: torch.dtype, sizes: list[int], score: str) -> dict:
    ref = _reference(dtype, make_moe(score))
    xs, cs = inputs(sizes, D)
    sum((ref(x) * c).sum() for x, c in zip(xs, cs, strict=True)).backward()
    return {n: p.grad for n, p in ref.routed_experts.inner_experts.named_parameters()}


@pytest.mark.parametrize(
    ("world", "dtype", "score"),
    [
        (1, torch.bfloat16, "sigmoid"),
        (2, torch.bfloat16, "sigmoid"),
        (3, torch.bfloat16, "softmax"),
        (4, torch.bfloat16, "sigmoid"),
        (2, torch.float32, "softmax"),
        (3, torch.float32, "sigmoid"),
    ],
)
def test_wrapped_moe_matches_unwrapped(world: int, dtype: torch.dtype, score: str) -> None:
    sizes = SIZES[world]
    tol = BF16_TOL if dtype == torch.bfloat16 else 1e-5
    got = run_ranks(_rank, world, sizes, dtype, score, timeout=90)
    total = _total_expert_grads(dtype, sizes, score)
    assert [e for g in got for e in g["home"]] == list(range(E))
    for r, g in enumerate(got):
        rel_close(g["y"], g["y0"], tol, what=f"rank {r} output")
        rel_close(g["dx"], g["dx0"], tol, what=f"rank {r} input grad")
        torch.testing.assert_close(g["tokens"], g["tokens0"])  # load-balancing counts
        for name, grad in g["grads"].items():
            if name.startswith(EXPERT_PREFIX):
                want = total[name.removeprefix(EXPERT_PREFIX)][g["home"]]
                assert g["shapes"][name][0] == len(g["home"])
            else:  # router, shared experts: the unwrapped module's local gradients
                want = g["grads0"][name]
                assert g["shapes"][name] == tuple(want.shape)
            rel_close(grad, want, tol, what=f"rank {r} {name} grad")
    if world > 1:
        assert sum(g["copies"] for g in got) > 0  # the skew made replicas: balancing ran


# ---- a few optimizer steps, with torchtitan's expert-bias update ---------------------------
STEPS, LR, COEFF = 3, 0.05, 1e-2


def _bias_update(moe: MoE, tokens_E: torch.Tensor) -> None:
    """torchtitan's auxiliary-loss-free update: ``bias += coeff * sign(mean - tokens)``."""
    with torch.no_grad():
        moe.expert_bias_E.add_(COEFF * torch.sign(tokens_E.mean() - tokens_E))
        moe.tokens_per_expert_E.zero_()


def _step_inputs(world: int, step: int) -> tuple[list, list]:
    return inputs(SIZES[world], D, seed=100 + step)


def _backward(wrapped: MoE, rank: int, world: int, step: int) -> None:
    """One step's forward and backward on this rank, the replicated parameters' gradients
    summed over ranks (the experts' are each rank's own)."""
    import torch.distributed as dist

    xs, cs = _step_inputs(world, step)
    (wrapped(xs[rank]) * cs[rank]).sum().backward()
    for n, p in wrapped.named_parameters():
        if not n.startswith(EXPERT_PREFIX):
            dist.all_reduce(p.grad)


def _train_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moonplan import checkpoint

    wrapped = wrap_moe(make_moe())
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    experts = wrapped.routed_experts.inner_experts
    for step in range(STEPS):
        opt.zero_grad()
        _backward(wrapped, rank, world, step)
        tokens = wrapped.tokens_per_expert_E.clone()
        dist.all_reduce(tokens)
        _bias_update(wrapped, tokens)
        opt.step()
    checkpoint.per_expert_keys(wrapped, False)  # torchtitan's keys, each rank's home rows
    return {
        "state": {n: t.detach().clone() for n, t in wrapped.state_dict().items()},
        "home": experts.home_experts.tolist(),
        "fetched_after_step": experts.runtime.last_stats.prefetched_rows,
    }


def _train_reference(world: int) -> dict:
    ref = make_moe()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        xs, cs = _step_inputs(world, step)
        opt.zero_grad()
        sum((ref(x) * c).sum() for x, c in zip(xs, cs, strict=True)).backward()
        _bias_update(ref, ref.tokens_per_expert_E.clone())
        opt.step()
    return dict(ref.state_dict())


@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_steps_match_unwrapped(world: int) -> None:
    got = run_ranks(_train_rank, world, timeout=120)
    want = _train_reference(world)
    for r, g in enumerate(got):
        assert sorted(g["state"]) == sorted(want)  # torchtitan's keys, unchanged
        for key, value in g["state"].items():
            ref = want[key][g["home"]] if key.startswith(EXPERT_PREFIX) else want[key]
            rel_close(value, ref, BF16_TOL, what=f"rank {r} {key} after {STEPS} steps")


# ---- structure checks (one process) ---------------------------------------------------------
def test_detection_by_structure() -> None:
    moe = make_moe(shared=False)
    assert is_torchtitan_moe(moe)
    assert not is_torchtitan_moe(moe.router)
    from moonplan.adapters.model import wrappable  # what wrap_model looks for

    assert wrappable(moe) and not wrappable(moe.router)
    wrapped = wrap_moe(moe)
    assert isinstance(wrapped.routed_experts, MoonRoutedExperts)
    assert isinstance(moe.routed_experts, RoutedExperts)  # the original is left as it was
    assert wrapped.router is moe.router and wrapped.expert_bias_E is moe.expert_bias_E
    assert "already run on moonplan" in str(torchtitan_moe_problem(wrapped))
    with pytest.raises(UnsupportedTorchtitanMoE, match="routed_experts"):
        wrap_moe(torch.nn.Linear(2, 2))


def test_moonplan_wrap_detects_torchtitan_moe() -> None:
    import moonplan

    wrapped = moonplan.wrap(make_moe())
    assert isinstance(wrapped.routed_experts, MoonRoutedExperts)
    model = torch.nn.ModuleDict({"a": make_moe(seed=1), "b": make_moe(seed=2)})
    moonplan.wrap_model(model)
    assert all(isinstance(m.routed_experts, MoonRoutedExperts) for m in model.values())


def test_torchtitan_expert_parallelism_is_refused() -> None:
    wrapped = wrap_moe(make_moe())
    with pytest.raises(RuntimeError, match="do not apply torchtitan's expert parallelism"):
        wrapped.routed_experts.parallelize(None)


def test_bad_routing_raises() -> None:
    wrapped = wrap_moe(make_moe())
    x = torch.randn(1, 3, D)
    ids = torch.full((1, 3, K), E)  # out of range
    with pytest.raises(Exception, match="outside"):
        wrapped.routed_experts(x, torch.ones(1, 3, K), ids, None)


# ---- checkpoints across EP sizes ---------------------------------------------------------
def _two_layers(seed: int = 0) -> torch.nn.ModuleDict:
    return torch.nn.ModuleDict({"a": make_moe(seed=seed), "b": make_moe(seed=seed + 1)})


def _save_rank(rank: int, world: int, directory: str) -> dict:
    from moonplan import adapters, checkpoint

    model = adapters.wrap_model(_two_layers())
    checkpoint.save_sharded(model, directory)
    return {"names": adapters.expert_parameter_names(model)}


def _load_rank(rank: int, world: int, directory: str, x: torch.Tensor) -> dict:
    from moonplan import adapters, checkpoint

    model = adapters.wrap_model(_two_layers(seed=50))  # other weights: the load must replace them
    checkpoint.load_sharded(model, directory)
    checkpoint.per_expert_keys(model, False)  # torchtitan's keys, each rank's home rows
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "home": model["a"].home_experts.tolist(),
        "y": model["b"](model["a"](x)).detach(),
    }


def test_checkpoint_saved_at_two_ranks_loads_at_three(tmp_path: Path) -> None:
    from moonplan import checkpoint

    got = run_ranks(_save_rank, 2, str(tmp_path), timeout=90)
    names = got[0]["names"]
    assert sorted(names) == sorted(f"{m}.{EXPERT_PREFIX}{w}" for m in "ab" for w in WEIGHTS)
    want = dict(_two_layers().state_dict())
    full = checkpoint.consolidate(tmp_path)  # the unwrapped torchtitan layout
    assert sorted(full) == sorted(want)
    for k, v in want.items():
        assert torch.equal(full[k], v), k
    x = torch.randn(1, 4, D, generator=torch.Generator().manual_seed(3))
    ref = _two_layers()
    y0 = ref["b"](ref["a"](x)).detach()
    for r, g in enumerate(run_ranks(_load_rank, 3, str(tmp_path), x, timeout=90)):
        for k, v in g["state"].items():
            expect = want[k][g["home"]] if EXPERT_PREFIX in k else want[k]
            assert torch.equal(v, expect), f"rank {r} {k}"
        rel_close(g["y"], y0, BF16_TOL, what=f"rank {r} output after loading")


# ---- torchtitan's own checkpointer (DCP) across EP sizes ---------------------------------
def _manager(model: torch.nn.Module, base: str, **config: object):
    """torchtitan's DCP ``CheckpointManager`` of ``model`` alone (model-only checkpoints)."""
    from torchtitan.components.checkpoint import CheckpointManager

    cfg = CheckpointManager.Config(enable=True, folder="ckpt", keep_latest_k=0, **config)
    return CheckpointManager(
        cfg,
        dataloader=None,
        model_parts=[model],
        optimizers=None,  # type: ignore[arg-type]
        lr_schedulers=None,  # type: ignore[arg-type]
        states={},
        sd_adapter=None,
        base_folder=base,
    )


def _titan_save(rank: int, world: int, base: str) -> None:
    from moonplan import adapters

    model = adapters.wrap_model(_two_layers())
    _manager(model, base).save(curr_step=1, last_step=True)  # model only, as torchtitan's last


def _titan_load(rank: int, world: int, base: str, x: torch.Tensor) -> dict:
    from moonplan import adapters, checkpoint

    model = adapters.wrap_model(_two_layers(seed=50))  # other weights: the load replaces them
    step = str(Path(base) / "ckpt" / "step-1")
    loaded = _manager(model, f"{base}-load-{world}", initial_load_path=step).load()
    checkpoint.per_expert_keys(model, False)
    return {
        "loaded": loaded,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "home": model["a"].home_experts.tolist(),
        "y": model["b"](model["a"](x)).detach(),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_torchtitan_checkpointer_saved_at_two_ranks_loads_at_any(
    tmp_path: Path, world: int
) -> None:
    """Per-expert keys (the default) make torchtitan's DCP checkpoints hold every expert once;
    loading at 2 (the same EP size) and 3 ranks gives each rank exactly its experts."""
    run_ranks(_titan_save, 2, str(tmp_path), timeout=90)
    want = dict(_two_layers().state_dict())
    x = torch.randn(1, 4, D, generator=torch.Generator().manual_seed(3))
    ref = _two_layers()
    y0 = ref["b"](ref["a"](x)).detach()
    for r, g in enumerate(run_ranks(_titan_load, world, str(tmp_path), x, timeout=90)):
        assert g["loaded"]
        for k, v in g["state"].items():
            expect = want[k][g["home"]] if EXPERT_PREFIX in k else want[k]
            assert torch.equal(v, expect), f"rank {r} {k}"
        rel_close(g["y"], y0, BF16_TOL, what=f"rank {r} output after loading")


# ---- re-homed between steps (ShardedExperts.rehome) ---------------------------------------
def _rehomed(rank: int, world: int, sizes: list[int]) -> dict:
    moe = make_moe("softmax")
    ref = fp32_oracle(moe).eval()
    wrapped = wrap_moe(moe, compute_dtype=torch.float32).eval()
    inner = wrapped.routed_experts.inner_experts
    moved = inner.rehome(list(range(E))[::-1])
    xs, _ = inputs(sizes, D)
    with torch.no_grad():
        return {"y": wrapped(xs[rank]), "y0": ref(xs[rank]), "moved": moved,
                "home": inner.home_experts.tolist()}  # fmt: skip


def test_rehomed_experts_match_unwrapped() -> None:
    got = run_ranks(_rehomed, 2, SIZES[2], timeout=90)
    assert [e for g in got for e in g["home"]] == list(range(E))[::-1]
    assert got[0]["moved"] == E  # reversed: every expert changes rank
    for r, g in enumerate(got):
        rel_close(g["y"], g["y0"], 1e-5, what=f"rank {r} output")


# ---- auto re-homes in training, after an optimizer step (moonplan.core.optimizer_rehome) --
AUTO_STEPS, AUTO_LR = 10, 1e-3  # a small rate: ten steps stay finite


def _train_auto_rank(rank: int, world: int) -> dict:
    """``AUTO_STEPS`` SGD steps of a wrapped MoE under ``balance="auto"`` whose copies are
    cheap (a re-home pays within a few steps): its state by home rows and the home ids
    after each step."""
    from moonplan import checkpoint
    from tests.plan.choice.costs import rows_only

    cost = rows_only(copy_s_intra=1e-6, copy_s_inter=1e-6, plan_s=1e-5)
    wrapped = wrap_moe(make_moe(), balance="auto", cost=cost, slots=2)
    opt = torch.optim.SGD(wrapped.parameters(), lr=AUTO_LR)
    experts, homes = wrapped.routed_experts.inner_experts, []
    for step in range(AUTO_STEPS):
        opt.zero_grad()
        _backward(wrapped, rank, world, step)
        opt.step()
        homes.append(experts.home_experts.tolist())
    checkpoint.per_expert_keys(wrapped, False)  # each rank's home rows, in its label order
    return {"state": {n: t.detach().clone() for n, t in wrapped.state_dict().items()},
            "homes": homes}  # fmt: skip


def test_auto_rehomes_in_training_and_still_matches_unwrapped() -> None:
    got = run_ranks(_train_auto_rank, 2, timeout=180)
    ref = make_moe()
    opt = torch.optim.SGD(ref.parameters(), lr=AUTO_LR)
    for step in range(AUTO_STEPS):
        xs, cs = _step_inputs(2, step)
        opt.zero_grad()
        sum((ref(x) * c).sum() for x, c in zip(xs, cs, strict=True)).backward()
        opt.step()
    want = dict(ref.state_dict())
    assert got[0]["homes"][0] == [0, 1, 2] and got[0]["homes"][-1] != [0, 1, 2]  # re-homed
    for a, b in zip(got[0]["homes"], got[1]["homes"], strict=True):  # the same step on both
        assert sorted(a + b) == list(range(E))
    for r, g in enumerate(got):
        for key, value in g["state"].items():
            home = g["homes"][-1]
            ref_value = want[key][home] if key.startswith(EXPERT_PREFIX) else want[key]
            rel_close(value, ref_value, BF16_TOL, what=f"rank {r} {key} after {AUTO_STEPS} steps")
