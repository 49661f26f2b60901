"""EPGroup: collectives and collective error agreement, without dist and on 1..4 ranks."""

from __future__ import annotations

import pytest
import torch

from moonplan.comm import ContractError, EPGroup
from moonplan.comm.group import MESSAGE_BYTES
from moonplan.testing.dist import run_ranks

TIMEOUT = 30.0


def test_single_rank_without_dist():
    g = EPGroup()
    assert (g.rank, g.size, g.backend, g.device, g.group) == (
        0,
        1,
        "local",
        torch.device("cpu"),
        None,
    )
    x = torch.arange(6).view(2, 3)
    assert torch.equal(g.all_gather(x), x[None])
    out = torch.empty(4, 2)
    g.all_to_all(out, torch.ones(4, 2), [4], [4])
    assert torch.equal(out, torch.ones(4, 2))
    g.barrier()
    g.agree(True, "ignored")
    g.check_same("experts", 8)
    assert torch.equal(g.gather_with_status(x, True, ""), x[None])


def test_single_rank_failures_raise():
    g = EPGroup()
    with pytest.raises(ContractError, match=r"what: contract violated on rank 0: rank 0: boom"):
        g.agree(False, "boom", what="what")
    with pytest.raises(ContractError, match="bad counts") as info:
        g.gather_with_status(torch.zeros(3), False, "bad counts")
    assert info.value.ranks == (0,)
    assert isinstance(info.value, ValueError)


def test_long_message_is_truncated_on_a_character_boundary():
    g = EPGroup()
    with pytest.raises(ContractError) as info:
        g.agree(False, "é" * 1000)
    detail = str(info.value).split("rank 0: ", 2)[-1]
    assert set(detail) == {"é"} and len(detail.encode()) <= MESSAGE_BYTES


def _collectives(rank: int, world: int) -> dict:
    g = EPGroup()
    counts = torch.tensor([rank, 10 * rank, 7], dtype=torch.int64)
    bf = torch.full((2,), float(rank), dtype=torch.bfloat16)
    g.agree(True, "")
    g.check_same("config", (8, 2.5, "swiglu"))
    g.barrier()
    return {
        "meta": (g.rank, g.size, g.backend, str(g.device)),
        "gather": g.all_gather(counts).tolist(),
        "bf16": g.all_gather(bf).float().tolist(),
        "with_status": g.gather_with_status(counts, True, "").tolist(),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives(world):
    results = run_ranks(_collectives, world, timeout=TIMEOUT)
    want = [[r, 10 * r, 7] for r in range(world)]
    for rank, res in enumerate(results):
        assert res["meta"] == (rank, world, "gloo", "cpu")
        assert res["gather"] == want and res["with_status"] == want
        assert res["bf16"] == [[float(r)] * 2 for r in range(world)]


def _failing(rank: int, world: int, kind: str, bad: tuple[int, ...]) -> tuple[str, tuple]:
    g = EPGroup()
    ok = rank not in bad
    try:
        if kind == "agree":
            g.agree(ok, f"rank {rank} saw expert id {100 + rank} >= 64", what="dispatch")
        elif kind == "gather":
            g.gather_with_status(torch.ones(4, dtype=torch.int64), ok, "negative count")
        else:
            g.check_same("hidden", 1024 if ok else (2048 + rank))
    except ContractError as exc:
        g.barrier()  # every rank is still in step after the error
        return str(exc), exc.ranks
    return "no error", ()


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["agree", "gather", "check_same"])
@pytest.mark.parametrize(("world", "bad"), [(1, (0,)), (2, (1,)), (3, (0, 2)), (4, (3,))])
def test_one_rank_failing_raises_the_same_error_everywhere(kind, world, bad):
    results = run_ranks(_failing, world, kind, bad, timeout=TIMEOUT)
    messages = {msg for msg, _ in results}
    assert len(messages) == 1, messages
    msg, ranks = results[0]
    if kind == "check_same" and world == 1:
        assert msg == "no error"  # one rank always agrees with itself
        return
    assert msg != "no error"
    if kind == "check_same":
        assert "'hidden' differs" in msg
        assert all(f"rank {r}: {2048 + r}" in msg for r in bad)
        if world == 4:
            assert ranks == bad  # the odd one out
    else:
        assert ranks == bad
        assert all(f"rank {r}" in msg for r in bad)
    if kind == "agree":
        assert msg.startswith("dispatch: ") and all(f"id {100 + r}" in msg for r in bad)


# ---- the background group --------------------------------------------------------------
def test_single_rank_background_group_is_itself():
    g = EPGroup()
    assert g.background_group() is g
    g.release_background()  # nothing held
    g.close()  # nothing to release
    assert g.size == 1 and g.group is None


def _concurrent_a2a(main: EPGroup, other: EPGroup) -> tuple[list, list]:
    """An all-to-all on ``main`` in this thread while a worker runs one on ``other``."""
    import threading

    R, r = main.size, main.rank
    got = {}

    def work() -> None:
        out = torch.empty(R)
        other.all_to_all(out, torch.full((R,), 10.0 * r) + torch.arange(R), [1] * R, [1] * R)
        got["other"] = out.tolist()

    worker = threading.Thread(target=work)
    worker.start()
    out = torch.empty(R)
    main.all_to_all(out, torch.full((R,), float(r)), [1] * R, [1] * R)
    worker.join()
    return out.tolist(), got["other"]


def _background(rank: int, world: int, sub: bool, given: bool) -> dict:
    import torch.distributed as dist

    pg = dist.new_group(ranks=[0, 1]) if sub else None  # every rank calls (default mode)
    second = dist.new_group(ranks=[0, 1] if sub else list(range(world))) if given else None
    out = {} if sub and rank >= 2 else _background_rounds(pg, second, given)
    dist.barrier()  # no rank leaves while a peer's new group still connects to it
    return out


def _background_rounds(pg: object, second: object, given: bool) -> dict:
    """A member's rounds of :func:`_background`."""
    from moonplan.comm.group import _timeout_of

    g = EPGroup(pg, background=second)
    out: dict = {"rounds": [], "none": False}
    for _ in range(3):  # taken by two holders, used beside the main group, released
        bg = g.background_group()
        if bg is None:  # a subgroup without background=: none (new_group could hang)
            out["none"] = True
            g.release_background()  # nothing held: nothing happens
            return out
        assert g.background_group() is bg  # a second holder shares it
        assert bg is not g and bg.group is not g.group
        assert (given and bg.group is second) or not given
        assert (bg.rank, bg.size, bg.backend) == (g.rank, g.size, g.backend)
        assert _timeout_of(g.group, g.device) is not None  # readable on this torch
        assert _timeout_of(bg.group, bg.device) == _timeout_of(g.group, g.device)
        out["rounds"].append(_concurrent_a2a(g, bg))
        out["owned"] = bg._owned
        g.release_background()
        assert g.background_group() is bg  # still held by one: the same group
        g.release_background()
        g.release_background()
        g.release_background()  # more releases than holds: nothing happens
        out["released_owned"] = bg._owned  # destroyed by the last release if created
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "sub", "given"), [(2, False, False), (3, False, False), (3, True, True)]
)
def test_background_group_runs_beside_the_main_one(world, sub, given):
    results = run_ranks(_background, world, sub, given, timeout=TIMEOUT)
    size = 2 if sub else world
    for r, res in enumerate(results[:size]):
        expected = ([float(q) for q in range(size)], [10.0 * q + r for q in range(size)])
        assert res["rounds"] == [expected] * 3
        # created (and destroyed on the last release) over the whole world; a given one
        # is the caller's and never destroyed here
        assert res["owned"] == (not given) and res["released_owned"] is False
    assert all(res == {} for res in results[size:])


@pytest.mark.distributed
def test_a_subgroup_without_a_given_background_group_gets_none():
    """Members of an EP subgroup holding different numbers of process groups would name
    a members-only group differently and hang: none is created, the caller is asked for
    one (``EPGroup(group, background=...)``)."""
    results = run_ranks(_background, 3, True, False, timeout=TIMEOUT)
    assert [r["none"] for r in results[:2]] == [True, True] and results[2] == {}


def _wrong_background(rank: int, world: int) -> str:
    import torch.distributed as dist

    pg = dist.new_group(ranks=[0, 1])
    other = dist.new_group(ranks=[1, 2])
    if rank > 1:
        return ""
    with pytest.raises(ValueError, match="differ from the EP group"):
        EPGroup(pg, background=other if rank == 1 else dist.group.WORLD)
    return "raised"


@pytest.mark.distributed
def test_a_background_group_of_other_ranks_is_refused():
    assert run_ranks(_wrong_background, 3, timeout=TIMEOUT)[:2] == ["raised", "raised"]


# ---- settings agreement (check_settings / fail_settings) ----------------------------------
def _settings(rank: int, world: int, kind: str) -> tuple[str, str, tuple]:
    g = EPGroup()
    base = {"experts": 8, "dtype": torch.float32, "name": "x" * 400}
    try:
        if kind == "same":
            g.check_settings("layer config", base)
        elif kind == "differ":  # rank 1 differs in two settings, rank 2 lacks one
            mine = dict(base, experts=8 + (rank == 1), name="x" * 399 + ("y" if rank == 1 else "x"))
            if rank == 2:
                del mine["dtype"]
            g.check_settings("layer config", mine)
        elif kind == "one fails":
            if rank == 1:
                g.fail_settings("layer config", KeyError("no such option"))
            g.check_settings("layer config", base)
        else:  # every rank fails alike: its own error
            g.fail_settings("layer config", TypeError("bad option"))
    except Exception as exc:
        g.barrier()  # every rank is still in step after the error
        ranks = getattr(exc, "ranks", ())
        return type(exc).__name__, str(exc), ranks
    return "", "", ()


@pytest.mark.distributed
def test_settings_are_agreed_naming_each_difference() -> None:
    for kind in ("same", "differ", "one fails", "all fail"):
        got = run_ranks(_settings, 3, kind, timeout=TIMEOUT)
        assert len(set(got)) == 1, (kind, got)  # the same error on every rank
        name, message, ranks = got[0]
        if kind == "same":
            assert name == ""
        elif kind == "differ":
            assert name == "ContractError" and ranks == (1, 2)
            assert message.startswith("layer config differs across ranks in 3 settings: ")
            assert "dtype (rank 0, 1: torch.float32; rank 2: (not set))" in message
            assert "experts (rank 0, 2: 8; rank 1: 9)" in message
            assert "name (rank 0, 2: 'xxx" in message and "...#" in message  # long: cut
        elif kind == "one fails":
            assert name == "ContractError" and ranks == (1,)
            want = "layer config: contract violated on rank 1: rank 1: KeyError: 'no such option'"
            assert message == want
        else:
            assert (name, message, ranks) == ("TypeError", "bad option", ())


def test_settings_on_one_rank() -> None:
    g = EPGroup()
    g.check_settings("config", {"a": 1})
    with pytest.raises(TypeError, match="bad"):
        g.fail_settings("config", TypeError("bad"))
