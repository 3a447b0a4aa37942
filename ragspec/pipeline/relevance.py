"""The relevance gate moved to `ragspec.retrieve.relevance` (a step after retrieval) and its window measurement
to `ragspec.retrieve.windows`; this module keeps the old import path working for code written against it."""

from ragspec.retrieve.relevance import (
    GateFound,
    RelevanceGate,
    calibrated_floor,
    is_task_on_sources,
    measured_band,
    resolve_gate,
)
from ragspec.retrieve.windows import EmbeddingMemo, Measured, measure, windows

__all__ = ["EmbeddingMemo", "GateFound", "Measured", "RelevanceGate", "calibrated_floor", "is_task_on_sources",
           "measure", "measured_band", "resolve_gate", "windows"]
