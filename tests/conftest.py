"""Test configuration: hypothesis profiles, picked by ``HYPOTHESIS_PROFILE`` (default ``dev``).

``ci``: derandomized, 60 examples, prints the reproduction blob on failure.
``dev``: 100 random examples.  ``nightly``: 2000 examples.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, max_examples=60, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile("nightly", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
