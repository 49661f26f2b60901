"""Test configuration: one CPU thread per process, and hypothesis profiles.

Threads: the suite's processes (pytest and the ranks of distributed tests) share this
machine's few cores with each other and with other jobs, so torch's thread pool only
oversubscribes them: its idle threads spin on cores another process needs. Measured on
the 2-core box with other jobs running, single-process tensor tests ran 5-20x slower
with torch's default of one thread per core than with one thread (e.g. 11 s against
0.6 s; README.md, "Tests"). ``OMP_NUM_THREADS`` defaults to 1 here, set before torch is
imported, and is inherited by every process a test starts; set it to run otherwise.

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
