"""The verifier the loop has always used: the transformers backend (backends/transformers.py) under its old
name, so existing callers and tests keep working. Other backends: ragspec.decoding.backends."""

from ragspec.decoding.backends.base import StepResult
from ragspec.decoding.backends.transformers import TransformersBackend, sliding_window

Verifier = TransformersBackend

__all__ = ["StepResult", "Verifier", "sliding_window"]
