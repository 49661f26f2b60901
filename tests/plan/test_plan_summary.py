"""``Plan.summary()`` (``plan/plan_type.py``): a dict that prints as tables with units."""

from __future__ import annotations

import json

import torch

import moonplan

COUNTS = torch.tensor([[9, 1, 2, 0, 3, 5, 4, 8], [0] * 8, [0] * 8, [0] * 8])


def test_summary_is_a_dict_that_prints_as_tables() -> None:
    s = moonplan.plan(COUNTS).summary()
    assert isinstance(s, dict) and s["copies"] == 2 and s["planned_load"] == [8, 8, 8, 8]
    assert json.loads(json.dumps(s))["static_load"] == [10, 2, 8, 12]
    lines = str(s).splitlines()
    assert lines[0] == "R=4 E=8 slots B=2 records N=32 policy exact"
    assert "static load (records)" in lines[1] and "planned load (records)" in lines[1]
    assert [ln.split()[:3] for ln in lines[3:7]] == [
        ["0", "10", "8"],
        ["1", "2", "8"],
        ["2", "8", "8"],
        ["3", "12", "8"],
    ]
    text = str(s)
    assert "static EP 1.500 -> planned 1.000" in text and "8 records" in text
    assert "predicted step" not in text  # only with a cost model's predictions
