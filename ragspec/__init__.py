"""ragspec: retrieval-augmented generation whose drafts are copied from the retrieved context."""

__version__ = "0.1.0"

from ragspec.errors import RagspecError

__all__ = ["Answer", "Pipeline", "RagspecError", "__version__"]


def __getattr__(name: str):
    """`ragspec.Pipeline` / `ragspec.Answer` without importing torch for every `import ragspec`."""
    if name in ("Pipeline", "Answer"):
        import ragspec.pipeline as p

        return getattr(p, name)
    raise AttributeError(f"module 'ragspec' has no attribute {name!r}")
