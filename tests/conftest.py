"""Test configuration: one CPU thread per process, and hypothesis profiles.

Threads: the suite's processes (pytest and the ranks of distributed tests) share this
machine's few cores with each other and with other jobs, so torch's thread pool only
oversubscribes them: its idle threads spin on cores another process needs. Measured on
the 2-core VM with other jobs running, alternating runs of four planner test files
(``tests/plan/test_{previous,route_rows,route,backends}.py``): 15.2 s and 8.2 s with
``OMP_NUM_THREADS=1``, 31.4 s and 22.1 s with 2. ``OMP_NUM_THREADS`` defaults to 1 here,
set before torch is imported, and every process a test starts inherits it; set it
yourself to run otherwise.

Hypothesis profiles, picked by ``HYPOTHESIS_PROFILE`` (default ``dev``):
``ci``: derandomized, 60 examples, prints the reproduction blob on failure.
``dev``: 100 random examples.  ``nightly``: 2000 examples.
"""

from __future__ import annotations

import os
import sys

from hypothesis import settings

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # a plugin imported torch before this file: set it directly
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

settings.register_profile("ci", derandomize=True, max_examples=60, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile("nightly", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
