"""The toy-policy example of ``docs/planner-policy.md`` runs as written (extracted from it)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "planner-policy.md"


def _example() -> str:
    """The python block that defines ``test_spread``."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "def test_spread" in b]
    return block


def test_toy_policy_example_is_short_and_passes() -> None:
    code = _example()
    body = [ln for ln in code.splitlines() if ln.strip() and not ln.startswith(("import", "from"))]
    assert len(body) < 10, body  # the policy and its property test
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)
    scope["test_spread"]()  # hypothesis runs the property


def test_toy_policy_example_can_fail() -> None:
    code = _example().replace("(T % R)", "(T % R + 1)")  # one record too many per expert
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)
    try:
        scope["test_spread"]()
    except Exception as exc:  # hypothesis re-raises the PlanError of the shrunk case
        assert "records" in str(exc) or "alloc" in str(exc), exc
    else:
        raise AssertionError("a policy that invents records passed the check")
