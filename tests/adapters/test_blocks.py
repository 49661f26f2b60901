"""A wrapped transformers block equals the original on every rank, outputs and gradients.

Legend: R ranks, E experts, E_r home experts of a rank, S tokens, H hidden.

Oracle: the original block. Outputs and the input, router and shared-expert gradients
are local (each rank's own tokens); home expert gradients are those of the total loss
``sum_r <block(x_r), c_r>`` over every rank's tokens.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

from moonplan.testing.dist import run_ranks
from tests.adapters.checks import forward_backward, inputs, rel_close
from tests.adapters.tiny import BLOCKS, H, make_block

pytestmark = pytest.mark.distributed

SIZES = {1: [7], 2: [5, 8], 3: [6, 0, 9], 4: [3, 7, 0, 5]}  # tokens per rank (x2 batch rows)


def _rank(rank: int, world: int, kind: str, sizes: list[int]) -> dict:
    from moonplan import adapters

    block = make_block(kind)
    ref = copy.deepcopy(block)
    wrapped = adapters.wrap(block)
    xs, cs = inputs(sizes, H)
    return forward_backward(wrapped, ref, xs[rank], cs[rank])


def _total_expert_grads(kind: str, sizes: list[int]) -> dict:
    block = make_block(kind)
    xs, cs = inputs(sizes, H)
    total = sum((block(x) * c).sum() for x, c in zip(xs, cs, strict=True))
    total.backward()
    return {n: p.grad for n, p in block.experts.named_parameters()}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", BLOCKS)
def test_wrapped_block_matches_original(kind: str, world: int) -> None:
    sizes = SIZES[world]
    got = run_ranks(_rank, world, kind, sizes, timeout=60)
    total = _total_expert_grads(kind, sizes)
    E = total["gate_up_proj"].shape[0]
    homes = [e for g in got for e in g["home"]]
    assert homes == list(range(E))  # every expert lives on exactly one rank
    for r, g in enumerate(got):
        rel_close(g["y"], g["y0"], what=f"rank {r} output")
        rel_close(g["dx"], g["dx0"], what=f"rank {r} input grad")
        for name, grad in g["grads"].items():
            if name.startswith("experts."):
                want = total[name.removeprefix("experts.")][g["home"]]
                assert g["shapes"][name][0] == len(g["home"])
            else:  # router, shared experts: the original block's local gradients
                want = g["grads0"][name]
                assert g["shapes"][name] == tuple(want.shape)
            rel_close(grad, want, what=f"rank {r} {name} grad")
