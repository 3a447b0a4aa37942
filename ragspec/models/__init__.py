"""Model registry and loaders: embedded offline models by name, anything else by Hugging Face id."""

from ragspec.models.registry import DEFAULT_EMBEDDER, DEFAULT_GENERATOR, EMBEDDED, EmbeddedModel, lookup

__all__ = ["DEFAULT_EMBEDDER", "DEFAULT_GENERATOR", "EMBEDDED", "EmbeddedModel", "lookup"]
