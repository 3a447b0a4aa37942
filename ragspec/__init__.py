"""ragspec: retrieval-augmented generation whose drafts are copied from the retrieved context."""

__version__ = "0.1.0"

from ragspec.errors import RagspecError  # noqa: E402

__all__ = ["RagspecError", "__version__"]
