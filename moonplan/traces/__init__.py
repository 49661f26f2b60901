"""Router traces: synthetic counts, drift over steps, counts files, and recording.

``generators`` draws expert popularities and exact top-k counts; ``drift`` holds the
AR(1) drift law and the step-by-step traces; ``files`` saves and loads counts;
``recorder`` records a wrapped model's routing (imported on its own: it needs the
adapters). The public names of the first three are re-exported here.

Legend: R ranks, E experts, T steps; counts are int64 ``[R, E]`` or ``[T, R, E]``.
"""

from moonplan.traces.drift import (
    DriftingTrace,
    DriftLaw,
    RotatingHotspot,
    StepTrace,
    drift_log_popularity,
    start_log_popularity,
)
from moonplan.traces.files import load_counts, save_counts
from moonplan.traces.generators import (
    COUNT_FAMILIES,
    FAMILIES,
    SAMPLE_METHODS,
    counts_for_ranks,
    counts_from_topk,
    generate_counts,
    popularity,
    sample_topk,
)

__all__ = [
    "COUNT_FAMILIES",
    "FAMILIES",
    "SAMPLE_METHODS",
    "DriftLaw",
    "DriftingTrace",
    "RotatingHotspot",
    "StepTrace",
    "counts_for_ranks",
    "counts_from_topk",
    "drift_log_popularity",
    "generate_counts",
    "load_counts",
    "popularity",
    "sample_topk",
    "save_counts",
    "start_log_popularity",
]
