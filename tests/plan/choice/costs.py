"""Cost models the choice's tests draw from: the presets, scaled from free to prohibitive.

Legend: none (no tensors).
"""

from __future__ import annotations

from hypothesis import strategies as st

from moonplan.stepcost import StepCost

H200 = StepCost.from_hardware("h200-node", "deepseek-v3", plan_us=20.0, exit_us=1.0)
MULTI = StepCost.from_hardware("h200-multinode", "mixtral-8x7b", plan_us=60.0, exit_us=2.0)
COMPUTE_ONLY = StepCost(  # only the busiest rank's rows cost: copies, traffic, planning free
    row_flop_s=1e-6,
    weight_read_s=0.0,
    row_mem_s=0.0,
    copy_s_intra=0.0,
    copy_s_inter=0.0,
    dispatch_row_s_intra=0.0,
    dispatch_row_s_inter=0.0,
    combine_row_s_intra=0.0,
    combine_row_s_inter=0.0,
)

DECODE = StepCost(  # mem-bound decode in round numbers (s): a weight read 100, a row 1 a link
    row_flop_s=0.0, weight_read_s=100.0, row_mem_s=0.0, copy_s_intra=1.0, copy_s_inter=1.0,
    dispatch_row_s_intra=1.0, dispatch_row_s_inter=1.0, combine_row_s_intra=1.0,
    combine_row_s_inter=1.0, plan_s=1.0,
)  # fmt: skip


def rows_only(**fields: float) -> StepCost:
    """A cost model where only rows (and ``fields``) take time."""
    zero = dict.fromkeys(
        ("weight_read_s", "row_mem_s", "copy_s_intra", "copy_s_inter", "dispatch_row_s_intra",
         "dispatch_row_s_inter", "combine_row_s_intra", "combine_row_s_inter"), 0.0
    )  # fmt: skip
    return StepCost(**{**zero, "row_flop_s": 1e-6, **fields})


FORCED_S = 1e9
"""A planning charge no step can beat: ``exit_s`` at it forces every candidate to be built."""


@st.composite
def costs(draw: st.DrawFn) -> StepCost:
    """The presets, scaled: cheap to prohibitive copies and planning (the exit's
    ``resident`` build included), either schedule, one or several fast-link domains."""
    base = draw(st.sampled_from([H200, MULTI, COMPUTE_ONLY]))
    copy = draw(st.sampled_from([0.0, 0.01, 1.0, 100.0]))
    return base.scaled(
        copy_s_intra=base.copy_s_intra * copy,
        copy_s_inter=base.copy_s_inter * copy,
        plan_s=draw(st.sampled_from([0.0, 2e-5, 1e-2])),
        exit_s=draw(st.sampled_from([0.0, 1e-6, 1e-2])),
        round_s=draw(st.sampled_from([0.0, 1e-5, 1e-2])),
        tile_rows=draw(st.sampled_from([1, 3, 16])),
        overlap=draw(st.booleans()),
        domain=draw(st.sampled_from([base.domain, 1, 2, 3])),
    )


def full(cost: StepCost) -> StepCost:
    """``cost`` with the early exit made impossible: every candidate is built and scored."""
    return cost.scaled(exit_s=FORCED_S)


def tiles_costs() -> tuple[StepCost, StepCost]:
    """``(compute, links)``: 16-row GEMM tiles that only compute pays (the ``resident``
    candidate's whole tiles win) and only dispatch rows (its records win): the hand cases
    of ``test_choice.py`` and the emulated kernel's."""
    zero = dict.fromkeys(
        ("weight_read_s", "row_mem_s", "copy_s_intra", "copy_s_inter", "dispatch_row_s_intra",
         "dispatch_row_s_inter", "combine_row_s_intra", "combine_row_s_inter", "row_flop_s"), 0.0
    )  # fmt: skip
    compute = StepCost(**{**zero, "row_flop_s": 1e-6}, tile_rows=16)
    links = StepCost(**{**zero, "dispatch_row_s_intra": 1e-6}, tile_rows=16)
    return compute, links
