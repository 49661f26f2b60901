"""The layer options as a Markdown table, generated from the config's sections.

Legend: none (text only).

``docs/api.md`` holds this table between its two ``MoEConfig options`` markers;
``tests/runtime/test_config.py`` checks that the page's table is the generated one.
Regenerate it with ``python -m moonplan.runtime.config.table``.
"""

from __future__ import annotations

import dataclasses

from moonplan.runtime.config.sections import SECTIONS


def option_table() -> str:
    """``| option | section | default | meaning |``, one row per option, section by section."""
    rows = ["| option | section | default | meaning |", "|---|---|---|---|"]
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            meaning = cls.MEANING[f.name].replace("``", "`")
            rows.append(f"| `{f.name}` | `{section}` | `{f.default!r}` | {meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(option_table(), end="")
