"""The README's Python example runs and says what it claims."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert scope["plan"].alloc.sum(0).tolist() == [8, 8, 8, 8]
    assert scope["plan"].summary()["copies"] == 2
    assert scope["nxt"].new_copies() == 0
